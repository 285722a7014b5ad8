"""event log partitioned by time on Postgres; indexes that keep every sweep off full scans; sweeps

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02
"""
import time

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_COLUMNS = ("response_id varchar(40) COLLATE \"C\" NOT NULL, seq integer NOT NULL, name varchar(64) NOT NULL, "
            "data text NOT NULL, created_at double precision NOT NULL")
_INDEXES = [  # (name, table, columns, partial index predicate)
    ("ix_tasks_ended", "tasks", ["ended_at"], None),
    ("ix_tasks_unowned", "tasks", ["model", "dispatched_at"],
     "worker_id IS NULL AND status IN ('queued', 'loading', 'running', 'cancelling')"),
    ("ix_tasks_events_kept", "tasks", ["created_at"], "NOT events_expired"),
    ("ix_responses_updated", "responses", ["updated_at"], None),
    ("ix_responses_generating", "responses", ["worker_id"], "status = 'in_progress'"),
    ("ix_responses_open", "responses", ["created_at"], "status IN ('queued', 'in_progress')"),
]


def _hour_floor_id() -> str:
    """The least response id made in the current hour (ids are ULIDs: the time is their first 10 characters)."""
    value, chars = (int(time.time()) // 3600 * 3600 * 1000) << 80, []
    for _ in range(26):
        chars.append(_ALPHABET[value & 31])
        value >>= 5
    return "resp_" + "".join(reversed(chars))[:10]


def upgrade() -> None:
    for name, table, columns, where in _INDEXES:
        where = sa.text(where) if where else None
        op.create_index(name, table, columns, postgresql_where=where, sqlite_where=where)
    op.create_table("sweeps", sa.Column("name", sa.String(250), primary_key=True),
                    sa.Column("swept_at", sa.Float, nullable=False))
    if op.get_bind().dialect.name != "postgresql":
        return  # SQLite keeps one table (the embedded mode's scale): retention deletes rows there
    # The table as it is becomes the first partition, for every id before this hour: its rows stay where
    # they are (no copy; only its key index is rebuilt for the "C" order). Any id from this hour on
    # (none but a clock running ahead) moves to the tail partition, which takes every later id until
    # the partitions of each period are made (common/partitions.py, right after the migration).
    first = _hour_floor_id()
    op.execute("ALTER TABLE events RENAME TO events_p0")
    op.execute("ALTER TABLE events_p0 RENAME CONSTRAINT events_pkey TO events_p0_pkey")
    op.execute('ALTER TABLE events_p0 ALTER COLUMN response_id TYPE varchar(40) COLLATE "C"')
    op.execute(f"CREATE TABLE events ({_COLUMNS}, CONSTRAINT events_pkey PRIMARY KEY (response_id, seq)) "
               "PARTITION BY RANGE (response_id)")
    op.execute("CREATE TABLE events_ptail (LIKE events INCLUDING DEFAULTS INCLUDING CONSTRAINTS)")
    op.execute(f"WITH moved AS (DELETE FROM events_p0 WHERE response_id >= '{first}' RETURNING *) "
               "INSERT INTO events_ptail SELECT * FROM moved")
    op.execute(f"ALTER TABLE events ATTACH PARTITION events_p0 FOR VALUES FROM (MINVALUE) TO ('{first}')")
    op.execute(f"ALTER TABLE events ATTACH PARTITION events_ptail FOR VALUES FROM ('{first}') TO (MAXVALUE)")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("CREATE TABLE events_flat (LIKE events INCLUDING DEFAULTS)")
        op.execute("INSERT INTO events_flat SELECT * FROM events")
        op.execute("DROP TABLE events")  # and its partitions
        op.execute("ALTER TABLE events_flat RENAME TO events")
        op.execute('ALTER TABLE events ALTER COLUMN response_id TYPE varchar(40) COLLATE "default"')
        op.execute("ALTER TABLE events ADD CONSTRAINT events_pkey PRIMARY KEY (response_id, seq)")
    op.drop_table("sweeps")
    for name, table, _, _ in reversed(_INDEXES):
        op.drop_index(name, table_name=table)
