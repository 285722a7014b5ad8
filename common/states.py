"""The two state machines: tasks (spec 7.2) and responses (6.2), applied only through conditional UPDATEs.

Only ``common.lifecycle`` calls the transition functions (docs/architecture.md, invariant 10).
"""

import json
from collections import namedtuple
from enum import StrEnum

from sqlalchemy import JSON, bindparam, literal, update
from sqlalchemy.orm import Session

from common.db import Compiled, db_now, driver_row, fetch_batch, json_at, run_batch


class TaskState(StrEnum):
    QUEUED = "queued"
    LOADING = "loading"
    RUNNING = "running"
    CANCELLING = "cancelling"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class ResponseState(StrEnum):
    QUEUED = "queued"            # a direct response no worker has claimed yet (shown as in_progress)
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    INCOMPLETE = "incomplete"
    FAILED = "failed"
    CANCELLED = "cancelled"


QUEUED, LOADING, RUNNING, CANCELLING = TaskState.QUEUED, TaskState.LOADING, TaskState.RUNNING, TaskState.CANCELLING
SUCCEEDED, FAILED, CANCELLED = TaskState.SUCCEEDED, TaskState.FAILED, TaskState.CANCELLED

STATES = tuple(TaskState)
TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELLED})
UNFINISHED = frozenset(STATES) - TERMINAL
LIVE = frozenset({LOADING, RUNNING, CANCELLING})  # states in which an attempt owns the task

TRANSITIONS: dict[TaskState, frozenset[TaskState]] = {
    QUEUED: frozenset({LOADING, CANCELLED, FAILED}),
    LOADING: frozenset({RUNNING, CANCELLING, FAILED}),
    RUNNING: frozenset({SUCCEEDED, FAILED, CANCELLING}),
    CANCELLING: frozenset({CANCELLED}),
    SUCCEEDED: frozenset(),
    FAILED: frozenset(),
    CANCELLED: frozenset(),
}

R = ResponseState
RESPONSE_FINAL = frozenset({R.COMPLETED, R.INCOMPLETE, R.FAILED, R.CANCELLED})
RESPONSE_TRANSITIONS: dict[ResponseState, frozenset[ResponseState]] = {
    R.QUEUED: frozenset({R.IN_PROGRESS, R.FAILED, R.CANCELLED}),
    R.IN_PROGRESS: RESPONSE_FINAL,
    **{final: frozenset() for final in RESPONSE_FINAL},
}

# The task state a response outcome leaves its task in (an incomplete response is a succeeded task, 7.2).
TASK_OUTCOME = {R.COMPLETED: SUCCEEDED, R.INCOMPLETE: SUCCEEDED, R.FAILED: FAILED, R.CANCELLED: CANCELLED}


def allowed(source: str, target: str) -> bool:
    return target in TRANSITIONS[TaskState(source)]


def sources(target: str, table=TRANSITIONS) -> list:
    """States from which ``target`` may be reached."""
    return [s for s, targets in table.items() if target in targets]


def _move(model, row_id: str, target: str, table, only_from, where, values):
    """The conditional UPDATE that moves one row of ``model`` to ``target``, or None if no state may."""
    allowed_from = sources(target, table)
    if only_from is not None:
        allowed_from = [s for s in allowed_from if s in set(only_from)]
    if not allowed_from:
        return None
    now = db_now()  # ended_at is judged by retention and the 410 check: one clock for every replica
    # The sources as parameters of their own, not one expanding list: a statement compiled once
    # (fenced_moves, db.Compiled) binds them as it is.
    stmt = (update(model).where(model.id == row_id, model.status.in_([literal(str(s)) for s in allowed_from]), *where)
            .values(status=target, updated_at=now, **values))
    if table is TRANSITIONS and target in TERMINAL:
        stmt = stmt.values(ended_at=now)
    return stmt


def _won(session: Session, stmt) -> bool:
    return stmt is not None and session.execute(stmt).rowcount == 1


def _row(session: Session, model, stmt):
    return None if stmt is None else session.execute(
        stmt.returning(model).execution_options(populate_existing=True)).scalar_one_or_none()


def transition(session: Session, task_id: str, target: str, *, only_from=None, where=(), **values) -> bool:
    """Move a task to ``target`` with one conditional UPDATE; True if this call won.

    ``only_from`` narrows the allowed source states; ``where`` adds conditions (the
    fence: the attempt that must still be current). Two racing callers can never
    both win, and a terminal task never matches. The caller commits.
    """
    from common.tables import Task  # the table module imports nothing from here

    return _won(session, _move(Task, task_id, target, TRANSITIONS, only_from, where, values))


_FENCED: dict[tuple, Compiled] = {}


def fenced_moves(session: Session, fence: tuple, params: dict, moves: list[tuple[str, tuple[str, ...]]]) -> list[bool]:
    """Moves of one task, each (target, only_from) with no other value, in order and in one round trip,
    each also conditional on ``fence`` (SQL with parameters ``task_id`` and the rest of ``params``: an
    attempt still current, lifecycle._FENCE); whether each won. Compiled once per move and fence: every
    task that starts and succeeds makes these, and the ORM's UPDATE cost more than the database does."""
    from common.tables import Task

    steps = []
    for target, only_from in moves:
        step = _FENCED.get((target, only_from, fence))
        if step is None:
            step = _FENCED[target, only_from, fence] = Compiled(_move(
                Task, bindparam("task_id"), target, TRANSITIONS, only_from, fence, {}))
        steps.append((step, params))
    return [count == 1 for count in run_batch(session, steps)]


def transition_returning(session: Session, task_id: str, target: str, *, only_from=None, where=(), **values):
    """``transition`` that returns the updated task (None if this call did not win), in one round trip."""
    from common.tables import Task

    return _row(session, Task, _move(Task, task_id, target, TRANSITIONS, only_from, where, values))


def respond(session: Session, response_id: str, target: str, *, only_from=None, where=(), **values) -> bool:
    """The same for a response row."""
    from common.tables import Response

    return _won(session, _move(Response, response_id, target, RESPONSE_TRANSITIONS, only_from, where, values))


_ENDINGS: dict[tuple, tuple] = {}


def respond_returning(session: Session, response_id: str, target: str, *, columns: tuple, **values):
    """``respond`` that returns ``columns`` of the updated row as a named tuple (None if this call did not
    win), in one round trip; compiled once per shape, run with the driver's cursor: every response's
    end makes it. A JSON column's value goes as its JSON text, None as JSON null, as the ORM writes it."""
    from common.tables import Response

    table, key = Response.__table__, (target, tuple(values), tuple(c.key for c in columns))
    entry = _ENDINGS.get(key)
    if entry is None:
        stmt = _move(Response, bindparam("response_id"), target, RESPONSE_TRANSITIONS, None, (),
                     {name: bindparam(f"value_{name}", type_=table.c[name].type) for name in values})
        entry = _ENDINGS[key] = (Compiled(stmt.returning(*columns)), namedtuple("Ended", [c.key for c in columns]),
                                 json_at(columns))
    step, kind, json_places = entry
    params = {f"value_{name}": json.dumps(value) if isinstance(table.c[name].type, JSON) else value
              for name, value in values.items()}
    rows = fetch_batch(session, [(step, {"response_id": response_id, **params})])[0]
    return driver_row(kind, rows[0], json_places, session.get_bind().dialect.name == "postgresql") if rows else None
