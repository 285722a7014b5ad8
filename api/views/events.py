"""Following a task's events over SSE (7.4) or WebSocket, resumable with after / Last-Event-ID."""

import time

from flask import Blueprint, Response, g, request, stream_with_context
from flask_sock import Sock

from api.auth import check_scope, principal, require
from api.extensions import services
from api.live import follow, stream_failed
from api.services.work import get_task
from common import events
from common.errors import LMSPError
from common.states import TERMINAL

bp = Blueprint("events", __name__, url_prefix="/lmsp/v1/tasks")
sock = Sock()


def _after() -> int:
    raw = request.args.get("after")
    param = "after"
    if not raw:
        raw, param = request.headers.get("Last-Event-ID"), "Last-Event-ID"
    if raw is None or raw == "":
        return 0
    if not raw.isdigit() or len(raw) > 12:
        raise LMSPError("invalid_request", f"{param} must be a non-negative integer event id", param=param)
    return int(raw)


def _open(task_id: str) -> tuple[str, int]:
    """Check access and retention; return (response id, after)."""
    svc = services()
    after = _after()
    with svc.sessions() as session:
        task = get_task(session, principal(), task_id)
        expired = task.events_expired or (
            task.status in TERMINAL and task.ended_at is not None
            and time.time() - task.ended_at > svc.settings.event_retention_seconds)
    if expired:
        raise LMSPError("event_history_expired", f"The events of task {task_id} are past their retention; "
                        f"GET /lmsp/v1/tasks/{task_id} has the final result")
    return task.response_id, after


def _follow(response_id: str, after: int):
    svc = services()
    return follow(svc.hub, response_id, after, logged=True, heartbeat=svc.settings.sse_heartbeat_seconds)


@bp.get("/<task_id>/events")
@require("tasks:read")
def sse(task_id: str):
    response_id, after = _open(task_id)

    def body():
        try:
            for batch in _follow(response_id, after):
                yield ": keep-alive\n\n" if batch is None else "".join(events.sse(*event) for event in batch)
        except Exception:  # noqa: BLE001 - end with an error event, never half a line
            yield stream_failed()

    return Response(stream_with_context(body()), mimetype="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@bp.before_request
def _ws_preflight():
    # flask-sock completes the handshake before calling the view: check access first,
    # so a refusal is an HTTP problem document, not a broken socket.
    if request.endpoint == "events.ws":
        check_scope("tasks:read")
        g.ws_target = _open(request.view_args["task_id"])


@sock.route("/<task_id>/ws", bp=bp)
def ws(socket, task_id: str):
    response_id, after = g.ws_target
    for batch in _follow(response_id, after):
        for event in batch or ():
            socket.send(events.ws_frame(*event))
    socket.close(reason=1000, message="final event sent")
