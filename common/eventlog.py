"""The durable event log (Postgres or SQLite): append in batches, replay after a seq."""

import time

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from common.tables import Event


def append(session: Session, response_id: str, batch: list[tuple[int, str, str]]) -> None:
    if batch:
        now = time.time()
        # Core executemany, not the ORM's bulk path: this runs for every batch of tokens.
        session.connection().execute(Event.__table__.insert(), [
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
