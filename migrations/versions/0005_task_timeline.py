"""task timeline: one row per attempt with when it was delivered, claimed, admitted, generated and finished

Revision ID: 0005
Revises: 0004
Create Date: 2027-01-10
"""
import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "task_attempts",
        sa.Column("task_id", sa.String(40), sa.ForeignKey("tasks.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("attempt", sa.Integer, primary_key=True),
        sa.Column("worker_id", sa.String(200), nullable=False),
        sa.Column("delivered_at", sa.Float, nullable=False),
        sa.Column("claimed_at", sa.Float, nullable=False),
        sa.Column("submitted_at", sa.Float),
        sa.Column("admitted_at", sa.Float),
        sa.Column("first_token_at", sa.Float),
        sa.Column("last_token_at", sa.Float),
        sa.Column("finished_at", sa.Float),
        sa.Column("commit_batches", sa.Integer),
        sa.Column("commit_lag_sum", sa.Float),
        sa.Column("commit_lag_max", sa.Float),
    )


def downgrade() -> None:
    op.drop_table("task_attempts")
