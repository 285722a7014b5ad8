"""fencing and readiness: token budgets as columns, re-send counter, worker readiness

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""
import json

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("responses") as batch:
        batch.add_column(sa.Column("input_tokens", sa.Integer))
        batch.add_column(sa.Column("max_tokens", sa.Integer))
    with op.batch_alter_table("tasks") as batch:
        batch.add_column(sa.Column("dispatches", sa.Integer, nullable=False, server_default="1"))
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("ready", sa.Boolean, nullable=False, server_default=sa.true()))
    # 0001 kept the budgets as private keys inside the stored request.
    conn = op.get_bind()
    responses = sa.table("responses", sa.column("id", sa.String), sa.column("request", sa.JSON().with_variant(JSONB(), "postgresql")),
                         sa.column("input_tokens", sa.Integer), sa.column("max_tokens", sa.Integer))
    for rid, request in conn.execute(sa.select(responses.c.id, responses.c.request)).all():
        request = json.loads(request) if isinstance(request, str) else request
        if request and "_input_tokens" in request:
            inp, mx = request.pop("_input_tokens"), request.pop("_max_tokens", None)
            conn.execute(responses.update().where(responses.c.id == rid).values(
                input_tokens=inp, max_tokens=mx, request=request))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("ready")
    with op.batch_alter_table("tasks") as batch:
        batch.drop_column("dispatches")
    with op.batch_alter_table("responses") as batch:
        batch.drop_column("max_tokens")
        batch.drop_column("input_tokens")
