import hashlib
import json
import time

from flask import Blueprint, Response, g, request

from api import params
from api.auth import hold_stream, principal
from api.body import json_body
from api.extensions import request_session, services
from api.operations import BODY_ERRORS, PREPARE_ERRORS, bare_answer, json_answer, operation
from api.services import idempotency, tickets
from api.services.validation import prepare
from api.services.work import (
    cancel_task,
    get_task,
    list_tasks_page,
    list_tasks_rows,
    new_task_once,
    page_etag,
    send_task,
    task_view,
)
from common import wire
from common.errors import LMSPError
from common.events import REASONING_DELTA, TEXT_DELTA
from common.ids import is_id
from common.protocol import TaskRequest, parse
from common.states import LOADING, QUEUED, STATES, TERMINAL

bp = Blueprint("tasks", __name__, url_prefix="/lmsp/v1/tasks")
# A long poll re-reads the task when its response's channel carries anything but text (or anything
# at all before the task runs: loading -> running publishes no event, its first text says it), and
# on this timer: queued -> loading publishes nothing, and a notification may be lost.
WAIT_RECHECK_SECONDS = 5.0
WAIT_RECHECK_WITHOUT_REDIS = 0.5
TEXT_ONLY = frozenset({TEXT_DELTA, REASONING_DELTA})
NOT_STARTED = frozenset({QUEUED, LOADING})


def _accepted(doc: dict) -> Response:
    return Response(json.dumps(doc), status=202, mimetype="application/json",
                    headers={"Location": f"/lmsp/v1/tasks/{doc['id']}"})


@bp.post("")
@operation("createTask", "Create a durable task (persisted before the answer)", tag="tasks", scope="tasks:write",
           answers={202: json_answer("The task, queued; replayed in its current state for a repeated "
                                     "Idempotency-Key", wire.TaskObject, "Location")},
           errors=[PREPARE_ERRORS + ("unsupported_capability is also on_restart resume on a model without "
                                     "resume_snapshots",),
                   (404, "model_not_found", "response_not_found", "task_not_found",
                    "task_not_found: the task of a replayed Idempotency-Key no longer exists"),
                   *BODY_ERRORS, (422, "idempotency_key_reused"),
                   (429, "rate_limited", "Too many queued tasks for this principal"),
                   (503, "overloaded", "model_unavailable", "overloaded: the model's queue is full; "
                    "model_unavailable: the api cannot read the model's tokenizer")],
           description="The key is recorded in the task's own transaction, so a task request is never seen in "
                       "flight (no 409).",
           params=["IdempotencyKey"], body=TaskRequest)
def create():
    svc = services()
    body = json_body()
    who = principal()
    envelope = parse(TaskRequest, body)
    key = idempotency.key_from(request.headers.get("Idempotency-Key"), who, "POST", request.path, body)
    with request_session() as session:  # the one authentication opened: one checkout per request
        if key is not None and (record := idempotency.existing(session, key)) is not None:
            return _replay(session, who, idempotency.check_replay(record, key))
        try:
            prepared = prepare(session, svc, who, {**body["input"], "stream": False})
        except LMSPError as exc:
            exc.param = f"input.{exc.param}" if exc.param else exc.param  # the field is inside the envelope
            raise
        task, made = new_task_once(svc, session, who, prepared, envelope.on_restart, key)
        doc = task_view(session, task, svc.registry)
    if made:
        send_task(svc, task)
    return _accepted(doc)


def _replay(session, who, record) -> Response:
    return _accepted(task_view(session, get_task(session, who, record.task_id), services().registry))


@bp.get("/<task_id>")
@operation("getTask", "A task (long poll with wait, conditional with If-None-Match)", tag="tasks",
           scope="tasks:read",
           answers={200: json_answer("The task", wire.TaskObject, "ETag"),
                    304: bare_answer("The task still matches If-None-Match", "ETag")},
           errors=[(400, "invalid_request", "`wait` is not a number of seconds >= 0"), (404, "task_not_found")],
           params=["TaskId", "Wait", "IfNoneMatch"])
def get(task_id: str):
    """The task; ``?wait=N`` holds the answer until it differs from the If-None-Match ETag (or from
    the task as it was when the request came) or N seconds pass; 304 when the client's ETag still holds."""
    svc = services()
    who = principal()
    wait = _wait_seconds(params.arg("wait"), svc.settings.max_task_wait_seconds)
    doc = _read(svc, who, task_id)
    given = request.if_none_match  # empty when the header is absent
    first = etag(doc)
    unchanged = given.contains_weak if given else first.__eq__
    if wait and unchanged(first) and doc["status"] not in TERMINAL:
        hold_stream()  # it holds its thread as a stream does: 429 + Retry-After when no slot is left
        doc = _wait_for_change(svc, who, task_id, doc["response_id"], unchanged, wait)
    tag = etag(doc)
    if given.contains_weak(tag):
        return Response(status=304, headers={"ETag": f'"{tag}"'})
    return Response(json.dumps(doc), mimetype="application/json", headers={"ETag": f'"{tag}"'})


def etag(doc: dict) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]


def _read(svc, who: str, task_id: str) -> dict:
    with svc.sessions() as session:
        return task_view(session, get_task(session, who, task_id), svc.registry)


def _wait_seconds(raw: str | None, cap: int) -> float:
    if raw is None:
        return 0
    seconds = params.number(raw)
    if seconds is None:
        raise LMSPError("invalid_request", f"wait must be a number of seconds >= 0 (at most {cap} are used)",
                        param="wait")
    return min(seconds, cap)


def _wait_for_change(svc, who: str, task_id: str, response_id: str, unchanged, wait: float) -> dict:
    deadline = time.monotonic() + wait
    recheck = WAIT_RECHECK_SECONDS if svc.hub.connected else WAIT_RECHECK_WITHOUT_REDIS
    with svc.hub.watch(response_id) as sub:
        while True:
            # Read after subscribing: a change between the first read and the subscription is seen here.
            doc = _read(svc, who, task_id)
            read_at = time.monotonic()
            if not unchanged(etag(doc)) or doc["status"] in TERMINAL or read_at >= deadline:
                return doc
            while (now := time.monotonic()) < min(deadline, read_at + recheck):
                batch = sub.get(timeout=min(deadline, read_at + recheck) - now)
                if batch is not None and (doc["status"] in NOT_STARTED
                                          or not all(name in TEXT_ONLY for _, name, _ in batch)):
                    break  # a state event, a first token (or a reconnect, []): read the task again


@bp.post("/<task_id>/cancel")
@operation("cancelTask", "Cancel a task (idempotent)", tag="tasks", scope="tasks:cancel",
           answers={200: json_answer("The task in its current state: cancelled, or cancelling until the backend "
                                     "stops", wire.TaskObject)},
           errors=[(404, "task_not_found"), (409, "task_not_cancelable", "The task already succeeded or failed")],
           params=["TaskId"])
def cancel(task_id: str):
    return cancel_task(services(), principal(), task_id)


# -- the task list (an extension of the spec: GET /lmsp/v1/tasks) --------------------------------
LIST_LIMIT = 20
MAX_LIST_LIMIT = 100


def _list_query() -> tuple[list[str], int, str | None]:
    args = request.args
    for name in args:
        if name not in ("state", "limit", "cursor"):
            raise LMSPError("invalid_request", f"Unknown query parameter {name!r}; this takes state, limit "
                            "and cursor", param=name)
    states = [s for s in (params.arg("state") or "").split(",") if s]
    for state in states:
        if state not in STATES:
            raise LMSPError("invalid_request", f"state {state!r} is not one of {', '.join(STATES)}",
                            param="state")
    limit = params.integer(params.arg("limit") or str(LIST_LIMIT))
    if limit is None or not 1 <= limit <= MAX_LIST_LIMIT:
        raise LMSPError("invalid_request", f"limit must be an integer from 1 to {MAX_LIST_LIMIT}", param="limit")
    cursor = params.arg("cursor") or None
    if cursor is not None and not is_id("task", cursor):
        raise LMSPError("invalid_request", "cursor must be the next_cursor of a previous page", param="cursor")
    return states, limit, cursor


@bp.get("")
@operation("listTasks", "The principal's tasks, newest first, by cursor (an extension of LMSP 1.0)", tag="tasks",
           scope="tasks:read",
           answers={200: json_answer("A page of tasks", wire.TaskList, "ETag"),
                    304: bare_answer("The page still matches If-None-Match: no task on it came, went or changed "
                                     "state", "ETag")},
           errors=[(400, "invalid_request", "A bad state, limit or cursor")],
           params=["State", "Limit", "Cursor", "IfNoneMatch"],
           description="A client that polls the list sends the ETag it has as If-None-Match; an unchanged "
                       "page answers 304 without a body.")
def list_tasks():
    """The principal's tasks, newest first; ``cursor`` (the last page's ``next_cursor``) pages on;
    304 while the page still matches If-None-Match."""
    states, limit, cursor = _list_query()
    with services().sessions() as session:
        rows = list_tasks_rows(session, principal(), states, limit, cursor)
        tag = page_etag(rows)
        if request.if_none_match.contains_weak(tag):
            return Response(status=304, headers={"ETag": f'W/"{tag}"'})
        doc = list_tasks_page(session, services().registry, rows, limit)
    return Response(json.dumps(doc), mimetype="application/json", headers={"ETag": f'W/"{tag}"'})


@bp.post("/<task_id>/events/ticket")
@operation("createStreamTicket", "A short-lived ticket to open the task's event stream without a header",
           tag="events", scope="tasks:read", answers={200: json_answer("The ticket", wire.StreamTicket)},
           errors=[(404, "task_not_found")], params=["TaskId"])
def events_ticket(task_id: str):
    """A short-lived ticket that opens this task's event stream without a header (EventSource)."""
    with services().sessions() as session:
        get_task(session, principal(), task_id)
        return tickets.mint(session, g.identity, task_id)
