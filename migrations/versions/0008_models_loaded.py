"""workers of several models: the models a worker serves and the ones it has loaded

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""
import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("workers", sa.Column("models", sa.JSON, nullable=True))
    op.add_column("workers", sa.Column("models_loaded", sa.JSON, nullable=True))


def downgrade() -> None:
    # Not a batch copy of the table on SQLite (see 0006).
    op.execute("ALTER TABLE workers DROP COLUMN models_loaded")
    op.execute("ALTER TABLE workers DROP COLUMN models")
