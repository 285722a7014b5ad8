"""Following a task's events over SSE (7.4) or WebSocket, resumable with after / Last-Event-ID."""

import logging
import time

from flask import Blueprint, Response, g, request, stream_with_context
from flask_sock import ConnectionClosed, Sock

from api import params
from api.auth import check_scope, hold_stream, principal, require, still_authorized, streamed
from api.extensions import services
from api.live import ShuttingDown, follow, stream_error
from common import events
from common.errors import LMSPError
from common.lifecycle import followed_task
from common.states import TERMINAL
from common.tables import Task

log = logging.getLogger("lmsp.events")
bp = Blueprint("events", __name__, url_prefix="/lmsp/v1/tasks")
sock = Sock()


def _after() -> int:
    """The one place that reads the resume point: ``after`` wins over ``Last-Event-ID`` (6.4)."""
    raw, param = params.arg("after"), "after"
    if not raw:
        raw, param = request.headers.get("Last-Event-ID"), "Last-Event-ID"
    if raw is None or raw == "":
        return 0
    after = params.integer(raw)
    if after is None:
        raise LMSPError("invalid_request", f"{param} must be a non-negative integer event id", param=param)
    return after


def _open(task_id: str) -> tuple[str, str, int]:
    """Check access, capability and retention; take a stream slot; return (task id, response id, after)."""
    svc = services()
    after = _after()
    with svc.sessions() as session:
        task = followed_task(session, principal(), task_id)
    expired = task.events_expired or (
        task.status in TERMINAL and task.ended_at is not None
        and time.time() - task.ended_at > svc.settings.event_retention_seconds)
    spec = svc.registry.models.get(task.model)
    if spec is not None and not spec.public_capabilities()["event_resume"]:
        raise LMSPError("unsupported_capability", f"Model {task.model} does not offer event streams "
                        f"(capability event_resume); GET /lmsp/v1/tasks/{task_id} has the result",
                        capability="event_resume")
    if expired:
        raise LMSPError("event_history_expired", f"The events of task {task_id} are past their retention; "
                        f"GET /lmsp/v1/tasks/{task_id} has the final result")
    hold_stream()
    return task.id, task.response_id, after


def _follow(task_id: str, response_id: str, after: int):
    svc = services()

    def ended():
        """A finished task whose log has nothing after ``after`` ends the stream with no event."""
        with svc.sessions() as session:
            task = session.get(Task, task_id)
        return [] if task is None or task.status in TERMINAL else None  # None: purged meanwhile

    return follow(svc.hub, response_id, after, logged=True, heartbeat=svc.settings.sse_heartbeat_seconds,
                  ended=ended, authorized=still_authorized())


@bp.get("/<task_id>/events")
@require("tasks:read")
def sse(task_id: str):
    task_id, response_id, after = _open(task_id)
    batches = _follow(task_id, response_id, after)

    def body():
        last = after
        try:
            for batch in batches:
                if batch is None:
                    yield events.HEARTBEAT
                    continue
                yield events.sse_many(batch)
                last = batch[-1][0]
        except ShuttingDown:
            yield ": this server is shutting down; reconnect with Last-Event-ID to continue\n\n"
        except LMSPError as exc:  # the token was revoked
            yield stream_error(last, exc.to_problem(instance=request.path))
        except Exception:  # noqa: BLE001 - end with an error event, never half a line
            yield stream_error(last)  # the id to resume from: a client reconnecting misses nothing
        finally:
            batches.close()

    return streamed(Response(stream_with_context(body()), content_type=events.SSE_TYPE,
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}))


@bp.before_request
def _ws_preflight():
    # flask-sock completes the handshake before calling the view: check access first,
    # so a refusal is an HTTP problem document, not a broken socket.
    if request.endpoint == "events.ws":
        check_scope("tasks:read")
        g.ws_target = _open(request.view_args["task_id"])


@sock.route("/<task_id>/ws", bp=bp)
def ws(socket, task_id: str):
    batches = _follow(*g.ws_target)
    try:
        for batch in batches:
            if not socket.connected:
                return  # the client left (or missed its pongs): free the thread
            while socket.receive(timeout=0) is not None:
                pass  # the client has nothing to say here: what it sends anyway must not pile up
            for event in batch or ():
                socket.send(events.ws_frame(*event))
    except ShuttingDown:
        socket.close(reason=1012, message="server restarting; reconnect with after to continue")
        return
    except LMSPError as exc:
        socket.close(reason=1008, message=exc.detail)  # policy violation: the token was revoked
        return
    except ConnectionClosed:
        return
    except Exception:  # noqa: BLE001 - close with "internal error": the client resumes with after
        log.exception("websocket stream failed")
        socket.close(reason=1011, message="the stream failed; reconnect with after to continue")
        return
    finally:
        batches.close()
    socket.close(reason=1000, message="final event sent")
