"""Background responses (OpenAI's ``background: true``) on durable tasks.

A background response is a task (7.1) behind the Responses surface: ``POST /responses`` persists the
task, response and event #1 and answers at once with the response, ``queued``; the client polls
``GET /responses/{id}``, streams or resumes the task's events with ``?stream=true&starting_after=N``,
and cancels with ``POST /responses/{id}/cancel``. Unlike OpenAI's (kept about ten minutes, lost with
their process), it lives for the service's retention and survives a worker's crash by its
``on_restart`` policy (7.5), which ``extensions`` may set:

* ``resume`` by default where the model can (capability ``resume_snapshots``): the client of a
  background response has asked for an answer and gone away; the service never runs tools itself
  (6.5), so continuing from the logged output has no side effect, and a stream that resumes sees
  the same items and sequence numbers (invariant 6) - ``retry`` would start the items again, which
  the OpenAI SDK's stream helper cannot follow, and ``fail`` would lose work this mode exists to keep;
* ``retry`` on a model without resumable snapshots, for the same reasons;
* any of ``fail``, ``retry``, ``resume`` as ``extensions["x-lmsp-on-restart"]``.
"""

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.extensions import Services
from api.services import idempotency
from api.services.validation import Prepared
from api.services.work import new_task_once
from common import lifecycle
from common.errors import LMSPError
from common.resources import is_background, response_object
from common.states import QUEUED, TERMINAL
from common.tables import Response, Task
from common.wire import OnRestart

RESTART = "x-lmsp-on-restart"  # extensions: the restart policy of a background response's task


def on_restart(prepared: Prepared) -> str:
    """The policy asked for in ``extensions``, else the default (module docstring)."""
    asked = (prepared.request.extensions or {}).get(RESTART)
    if asked is None:
        return OnRestart.RESUME if prepared.spec.public_capabilities()["resume_snapshots"] else OnRestart.RETRY
    if asked not in tuple(OnRestart):
        raise LMSPError("invalid_request", f"extensions.{RESTART} must be one of "
                        f"{', '.join(OnRestart)}", param=f"extensions.{RESTART}")
    if asked == OnRestart.RESUME and not prepared.spec.public_capabilities()["resume_snapshots"]:
        raise LMSPError("unsupported_capability", f"Model {prepared.spec.id} cannot resume from a snapshot; "
                        "use fail or retry", param=f"extensions.{RESTART}", capability="resume_snapshots")
    return asked


def create(svc: Services, session: Session, principal: str, prepared: Prepared,
           key: idempotency.Key | None) -> tuple[Task, bool]:
    """The background response's task, committed within the queue limits, or the one a concurrent
    request with the same Idempotency-Key made (``work.new_task_once``); the caller sends it if made."""
    if not prepared.spec.public_capabilities()["conversations"]:
        raise LMSPError("unsupported_capability", f"Model {prepared.spec.id} cannot keep responses (capability "
                        "conversations), and a background response is one that is kept", param="background",
                        capability="conversations")
    return new_task_once(svc, session, principal, prepared, on_restart(prepared), key)


def replayed(session: Session, principal: str, record) -> Task:
    """The task a finished Idempotency-Key record made."""
    return lifecycle.require_task(session, principal, record.task_id)


def task_of(session: Session, response_id: str) -> Task | None:
    return session.execute(select(Task).where(Task.response_id == response_id)
                           .execution_options(populate_existing=True)).scalar_one_or_none()


def view(session: Session, row: Response) -> dict:
    """The response object as GET answers it: a background response is ``queued`` while its task is."""
    if not is_background(row):
        return response_object(row)
    task = task_of(session, row.id)
    return response_object(row, queued=task is not None and task.status == QUEUED)


def cancel(svc: Services, session: Session, row: Response) -> None:
    """Cancel a background response's task (7.3); one already ended is left as it is (cancelling twice,
    or after the end, answers the response again)."""
    if not is_background(row):
        raise LMSPError("invalid_request", f"Response {row.id} was not created with background: true; only "
                        "background responses can be cancelled (a direct one ends when its client goes away)",
                        param="response_id")
    task = task_of(session, row.id)
    if task is None or task.status in TERMINAL:
        return
    notify, publish = lifecycle.cancel(session, task, svc.settings.lease_seconds)
    session.commit()
    svc.publisher.publish_many(publish)
    if notify:
        svc.publisher.abort(task.response_id)
