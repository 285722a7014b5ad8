"""model_revisions: the commit `lmsp models pull` resolved for a hub model whose revision is not
pinned, so every host (and pod) that pulls it later takes that same snapshot

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04
"""
import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "model_revisions",
        sa.Column("model_id", sa.String(200), primary_key=True),
        sa.Column("checkpoint", sa.String(400), nullable=False),
        sa.Column("commit", sa.String(64), nullable=False),
        sa.Column("recorded_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("model_revisions")
