"""queue counts: queued tasks per principal and per model, kept by triggers on tasks

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""
import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

# Each trigger touches the model's row before the principal's, always: two transactions that both
# change counts (a task created, another claimed) wait for each other, never deadlock.
POSTGRES = [
    """
    CREATE FUNCTION lmsp_queue_counts() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF TG_OP <> 'INSERT' AND OLD.status = 'queued' THEN
            UPDATE queue_counts SET queued = queued - 1 WHERE kind = 'model' AND name = OLD.model;
            UPDATE queue_counts SET queued = queued - 1 WHERE kind = 'principal' AND name = OLD.principal_id;
        END IF;
        IF TG_OP <> 'DELETE' AND NEW.status = 'queued' THEN
            INSERT INTO queue_counts (kind, name, queued) VALUES ('model', NEW.model, 1)
                ON CONFLICT (kind, name) DO UPDATE SET queued = queue_counts.queued + 1;
            INSERT INTO queue_counts (kind, name, queued) VALUES ('principal', NEW.principal_id, 1)
                ON CONFLICT (kind, name) DO UPDATE SET queued = queue_counts.queued + 1;
        END IF;
        RETURN NULL;
    END $$
    """,
    """
    CREATE TRIGGER tasks_queue_counts AFTER INSERT OR DELETE OR UPDATE OF status, model, principal_id ON tasks
        FOR EACH ROW EXECUTE FUNCTION lmsp_queue_counts()
    """,
]
_LEAVE = """
    UPDATE queue_counts SET queued = queued - 1 WHERE kind = 'model' AND name = OLD.model;
    UPDATE queue_counts SET queued = queued - 1 WHERE kind = 'principal' AND name = OLD.principal_id;
"""
_ENTER = """
    INSERT INTO queue_counts (kind, name, queued) VALUES ('model', NEW.model, 1)
        ON CONFLICT (kind, name) DO UPDATE SET queued = queued + 1;
    INSERT INTO queue_counts (kind, name, queued) VALUES ('principal', NEW.principal_id, 1)
        ON CONFLICT (kind, name) DO UPDATE SET queued = queued + 1;
"""
SQLITE = [
    f"CREATE TRIGGER tasks_queue_counts_insert AFTER INSERT ON tasks WHEN NEW.status = 'queued' BEGIN {_ENTER} END",
    f"CREATE TRIGGER tasks_queue_counts_delete AFTER DELETE ON tasks WHEN OLD.status = 'queued' BEGIN {_LEAVE} END",
    """CREATE TRIGGER tasks_queue_counts_update AFTER UPDATE OF status, model, principal_id ON tasks
        WHEN OLD.status = 'queued' OR NEW.status = 'queued' BEGIN
        UPDATE queue_counts SET queued = queued - 1
            WHERE OLD.status = 'queued' AND kind = 'model' AND name = OLD.model;
        UPDATE queue_counts SET queued = queued - 1
            WHERE OLD.status = 'queued' AND kind = 'principal' AND name = OLD.principal_id;
        INSERT INTO queue_counts (kind, name, queued) SELECT 'model', NEW.model, 1 WHERE NEW.status = 'queued'
            ON CONFLICT (kind, name) DO UPDATE SET queued = queued + 1;
        INSERT INTO queue_counts (kind, name, queued) SELECT 'principal', NEW.principal_id, 1
            WHERE NEW.status = 'queued' ON CONFLICT (kind, name) DO UPDATE SET queued = queued + 1;
        END""",
]


def upgrade() -> None:
    op.create_table(
        "queue_counts",
        sa.Column("kind", sa.String(10), primary_key=True),
        sa.Column("name", sa.String(200), primary_key=True),
        sa.Column("queued", sa.Integer, nullable=False),
    )
    for statement in POSTGRES if op.get_bind().dialect.name == "postgresql" else SQLITE:
        op.execute(statement)
    # The triggers exist (and lock the table on Postgres) before the counts of the tasks already there.
    op.execute("INSERT INTO queue_counts (kind, name, queued) SELECT 'model', model, count(*) FROM tasks "
               "WHERE status = 'queued' GROUP BY model")
    op.execute("INSERT INTO queue_counts (kind, name, queued) SELECT 'principal', principal_id, count(*) "
               "FROM tasks WHERE status = 'queued' GROUP BY principal_id")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER tasks_queue_counts ON tasks")
        op.execute("DROP FUNCTION lmsp_queue_counts()")
    else:
        for name in ("insert", "delete", "update"):
            op.execute(f"DROP TRIGGER tasks_queue_counts_{name}")
    op.drop_table("queue_counts")
