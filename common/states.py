"""The task state machine of spec 7.2, applied only through conditional UPDATEs."""

import time

from sqlalchemy import update
from sqlalchemy.orm import Session

QUEUED, LOADING, RUNNING, CANCELLING = "queued", "loading", "running", "cancelling"
SUCCEEDED, FAILED, CANCELLED = "succeeded", "failed", "cancelled"

STATES = (QUEUED, LOADING, RUNNING, CANCELLING, SUCCEEDED, FAILED, CANCELLED)
TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELLED})
UNFINISHED = frozenset(STATES) - TERMINAL

TRANSITIONS: dict[str, frozenset[str]] = {
    QUEUED: frozenset({LOADING, CANCELLED, FAILED}),
    LOADING: frozenset({RUNNING, CANCELLING, FAILED}),
    RUNNING: frozenset({SUCCEEDED, FAILED, CANCELLING}),
    CANCELLING: frozenset({CANCELLED}),
    SUCCEEDED: frozenset(),
    FAILED: frozenset(),
    CANCELLED: frozenset(),
}


def allowed(source: str, target: str) -> bool:
    return target in TRANSITIONS[source]


def sources(target: str) -> list[str]:
    """States from which ``target`` may be reached."""
    return [s for s, targets in TRANSITIONS.items() if target in targets]


def transition(session: Session, task_id: str, target: str, *, only_from=None, **values) -> bool:
    """Move a task to ``target`` with one conditional UPDATE; True if this call won.

    ``only_from`` narrows the allowed source states (e.g. a worker finishing only
    from ``running``). Two racing callers can never both win, and a terminal task
    never matches. The caller commits.
    """
    from common.tables import Task  # the table module imports nothing from here

    allowed_from = sources(target)
    if only_from is not None:
        allowed_from = [s for s in allowed_from if s in set(only_from)]
    if not allowed_from:
        return False
    now = time.time()
    stmt = (update(Task).where(Task.id == task_id, Task.status.in_(allowed_from))
            .values(status=target, updated_at=now, **values))
    if target in TERMINAL:
        stmt = stmt.values(ended_at=now)
    return session.execute(stmt).rowcount == 1
