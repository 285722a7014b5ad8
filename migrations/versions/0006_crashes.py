"""engine crashes per task: a request that kills the engine while it is prefilled is run again only
up to LMSP_MAX_ATTEMPTS times

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02
"""
import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tasks", sa.Column("crashes", sa.Integer, nullable=False, server_default="0"))


def downgrade() -> None:
    # Not a batch copy of the table on SQLite: that would drop 0003's triggers on tasks.
    op.execute("ALTER TABLE tasks DROP COLUMN crashes")
