"""WebSocket mode of the Responses API: ``GET /lmsp/v1/responses`` upgraded (the OpenAI SDK's
``client.responses.connect()``), with flask-sock. A connection reads and writes for its whole life, so
it holds its api thread (and a stream slot, as a direct stream does), plus a thread per lane at work
(api/services/lanes.py); the fan-out thread of task followers (api/live/) is not involved.

Everything that can refuse a connection is checked before the handshake, so a refusal is a problem
document with its HTTP status; after it, errors are ``error`` events and the socket stays open.
"""

import logging
import time

import flask_sock
from flask import Blueprint, current_app, g, request
from flask_sock import Sock
from simple_websocket import ConnectionClosed, Server
from wsproto.events import CloseConnection, Ping

from api.auth import check_scope, hold_stream, principal, still_authorized
from api.extensions import services
from api.live.websocket import PING_FLOOD, PING_WINDOW
from api.operations import EVENT_KINDS, EVENTS, bare_answer, operation
from api.ratelimit import StreamSlots
from api.services.lanes import Connection, error_event
from api.websocket import check_handshake
from common.errors import LMSPError, problem

log = logging.getLogger("lmsp.api")
bp = Blueprint("realtime", __name__, url_prefix="/lmsp/v1/responses")
sock = Sock()
GOING_AWAY, POLICY_VIOLATION, INTERNAL_ERROR, SERVICE_RESTART = 1001, 1008, 1011, 1012  # RFC 6455 7.4.1, IANA


class _PingBudget:
    """simple_websocket's wsproto connection, whose events end in a close (1008) once the client has sent
    more than PING_FLOOD pings in a PING_WINDOW, as a task follower's do (api/live/websocket.py):
    simple_websocket answers every ping on the connection's thread, so a flood cost a core."""

    def __init__(self, conn):
        self._conn, self._pings, self._window = conn, 0, 0.0

    def events(self):
        for event in self._conn.events():
            if isinstance(event, Ping):
                now = time.monotonic()
                if now - self._window >= PING_WINDOW:
                    self._window, self._pings = now, 0
                self._pings += 1
                if self._pings > PING_FLOOD:
                    yield CloseConnection(POLICY_VIOLATION, "too many pings")  # answered with our close
                    return  # the rest of the input is not parsed
            yield event

    def __getattr__(self, name):
        return getattr(self._conn, name)


class _Server(Server):
    def handshake(self):  # (before the connection's thread starts)
        super().handshake()
        self.ws = _PingBudget(self.ws)


flask_sock.Server = _Server  # what flask-sock's routes make their connection with: it takes no class
SCOPE = "responses:write"
SLOTS = "lmsp.realtime"  # app.extensions: the connections per principal (a StreamSlots)


@bp.record_once
def _setup(state) -> None:
    settings = state.app.extensions["lmsp"].settings
    # simple_websocket (under flask-sock) pings, so a vanished client is noticed; a message larger than a
    # request body closes the socket (1009).
    state.app.config["SOCK_SERVER_OPTIONS"] = {"ping_interval": settings.ws_ping_seconds,
                                               "max_message_size": settings.max_body_bytes}
    state.app.extensions[SLOTS] = StreamSlots(settings.api_threads, settings.ws_max_connections_per_principal)


@bp.before_request
def _admit() -> None:
    """Scope, handshake, server and caps, before the 101."""
    check_scope(SCOPE)
    check_handshake()
    if "gunicorn.socket" not in request.environ and "werkzeug.socket" not in request.environ:
        raise LMSPError("invalid_request", "WebSocket mode needs the api's own server (lmsp serve); use "
                        "POST /lmsp/v1/responses with stream: true")
    g.release_socket = current_app.extensions[SLOTS].acquire(principal())
    hold_stream()  # the connection holds this thread for its life


@bp.teardown_request
def _release(_exc) -> None:
    release = g.pop("release_socket", None)
    if release is not None:
        release()


def connect(ws) -> None:
    svc = services()
    settings = svc.settings
    authorized = still_authorized()
    conn = Connection(svc, principal(), ws.send)
    deadline = time.monotonic() + settings.ws_max_connection_seconds
    try:
        while not conn.closed.is_set():
            if svc.hub.closing.is_set() and conn.idle():  # SIGTERM: what runs may finish within the grace
                ws.close(SERVICE_RESTART, "The server restarts; reconnect")
                return
            left = deadline - time.monotonic()
            if left <= 0:
                ws.close(GOING_AWAY, f"A connection lives {settings.ws_max_connection_seconds:g} s; reconnect")
                return
            if not authorized():
                conn.send(error_event(LMSPError("unauthorized", "The token was revoked").to_problem()))
                ws.close(POLICY_VIOLATION, "The token was revoked")
                return
            message = ws.receive(timeout=min(left, settings.stream_auth_recheck_seconds))
            if message is not None:
                conn.receive(message)
    except ConnectionClosed:
        raise  # the client went away (flask-sock's to catch)
    except Exception:  # noqa: BLE001 - past the 101 an HTTP answer cannot be sent: an error event and 1011
        log.exception("WebSocket connection failed")
        conn.send(error_event(problem("server_error", "The connection failed; reconnect")))
        ws.close(INTERNAL_ERROR, "The connection failed; reconnect")
    finally:
        conn.close()


sock.route("", bp=bp)(operation(
    "responsesWebSocket", "WebSocket mode: create responses over one connection", tag="responses", scope=SCOPE,
    answers={101: bare_answer(
        "Switching protocols. The client sends `response.create` events: `{\"type\": \"response.create\", "
        "...}` with the fields of createResponse's body, flat, without `stream` or `background`, plus "
        "`stream_id` (a lane; none: the default lane) and `generate` (false: a completed response without "
        "output, to continue from). A lane runs its responses one at a time, first in first out, beside "
        "the other lanes (at most LMSP_WS_MAX_LANES at work). The server sends each response's events as "
        "createResponse streams them, one JSON text message each (the SSE data, with the lane's "
        "`stream_id`); a refused or failed request is `{\"type\": \"error\", \"error\": {problem, "
        "message}, \"status\": n}`. `previous_response_id` reads the connection's own finished responses, "
        "then stored ones. Closing the socket aborts its generations. The server closes with 1001 after "
        "LMSP_WS_MAX_CONNECTION_SECONDS, with 1008 when the token is revoked and with 1012 when it restarts.",
        models=EVENT_KINDS, **EVENTS)},
    errors=[(400, "invalid_request", "A bad WebSocket handshake (param names the header)"),
            (405, "method_not_allowed", "Not an upgrade request: a plain GET is not allowed here"),
            (429, "rate_limited", "Too many connections (LMSP_WS_MAX_CONNECTIONS_PER_PRINCIPAL) or streams "
             "open for this principal on this server")],
    description="The OpenAI SDK's `client.responses.connect()` (`base_url` ending in /lmsp/v1)."
)(connect))
