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

from api.extensions import Services, request_session
from api.services import idempotency
from api.services.streams import open_stream
from api.services.validation import Prepared, prepare
from api.services.work import queue_task_once, send_task
from common import lifecycle, wire
from common.errors import LMSPError
from common.resources import is_background, response_model
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


def submit(svc: Services, principal: str, body: dict,
           key: idempotency.Key | None) -> tuple[wire.ResponseObject, tuple[str, str] | None]:
    """``POST /responses`` with ``background: true``: the response (``queued``), its task committed and
    sent, or for a repeated Idempotency-Key the response it made, as it is now (9.2); and when ``stream``
    is true, the stream to follow from the start (``open_stream``'s task and response ids)."""
    with request_session() as session:  # the one authentication opened
        record = idempotency.existing(session, key) if key is not None else None
        made = record is None
        if record is not None:
            task = lifecycle.require_task(session, principal, idempotency.check_replay(record, key).task_id)
            stream = body.get("stream") is True
        else:
            prepared = prepare(session, svc, principal, body)
            stream = prepared.request.stream
            task, made = _create(svc, session, principal, prepared, key)
            stream = stream or (not made and body.get("stream") is True)
        shown = view(session, session.get(Response, task.response_id))
    if made:
        send_task(svc, task)
    return shown, open_stream(svc, principal, task.id) if stream else None


def _create(svc: Services, session: Session, principal: str, prepared: Prepared,
            key: idempotency.Key | None) -> tuple[Task, bool]:
    """The background response's task, committed within the queue limits, or the one a concurrent
    request with the same Idempotency-Key made (``work.queue_task_once``); the caller sends it if made."""
    if prepared.request.stream and not prepared.spec.public_capabilities()["event_resume"]:
        raise LMSPError("unsupported_capability", f"Model {prepared.spec.id} cannot stream a background "
                        "response (capability event_resume); poll it instead", param="stream",
                        capability="event_resume")
    if not prepared.spec.public_capabilities()["conversations"]:
        raise LMSPError("unsupported_capability", f"Model {prepared.spec.id} cannot keep responses (capability "
                        "conversations), and a background response is one that is kept", param="background",
                        capability="conversations")
    return queue_task_once(svc, session, principal, prepared, on_restart(prepared), key)


def task_of(session: Session, response_id: str) -> Task | None:
    return session.execute(select(Task).where(Task.response_id == response_id)
                           .execution_options(populate_existing=True)).scalar_one_or_none()


def view(session: Session, row: Response) -> wire.ResponseObject:
    """The response object as GET answers it: a background response is ``queued`` while its task is."""
    if not is_background(row):
        return response_model(row)
    task = task_of(session, row.id)
    return response_model(row, queued=task is not None and task.status == QUEUED)


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

