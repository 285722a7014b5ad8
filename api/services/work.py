"""Creating and controlling work: direct responses and durable tasks.

Every row is committed before the broker hears of it (docs/architecture.md, invariant 2);
Celery messages are sent only after the transaction commits. Statuses and
events are written by ``common.lifecycle`` only.
"""

import logging
import time

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.extensions import Services
from api.services import idempotency
from api.services.validation import Prepared
from common import events, interactive_wire, lifecycle, liveness, wire
from common.broker import BACKGROUND, dispatch
from common.errors import LMSPError, problem
from common.resources import response_model, response_object
from common.states import R
from common.tables import Response, Task

log = logging.getLogger("lmsp.api")


def _response_row(prepared: Prepared, principal: str, status: R, stored: bool) -> Response:
    req = prepared.request
    return lifecycle.new_response(
        principal=principal, model=prepared.spec.id,
        request=req.model_dump(mode="json", by_alias=True, exclude_none=True),
        input_tokens=prepared.input_tokens, max_tokens=prepared.max_tokens, status=status, stored=stored,
        previous_response_id=req.previous_response_id, instructions=req.given_instructions)


def ensure_available(svc: Services, session: Session, model_id: str) -> None:
    # A worker found live less than a heartbeat ago is taken as live still, without a query: the
    # answer is up to a lease old anyway (heartbeats), and a request whose worker is gone fails
    # model_unavailable or server_restarted through DirectWatch, never waits forever.
    now = time.monotonic()
    if now - svc.available.get(model_id, -1e18) < svc.settings.heartbeat_seconds:
        return
    if not liveness.live_workers(session, svc.settings.lease_seconds).get(model_id):
        raise LMSPError("model_unavailable", f"No worker serves {model_id} right now; retry later "
                        "or submit a task, which waits in the queue", retry_after=10)
    svc.available[model_id] = now


def _stored(prepared: Prepared) -> bool:
    """Whether GET /responses/{id} and previous_response_id may use the response: it asked with
    store, and its model has capability conversations (6.1: else store is ignored). A task's
    response is in its task object whatever this says."""
    return prepared.request.store and prepared.spec.public_capabilities()["conversations"]


def submit_direct(svc: Services, principal: str, prepared: Prepared, before_commit=None,
                  before_dispatch=None, session: Session | None = None) -> tuple[str, bool]:
    """The response's id, and whether its message was sent (``DirectWatch`` sends it again).
    ``before_commit(response_id)`` and ``before_dispatch(response_id)`` run around the commit: the
    caller subscribes to the response's events there, so it misses none of them; ``before_dispatch``
    returns False when the subscription is not live, and the worker then logs the events too.
    ``session``: the request's own (closed here), else a new one."""
    row = _response_row(prepared, principal, R.QUEUED, _stored(prepared))
    if before_commit is not None:
        before_commit(row.id)
    with session or svc.sessions() as session:
        ensure_available(svc, session, prepared.spec.id)
        lifecycle.create_direct(session, row)
        session.commit()
    logged = before_dispatch is not None and before_dispatch(row.id) is False
    return row.id, send_direct(svc, prepared.spec.interactive_queue, row.id, prepared.prompt_ids, logged)


def warm_direct(svc: Services, principal: str, prepared: Prepared) -> wire.ResponseObject:
    """WebSocket mode's ``generate: false``: a completed response without output whose id a later turn
    continues; stored by the same rule as any response."""
    row = _response_row(prepared, principal, R.COMPLETED, _stored(prepared))
    with svc.sessions() as session:
        lifecycle.create_warmed(session, row)
        session.commit()
        return response_model(row)


def send_direct(svc: Services, queue: str, response_id: str, prompt_ids: list[int] | None = None,
                logged: bool = False) -> bool:
    """The message of a committed, queued direct response; False when it was not sent. One a broker
    fault loses is sent again by the response's DirectWatch, so the request goes on: a broker fault is
    never the client's 500."""
    try:
        interactive_wire.send(svc.celery, queue, response_id, prompt_ids, logged)
        return True
    except Exception as exc:  # noqa: BLE001 - kombu's pooled connection, broken by a Redis fault, raises anything
        log.warning("broker message of %s not sent (%s: %s); it is sent again while the response waits",
                    response_id, type(exc).__name__, exc)
        return False


def drop_direct(svc: Services, response_id: str) -> None:
    """The client went away: stop generating for it."""
    with svc.sessions() as session:
        lifecycle.abort_direct(session, response_id)
        session.commit()
    svc.publisher.abort(response_id)


class DirectWatch:
    """What a quiet direct stream asks (``api.live.follow``'s ``ended``): the final event of a
    response that ended without one reaching the stream, or None while it runs. Nothing waits
    forever: a response still queued has its message sent again every
    ``direct_requeue_after_seconds`` (the broker lost it, or a paused worker took it;
    ``claim_direct`` makes a copy harmless) and fails ``model_unavailable`` once no worker has served
    its model for ``lease_seconds``, or ``overloaded`` once its message could not be sent for as long
    (the broker is away: a live worker cannot get it either); one whose worker's lease expired (and
    stayed so for another lease) fails ``server_restarted`` (a worker's sweeper does the same, but
    there may be none left)."""

    def __init__(self, svc: Services, response_id: str, spec, logged: bool = False, sent: bool = True):
        """``sent``: whether its first message was."""
        self.svc, self.response_id, self.spec, self.logged = svc, response_id, spec, logged
        self.sent = self.served = time.monotonic()
        self.orphaned: float | None = None  # since when its worker has looked expired
        self.unsent: float | None = None if sent else self.sent  # since when its message could not be sent

    def __call__(self) -> list[events.EventData] | None:
        with self.svc.sessions() as session:
            row = session.get(Response, self.response_id)
            if row is not None and self._unstick(session, row):
                session.commit()
                row = session.get(Response, self.response_id, populate_existing=True)
        if row is None:  # lost with its lazy commit (lifecycle.create_direct) by a database crash
            error = lifecycle.restarted_error("The database restarted and lost this response; send the request "
                                              "again")
            # Its final event shows a response object as every final event does (the OpenAI SDK's stream
            # helper reads its id): the lost one as this request knew it.
            lost = Response(id=self.response_id, model=self.spec.id, created_at=time.time(), status=R.FAILED,
                            error=error, output=[])
            ending = events.final(self.response_id, R.FAILED, error=error, response=response_object(lost))
        elif row.status in (R.QUEUED, R.IN_PROGRESS):
            return None
        else:
            ending = events.final(row.id, row.status, usage=row.usage, error=row.error,
                                  incomplete_details=row.incomplete_details, response=response_object(row))
        # Numbered by the follower's Sequence after the last it sent (``Sequence.closing``).
        return [ending]

    def _unstick(self, session: Session, row: Response) -> bool:
        """True when it failed the response now."""
        settings, now = self.svc.settings, time.monotonic()
        if row.status == R.IN_PROGRESS:
            # Expired for a whole lease more, as this api saw it: right after a database outage every
            # heartbeat looks old until the live workers write again (the sweepers wait likewise).
            if not liveness.worker_expired(session, row.worker_id, settings.lease_seconds):
                self.orphaned = None
                return False
            self.orphaned = self.orphaned or now
            return now - self.orphaned >= settings.lease_seconds and \
                lifecycle.fail_orphaned_direct(session, row.id, settings.lease_seconds)
        if row.status != R.QUEUED:
            return False
        if liveness.live_workers(session, settings.lease_seconds).get(self.spec.id):
            self.served = now
        elif now - self.served >= settings.lease_seconds:
            error = problem("model_unavailable", f"No worker served {self.spec.id} for "
                            f"{settings.lease_seconds:g} s; send the request again later or submit a task")
            return lifecycle.fail_unclaimed_direct(session, row.id, error)
        if self.unsent is not None and now - self.unsent >= settings.lease_seconds:
            error = problem("overloaded", f"The broker could not be reached for {settings.lease_seconds:g} s "
                            "to hand this request to a worker; send it again later, or submit a task (a task "
                            "waits for the broker)")
            return lifecycle.fail_unclaimed_direct(session, row.id, error)
        if now - self.sent >= settings.direct_requeue_after_seconds:
            self.sent = now
            lifecycle.watched_direct(session, row.id)  # committed by the caller below
            session.commit()
            if send_direct(self.svc, self.spec.interactive_queue, row.id, logged=self.logged):
                self.unsent = None
            elif self.unsent is None:
                self.unsent = now
        return False


def queue_task(svc: Services, session: Session, principal: str, prepared: Prepared, on_restart: str,
               key: idempotency.Key | None) -> Task:
    """Task, response and event #1, committed (7.1: persist before answering) within the queue
    limits: 429 past the principal's, 503 past the model's."""
    if on_restart == "resume" and not prepared.spec.public_capabilities()["resume_snapshots"]:
        raise LMSPError("unsupported_capability", f"Model {prepared.spec.id} cannot resume from a "
                        "snapshot; use on_restart fail or retry", param="on_restart",
                        capability="resume_snapshots")
    settings, model = svc.settings, prepared.spec.id
    room = lifecycle.Room(settings.max_queued_tasks_per_principal, min(prepared.spec.queue_depth,
                                                                       settings.max_queue_depth))
    response = _response_row(prepared, principal, R.IN_PROGRESS, _stored(prepared))
    task = lifecycle.new_task(response, on_restart)
    # The key in the task's transaction: a task exists exactly when its key is recorded.
    record = () if key is None else (idempotency.record_for_insert(key, status_code=202, task_id=task.id),)
    for _ in range(3):  # a queue that drained between a refusal and the count below has room again
        if lifecycle.create_task(session, response, task, room, also=record, commit=True):
            return task
        mine, total = lifecycle.queued(session, principal, model)
        if room.mine == 0:  # a closed door, not a full one: waiting changes nothing
            raise LMSPError("rate_limited", "This service takes no tasks now (its limit of queued tasks per "
                            "principal is 0); ask its operator", retry_after=60)
        if mine >= room.mine:
            raise LMSPError("rate_limited", f"You have {mine} queued tasks, the limit is {room.mine}; wait for "
                            "some to finish", retry_after=5)
        if room.total == 0:
            raise LMSPError("overloaded", f"The queue of {model} takes no tasks now (its depth is 0); ask the "
                            "service's operator", retry_after=60)
        if total >= room.total:
            raise LMSPError("overloaded", f"The queue of {model} is full ({total} tasks); retry later",
                            retry_after=10)
    raise LMSPError("overloaded", f"The queue of {model} is full; retry later", retry_after=10)


def send_task(svc: Services, task: Task) -> None:
    """Announce a committed task, off the request thread: the 202 need not wait for the broker.
    A message lost here (process killed, broker down) is sent again by the workers' sweeper."""
    svc.sender.submit(dispatch, svc.celery, svc.registry.get(task.model).queue, {"task_id": task.id},
                      BACKGROUND)


def queue_task_once(svc: Services, session: Session, principal: str, prepared: Prepared, on_restart: str,
                    key: idempotency.Key | None) -> tuple[Task, bool]:
    """``queue_task``, or the task a concurrent request with the same Idempotency-Key committed first
    (9.2); the flag says whether this request made it, and so must send it (``send_task``)."""
    try:
        return queue_task(svc, session, principal, prepared, on_restart, key), True
    except IntegrityError:
        session.rollback()  # a concurrent request with the same key won the race
        record = idempotency.existing(session, key) if key is not None else None
        if record is None:
            raise
        return lifecycle.require_task(session, principal, idempotency.check_replay(record, key).task_id), False


def response_of(svc: Services, response_id: str) -> wire.ResponseObject | None:
    """A direct response's object as its request answers it (once it has ended)."""
    with svc.sessions() as session:
        row = session.get(Response, response_id)
        return None if row is None else response_model(row)
