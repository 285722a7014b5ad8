import json

from flask import Blueprint, Response, request, stream_with_context

from api.auth import hold_stream, principal, streamed
from api.body import json_body
from api.extensions import request_session, services
from api.live import follow, stream_error
from api.operations import BODY_ERRORS, PREPARE_ERRORS, json_answer, operation, sse_answer
from api.problems import problem_response
from api.services import idempotency
from api.services.validation import prepare
from api.services.work import DirectWatch, abort_direct, create_direct, response_json, stored_response
from common import events, wire
from common.errors import TRANSIENT
from common.protocol import ResponseRequest

bp = Blueprint("responses", __name__, url_prefix="/lmsp/v1/responses")


@bp.post("")
@operation(
    "createResponse", "Generate a response, synchronously or as a stream", tag="responses", scope="responses:write",
    answers={200: json_answer(
        "With `stream: false`: the finished response object (status completed, incomplete or cancelled; a "
        "failed generation answers its problem instead). With `stream: true`: server-sent events (6.3), ids 1, "
        "2, ... from response.created to the one final event. A direct stream cannot be resumed.", wire.Response,
        also=sse_answer("", "Server-sent events: `id:`, `event:` and a JSON `data:` line per event; "
                            "`: keep-alive` comments in between"))},
    errors=[PREPARE_ERRORS,
            (404, "model_not_found", "response_not_found", "response_not_found names previous_response_id"),
            (409, "idempotency_key_in_use"), *BODY_ERRORS, (422, "idempotency_key_reused"),
            (500, "server_error", "generation_failed", "server_restarted",
             "A synchronous request whose generation failed answers the response's problem"),
            (429, "rate_limited", "Too many open streams (or requests waiting for a model) for this principal "
             "or this server"),
            (503, "model_unavailable", "No live worker serves the model")],
    description="An Idempotency-Key replays the stored outcome (status and body) of a finished request: the "
                "response object, or the problem it failed with; a finished stream's replay is a stream again, "
                "its items each in one delta, ending with the same final event. A request that ended without "
                "an outcome (its client went away) frees its key.\n\n"
                "The OpenAI SDK's spellings are accepted too, and stored as LMSP's: `input` as a string (one "
                "user message), items as `{role, content}` without `type` (messages), `instructions` (a system "
                "message before the input) and `text.format` (another spelling of `response_format`, its "
                "json_schema with `name` and `schema` at the top; giving both is a 400 with param `text`). "
                "`background: true` is refused: create a task. Every event's data starts with `type` (its "
                "name) and `sequence_number` (its id).",
    params=["IdempotencyKey"], body=ResponseRequest)
def create():
    svc = services()
    body = json_body()
    who = principal()
    key = idempotency.key_from(request.headers.get("Idempotency-Key"), who, "POST", request.path, body)
    session = request_session()  # the one authentication opened; create_direct commits and closes it
    prepared = prepare(session, svc, who, body)
    hold_stream()  # the request holds this thread while the model generates
    if key is not None:
        done = svc.claims.begin(key)
        if done is not None:
            return _replay(done.status_code, done.body, prepared.request.stream)
    subscription, live = None, True

    def subscribe(response_id: str) -> None:
        nonlocal subscription  # Redis confirms while Postgres commits
        subscription = svc.hub.subscribe(response_id, confirm=False)

    def confirmed(_response_id: str) -> bool:
        nonlocal live  # before the dispatch: the first event cannot be published to nobody
        live = svc.hub.confirm(subscription)
        return live

    try:
        response_id = create_direct(svc, who, prepared, before_commit=subscribe, before_dispatch=confirmed,
                                    session=session)
    except BaseException:
        if subscription is not None:
            subscription.close()
        if key is not None:
            svc.claims.abandon(key)  # whatever went wrong, the key is free again at once
        raise
    events_ = _events(svc, response_id, subscription, DirectWatch(svc, response_id, prepared.spec,
                                                                         logged=not live))
    if prepared.request.stream:
        return streamed(Response(stream_with_context(_stream(svc, response_id, key, events_)),
                                 content_type=events.SSE_TYPE,
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}))
    return _wait(svc, response_id, key, events_)


def _events(svc, response_id, subscription, ended: DirectWatch):
    """The direct stream's events one by one; None for a heartbeat."""
    for batch in follow(svc.hub, response_id, 0, logged=False, heartbeat=svc.settings.sse_heartbeat_seconds,
                        ended=ended, subscription=subscription):
        yield from (None,) if batch is None else batch


def _outcome(svc, response_id, final_name, final_data) -> tuple[int, str]:
    if final_name == events.FAILED:
        # The problem the response failed with, answered for this request (9.3: its instance is the path).
        doc = {**json.loads(final_data)["error"], "instance": request.path}
        return doc.get("status", 500), json.dumps(doc)
    with svc.sessions() as session:
        return 200, json.dumps(response_json(session, response_id))


def _answer(status: int, body: str) -> Response:
    """A synchronous outcome (6.2): the response object, or the problem of a failed generation."""
    if status < 400:
        return Response(body, status=status, mimetype="application/json")
    return problem_response({**json.loads(body), "status": status}, body=body)


def _replay(status: int, body: str, stream: bool) -> Response:
    """A finished request's outcome again (9.2); a stream's is kept as its response object."""
    if not stream or status != 200:
        return _answer(status, body)
    frames = [events.sse(*event) for event in events.Sequence().number(events.of_response(json.loads(body)))]
    return Response("".join(frames), content_type=events.SSE_TYPE, headers={"Cache-Control": "no-cache"})


def _kept(svc, response_id) -> str | None:
    """What a replay of a stream's Idempotency-Key sends again: its response object, failed ones too."""
    with svc.sessions() as session:
        obj = response_json(session, response_id)
    return None if obj is None else json.dumps(obj)


def _keep(svc, key, status: int, body: str, code: str | None) -> None:
    """Keep a final outcome for the key's replays; a transient failure frees the key instead."""
    if code in TRANSIENT:
        svc.claims.abandon(key)
    else:
        svc.claims.finish(key, status, body)


def _wait(svc, response_id, key, events_):
    finished = False
    try:
        for event in events_:
            if event is not None and event[1] in events.FINAL:
                status, body = _outcome(svc, response_id, event[1], event[2])
                if key is not None:
                    _keep(svc, key, status, body, json.loads(body).get("code") if status >= 400 else None)
                finished = True
                return _answer(status, body)
    finally:
        events_.close()
        if not finished:  # the client went away, or the server failed
            abort_direct(svc, response_id)
            if key is not None:
                svc.claims.abandon(key)
    raise AssertionError("follow() ends only after a final event")


def _stream(svc, response_id, key, events_):
    last = 0
    finished = False
    try:
        for event in events_:
            if event is None:
                yield events.HEARTBEAT  # lets WSGI notice a closed client within a heartbeat
                continue
            last, name, data = event
            yield events.sse(last, name, data)
            if name in events.FINAL:
                finished = True
                if key is not None:
                    kept = _kept(svc, response_id)
                    if kept is None:  # lost by a database crash: nothing to replay
                        svc.claims.abandon(key)
                    else:
                        _keep(svc, key, 200, kept, (json.loads(data).get("error") or {}).get("code"))
                return
    except Exception:  # noqa: BLE001 - the stream must end with an event, never half a line
        yield stream_error(last + 1)  # a direct stream is never resumed: the id just goes on
    finally:
        events_.close()
        if not finished:
            abort_direct(svc, response_id)
            if key is not None:
                svc.claims.abandon(key)


@bp.get("/<response_id>")
@operation("getResponse", "A response stored with store: true", tag="responses", scope="responses:read",
           answers={200: json_answer("The response", wire.Response)}, errors=[(404, "response_not_found")],
           params=["ResponseId"])
def get(response_id: str):
    svc = services()
    with svc.sessions() as session:
        return stored_response(session, principal(), response_id)
