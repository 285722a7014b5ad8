"""Whether a task's event stream may open, and when an open one has ended (api/views/events.py)."""

from sqlalchemy import select

from common.db import db_now
from common.errors import LMSPError
from common.lifecycle import followed_task
from common.states import TERMINAL
from common.tables import Task


def open_stream(svc, principal: str, task_id: str) -> tuple[str, str]:
    """Check access, capability and retention; return (task id, response id)."""
    with svc.reads.connect() as conn:
        task = followed_task(conn, principal, task_id)
    expired = _expired(task, svc.settings, task.ended_ago)
    spec = svc.registry.models.get(task.model)
    if spec is not None and not spec.public_capabilities()["event_resume"]:
        raise LMSPError("unsupported_capability", f"Model {task.model} does not offer event streams "
                        f"(capability event_resume); GET /lmsp/v1/tasks/{task_id} has the result",
                        capability="event_resume")
    if expired:
        raise LMSPError("event_history_expired", f"The events of task {task_id} are past their retention; "
                        f"GET /lmsp/v1/tasks/{task_id} has the final result")
    return task.id, task.response_id


def _expired(task, settings, ended_ago: float | None) -> bool:
    """Past its event retention (11.2): its rows purged (SQLite), or its partition dropped (Postgres).
    ``ended_ago``: seconds since it ended by the database's clock (replicas' own clocks may disagree)."""
    return task.events_expired or (task.status in TERMINAL and ended_ago is not None
                                   and ended_ago > settings.event_retention_seconds)


def ended_check(svc, task_id: str):
    """The follower's question once its log has nothing more: has the stream ended?"""

    def ended():
        """A finished task whose log has nothing after the follower's point ends its stream with no
        event; one whose events were purged meanwhile (or gone with the task) ends it with 410's
        problem as an ``error`` event, never silently."""
        with svc.sessions() as session:
            task = session.get(Task, task_id)
            ago = None if task is None or task.ended_at is None else \
                session.execute(select(db_now())).scalar() - task.ended_at
            if task is None or _expired(task, svc.settings, ago):
                raise LMSPError("event_history_expired", f"The events of task {task_id} passed their "
                                f"retention while this stream read them; GET /lmsp/v1/tasks/{task_id} "
                                "has the final result")
            return [] if task.status in TERMINAL else None
    return ended
