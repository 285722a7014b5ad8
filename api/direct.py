"""The direct path (spec 6.1) that every synchronous or streamed generation endpoint runs on:
``POST /responses`` and ``POST /chat/completions`` differ only in how they word the request and the
outcome. A direct response has no task: the api subscribes to its events, commits it, sends it to a
worker and relays what comes back; a client that goes away aborts it (docs/architecture.md,
invariant 9), whether it reads a stream or waits for one answer.
"""

import json
import logging
import select
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from flask import Response, request

from api.auth import hold_stream, principal
from api.extensions import request_session, services
from api.live import follow, stream_error
from api.operations import BODY_ERRORS, PREPARE_ERRORS
from api.problems import problem_response
from api.services import idempotency
from api.services.validation import Prepared, prepare
from api.services.work import DirectWatch, drop_direct, response_of, submit_direct
from common import events
from common.errors import TRANSIENT, LMSPError, Problem, problem
from common.events import Event

log = logging.getLogger("lmsp.api")

# The problems of every direct request, in its endpoint's operation (api/operations.py) with its own.
ERRORS = (PREPARE_ERRORS, (409, "idempotency_key_in_use"), *BODY_ERRORS, (422, "idempotency_key_reused"),
          (500, "server_error", "generation_failed", "server_restarted",
           "A synchronous request whose generation failed answers the response's problem"),
          (429, "rate_limited", "Too many open streams (or requests waiting for a model) for this principal "
           "or this server"))
GONE_CHECK_SECONDS = 0.2  # how often a waiting request looks at its client's socket


@dataclass
class Direct:
    """One direct response under way for this request."""
    svc: object
    response_id: str
    prepared: Prepared
    key: idempotency.Key | None
    events: Iterator[Event | None]  # None: nothing happened for a heartbeat


@dataclass
class Done:
    """An Idempotency-Key's finished request: its outcome again (9.2), as the endpoint kept it."""
    status: int
    body: str
    stream: bool


def begin(body, asked=None) -> Direct | Done:
    """Validate ``body`` (a ``ResponseRequest``'s JSON) and start generating it for this request;
    ``asked``: the body as the client sent it, when ``body`` is a translation (what a key is bound to)."""
    svc = services()
    who = principal()
    key = idempotency.key_from(request.headers.get("Idempotency-Key"), who, "POST", request.path,
                               body if asked is None else asked)
    session = request_session()  # the one authentication opened; submit_direct commits and closes it
    prepared = prepare(session, svc, who, body)
    hold_stream()  # the request holds this thread while the model generates
    if key is not None:
        done = svc.claims.begin(key)
        if done is not None:
            return Done(done.status_code, done.body, prepared.request.stream)
    try:
        return launch(svc, who, prepared, key, session)
    except BaseException:
        if key is not None:
            svc.claims.abandon(key)  # whatever went wrong, the key is free again at once
        raise


def launch(svc, who: str, prepared: Prepared, key: idempotency.Key | None = None, session=None) -> Direct:
    """Start generating ``prepared`` for principal ``who``, subscribed to its events before the commit
    (also WebSocket mode's lanes, api/services/lanes.py, which hold no request)."""
    subscription, live = None, True

    def subscribe(response_id: str) -> None:
        nonlocal subscription  # Redis confirms while Postgres commits
        subscription = svc.hub.subscribe(response_id, confirm=False)

    def confirmed(_response_id: str) -> bool:
        nonlocal live  # before the dispatch: the first event cannot be published to nobody
        live = svc.hub.confirm(subscription)
        return live

    try:
        response_id, sent = submit_direct(svc, who, prepared, before_commit=subscribe, before_dispatch=confirmed,
                                          session=session)
    except BaseException:
        if subscription is not None:
            subscription.close()
        raise
    watch = DirectWatch(svc, response_id, prepared.spec, logged=not live, sent=sent)
    return Direct(svc, response_id, prepared, key, _events(svc, response_id, subscription, watch))


def _events(svc, response_id, subscription, ended: DirectWatch):
    for batch in follow(svc.hub, response_id, 0, logged=False, heartbeat=svc.settings.sse_heartbeat_seconds,
                        ended=ended, subscription=subscription):
        yield from (None,) if batch is None else batch


def outcome(svc, response_id: str, final_name: str, final_data: str) -> tuple[int, str]:
    """(status, body) of a finished direct response: its object, or the problem it failed with."""
    if final_name == events.FAILED:
        # The problem the response failed with, answered for this request (9.3: its instance is the path).
        doc = Problem.model_validate({**json.loads(final_data)["error"], "instance": request.path})
        return doc.status, json.dumps(doc.answer())
    obj = response_of(svc, response_id)
    return 200, json.dumps(None if obj is None else obj.wire())


def answer(status: int, body: str) -> Response:
    """A synchronous outcome (6.2): the endpoint's object, or the problem of a failed generation."""
    if status < 400:
        return Response(body, status=status, mimetype="application/json")
    return problem_response(Problem.model_validate({**json.loads(body), "status": status}), body=body)


def replay(done: Done, frames: Callable[[Event], str] = lambda event: events.sse(*event), end: str = "") -> Response:
    """A finished request's outcome again (9.2); a stream's, kept as its response object, is a stream
    again in the caller's frames, its items each in one delta."""
    if not done.stream or done.status != 200:
        return answer(done.status, done.body)
    text = "".join(map(frames, events.of_response(json.loads(done.body)))) + end
    return Response(text, content_type=events.SSE_TYPE, headers={"Cache-Control": "no-cache"})


def kept_response(svc, response_id: str) -> str | None:
    """What a replay of a stream's Idempotency-Key sends again: its response object, failed ones too."""
    obj = response_of(svc, response_id)
    return None if obj is None else json.dumps(obj.wire())


def keep(svc, key, status: int, body: str, code: str | None) -> None:
    """Keep a final outcome for the key's replays; a transient failure frees the key instead."""
    if code in TRANSIENT:
        svc.claims.abandon(key)
    else:
        svc.claims.finish(key, status, body)


class ClientWatch:
    """Whether the client of a request that writes nothing while it waits has gone. A WSGI app
    learns of a closed connection only when it writes, so the socket is looked at directly: readable
    with nothing to read is the client's FIN (or a reset). A client that half-closes after its request
    counts as gone, as in vLLM's own server. Without a plain socket (TLS, the Flask test client) it
    never says gone."""

    def __init__(self, environ):
        sock = environ.get("gunicorn.socket")
        self.sock = sock if type(sock) is socket.socket else None  # an SSLSocket cannot peek
        self.checked = 0.0

    def gone(self) -> bool:
        now = time.monotonic()
        if self.sock is None or now - self.checked < GONE_CHECK_SECONDS:
            return False
        self.checked = now
        try:
            if not select.select([self.sock], [], [], 0)[0]:
                return False
            return self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except (OSError, ValueError):  # reset, or closed under us
            return True


def wait(run: Direct, finish: Callable[[int, str], tuple[int, str]] = lambda status, body: (status, body)
         ) -> Response:
    """The synchronous answer: the outcome once the final event comes, worded by ``finish`` (the
    response object's or problem's (status, body) -> the endpoint's) and kept for the key. A client
    that goes away meanwhile aborts the generation (recorded cancelled, as a closed stream is)."""
    svc, finished = run.svc, False
    client = ClientWatch(request.environ)
    try:
        for event in run.events:
            if event is not None and event[1] in events.FINAL:
                status, body = finish(*outcome(svc, run.response_id, event[1], event[2]))
                if run.key is not None:
                    keep(svc, run.key, status, body, json.loads(body).get("code") if status >= 400 else None)
                finished = True
                return answer(status, body)
            if client.gone():
                return Response(status=204)  # written to no one: the socket is closed
    finally:
        run.events.close()
        if not finished:  # the client went away, or the server failed
            drop_direct(svc, run.response_id)
            if run.key is not None:
                svc.claims.abandon(run.key)
    raise AssertionError("follow() ends only after a final event")


def stream_problem(exc: Exception) -> dict:
    """What ends a direct stream that failed with ``exc``: its problem (the api process restarting), or
    a failure of ours, logged."""
    if isinstance(exc, LMSPError):
        return exc.to_problem()
    log.error("direct stream failed", exc_info=exc)
    return problem("server_error", "The stream failed; send the request again")


def stream(run: Direct, frames: Callable[[Event], str] = lambda event: events.sse(*event), end: str = "",
           failed: Callable[[int, dict], str] = stream_error) -> Iterator[str]:
    """The streamed answer: ``frames(event)`` for each event (SSE text, "" for none), ``end`` after the
    final one, ``failed(position, problem)`` if the stream fails (the last id sent, as on a task's
    stream: an error is not one of the response's events); the response object is kept for the key's
    replays."""
    svc, last, finished = run.svc, 0, False
    try:
        for event in run.events:
            if event is None:
                yield events.HEARTBEAT  # lets WSGI notice a closed client within a heartbeat
                continue
            last, name, data = event
            yield frames(event)
            if name in events.FINAL:
                finished = True
                if run.key is not None:
                    kept = kept_response(svc, run.response_id)
                    if kept is None:  # lost by a database crash: nothing to replay
                        svc.claims.abandon(run.key)
                    else:
                        keep(svc, run.key, 200, kept, (json.loads(data).get("error") or {}).get("code"))
                if end:
                    yield end
                return
    except Exception as exc:  # noqa: BLE001 - the stream must end with an event, never half a line
        yield failed(last, stream_problem(exc))
    finally:
        run.events.close()
        if not finished:
            drop_direct(svc, run.response_id)
            if run.key is not None:
                svc.claims.abandon(run.key)

