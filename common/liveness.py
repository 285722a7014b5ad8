"""Workers' leases: heartbeats, and who is alive, always judged by the database's clock, never a host's
(docs/architecture.md, invariants 4 and 5). Every reader asks here: the api (is a model served, the
metrics), the workers' sweeps (whose tasks to hand on), ``lmsp dev`` (is its own worker up).

A worker is *alive* while its heartbeat is younger than the lease, it did not stop, and its engine is
ready to take work; its lease has *expired* once its heartbeat is older than the lease.
"""

from typing import NamedTuple

from sqlalchemy import and_, func, select, update
from sqlalchemy.orm import Session

from common.db import db_now
from common.tables import Worker


def expired(lease_seconds: float):
    """SQL: the worker's lease has expired."""
    return Worker.heartbeat_at < db_now() - lease_seconds


def alive(lease_seconds: float):
    """SQL: the worker can take work now."""
    return and_(Worker.heartbeat_at > db_now() - lease_seconds, Worker.stopped_at.is_(None),
                Worker.ready.is_(True))


class Replaced(Exception):
    """Another process booted with this worker id after this one: this one must stop."""


def heartbeat(session: Session, worker_id: str, model: str, started_at: float, *, running: int, ready: bool,
              state: str | None = None, tokens_per_second: float = 0.0, stopped: bool = False,
              boot: bool = False) -> None:
    """``boot``: this process (``started_at``) takes the id; every later heartbeat is conditional on
    it still holding it, and raises Replaced once another process took the id over. ``state`` and
    ``tokens_per_second``: what the workers panel shows (worker/context.py's ``state``, worker/rate.py)."""
    values = {"heartbeat_at": db_now(), "model": model, "running": running, "ready": ready and not stopped,
              "stopped_at": db_now() if stopped else None, "state": state,
              "tokens_per_second": round(tokens_per_second, 2)}
    mine = () if boot else (Worker.started_at == started_at,)
    if session.execute(update(Worker).where(Worker.id == worker_id, *mine).values(
            **values, started_at=started_at)).rowcount:
        return
    if not boot and session.get(Worker, worker_id) is not None:
        raise Replaced(worker_id)
    session.add(Worker(id=worker_id, started_at=started_at, **values))
    session.flush()


def heartbeat_of(session: Session, worker_id: str) -> tuple[float, float] | None:
    """(the last heartbeat, its age by the database's clock) of a worker id that did not stop."""
    row = session.execute(select(Worker.heartbeat_at, db_now() - Worker.heartbeat_at).where(
        Worker.id == worker_id, Worker.stopped_at.is_(None))).one_or_none()
    return None if row is None else (row[0], row[1])


def live_workers(session: Session, lease_seconds: float, started_since: float | None = None) -> dict[str, int]:
    """Workers per model alive now; ``started_since``: only processes that took their id at or after
    this time."""
    since = () if started_since is None else (Worker.started_at >= started_since,)
    rows = session.execute(select(Worker.model, func.count()).where(alive(lease_seconds), *since)
                           .group_by(Worker.model))
    return dict(rows.all())


class WorkerState(NamedTuple):
    id: str
    model: str
    alive: bool
    running: int  # engine requests in flight at its last heartbeat
    state: str  # ready | loading | reloading | draining as it reported; lost once its lease expired
    tokens_per_second: float
    models_loaded: list[str]


# Written by workers that serve a set of models (issue 24, part 3); until that column exists, or while
# a worker leaves it empty, a worker has its one model loaded.
_LOADED = getattr(Worker, "models_loaded", None)


def worker_states(session: Session, lease_seconds: float, lost_for: float | None = None) -> list[WorkerState]:
    """Every worker that did not stop, by id: one query of the workers table, no scan of anything else.
    ``lost_for``: leave out workers whose last heartbeat is older than this (long gone)."""
    recent = () if lost_for is None else (Worker.heartbeat_at > db_now() - lost_for,)
    columns = [Worker.id, Worker.model, alive(lease_seconds), Worker.running, Worker.state, Worker.ready,
               Worker.tokens_per_second, expired(lease_seconds)]
    if _LOADED is not None:
        columns.append(_LOADED)
    out = []
    for wid, model, up, running, state, ready, rate, lost, *loaded in session.execute(
            select(*columns).where(Worker.stopped_at.is_(None), *recent).order_by(Worker.id)):
        state = "lost" if lost else state or ("ready" if ready else "loading")
        out.append(WorkerState(wid, model, bool(up), running or 0, state, rate or 0.0,
                               _model_ids(loaded[0] if loaded else None, model)))
    return out


def _model_ids(loaded, model: str) -> list[str]:
    """``models_loaded`` read defensively: a list of ids (or of objects naming one), or a mapping by id."""
    if loaded is None:
        return [model]
    if isinstance(loaded, dict):
        return sorted(loaded)
    return [m if isinstance(m, str) else m.get("id") or m.get("model") for m in loaded
            if isinstance(m, str) or isinstance(m, dict) and (m.get("id") or m.get("model"))]


def expired_workers(session: Session, lease_seconds: float, me: str) -> list[str]:
    return [w for w in session.execute(select(Worker.id).where(expired(lease_seconds))).scalars() if w != me]


def worker_expired(session: Session, worker_id: str, lease_seconds: float) -> bool:
    return bool(session.execute(select(Worker.id).where(Worker.id == worker_id, expired(lease_seconds))).first())
