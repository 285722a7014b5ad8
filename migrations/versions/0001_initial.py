"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

Json = sa.JSON().with_variant(JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "principals",
        sa.Column("id", sa.String(128), primary_key=True),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("principal_id", sa.String(128), sa.ForeignKey("principals.id"), nullable=False, index=True),
        sa.Column("name", sa.String(200)),
        sa.Column("token_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("scopes", sa.Text, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("revoked_at", sa.Float),
    )
    op.create_table(
        "responses",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("principal_id", sa.String(128), sa.ForeignKey("principals.id"), nullable=False, index=True),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("request", Json, nullable=False),
        sa.Column("output", Json),
        sa.Column("usage", Json),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("error", Json),
        sa.Column("incomplete_details", Json),
        sa.Column("stored", sa.Boolean, nullable=False),
        sa.Column("previous_response_id", sa.String(40)),
        sa.Column("worker_id", sa.String(200)),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )
    op.create_table(
        "tasks",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("principal_id", sa.String(128), sa.ForeignKey("principals.id"), nullable=False, index=True),
        sa.Column("response_id", sa.String(40), sa.ForeignKey("responses.id"), nullable=False, unique=True),
        sa.Column("type", sa.String(20), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("on_restart", sa.String(10), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("worker_id", sa.String(200)),
        sa.Column("error", Json),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
        sa.Column("dispatched_at", sa.Float),
        sa.Column("ended_at", sa.Float),
        sa.Column("events_expired", sa.Boolean, nullable=False),
    )
    op.create_index("ix_tasks_status_model", "tasks", ["status", "model"])
    op.create_index("ix_tasks_worker_status", "tasks", ["worker_id", "status"])
    op.create_index("ix_tasks_principal_status", "tasks", ["principal_id", "status"])
    op.create_table(
        "events",
        sa.Column("response_id", sa.String(40), primary_key=True),
        sa.Column("seq", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("data", sa.Text, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_table(
        "idempotency_records",
        sa.Column("principal_id", sa.String(128), primary_key=True),
        sa.Column("method", sa.String(10), primary_key=True),
        sa.Column("path", sa.String(200), primary_key=True),
        sa.Column("key", sa.String(255), primary_key=True),
        sa.Column("request_hash", sa.String(64), nullable=False),
        sa.Column("status_code", sa.Integer),
        sa.Column("body", sa.Text),
        sa.Column("task_id", sa.String(40)),
        sa.Column("created_at", sa.Float, nullable=False, index=True),
    )
    op.create_table(
        "workers",
        sa.Column("id", sa.String(200), primary_key=True),
        sa.Column("model", sa.String(200), nullable=False, index=True),
        sa.Column("heartbeat_at", sa.Float, nullable=False),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("stopped_at", sa.Float),
        sa.Column("running", sa.Integer, nullable=False, server_default="0"),
    )


def downgrade() -> None:
    for table in ("workers", "idempotency_records", "events", "tasks", "responses", "api_tokens", "principals"):
        op.drop_table(table)
