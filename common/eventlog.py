"""The durable event log (Postgres or SQLite): append in batches, replay after a seq."""

import time

from sqlalchemy import delete, func, insert, select
from sqlalchemy.orm import Session

from common.tables import Event


def append(session: Session, response_id: str, batch: list[tuple[int, str, str]]) -> None:
    if batch:
        now = time.time()
        session.execute(insert(Event), [
            {"response_id": response_id, "seq": s, "name": n, "data": d, "created_at": now} for s, n, d in batch])


def max_seq(session: Session, response_id: str) -> int:
    return session.execute(select(func.max(Event.seq)).where(Event.response_id == response_id)).scalar() or 0


def read(session: Session, response_id: str, after: int, limit: int = 1000) -> list[tuple[int, str, str]]:
    rows = session.execute(
        select(Event.seq, Event.name, Event.data)
        .where(Event.response_id == response_id, Event.seq > after)
        .order_by(Event.seq).limit(limit))
    return [tuple(r) for r in rows]


def purge(session: Session, response_ids: list[str]) -> int:
    return session.execute(delete(Event).where(Event.response_id.in_(response_ids))).rowcount
