"""Stored and background responses, as the OpenAI Responses API reads them: GET (a poll, or the events
again with ``stream=true``), cancel, input items, DELETE. ``POST /responses`` itself is
api/views/responses.py, which hands ``background: true`` to ``create_background`` here."""

import json
import time

from flask import Blueprint, Response, request

from api import params
from api.auth import hold_stream, principal
from api.extensions import request_session, services
from api.operations import json_answer, operation, sse_answer
from api.services import background, idempotency, stored
from api.services.streams import open_stream
from api.services.validation import prepare
from api.services.work import send_task
from api.views.events import follow_sse
from common import wire
from common.errors import LMSPError
from common.resources import is_background
from common.tables import Response as ResponseRow

bp = Blueprint("stored", __name__, url_prefix="/lmsp/v1/responses")
CANCEL_WAIT_SECONDS = 5.0  # how long a cancel waits for the worker to stop, to answer the response cancelled
RUNNING = ("queued", "in_progress")
ITEMS_LIMIT, MAX_ITEMS_LIMIT = 20, 100


def create_background(body) -> Response:
    """``POST /responses`` with ``background: true``: a durable task, answered at once with the response
    (``queued``), or with its events from the start when ``stream`` is true too."""
    svc, who = services(), principal()
    key = idempotency.key_from(request.headers.get("Idempotency-Key"), who, "POST", request.path, body)
    with request_session() as session:
        record = idempotency.existing(session, key) if key is not None else None
        made = record is None
        if record is not None:  # the same request again (9.2): the response it made, as it is now
            task, stream = background.replayed(session, who, idempotency.check_replay(record, key)), False
        else:
            prepared = prepare(session, svc, who, body)
            stream = prepared.request.stream
            if stream and not prepared.spec.public_capabilities()["event_resume"]:
                raise LMSPError("unsupported_capability", f"Model {prepared.spec.id} cannot stream a background "
                                "response (capability event_resume); poll it instead", param="stream",
                                capability="event_resume")
            task, made = background.create(svc, session, who, prepared, key)
        obj = background.view(session, session.get(ResponseRow, task.response_id))
    if made:
        send_task(svc, task)
    if stream or (not made and body.get("stream") is True):
        return follow_sse(*open_stream(svc, who, task.id), 0)
    return _json(obj)


def _json(doc: dict, status: int = 200) -> Response:
    return Response(json.dumps(doc), status=status, mimetype="application/json")


def _stream_query() -> tuple[bool, int]:
    raw = params.arg("stream")
    if raw not in (None, "", "true", "false"):
        raise LMSPError("invalid_request", "stream must be true or false", param="stream")
    after = params.arg("starting_after")
    start = 0 if not after else params.integer(after)
    if start is None:
        raise LMSPError("invalid_request", "starting_after must be a non-negative integer event id",
                        param="starting_after")
    return raw == "true", start


@bp.get("/<response_id>")
@operation("getResponse", "A stored response; a background one's events with stream=true", tag="responses",
           scope="responses:read",
           answers={200: json_answer(
               "The response as it is now (a background response is `queued` until a worker starts it). With "
               "`stream=true`: a background response's events (6.3) from `response.created`, or after "
               "`starting_after`, live until the final event", wire.ResponseObject,
               also=sse_answer("", "Server-sent events: `id:`, `event:` and a JSON `data:` line per event"))},
           errors=[(400, "invalid_request", "unsupported_capability", "A bad `stream` or `starting_after`, or "
                    "stream=true on a response that was not created with background: true"),
                   (404, "response_not_found"), (410, "event_history_expired", "The events are past their "
                    "retention: GET without stream has the final response")],
           params=["ResponseId", "Stream", "StartingAfter"])
def get(response_id: str):
    svc, who = services(), principal()
    stream, after = _stream_query()
    with svc.sessions() as session:
        row = stored.require(session, who, response_id)
        if not stream:
            return _json(background.view(session, row))
        task = background.task_of(session, row.id) if is_background(row) else None
    if task is None:
        raise LMSPError("invalid_request", "Only a background response's events can be streamed again; GET it "
                        "without stream", param="stream")
    return follow_sse(*open_stream(svc, who, task.id), after)


@bp.post("/<response_id>/cancel")
@operation("cancelResponse", "Cancel a background response (idempotent)", tag="responses", scope="responses:write",
           answers={200: json_answer("The response: cancelled once its worker has stopped (waited for up to "
                                     f"{CANCEL_WAIT_SECONDS:g} s, else still in_progress); one that had already "
                                     "ended, as it ended", wire.ResponseObject)},
           errors=[(400, "invalid_request", "The response was not created with background: true"),
                   (404, "response_not_found")],
           params=["ResponseId"])
def cancel(response_id: str):
    svc, who = services(), principal()
    with svc.sessions() as session:
        row = stored.require(session, who, response_id)
        background.cancel(svc, session, row)
        obj = background.view(session, row)
    if obj["status"] in RUNNING:
        hold_stream()  # it waits, as a long poll does, for the worker to stop
        obj = _settled(svc, who, response_id)
    return _json(obj)


def _settled(svc, who: str, response_id: str) -> dict:
    """The response once it has ended, or as it is after ``CANCEL_WAIT_SECONDS``."""
    deadline = time.monotonic() + CANCEL_WAIT_SECONDS
    with svc.hub.watch(response_id) as sub:
        while True:
            with svc.sessions() as session:  # read after subscribing: an end in between is seen here
                obj = background.view(session, stored.require(session, who, response_id))
            left = deadline - time.monotonic()
            if obj["status"] not in RUNNING or left <= 0:
                return obj
            sub.get(timeout=min(left, 0.5))


def _items_query() -> tuple[str | None, int, str]:
    limit = params.integer(params.arg("limit") or str(ITEMS_LIMIT))
    if limit is None or not 1 <= limit <= MAX_ITEMS_LIMIT:
        raise LMSPError("invalid_request", f"limit must be an integer from 1 to {MAX_ITEMS_LIMIT}", param="limit")
    order = params.arg("order") or "desc"
    if order not in stored.ORDERS:
        raise LMSPError("invalid_request", "order must be asc or desc", param="order")
    return params.arg("after") or None, limit, order


@bp.get("/<response_id>/input_items")
@operation("listInputItems", "The input items of a stored response, a page at a time", tag="responses",
           scope="responses:read", answers={200: json_answer("A page of input items", wire.InputItemList)},
           errors=[(400, "invalid_request", "A bad limit or order, or an `after` that is not one of the "
                    "response's items"), (404, "response_not_found")],
           params=["ResponseId", "ItemAfter", "Limit", "Order"])
def input_items(response_id: str):
    after, limit, order = _items_query()
    with services().sessions() as session:
        row = stored.require(session, principal(), response_id)
        return _json(wire.InputItemList.model_validate(
            stored.input_items(row, after=after, limit=limit, order=order)).wire())


@bp.delete("/<response_id>")
@operation("deleteResponse", "Delete a stored response", tag="responses", scope="responses:write",
           answers={200: json_answer("Deleted: every read of it answers 404 from now on; a background "
                                     "response still running is cancelled first", wire.DeletedResponse)},
           errors=[(404, "response_not_found")], params=["ResponseId"])
def delete(response_id: str):
    svc = services()
    with svc.sessions() as session:
        row = stored.require(session, principal(), response_id)
        return _json(wire.DeletedResponse.model_validate(stored.delete(svc, session, row)).wire())

