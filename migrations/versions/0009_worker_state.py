"""workers.state (ready, loading, reloading, draining) and workers.tokens_per_second (its recent
generated tokens per second), both written with each heartbeat, for the dashboard's workers panel;
an index for a principal's task list newest first, which the dashboard polls

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01
"""
import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("workers", sa.Column("state", sa.String(20)))
    op.add_column("workers", sa.Column("tokens_per_second", sa.Float))
    op.create_index("ix_tasks_principal_newest", "tasks", ["principal_id", "id"])


def downgrade() -> None:
    op.drop_index("ix_tasks_principal_newest", "tasks")
    # Not a batch copy of the table on SQLite (see 0006).
    op.execute("ALTER TABLE workers DROP COLUMN tokens_per_second")
    op.execute("ALTER TABLE workers DROP COLUMN state")
