"""The durable event log (Postgres or SQLite): append in batches, replay after a seq.

On Postgres the log is partitioned by period (common/partitions.py) and retention drops whole
partitions; on SQLite (the embedded mode) ``purge`` and ``purge_direct`` delete rows."""

import time

from sqlalchemy import delete, exists, func, select
from sqlalchemy.orm import Session

from common.states import ResponseState
from common.tables import Event, Response, Task

# One statement whatever the batch's size: the rows go as arrays, unnested by Postgres (the driver
# sends them in binary), so a batch costs one parse and one round trip, not one per event.
INSERT_PG = ("INSERT INTO events (response_id, seq, name, data, created_at) "
             "SELECT %(rid)s, s, n, d, %(now)s FROM unnest(%(seqs)s::int[], %(names)s::text[], %(datas)s::text[]) "
             "AS e(s, n, d)")


def append(session: Session, response_id: str, batch: list[tuple[int, str, str]]) -> None:
    if not batch:
        return
    now = time.time()
    conn = session.connection()
    if conn.dialect.name == "postgresql":
        seqs, names, datas = (list(column) for column in zip(*batch, strict=True))
        conn.exec_driver_sql(INSERT_PG, {"rid": response_id, "now": now, "seqs": seqs, "names": names,
                                         "datas": datas})
        return
    # Core executemany, not the ORM's bulk path: this runs for every batch of tokens.
    conn.execute(Event.__table__.insert(), [
        {"response_id": response_id, "seq": s, "name": n, "data": d, "created_at": now} for s, n, d in batch])


def max_seq(session: Session, response_id: str) -> int:
    return session.execute(select(func.max(Event.seq)).where(Event.response_id == response_id)).scalar() or 0


def read(session: Session, response_id: str, after: int, limit: int = 1000) -> list[tuple[int, str, str]]:
    # Replays read with the driver's own cursor: SQLAlchemy's row objects cost 4x here, and a
    # long report's log is replayed whole by every late follower.
    conn = session.connection()
    mark = "?" if conn.dialect.paramstyle == "qmark" else "%s"
    cursor = conn.connection.cursor()
    try:
        cursor.execute(f"SELECT seq, name, data FROM events WHERE response_id = {mark} AND seq > {mark} "
                       f"ORDER BY seq LIMIT {mark}", (response_id, after, limit))
        return cursor.fetchall()
    finally:
        cursor.close()


def purge(session: Session, response_ids: list[str]) -> int:
    return session.execute(delete(Event).where(Event.response_id.in_(response_ids))).rowcount


def purge_direct(session: Session, before: float, limit: int = 500) -> int:
    """Delete the events of direct responses (no task's) that ended before ``before``: a direct stream
    cannot be resumed (spec 6.4), so they outlive it only as long as a task's do (SQLite; on Postgres
    their partition goes)."""
    ended = [s.value for s in ResponseState if s not in (ResponseState.QUEUED, ResponseState.IN_PROGRESS)]
    ids = select(Response.id).where(
        Response.updated_at < before, Response.status.in_(ended), ~exists().where(Task.response_id == Response.id),
        exists().where(Event.response_id == Response.id)).limit(limit)
    return purge(session, list(session.execute(ids).scalars()))
