"""Creating and controlling work: direct responses and durable tasks.

Every row is committed before the broker hears of it (DESIGN invariant 2);
Celery messages are sent only after the transaction commits.
"""

import time

from sqlalchemy import func, or_, select, text, update
from sqlalchemy.orm import Session

from api.extensions import Services
from api.services.models import live_workers
from api.services.validation import Prepared
from common import eventlog, events
from common.broker import BACKGROUND, INTERACTIVE, dispatch
from common.errors import LMSPError
from common.events import dumps
from common.ids import new_id
from common.resources import response_object, task_object
from common.states import CANCELLED, CANCELLING, FAILED, LOADING, QUEUED, RUNNING, SUCCEEDED, transition
from common.tables import Response, Task

CONTROL_CHANNEL = "lmsp:control"


def _response_row(prepared: Prepared, principal: str, status: str, stored: bool) -> Response:
    now = time.time()
    req = prepared.request
    return Response(
        id=new_id("response"), principal_id=principal, model=prepared.spec.id,
        request={**req.model_dump(mode="json", by_alias=True, exclude_none=True),
                 "_input_tokens": prepared.input_tokens, "_max_tokens": prepared.max_tokens},
        status=status, stored=stored, previous_response_id=req.previous_response_id,
        created_at=now, updated_at=now)


def ensure_available(svc: Services, session: Session, model_id: str) -> None:
    if not live_workers(session, svc.settings.lease_seconds).get(model_id):
        raise LMSPError("model_unavailable", f"No worker serves {model_id} right now; retry later "
                        "or submit a task, which waits in the queue", retry_after=10)


def create_direct(svc: Services, principal: str, prepared: Prepared, before_dispatch=None) -> str:
    """``before_dispatch(response_id)`` runs between the commit and the dispatch: the caller
    subscribes to the response's events there, so it misses none of them."""
    with svc.sessions() as session:
        ensure_available(svc, session, prepared.spec.id)
        # Without capability conversations, store is ignored (6.1).
        stored = prepared.request.store and prepared.spec.public_capabilities()["conversations"]
        row = _response_row(prepared, principal, "queued", stored)
        session.add(row)
        session.commit()
    if before_dispatch is not None:
        before_dispatch(row.id)
    dispatch(svc.celery, prepared.spec.interactive_queue, {"response_id": row.id}, INTERACTIVE)
    return row.id


def abort_direct(svc: Services, response_id: str) -> None:
    """The client went away: stop generating for it."""
    with svc.sessions() as session:
        session.execute(update(Response).where(Response.id == response_id,
                                               Response.status.in_(("queued", "in_progress")))
                        .values(status="cancelled", updated_at=time.time()))
        session.commit()
    svc.publisher.control(CONTROL_CHANNEL, response_id)


def final_from_row(svc: Services, response_id: str):
    """The final event of a direct response whose stream lost it (its worker died)."""
    with svc.sessions() as session:
        row = session.get(Response, response_id)
    if row is None or row.status in ("queued", "in_progress"):
        return None
    name, data = events.final(row.id, row.status, usage=row.usage, error=row.error,
                              incomplete_details=row.incomplete_details)
    return (events.UNNUMBERED, name, dumps(data))


def check_task_limits(svc: Services, session: Session, principal: str, prepared: Prepared) -> None:
    # Count and insert under transaction-scoped advisory locks (the principal's and the model's,
    # always in one order: no deadlock), so concurrent POSTs cannot all see room and overshoot.
    if session.get_bind().dialect.name == "postgresql":
        for name in sorted((f"principal:{principal}", f"model:{prepared.spec.id}")):
            session.execute(text("SELECT pg_advisory_xact_lock(hashtext(:name))"), {"name": name})
    # One round trip for both limits: this runs on every POST /tasks.
    mine, total = session.execute(
        select(func.count().filter(Task.principal_id == principal), func.count().filter(Task.model == prepared.spec.id))
        .where(Task.status == QUEUED, or_(Task.model == prepared.spec.id, Task.principal_id == principal))).one()
    if mine >= svc.settings.max_queued_tasks_per_principal:
        raise LMSPError("rate_limited", f"You have {mine} queued tasks, the limit is "
                        f"{svc.settings.max_queued_tasks_per_principal}; wait for some to finish",
                        retry_after=5)
    depth = min(prepared.spec.queue_depth, svc.settings.max_queue_depth)
    if total >= depth:
        raise LMSPError("overloaded", f"The queue of {prepared.spec.id} is full ({total} tasks); retry later",
                        retry_after=10)


def new_task(session: Session, principal: str, prepared: Prepared, on_restart: str) -> Task:
    """Task, response and event #1 in the caller's transaction (7.1: persist before answering)."""
    if on_restart == "resume" and not prepared.spec.public_capabilities()["resume_snapshots"]:
        raise LMSPError("unsupported_capability", f"Model {prepared.spec.id} cannot resume from a "
                        "snapshot; use on_restart fail or retry", param="on_restart")
    response = _response_row(prepared, principal, "in_progress", True)
    now = response.created_at
    task = Task(id=new_id("task"), principal_id=principal, response_id=response.id, type="response",
                model=prepared.spec.id, status=QUEUED, on_restart=on_restart, attempt=0,
                created_at=now, updated_at=now, dispatched_at=now, events_expired=False)
    session.add_all([response, task])  # the unit of work inserts the response first (foreign key)
    eventlog.append(session, response.id, [(1, events.CREATED, dumps(events.created(response.id)))])
    return task


def send_task(svc: Services, task: Task) -> None:
    """Announce a committed task, off the request thread: the 202 need not wait for the broker.
    A message lost here (process killed, broker down) is sent again by the workers' sweeper."""
    svc.sender.submit(dispatch, svc.celery, svc.registry.get(task.model).queue, {"task_id": task.id},
                      BACKGROUND)


def get_task(session: Session, principal: str, task_id: str) -> Task:
    task = session.execute(select(Task).where(Task.id == task_id, Task.principal_id == principal)
                           ).scalar_one_or_none()
    if task is None:
        raise LMSPError("task_not_found", f"No task {task_id}")
    return task


def task_view(session: Session, task: Task, registry) -> dict:
    response = session.get(Response, task.response_id) if task.status == SUCCEEDED else None
    spec = registry.models.get(task.model)  # a model since removed keeps its events readable
    return task_object(task, response, event_resume=spec is None or spec.public_capabilities()["event_resume"])


def cancel_task(svc: Services, principal: str, task_id: str) -> dict:
    with svc.sessions() as session:
        task = get_task(session, principal, task_id)
        if task.status in (SUCCEEDED, FAILED):
            raise LMSPError("task_not_cancelable", f"Task {task_id} already {task.status}")
        if task.status == QUEUED and transition(session, task_id, CANCELLED, only_from=[QUEUED]):
            # No worker owns a queued task, so this transaction is the response's only writer.
            seq = eventlog.max_seq(session, task.response_id) + 1
            name, data = events.final(task.response_id, "cancelled")
            eventlog.append(session, task.response_id, [(seq, name, dumps(data))])
            session.execute(update(Response).where(Response.id == task.response_id)
                            .values(status="cancelled", updated_at=time.time()))
            session.commit()
            svc.publisher.publish(task.response_id, [(seq, name, dumps(data))])
        elif transition(session, task_id, CANCELLING, only_from=[LOADING, RUNNING]):
            session.commit()
            svc.publisher.control(CONTROL_CHANNEL, task.response_id)
        else:
            session.rollback()
        session.expire_all()
        task = get_task(session, principal, task_id)
        if task.status in (SUCCEEDED, FAILED):  # it finished while we tried
            raise LMSPError("task_not_cancelable", f"Task {task_id} already {task.status}")
        return task_view(session, task, svc.registry)


def stored_response(session: Session, principal: str, response_id: str) -> dict:
    row = session.execute(select(Response).where(
        Response.id == response_id, Response.principal_id == principal, Response.stored.is_(True))
    ).scalar_one_or_none()
    if row is None:
        raise LMSPError("response_not_found", f"No stored response {response_id}")
    return response_object(row)


def response_json(session: Session, response_id: str) -> dict:
    return response_object(session.get(Response, response_id))

