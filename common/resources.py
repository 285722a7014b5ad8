"""The response (6.2) and task (7.1) objects of stored rows, as clients see them (common/wire.py)."""

import logging

from pydantic import ValidationError

from common import timeline, wire
from common.states import FAILED, SUCCEEDED
from common.tables import Response, Task


def response_object(r: Response, queued: bool = False) -> dict:
    """``queued``: a background response whose task waits for a worker (OpenAI's status for it)."""
    return response_model(r, queued).wire()


def is_background(r: Response) -> bool:
    """Created with ``background: true``: a durable task behind the OpenAI surface (api/services/background.py)."""
    return bool((r.request or {}).get("background"))


def event_response(r: Response, queued: bool = False) -> dict:
    """``response_object`` for a lifecycle event (common/events.py), written in the transaction that
    ends or creates the response: a row the wire model refuses (a partial usage a caller passed) is
    shown as it is stored, never a reason for that write to fail."""
    fields = _fields(r, queued)
    try:
        return wire.ResponseObject(**fields).wire()
    except ValidationError as exc:
        logging.getLogger("lmsp.resources").warning("response %s shown unchecked in its event: %s", r.id, exc)
        return {"object": "response", **fields}


# The request's members a response object repeats, as OpenAI's Response does (wire.ResponseObject shows
# each one a request left out as its default).
ECHOED = ("tools", "tool_choice", "metadata", "temperature", "top_p", "background")


def echoed(request: dict, instructions: str | None = None) -> dict | None:
    """A new response row's ``echo``: what it keeps of its ``request`` (stored as the api parsed it), and
    the ``instructions`` as given (the request holds them as its first message)."""
    kept = {name: request[name] for name in ECHOED if request.get(name) is not None}
    if instructions is not None:
        kept["instructions"] = instructions
    return kept or None


def _fields(r: Response, queued: bool) -> dict:
    return dict(id=r.id, created_at=int(r.created_at), model=r.model, output=r.output or [], usage=r.usage,
                status="queued" if queued else "in_progress" if r.status == "queued" else r.status,
                error=r.error, incomplete_details=r.incomplete_details, previous_response_id=r.previous_response_id,
                **(r.echo or {}))


def response_model(r: Response, queued: bool = False) -> wire.ResponseObject:
    return wire.ResponseObject(**_fields(r, queued))


def task_object(t: Task, r: Response | None, event_resume: bool = True, attempts=()) -> wire.TaskObject:
    """``event_resume``: whether the task's model offers its events endpoint (else no events_url);
    ``attempts``: its recorded attempts (common/timeline.py), for the timeline extension."""
    return wire.TaskObject(
        id=t.id, type=t.type, status=t.status, created_at=int(t.created_at), updated_at=int(t.updated_at),
        response_id=t.response_id, events_url=f"{wire.API}/tasks/{t.id}/events" if event_resume else None,
        on_restart=t.on_restart, response=response_model(r) if t.status == SUCCEEDED and r is not None else None,
        error=t.error if t.status == FAILED else None,
        extensions=timeline.extension(t.created_at, t.ended_at, list(attempts)))
