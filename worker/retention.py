"""Retention (spec 11.2): events, then tasks, responses and idempotency records past theirs. One worker
a sweep interval runs it (worker/sweeper.py)."""

from sqlalchemy import delete, exists, select, update

from common import eventlog, partitions
from common.db import db_now
from common.tables import Event, IdempotencyRecord, Response, Task
from worker.context import WorkerContext


def enforce_retention(ctx: WorkerContext) -> None:
    """Events past their retention (spec 11.2), then tasks, responses and idempotency records past theirs.
    On Postgres events go by whole partitions (common/partitions.py), direct responses' with the rest; on
    SQLite by rows, a task's once it is past its retention and a direct response's likewise."""
    s = ctx.settings
    engine = ctx.sessions.kw["bind"]
    by_partition = partitions.partitioned(engine)
    if by_partition:
        partitions.maintain(engine, retention=s.event_retention_seconds, width=s.event_partition_seconds,
                            ahead=s.event_partitions_ahead_seconds)
    with ctx.sessions() as session:
        now = session.execute(select(db_now())).scalar()
        if not by_partition:
            expired = list(session.execute(select(Task.id, Task.response_id).where(
                Task.ended_at < now - s.event_retention_seconds, ~Task.events_expired).limit(500)).all())
            if expired:
                eventlog.purge(session, [rid for _, rid in expired])
                session.execute(update(Task).where(Task.id.in_([tid for tid, _ in expired]))
                                .values(events_expired=True))
            eventlog.purge_direct(session, now - s.event_retention_seconds)
        old = list(session.execute(select(Task.id, Task.response_id).where(
            Task.ended_at < now - s.record_retention_seconds).limit(500)).all())
        if old:
            session.execute(delete(Task).where(Task.id.in_([tid for tid, _ in old])))
            session.execute(delete(Response).where(Response.id.in_([rid for _, rid in old])))
        # Direct responses: unstored ones only live for their stream; stored ones as long as tasks. On
        # SQLite one whose events are still there waits for purge_direct (500 a sweep).
        direct = ~exists().where(Task.response_id == Response.id)
        logged = () if by_partition else (~exists().where(Event.response_id == Response.id),)
        session.execute(delete(Response).where(direct, Response.stored.is_(False),
                                               Response.updated_at < now - s.event_retention_seconds, *logged))
        session.execute(delete(Response).where(direct, Response.updated_at < now - s.record_retention_seconds))
        session.execute(delete(IdempotencyRecord).where(
            IdempotencyRecord.created_at < now - s.idempotency_retention_seconds))
        session.commit()
