import json

from flask import Blueprint, Response, request, stream_with_context

from api.auth import principal, require
from api.body import json_body
from api.extensions import services
from api.live import follow, stream_failed
from api.services import idempotency
from api.services.validation import prepare
from api.services.work import abort_direct, create_direct, final_from_row, response_json, stored_response
from common import events
from common.errors import LMSPError

bp = Blueprint("responses", __name__, url_prefix="/lmsp/v1/responses")


@bp.post("")
@require("responses:write")
def create():
    svc = services()
    body = json_body()
    who = principal()
    key = idempotency.key_from(request.headers.get("Idempotency-Key"), who, "POST", request.path, body)
    with svc.sessions() as session:
        prepared = prepare(session, svc.registry, who, body)
    if key is not None:
        done = idempotency.begin(svc.sessions, key)
        if done is not None:
            return Response(done.body, status=done.status_code,
                            mimetype="application/json" if done.status_code < 400 else "application/problem+json")
    try:
        response_id = create_direct(svc, who, prepared)
    except LMSPError:
        if key is not None:
            idempotency.abandon(svc.sessions, key)
        raise
    if prepared.request.stream:
        return Response(stream_with_context(_stream(svc, response_id, key)), mimetype="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return _wait(svc, response_id, key)


def _events(svc, response_id):
    """The direct stream's events one by one; None for a heartbeat."""
    for batch in follow(svc.hub, response_id, 0, logged=not svc.hub.live,
                        heartbeat=svc.settings.sse_heartbeat_seconds,
                        is_final_in_db=lambda: final_from_row(svc, response_id)):
        yield from (None,) if batch is None else batch


def _outcome(svc, response_id, final_name, final_data) -> tuple[int, str]:
    if final_name == events.FAILED:
        doc = json.loads(final_data)["error"]
        return doc.get("status", 500), json.dumps(doc)
    with svc.sessions() as session:
        return 200, json.dumps(response_json(session, response_id))


def _wait(svc, response_id, key):
    finished = False
    try:
        for event in _events(svc, response_id):
            if event is not None and event[1] in events.FINAL:
                finished = True
                status, body = _outcome(svc, response_id, event[1], event[2])
                if key is not None:
                    idempotency.finish(svc.sessions, key, status, body)
                mimetype = "application/json" if status < 400 else "application/problem+json"
                return Response(body, status=status, mimetype=mimetype)
    finally:
        if not finished:
            abort_direct(svc, response_id)
            if key is not None:
                idempotency.abandon(svc.sessions, key)
    raise LMSPError("server_error", "The stream ended without a final event")


def _stream(svc, response_id, key):
    finished = False
    try:
        for event in _events(svc, response_id):
            if event is None:
                yield ": keep-alive\n\n"  # lets WSGI notice a closed client within a heartbeat
                continue
            seq, name, data = event
            yield events.sse(None if seq == events.UNNUMBERED else seq, name, data)
            if name in events.FINAL:
                finished = True
                if key is not None:
                    idempotency.finish(svc.sessions, key, *_outcome(svc, response_id, name, data))
                return
    except Exception:  # noqa: BLE001 - the stream must end with an event, never half a line
        yield stream_failed()
    finally:
        if not finished:
            abort_direct(svc, response_id)
            if key is not None:
                idempotency.abandon(svc.sessions, key)


@bp.get("/<response_id>")
@require("responses:read")
def get(response_id: str):
    svc = services()
    with svc.sessions() as session:
        return stored_response(session, principal(), response_id)

