"""The response (6.2) and task (7.1) objects as clients see them."""

from common.states import FAILED, SUCCEEDED
from common.tables import Response, Task

API = "/lmsp/v1"


def response_object(r: Response) -> dict:
    return {
        "id": r.id,
        "object": "response",
        "created_at": int(r.created_at),
        "status": "in_progress" if r.status == "queued" else r.status,
        "model": r.model,
        "output": r.output or [],
        "usage": r.usage,
        "error": r.error,
        "incomplete_details": r.incomplete_details,
        "previous_response_id": r.previous_response_id,
    }


def task_object(t: Task, r: Response | None, event_resume: bool = True) -> dict:
    """``event_resume``: whether the task's model offers its events endpoint (else no events_url)."""
    doc = {
        "id": t.id,
        "object": "task",
        "type": t.type,
        "status": t.status,
        "created_at": int(t.created_at),
        "updated_at": int(t.updated_at),
        "response_id": t.response_id,
        "events_url": f"{API}/tasks/{t.id}/events",
        "on_restart": t.on_restart,
        "response": response_object(r) if t.status == SUCCEEDED and r is not None else None,
        "error": t.error if t.status == FAILED else None,
    }
    if not event_resume:
        del doc["events_url"]
    return doc
