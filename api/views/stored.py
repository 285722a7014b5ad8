"""Stored and background responses, as the OpenAI Responses API reads them: GET (a poll, or the events
again with ``stream=true``), cancel, input items, DELETE. ``POST /responses`` itself is
api/views/responses.py, which hands ``background: true`` to ``create_background`` here."""

import json

from flask import Blueprint, request
from flask import Response as HttpResponse

from api import params
from api.auth import hold_stream, principal
from api.extensions import services
from api.operations import json_answer, operation, sse_answer
from api.services import background, idempotency, stored
from api.views.events import follow_sse
from common import wire
from common.errors import LMSPError

bp = Blueprint("stored", __name__, url_prefix="/lmsp/v1/responses")
ITEMS_LIMIT, MAX_ITEMS_LIMIT = 20, 100


def create_background(body) -> HttpResponse:
    """``POST /responses`` with ``background: true``: a durable task, answered at once with the response
    (``queued``), or with its events from the start when ``stream`` is true too."""
    svc, who = services(), principal()
    key = idempotency.key_from(request.headers.get("Idempotency-Key"), who, "POST", request.path, body)
    shown, stream = background.submit(svc, who, body, key)
    if stream is not None:
        return follow_sse(*stream, 0)
    return _json(shown)


def _json(shape: wire.Shape) -> HttpResponse:
    return HttpResponse(json.dumps(shape.wire()), mimetype="application/json")


def _stream_query() -> tuple[bool, int]:
    raw = params.arg("stream")
    if raw not in (None, "", "true", "false"):
        raise LMSPError("invalid_request", "stream must be true or false", param="stream")
    stream = raw == "true"
    return stream, params.resume_point("starting_after") if stream else 0  # (a JSON answer resumes nothing)


@bp.get("/<response_id>")
@operation("getResponse", "A stored response; a background one's events with stream=true", tag="responses",
           scope="responses:read",
           answers={200: json_answer(
               "The response as it is now (a background response is `queued` until a worker starts it). With "
               "`stream=true`: a background response's events (6.3) from `response.created`, or after "
               "`starting_after` (or Last-Event-ID), live until the final event", wire.ResponseObject,
               also=sse_answer("", "Server-sent events: `id:`, `event:` and a JSON `data:` line per event"))},
           errors=[(400, "invalid_request", "unsupported_capability", "A bad `stream`, `starting_after` or "
                    "Last-Event-ID, or "
                    "stream=true on a response that was not created with background: true"),
                   (404, "response_not_found"), (410, "event_history_expired", "The events are past their "
                    "retention: GET without stream has the final response")],
           params=["ResponseId", "Stream", "StartingAfter", "LastEventId"])
def get(response_id: str):
    stream, after = _stream_query()
    if not stream:
        return _json(stored.show(services(), principal(), response_id))
    return follow_sse(*stored.events_of(services(), principal(), response_id), after)


@bp.post("/<response_id>/cancel")
@operation("cancelResponse", "Cancel a background response (idempotent)", tag="responses", scope="responses:write",
           answers={200: json_answer("The response: cancelled once its worker has stopped (waited for up to "
                                     f"{stored.CANCEL_WAIT_SECONDS:g} s, else still in_progress); one that had already "
                                     "ended, as it ended", wire.ResponseObject)},
           errors=[(400, "invalid_request", "The response was not created with background: true"),
                   (404, "response_not_found")],
           params=["ResponseId"])
def cancel(response_id: str):
    # A cancel that waits for the worker to stop holds its thread, as a long poll does.
    return _json(stored.cancel(services(), principal(), response_id, on_wait=hold_stream))


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
    return _json(stored.input_items(services(), principal(), response_id, after=after, limit=limit, order=order))


@bp.delete("/<response_id>")
@operation("deleteResponse", "Delete a stored response", tag="responses", scope="responses:write",
           answers={200: json_answer("Deleted: every read of it answers 404 from now on; a background "
                                     "response still running is cancelled first", wire.DeletedResponse)},
           errors=[(400, "invalid_request", "The response is a task's output (POST /lmsp/v1/tasks): it is kept "
                    "with its task"), (404, "response_not_found")], params=["ResponseId"])
def delete(response_id: str):
    return _json(stored.delete(services(), principal(), response_id))

