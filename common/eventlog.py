"""The durable event log (Postgres or SQLite): append in batches, replay after a seq.

On Postgres the log is partitioned by period (common/partitions.py) and retention drops whole
partitions; on SQLite (the embedded mode) ``purge`` and ``purge_direct`` delete rows."""

import time

from psycopg import ClientCursor
from sqlalchemy import delete, exists, func, select
from sqlalchemy.engine import Connection
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


_PAGE = "SELECT seq, name, data FROM events WHERE response_id = {mark} AND seq > {mark} ORDER BY seq LIMIT {mark}"
# A page is read in the primary key's order, which stops at its LIMIT. Left to itself Postgres plans it
# as a bitmap scan whenever it takes the response for a small one (statistics not yet gathered, or a
# response against the table's average): every event after ``after`` read and sorted for each page, a
# long log's replay costing the square of its length. Measured on 100,000 events in pages of 5,000:
# 3 µs of CPU a replayed event (Postgres 2.0, api 0.95), 1.05 in order (Postgres 0.3, api 0.75).
_IN_ORDER = "SET LOCAL enable_bitmapscan = off;\n{};\nRESET enable_bitmapscan"


def read(session: Session, response_id: str, after: int, limit: int = 1000) -> list[tuple[int, str, str]]:
    return read_on(session.connection(), response_id, after, limit)


def read_on(conn: Connection, response_id: str, after: int, limit: int = 1000) -> list[tuple[int, str, str]]:
    """``read`` on a Core connection: a follower's, of ``db.autocommit`` (no transaction to open and
    roll back around the page's one query string)."""
    # Replays read with the driver's own cursor: SQLAlchemy's row objects cost 4x here, and a
    # long report's log is replayed whole by every late follower.
    if conn.dialect.name == "postgresql":
        return _in_order(conn, _PAGE.format(mark="%s"), (response_id, after, limit))
    cursor = conn.connection.cursor()
    try:
        cursor.execute(_PAGE.format(mark="?"), (response_id, after, limit))
        return cursor.fetchall()
    finally:
        cursor.close()


def _in_order(conn, sql: str, params: tuple) -> list[tuple]:
    with ClientCursor(conn.connection.driver_connection) as cursor:  # the three statements in one round trip
        cursor.execute(_IN_ORDER.format(sql), params)
        cursor.nextset()
        return cursor.fetchall()


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
