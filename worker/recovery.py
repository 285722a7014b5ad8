"""Restart semantics (7.5), leases, and the periodic sweeper every worker runs.

On boot a worker applies each of its unfinished tasks' ``on_restart`` policy;
the sweeper does the same for workers whose lease expired, re-dispatches
queued tasks whose broker message was lost, and enforces retention.
"""

import logging
import threading
import time

from sqlalchemy import delete, select, update
from sqlalchemy.exc import SQLAlchemyError

from common import eventlog, events
from common.broker import BACKGROUND, dispatch, queue_length
from common.bus import CONTROL, aborted
from common.errors import problem
from common.events import dumps
from common.states import CANCELLED, CANCELLING, FAILED, LOADING, QUEUED, RUNNING, TERMINAL, transition
from common.tables import IdempotencyRecord, Response, Task, Worker
from worker.context import WorkerContext
from worker.runner import EngineStopped, cancelling_tasks, run_recovered, unfinished_direct, write_final

log = logging.getLogger("lmsp.recovery")


def apply_policy(ctx: WorkerContext, task_id: str) -> None:
    """This worker owns an unfinished task whose previous run died."""
    with ctx.sessions() as session:
        task = session.get(Task, task_id)
        if task is None or task.status in TERMINAL or task.status == QUEUED:
            return
        batch = None
        if task.status == CANCELLING:
            if transition(session, task_id, CANCELLED, only_from=[CANCELLING]):
                batch = write_final(session, task.response_id, "cancelled")
        elif task.on_restart == "fail":
            error = problem("server_restarted", "The worker running this task restarted; "
                            "submit it again (or use on_restart retry/resume)")
            if transition(session, task_id, FAILED, only_from=[LOADING, RUNNING], error=error):
                batch = write_final(session, task.response_id, "failed", error)
        else:
            ctx.recovered.submit(_run_recovered, ctx, task_id, task.on_restart == "resume")
        session.commit()
    if batch:
        ctx.publisher.publish(task.response_id, batch)


def _run_recovered(ctx, task_id, resume):
    try:
        run_recovered(ctx, task_id, resume)
    except EngineStopped:
        pass
    except Exception:  # noqa: BLE001 - a thread must not die silently
        log.exception("recovered task %s failed", task_id)


def fail_direct(ctx: WorkerContext, worker_ids: list[str]) -> None:
    """Direct responses of a dead worker: their client is waiting; end its stream with response.failed."""
    error = problem("server_restarted", "The worker generating this response stopped; send the request again")
    with ctx.sessions() as session:
        rows = list(session.execute(update(Response).where(
            Response.worker_id.in_(worker_ids), Response.status == "in_progress",
            ~Response.id.in_(select(Task.response_id))).values(
            status="failed", error=error, updated_at=time.time()).returning(Response.id)).scalars())
        session.commit()
    for rid in rows:
        name, data = events.final(rid, "failed", error=error)
        ctx.publisher.publish(rid, [(events.UNNUMBERED, name, dumps(data))])


def recover_own(ctx: WorkerContext) -> None:
    fail_direct(ctx, [ctx.worker_id])
    with ctx.sessions() as session:
        ids = list(session.execute(select(Task.id).where(
            Task.worker_id == ctx.worker_id, Task.status.in_((LOADING, RUNNING, CANCELLING)))).scalars())
    for task_id in ids:
        log.info("applying on_restart to %s", task_id)
        apply_policy(ctx, task_id)


def take_over_dead(ctx: WorkerContext) -> None:
    """Tasks of workers whose lease expired: claim each with a compare-and-set, then apply its policy."""
    cutoff = time.time() - ctx.settings.lease_seconds
    with ctx.sessions() as session:
        dead = list(session.execute(select(Worker.id).where(Worker.heartbeat_at < cutoff)).scalars())
        dead = [w for w in dead if w != ctx.worker_id]
        if not dead:
            return
    fail_direct(ctx, dead)
    with ctx.sessions() as session:
        rows = session.execute(select(Task.id, Task.worker_id, Task.status, Task.model).where(
            Task.worker_id.in_(dead), Task.status.in_((LOADING, RUNNING, CANCELLING)))).all()
    for task_id, owner, status, model in rows:
        if model != ctx.spec.id and status != CANCELLING:
            continue  # only a worker of the same model can run it again
        with ctx.sessions() as session:
            won = session.execute(update(Task).where(Task.id == task_id, Task.worker_id == owner)
                                  .values(worker_id=ctx.worker_id)).rowcount
            session.commit()
        if won:
            log.info("took over %s from %s (lease expired)", task_id, owner)
            apply_policy(ctx, task_id)


def redispatch_lost(ctx: WorkerContext) -> None:
    """Queued tasks whose broker message vanished (Redis restarted empty) are sent again."""
    cutoff = time.time() - ctx.settings.requeue_after_seconds
    with ctx.sessions() as session:
        ids = list(session.execute(select(Task.id).where(
            Task.model == ctx.spec.id, Task.status == QUEUED, Task.dispatched_at < cutoff)).scalars())
    if not ids or queue_length(ctx.celery, ctx.spec.queue) > 0:
        return
    log.info("re-dispatching %d queued tasks whose messages are gone", len(ids))
    for task_id in ids:
        with ctx.sessions() as session:
            session.execute(update(Task).where(Task.id == task_id, Task.status == QUEUED)
                            .values(dispatched_at=time.time()))
            session.commit()
        dispatch(ctx.celery, ctx.spec.queue, {"task_id": task_id}, BACKGROUND)


def enforce_retention(ctx: WorkerContext) -> None:
    s, now = ctx.settings, time.time()
    with ctx.sessions() as session:
        expired = list(session.execute(select(Task.id, Task.response_id).where(
            Task.ended_at < now - s.event_retention_seconds, Task.events_expired.is_(False)).limit(500)).all())
        if expired:
            eventlog.purge(session, [rid for _, rid in expired])
            session.execute(update(Task).where(Task.id.in_([tid for tid, _ in expired]))
                            .values(events_expired=True))
        old = list(session.execute(select(Task.id, Task.response_id).where(
            Task.ended_at < now - s.record_retention_seconds).limit(500)).all())
        if old:
            session.execute(delete(Task).where(Task.id.in_([tid for tid, _ in old])))
            session.execute(delete(Response).where(Response.id.in_([rid for _, rid in old])))
        # Direct responses: unstored ones only live for their stream; stored ones as long as tasks.
        direct = ~Response.id.in_(select(Task.response_id))
        session.execute(delete(Response).where(direct, Response.stored.is_(False),
                                               Response.updated_at < now - s.event_retention_seconds))
        session.execute(delete(Response).where(direct, Response.updated_at < now - s.record_retention_seconds))
        session.execute(delete(IdempotencyRecord).where(
            IdempotencyRecord.created_at < now - s.idempotency_retention_seconds))
        session.commit()


def heartbeat(ctx: WorkerContext, stopped: bool = False) -> None:
    now = time.time()
    with ctx.sessions() as session:
        values = {"heartbeat_at": now, "model": ctx.spec.id, "stopped_at": now if stopped else None,
                  "running": 0 if stopped else ctx.engine.running()}
        if session.execute(update(Worker).where(Worker.id == ctx.worker_id).values(**values)).rowcount == 0:
            session.add(Worker(id=ctx.worker_id, started_at=now, **values))
        session.commit()


def _every(ctx: WorkerContext, seconds: float, fn, name: str) -> threading.Thread:
    def loop():
        while not ctx.stopping.wait(seconds):
            try:
                fn(ctx)
            except SQLAlchemyError as exc:
                log.warning("%s: database unavailable (%s)", name, exc.__class__.__name__)
            except Exception:  # noqa: BLE001 - keep the loop alive
                log.exception("%s failed", name)
    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    return thread


def sweep(ctx: WorkerContext) -> None:
    take_over_dead(ctx)
    redispatch_lost(ctx)
    enforce_retention(ctx)


def watch_cancellations(ctx: WorkerContext) -> None:
    for rid in cancelling_tasks(ctx) + unfinished_direct(ctx):
        ctx.cancel(rid)


def start_background(ctx: WorkerContext) -> list[threading.Thread]:
    threads = [
        _every(ctx, ctx.settings.heartbeat_seconds, heartbeat, "lmsp-heartbeat"),
        _every(ctx, ctx.settings.sweep_seconds, sweep, "lmsp-sweeper"),
        _every(ctx, 0.5, watch_cancellations, "lmsp-cancel-watch"),
    ]
    if ctx.publisher.live:
        threads.append(threading.Thread(target=_control_listener, args=(ctx,), name="lmsp-control", daemon=True))
        threads[-1].start()
    return threads


def _control_listener(ctx: WorkerContext) -> None:
    """Redis hint from the api: abort this response now (the watcher catches it anyway)."""
    import redis

    while not ctx.stopping.is_set():
        try:
            pubsub = ctx.publisher.client.pubsub(ignore_subscribe_messages=True)
            pubsub.subscribe(CONTROL)
            while not ctx.stopping.is_set():
                message = pubsub.get_message(timeout=1.0)
                if message and message["type"] == "message":
                    ctx.cancel(aborted(message["data"]))
        except (redis.RedisError, OSError):
            time.sleep(1)
