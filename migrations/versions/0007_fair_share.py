"""fair share: principals' weights, tasks' charges and virtual times, the clocks per model

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""
import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

QUEUED = "status = 'queued'"


def upgrade() -> None:
    op.add_column("principals", sa.Column("weight", sa.Float, nullable=False, server_default="1"))
    # Tasks queued before this migration get virtual time 0: claimed before any charged after it.
    for column, kind in (("cost", sa.Integer), ("virtual_start", sa.Float), ("virtual_finish", sa.Float)):
        op.add_column("tasks", sa.Column(column, kind, nullable=False, server_default="0"))
    op.create_index("ix_tasks_fair", "tasks", ["model", "virtual_finish", "id"],
                    postgresql_where=sa.text(QUEUED), sqlite_where=sa.text(QUEUED))
    op.create_table(
        "virtual_times",
        sa.Column("model", sa.String(200), primary_key=True),
        sa.Column("principal_id", sa.String(128), primary_key=True),
        sa.Column("finish", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("virtual_times")
    op.drop_index("ix_tasks_fair", "tasks")
    # Not a batch copy of the table on SQLite: that would drop 0003's triggers on tasks.
    for column in ("virtual_finish", "virtual_start", "cost"):
        op.execute(f"ALTER TABLE tasks DROP COLUMN {column}")
    op.execute("ALTER TABLE principals DROP COLUMN weight")
