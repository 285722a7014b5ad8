"""What the task routes ask (api/views/tasks.py): create, read (a long poll, conditional), list, cancel,
and a stream ticket. Each opens and closes its own database work and answers a shape of common/wire.py;
a conditional read answers (its ETag, the shape or None while the client's If-None-Match still holds)."""

import hashlib
import json
import time
from collections import namedtuple
from collections.abc import Callable

from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session
from werkzeug.datastructures import ETags

from api.extensions import Services, request_session
from api.services import idempotency, tickets
from api.services.validation import prepare
from api.services.work import queue_task_once, send_task
from common import lifecycle, timeline, wire
from common.db import Compiled, driver_row, fetch_on, json_at
from common.errors import LMSPError
from common.ids import is_id
from common.resources import task_object
from common.states import FAILED, QUEUED, SUCCEEDED, TERMINAL
from common.tables import Response, Task, TaskAttempt
from common.tokens import Identity

# A long poll re-reads the task at each of its response's notices (hub.watch: a batch with more than
# text, the first text's batch included, as its output item opens; a claim's or a cancel's notice), and
# on this timer: a notice is lost only when its publisher dies between its commit and its publish (a
# lost Redis connection is heard as one), so that change is seen within the longest wait the api grants
# (max_task_wait_seconds' default) or at the client's next poll, whichever comes first. Reads are what
# a waiting poll costs: 0.6 CPU-ms of the api's each, and a round trip to Postgres.
WAIT_RECHECK_SECONDS = 30.0
WAIT_RECHECK_WITHOUT_REDIS = 0.5


def accept(svc: Services, principal: str, body: dict, on_restart: str, key: idempotency.Key | None) -> wire.TaskObject:
    """POST /tasks: the task made of ``body`` (committed, then sent), or the one a repeated
    Idempotency-Key made, as it is now."""
    with request_session() as session:  # the one authentication opened: one checkout per request
        if key is not None and (record := idempotency.existing(session, key)) is not None:
            task = lifecycle.require_task(session, principal, idempotency.check_replay(record, key).task_id)
            return _shown(session, task, svc.registry)
        try:
            prepared = prepare(session, svc, principal, {**body["input"], "stream": False})
        except LMSPError as exc:
            exc.param = f"input.{exc.param}" if exc.param else exc.param  # the field is inside the envelope
            raise
        task, made = queue_task_once(svc, session, principal, prepared, on_restart, key)
        shown = _shown(session, task, svc.registry)
    if made:
        send_task(svc, task)
    return shown


def poll(svc: Services, principal: str, task_id: str, wait: float, given: ETags,
         on_wait: Callable[[], None]) -> tuple[str, wire.TaskObject | None]:
    """The task; with ``wait`` it is held until it differs from ``given`` (or from the task as it was
    when asked) or ``wait`` seconds pass; ``on_wait`` runs before it is held."""
    response_id = _RESPONSE_OF.get((principal, task_id)) if wait and given else None
    if response_id is not None:  # a task this process has read: subscribed first, read once
        tag, task = _wait_for_change(svc, principal, task_id, response_id, given.contains_weak, wait, on_wait)
    else:
        task = read(svc, principal, task_id)
        tag = etag(task)
        unchanged = given.contains_weak if given else tag.__eq__  # given is empty when the header is absent
        if wait and unchanged(tag) and task.status not in TERMINAL:
            tag, task = _wait_for_change(svc, principal, task_id, task.response_id, unchanged, wait, on_wait)
    return tag, None if given.contains_weak(tag) else task


# A task's response id never changes: a process that has read a task (for its principal) knows which
# notices to subscribe to, so the client's next conditional long poll subscribes before its one read,
# not after a read that tells it which (a poll cycle's reads: two, then one). Bounded: cleared when full.
_RESPONSE_OF: dict[tuple[str, str], str] = {}
_RESPONSE_OF_MAX = 20_000  # about 6 MB of keys and ids


# The read a long poll repeats (its first look and each recheck): the task and its attempts joined, one
# statement compiled once, read with the driver's cursor on an autocommit connection (svc.reads): one
# round trip, no session's BEGIN and ROLLBACK, no ORM objects, no SQLAlchemy result per read. A
# succeeded task's response is read once more.
_READ_TASK = (Task.id, Task.type, Task.model, Task.status, Task.on_restart, Task.error, Task.created_at,
              Task.updated_at, Task.ended_at, Task.response_id)
_READ_ATTEMPT = tuple(TaskAttempt.__table__.columns)
_READ = Compiled(select(*_READ_TASK, *(c.label(f"attempt_{c.key}") for c in _READ_ATTEMPT))
                 .outerjoin(TaskAttempt, TaskAttempt.task_id == Task.id)
                 .where(Task.id == bindparam("task_id"), Task.principal_id == bindparam("principal"))
                 .order_by(TaskAttempt.attempt))
TaskRow = namedtuple("TaskRow", [c.key for c in _READ_TASK])
_TASK_JSON = json_at(_READ_TASK)
AttemptRow = namedtuple("AttemptRow", [c.key for c in _READ_ATTEMPT])


def read(svc: Services, principal: str, task_id: str) -> wire.TaskObject:
    with svc.reads.connect() as conn:
        rows = fetch_on(conn, [(_READ, {"task_id": task_id, "principal": principal})])[0] \
            if is_id("task", task_id) else []
        if not rows:
            raise lifecycle.no_task(task_id)
        width = len(_READ_TASK)
        task = driver_row(TaskRow, rows[0][:width], _TASK_JSON, conn.dialect.name == "postgresql")
        attempts = [AttemptRow._make(row[width:]) for row in rows if row[width] is not None]
        response = lifecycle.read_response(conn, task.response_id) if task.status == SUCCEEDED else None
    if len(_RESPONSE_OF) >= _RESPONSE_OF_MAX:
        _RESPONSE_OF.clear()
    _RESPONSE_OF[principal, task.id] = task.response_id
    return _task(task, response, svc.registry, attempts)


def etag(task: wire.TaskObject) -> str:
    return hashlib.sha256(json.dumps(task.wire(), sort_keys=True).encode()).hexdigest()[:32]


def _wait_for_change(svc: Services, principal: str, task_id: str, response_id: str, unchanged, wait: float,
                     on_wait: Callable[[], None]) -> tuple[str, wire.TaskObject]:
    """(ETag, task) once it differs (``unchanged`` false), ends, or ``wait`` passes; ``on_wait`` runs
    before the first wait (a stream slot: a poll answered by its first read holds none)."""
    deadline = time.monotonic() + wait
    waited = False
    with svc.hub.watch(response_id) as sub:
        while True:
            # Read after subscribing: a change before the subscription is seen here.
            task = read(svc, principal, task_id)
            tag, read_at = etag(task), time.monotonic()
            # Asked at each read: Redis going away is heard as a notice, and what changes while it is
            # away publishes none.
            recheck = WAIT_RECHECK_SECONDS if svc.hub.connected else WAIT_RECHECK_WITHOUT_REDIS
            # (SIGTERM: the task as it is now, rather than a reset when the process exits)
            if not unchanged(tag) or task.status in TERMINAL or read_at >= deadline or svc.hub.closing.is_set():
                return tag, task
            if not waited:
                on_wait()
                waited = True
            while (now := time.monotonic()) < min(deadline, read_at + recheck):
                if sub.get(timeout=min(deadline, read_at + recheck) - now) is not None:
                    break  # a notice (or a reconnect, []): read the task again
            else:
                if read_at + recheck > deadline:
                    return tag, task  # the wait is over and nothing was heard since this read: it stands


def page(svc: Services, principal: str, states: list[str], limit: int, cursor: str | None,
         given: ETags) -> tuple[str, wire.TaskList | None]:
    """A page of the principal's tasks, newest first; ``cursor`` (the last page's ``next_cursor``) pages
    on. Its weak ETag is compared before the page is built, so a poll of an unchanged list costs one
    indexed query and no body (the dashboard polls it)."""
    with svc.sessions() as session:
        rows = _rows(session, principal, states, limit, cursor)
        tag = _page_etag(rows)
        if given.contains_weak(tag):
            return tag, None
        return tag, _page(session, svc.registry, rows, limit)


def _rows(session: Session, principal: str, states, limit: int, cursor: str | None) -> list[Task]:
    """A page of tasks and one more if there is one."""
    query = select(Task).where(Task.principal_id == principal)
    if states:
        query = query.where(Task.status.in_(states))
    if cursor is not None:
        query = query.where(Task.id < cursor)  # ids are ULIDs: they sort by creation time
    return list(session.execute(query.order_by(Task.id.desc()).limit(limit + 1)).scalars())


def _page_etag(rows: list[Task]) -> str:
    """Changes whenever the page would: a task comes or goes, or one changes state (each transition
    sets updated_at, a new attempt its number)."""
    key = repr([(t.id, t.status, t.updated_at, t.attempt) for t in rows])
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def _page(session: Session, registry, rows: list[Task], limit: int) -> wire.TaskList:
    page_rows = rows[:limit]
    done = [t.response_id for t in page_rows if t.status == SUCCEEDED]
    responses = {r.id: r for r in session.execute(select(Response).where(Response.id.in_(done))).scalars()}
    attempts = timeline.attempts_of(session, [t.id for t in page_rows])
    data = [_task(t, responses.get(t.response_id), registry, attempts.get(t.id, [])) for t in page_rows]
    more = len(rows) > limit
    return wire.TaskList(data=data, has_more=more, next_cursor=page_rows[-1].id if more else None)


def cancel(svc: Services, principal: str, task_id: str) -> wire.TaskObject:
    with svc.sessions() as session:
        task = lifecycle.require_task(session, principal, task_id)
        if task.status in (SUCCEEDED, FAILED):
            raise LMSPError("task_not_cancelable", f"Task {task_id} already {task.status}")
        notify, publish = lifecycle.cancel(session, task, svc.settings.lease_seconds)
        session.commit()
        svc.publisher.publish_many(publish)
        if notify:
            svc.publisher.abort(task.response_id)
        task = lifecycle.require_task(session, principal, task_id)
        if task.status in (SUCCEEDED, FAILED):  # it finished while we tried
            raise LMSPError("task_not_cancelable", f"Task {task_id} already {task.status}")
        return _shown(session, task, svc.registry)


def ticket(svc: Services, identity: Identity, task_id: str) -> wire.StreamTicket:
    """A ticket that opens the task's event stream without a header (api/services/tickets.py)."""
    with svc.sessions() as session:
        lifecycle.require_task(session, identity.principal, task_id)
        return tickets.mint(session, identity, task_id)


def _shown(session: Session, task: Task, registry) -> wire.TaskObject:
    # A queued task has no attempt yet: a new task's 202 costs no query for its timeline.
    attempts = [] if task.status == QUEUED else timeline.attempts_of(session, [task.id]).get(task.id, [])
    return _task(task, session.get(Response, task.response_id) if task.status == SUCCEEDED else None, registry,
                 attempts)


def _task(task: Task, response: Response | None, registry, attempts=()) -> wire.TaskObject:
    spec = registry.models.get(task.model)  # a model since removed keeps its events readable
    return task_object(task, response, event_resume=spec is None or spec.public_capabilities()["event_resume"],
                       attempts=attempts)
