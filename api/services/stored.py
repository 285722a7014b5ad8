"""Stored responses (``store: true``) as the OpenAI Responses API reads them (api/views/stored.py): one
principal's response by id, its events again (a background response's), its cancellation, the page of
its input items, and its deletion."""

import time
from collections.abc import Callable

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from api.extensions import Services
from api.services import background
from api.services.streams import open_stream
from common import lifecycle, wire
from common.errors import LMSPError
from common.resources import is_background
from common.tables import Response, Task

ORDERS = ("asc", "desc")
CANCEL_WAIT_SECONDS = 5.0  # how long a cancel waits for the worker to stop, to answer the response cancelled
RUNNING = ("queued", "in_progress")
# Ids of input items the client sent without one (a string input, a message without id): made from the
# response's id and the item's place, so the same item has the same id on every read (a cursor).
_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def require(session: Session, principal: str, response_id: str) -> Response:
    """The principal's stored response; another principal's, a deleted or an unknown one is a 404 alike."""
    row = lifecycle.stored_response(session, principal, response_id)
    if row is None:
        raise LMSPError("response_not_found", f"No stored response {response_id}")
    return row


def show(svc: Services, principal: str, response_id: str) -> wire.ResponseObject:
    with svc.sessions() as session:
        return background.view(session, require(session, principal, response_id))


def events_of(svc: Services, principal: str, response_id: str) -> tuple[str, str]:
    """The stream of a background response's events (``open_stream``'s task and response ids)."""
    with svc.sessions() as session:
        row = require(session, principal, response_id)
        task = background.task_of(session, row.id) if is_background(row) else None
    if task is None:
        raise LMSPError("invalid_request", "Only a background response's events can be streamed again; GET it "
                        "without stream", param="stream")
    return open_stream(svc, principal, task.id)


def cancel(svc: Services, principal: str, response_id: str, on_wait: Callable[[], None]) -> wire.ResponseObject:
    """The response once its worker has stopped, or as it is after ``CANCEL_WAIT_SECONDS``; ``on_wait``
    runs before it waits."""
    with svc.sessions() as session:
        row = require(session, principal, response_id)
        background.cancel(svc, session, row)
        shown = background.view(session, row)
    if shown.status not in RUNNING:
        return shown
    on_wait()
    deadline = time.monotonic() + CANCEL_WAIT_SECONDS
    with svc.hub.watch(response_id) as sub:
        while True:
            shown = show(svc, principal, response_id)  # read after subscribing: an end in between is seen here
            left = deadline - time.monotonic()
            if shown.status not in RUNNING or left <= 0:
                return shown
            sub.get(timeout=min(left, 0.5))


def input_items(svc: Services, principal: str, response_id: str, *, after: str | None, limit: int,
                order: str) -> wire.InputItemList:
    with svc.sessions() as session:
        return input_page(require(session, principal, response_id), after=after, limit=limit, order=order)


def input_page(row: Response, *, after: str | None, limit: int, order: str) -> wire.InputItemList:
    """A page of the input the model was given (earlier turns of previous_response_id and instructions,
    as a system message, included), ``order`` asc (as sent) or desc, after the item ``after``."""
    items = [_listed(row.id, place, item) for place, item in enumerate((row.request or {}).get("input") or [])]
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise LMSPError("invalid_request", f"after must be the id of one of {row.id}'s input items",
                            param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return wire.InputItemList(data=page, first_id=page[0]["id"] if page else None,
                              last_id=page[-1]["id"] if page else None, has_more=len(items) > limit)


def _listed(response_id: str, place: int, item: dict) -> dict:
    out = dict(item)
    out.setdefault("type", "message")
    if not out.get("id"):
        out["id"] = f"{_PREFIXES.get(out['type'], 'item')}_{response_id.split('_', 1)[1]}_{place}"
    if out["type"] == "message" and isinstance(out.get("content"), str):  # the OpenAI shape: parts
        kind = "output_text" if out.get("role") == "assistant" else "input_text"
        out["content"] = [{"type": kind, "text": out["content"]}]
    if out["type"] == "message":  # an output text part and an item have members the OpenAI SDK requires
        out["content"] = [{"annotations": [], **part} if part.get("type") == "output_text" else part
                          for part in out["content"]]
    if out["type"] != "reasoning":
        out.setdefault("status", "completed")
    return out


def delete(svc: Services, principal: str, response_id: str) -> wire.DeletedResponse:
    """Forget a stored response: every read (GET, input items, its stream, previous_response_id) answers
    404 from now on. A background response still running is cancelled first, so nothing generates for
    a response nobody can read. Its rows go with the retention, as every row does (invariant 13:
    nothing is deleted row by row at scale)."""
    with svc.sessions() as session:
        row = require(session, principal, response_id)
        if is_background(row):
            background.cancel(svc, session, row)
        elif (task_id := session.execute(select(Task.id).where(Task.response_id == row.id)).scalar()) is not None:
            # Its task would still show it (GET /tasks/{id}, the task's events): refused, not half done.
            raise LMSPError("invalid_request", f"Response {row.id} is the output of task {task_id}: it is kept "
                            "with its task (LMSP_RECORD_RETENTION_SECONDS) and cannot be deleted on its own")
        session.execute(update(Response).where(Response.id == row.id).values(stored=False))
        session.commit()
        return wire.DeletedResponse(id=row.id)
