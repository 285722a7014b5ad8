"""Following a task's events over SSE (7.4) or WebSocket, resumable with after / Last-Event-ID.

The view checks the request (token, scope, task, capability, retention, stream caps) and then hands
the client's socket to the process's fan-out thread (api/live/, api/handover.py): a follower holds
no api thread. Where the server cannot hand a socket over, an SSE stream is read by its request
thread instead (``follow``), with the same follower underneath.
"""

from flask import Blueprint, Response, request, stream_with_context

from api import params
from api.auth import hold_follower, hold_stream, principal, still_authorized, streamed
from api.extensions import services
from api.handover import Handover, can_detach, chunked
from api.live import SHUTDOWN_NOTE, ShuttingDown, follow, stream_error, ws_accept
from api.operations import bare_answer, operation, ref, sse_answer
from api.services.streams import ended_check, open_stream
from api.websocket import check_handshake
from common import events, wire
from common.errors import LMSPError

bp = Blueprint("events", __name__, url_prefix="/lmsp/v1/tasks")
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _open(task_id: str) -> tuple[str, str, int]:
    """Check access, capability and retention; return (task id, response id, after)."""
    after = params.resume_point("after")
    return (*open_stream(services(), principal(), task_id), after)


def _hand_over(task_id: str, response_id: str, after: int, *, ws: bool, status: int, headers: dict) -> Response:
    svc = services()
    ended, authorized, path = ended_check(svc, task_id), still_authorized(), request.path
    chunks = not ws and chunked(request.environ)

    def take(sock, release):
        svc.hub.attach(sock, ws=ws, chunked=chunks, path=path, response_id=response_id, after=after,
                       ended=ended, authorized=authorized, on_close=release)

    hold_follower()
    return Handover(take, status, headers)


@bp.get("/<task_id>/events")
@operation("taskEvents", "Follow a task's events (SSE), resumable", tag="events", scope="tasks:read",
           answers={200: sse_answer("The missed events, then live ones; closed after the final event",
                                    "Server-sent events, each with an integer `id` (1, 2, ...), an `event` name "
                                    "and a JSON `data` line")},
           errors=[(400, "invalid_request", "unsupported_capability", "`after` or Last-Event-ID is not a "
                    "non-negative integer; unsupported_capability: the task's model lacks event_resume"),
                   (404, "task_not_found"),
                   (410, "event_history_expired", "Fetch the final result with GET /lmsp/v1/tasks/{task_id}")],
           params=["TaskId", "After", "LastEventId", "Ticket"])
def sse(task_id: str):
    task_id, response_id, after = _open(task_id)
    if request.method == "HEAD":  # the stream's headers and no stream (RFC 9110 9.3.2): nobody follows
        return Response(content_type=events.SSE_TYPE, headers=STREAM_HEADERS)
    return follow_sse(task_id, response_id, after)


def follow_sse(task_id: str, response_id: str, after: int) -> Response:
    """The SSE answer that follows the events of a task whose stream may open (``open_stream``) after
    ``after``: also a background response's (api/views/stored.py)."""
    if can_detach(request.environ):
        return _hand_over(task_id, response_id, after, ws=False, status=200,
                          headers={"Content-Type": events.SSE_TYPE, **STREAM_HEADERS})
    hold_stream()  # this request's thread reads the follower
    svc = services()
    batches = follow(svc.hub, response_id, after, logged=True, heartbeat=svc.settings.sse_heartbeat_seconds,
                     ended=ended_check(svc, task_id), authorized=still_authorized())

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
            yield SHUTDOWN_NOTE
        except LMSPError as exc:  # the token was revoked, or the log expired under the replay
            yield stream_error(last, exc.to_problem(instance=request.path))
        except Exception:  # noqa: BLE001 - end with an error event, never half a line
            yield stream_error(last)  # the id to resume from: a client reconnecting misses nothing
        finally:
            batches.close()

    return streamed(Response(stream_with_context(body()), content_type=events.SSE_TYPE, headers=STREAM_HEADERS))


# websocket=True: werkzeug routes only upgrade requests here, and answers others (or an upgrade
# elsewhere) with WebsocketMismatch, a problem document (api/problems.py).
@bp.get("/<task_id>/ws", websocket=True)
@operation("taskEventsWebSocket", "Follow a task's events over a WebSocket, resumable", tag="events",
           scope="tasks:read",
           answers={101: bare_answer("Switching protocols. One text frame per event (WebSocketFrame: "
                                     "`{\"id\":n,\"event\":name,\"data\":{...}}`); the server closes with 1000 "
                                     "after the final event; 1008 when the token is revoked, 1012 when the server "
                                     "restarts, 1011 when the stream fails (reconnect with `after`).",
                                     models=(wire.WebSocketFrame,), **{"x-lmsp-frame": ref("WebSocketFrame")})},
           # Scope, task, capability, retention and `after` are checked before the handshake (``_open``),
           # so they answer with a status, as on the SSE endpoint.
           errors=[(400, "invalid_request", "unsupported_capability",
                    "Not a WebSocket handshake (param names the header), or a bad `after`"),
                   (404, "task_not_found"), (410, "event_history_expired")],
           description="Same events and resumption (`after`, Last-Event-ID) as the SSE endpoint.",
           params=["TaskId", "After", "LastEventId"])
def ws(task_id: str):
    # Access first (404, 403, 410 ...), then the handshake: every refusal is an HTTP problem document.
    task_id, response_id, after = _open(task_id)
    key = check_handshake()
    if not can_detach(request.environ):
        raise LMSPError("invalid_request", "WebSockets need the api's own server (lmsp serve); follow "
                        "the events over SSE at .../events")
    return _hand_over(task_id, response_id, after, ws=True, status=101, headers={
        "Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Accept": ws_accept(key)})
