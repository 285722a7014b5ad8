import json

from flask import Blueprint, g, request
from flask import Response as HttpResponse

from api import params
from api.auth import hold_stream, principal
from api.body import json_body
from api.extensions import services
from api.operations import BODY_ERRORS, PREPARE_ERRORS, bare_answer, json_answer, operation
from api.services import idempotency, tasks
from common import wire
from common.errors import LMSPError
from common.ids import is_id
from common.protocol import TaskRequest, parse
from common.states import STATES

bp = Blueprint("tasks", __name__, url_prefix="/lmsp/v1/tasks")


def _json(shape: wire.Shape, status: int = 200, headers: dict | None = None) -> HttpResponse:
    return HttpResponse(json.dumps(shape.wire()), status=status, mimetype="application/json", headers=headers)


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
    body = json_body()
    who = principal()
    envelope = parse(TaskRequest, body)
    key = idempotency.key_from(request.headers.get("Idempotency-Key"), who, "POST", request.path, body)
    task = tasks.accept(services(), who, body, envelope.on_restart, key)
    return _json(task, 202, {"Location": f"/lmsp/v1/tasks/{task.id}"})


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
    wait = _wait_seconds(params.arg("wait"), svc.settings.max_task_wait_seconds)
    # A held poll holds its thread as a stream does: 429 + Retry-After when no slot is left.
    tag, task = tasks.poll(svc, principal(), task_id, wait, request.if_none_match, on_wait=hold_stream)
    if task is None:
        return HttpResponse(status=304, headers={"ETag": f'"{tag}"'})
    return _json(task, headers={"ETag": f'"{tag}"'})


def _wait_seconds(raw: str | None, cap: int) -> float:
    if raw is None:
        return 0
    seconds = params.number(raw)
    if seconds is None:
        raise LMSPError("invalid_request", f"wait must be a number of seconds >= 0 (at most {cap} are used)",
                        param="wait")
    return min(seconds, cap)


@bp.post("/<task_id>/cancel")
@operation("cancelTask", "Cancel a task (idempotent)", tag="tasks", scope="tasks:cancel",
           answers={200: json_answer("The task in its current state: cancelled, or cancelling until the backend "
                                     "stops", wire.TaskObject)},
           errors=[(404, "task_not_found"), (409, "task_not_cancelable", "The task already succeeded or failed")],
           params=["TaskId"])
def cancel(task_id: str):
    return tasks.cancel(services(), principal(), task_id).wire()


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
    tag, page = tasks.page(services(), principal(), states, limit, cursor, request.if_none_match)
    if page is None:
        return HttpResponse(status=304, headers={"ETag": f'W/"{tag}"'})
    return _json(page, headers={"ETag": f'W/"{tag}"'})


@bp.post("/<task_id>/events/ticket")
@operation("createStreamTicket", "A short-lived ticket to open the task's event stream without a header",
           tag="events", scope="tasks:read", answers={200: json_answer("The ticket", wire.StreamTicket)},
           errors=[(404, "task_not_found")], params=["TaskId"])
def events_ticket(task_id: str):
    """A short-lived ticket that opens this task's event stream without a header (EventSource)."""
    return tasks.ticket(services(), g.identity, task_id).wire()
