"""Workers' leases: heartbeats, and who is alive, always judged by the database's clock, never a host's
(docs/architecture.md, invariants 4 and 5). Every reader asks here: the api (is a model served, the
metrics), the workers' sweeps (whose tasks to hand on), ``lmsp dev`` (is its own worker up).

A worker is *alive* while its heartbeat is younger than the lease, it did not stop, and its engine is
ready to take work; its lease has *expired* once its heartbeat is older than the lease.
"""

from typing import NamedTuple

from sqlalchemy import and_, select, update
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


def heartbeat(session: Session, worker_id: str, models: list[str], started_at: float, *, running: int, ready: bool,
              loaded: list[str], state: str | None = None, tokens_per_second: float = 0.0, stopped: bool = False,
              boot: bool = False) -> None:
    """``models``: the ones the worker serves (the first is its ``model``), ``loaded``: those loaded now.
    ``boot``: this process (``started_at``) takes the id; every later heartbeat is conditional on
    it still holding it, and raises Replaced once another process took the id over. ``state`` and
    ``tokens_per_second``: what the workers panel shows (worker/context.py's ``state``, worker/rate.py)."""
    values = {"heartbeat_at": db_now(), "model": models[0], "models": models if len(models) > 1 else None,
              "models_loaded": loaded, "running": running, "ready": ready and not stopped,
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


def lease_of(session: Session, worker_id: str, lease_seconds: float) -> tuple[float, float] | None:
    """(the last heartbeat, its age by the database's clock) while a process holds ``worker_id``'s lease (it
    did not stop, and its lease has not expired); None once the id is free."""
    row = session.execute(select(Worker.heartbeat_at, db_now() - Worker.heartbeat_at).where(
        Worker.id == worker_id, Worker.stopped_at.is_(None), ~expired(lease_seconds))).one_or_none()
    return None if row is None else (row[0], row[1])


def live_workers(session: Session, lease_seconds: float, started_since: float | None = None) -> dict[str, int]:
    """Live workers per model they serve, loaded or not (a worker of several models loads one when work
    for it comes); ``started_since``: only processes that took their id at or after this time."""
    since = () if started_since is None else (Worker.started_at >= started_since,)
    counts: dict[str, int] = {}
    for model, models in session.execute(select(Worker.model, Worker.models).where(alive(lease_seconds), *since)):
        for served in models or [model]:
            counts[served] = counts.get(served, 0) + 1
    return counts


def loaded_on(session: Session, lease_seconds: float) -> dict[str, list[str]]:
    """The live workers that have each model loaded now (as of their last heartbeat), by id."""
    where: dict[str, list[str]] = {}
    for worker_id, loaded in session.execute(select(Worker.id, Worker.models_loaded).where(alive(lease_seconds))
                                             .order_by(Worker.id)):
        for model in loaded or ():
            where.setdefault(model, []).append(worker_id)
    return where


class WorkerState(NamedTuple):
    id: str
    model: str                # the first it serves
    alive: bool
    running: int              # engine requests in flight at its last heartbeat
    state: str                # ready | loading | reloading | draining as it reported; lost once its lease expired
    tokens_per_second: float
    models: list[str]         # every model it serves
    models_loaded: list[str]  # those loaded at its last heartbeat


LOST_SHOWN_SECONDS = 3600  # a worker that stopped heartbeating is shown as lost for an hour, then left out


def worker_states(session: Session, lease_seconds: float) -> list[WorkerState]:
    """Every worker that did not stop, by id, but those lost for over LOST_SHOWN_SECONDS (long gone: a
    worker ended without its last heartbeat, or a node lost, would be a series of ``lmsp_worker_up 0``
    for ever): one query of the workers table, no scan of anything else."""
    recent = (Worker.heartbeat_at > db_now() - LOST_SHOWN_SECONDS,)
    out = []
    for wid, model, up, running, state, ready, rate, lost, models, loaded in session.execute(select(
            Worker.id, Worker.model, alive(lease_seconds), Worker.running, Worker.state, Worker.ready,
            Worker.tokens_per_second, expired(lease_seconds), Worker.models, Worker.models_loaded)
            .where(Worker.stopped_at.is_(None), *recent).order_by(Worker.id)):
        state = "lost" if lost else state or ("ready" if ready else "loading")
        out.append(WorkerState(wid, model, bool(up), running or 0, state, rate or 0.0, models or [model],
                               loaded or []))
    return out


def expired_workers(session: Session, lease_seconds: float, me: str) -> list[str]:
    return [w for w in session.execute(select(Worker.id).where(expired(lease_seconds))).scalars() if w != me]


def worker_expired(session: Session, worker_id: str, lease_seconds: float) -> bool:
    return bool(session.execute(select(Worker.id).where(Worker.id == worker_id, expired(lease_seconds))).first())
