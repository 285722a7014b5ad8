"""Restart semantics (7.5), leases, and the background threads every worker runs.

Every non-final state has an owner that moves it on (docs/architecture.md, invariant 8): at
boot a worker hands on its own unfinished tasks by their ``on_restart`` policy;
its sweeper does the same for workers whose lease expired, finishes
cancellations nobody runs, and re-sends broker messages that may be lost; its
engine watch stops claiming when the engine dies and brings a new one up.
"""

import logging
import os
import threading
import time

import redis
from sqlalchemy import delete, exists, select, text, union_all, update
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from common import eventlog, lifecycle, liveness, partitions
from common.broker import BACKGROUND, dispatch
from common.bus import CONTROL, aborted
from common.db import db_now, transaction
from common.registry import queue_name
from common.states import CANCELLING, LIVE
from common.tables import Event, IdempotencyRecord, Response, Sweep, Task
from worker import metrics, runner
from worker.context import WorkerContext
from worker.procs import kill_stale_engines

log = logging.getLogger("lmsp.recovery")


def recover_own(ctx: WorkerContext) -> None:
    """At boot: whatever this worker id ran before it restarted is handed on by its policy."""
    fail_direct(ctx, [ctx.worker_id])
    with ctx.sessions() as session:
        rows = session.execute(select(Task.id, Task.attempt).where(
            Task.worker_id == ctx.worker_id, Task.status.in_(LIVE))).all()
    for task_id, attempt in rows:
        log.info("applying on_restart to %s", task_id)
        runner.hand_on(ctx, task_id, attempt, "The worker running this task restarted")


def fail_direct(ctx: WorkerContext, worker_ids: list[str]) -> None:
    """Direct responses of a dead worker: their client is waiting; its stream ends with response.failed."""
    error = lifecycle.restarted_error(lifecycle.DIRECT_WORKER_STOPPED)
    ctx.write(lambda s: (lifecycle.fail_direct(s, worker_ids, error), {}))


def take_over_dead(ctx: WorkerContext) -> None:
    """Tasks of workers whose lease expired, whatever model they run: each handed on by its policy,
    the lease re-checked by the database's clock in the same statement."""
    if not ctx.settled():
        return  # back from a database outage: every heartbeat looks old until the live ones write again
    with ctx.sessions() as session:
        dead = liveness.expired_workers(session, ctx.settings.lease_seconds, ctx.worker_id)
    if not dead:
        return
    fail_direct(ctx, dead)
    with ctx.sessions() as session:
        rows = session.execute(select(Task.id, Task.attempt, Task.worker_id).where(
            Task.worker_id.in_(dead), Task.status.in_(LIVE))).all()
    for task_id, attempt, owner in rows:
        try:
            _take_over(ctx, task_id, attempt, owner)
        except SQLAlchemyError as exc:  # e.g. the paused owner still holds the row: next sweep
            log.warning("take-over of %s skipped (%s)", task_id, type(exc).__name__)


def _take_over(ctx: WorkerContext, task_id: str, attempt: int, owner: str) -> None:
    error = lifecycle.restarted_error(f"The worker {owner} running this task stopped; submit it again "
                                      "(or use on_restart retry/resume)")
    with transaction(ctx.sessions) as session:
        if session.bind.dialect.name == "postgresql":
            # A paused owner may hold the row inside a commit: do not wait for it here.
            session.execute(text("SET LOCAL lock_timeout = '2s'"))
        send, publish = lifecycle.hand_on(session, task_id, error=error, attempt=attempt,
                                          owner_expired_after=ctx.settings.lease_seconds)
        model = session.get(Task, task_id).model
    if send or publish:
        log.info("took over %s from %s (lease expired)", task_id, owner)
        metrics.TAKEOVERS.labels(model=model).inc()
    ctx.publisher.publish_many(publish)
    if send:
        dispatch(ctx.celery, queue_name(model), {"task_id": task_id}, BACKGROUND - 1)


def hand_on_orphans(ctx: WorkerContext) -> None:
    """Tasks nobody is moving on: ``cancelling`` ones with no owner, and ones this worker owns but does
    not run (seen so in two sweeps in a row, so a claim on its way to its thread is not one)."""
    running = ctx.running_ids()
    with ctx.sessions() as session:
        columns = (Task.id, Task.attempt, Task.response_id, Task.worker_id)
        rows = session.execute(select(*columns).where(Task.status.in_(LIVE), Task.worker_id == ctx.worker_id)
                               .union_all(select(*columns).where(Task.status == CANCELLING,
                                                                  Task.worker_id.is_(None)))).all()
    suspects = {(task_id, attempt) for task_id, attempt, rid, owner in rows
                if owner == ctx.worker_id and rid not in running}
    for task_id, attempt, _, owner in rows:
        if owner is None or (task_id, attempt) in suspects & ctx.orphans:
            runner.hand_on(ctx, task_id, attempt, "The worker running this task lost track of it")
    ctx.orphans = suspects


def fail_abandoned_direct(ctx: WorkerContext) -> None:
    """Queued direct responses whose api died (it re-sends their messages, so a lost one would be sent
    again) get a final state: nobody else would ever give them one."""
    s = ctx.settings
    older_than = s.lease_seconds + 3 * s.direct_requeue_after_seconds
    ctx.write(lambda session: (lifecycle.fail_abandoned_direct(session, older_than), {}))


def redispatch_lost(ctx: WorkerContext, model: str, force: bool = False) -> None:
    """Tasks of ``model`` whose broker message may be lost are sent again, each on its own clock;
    all at once when the broker restarted (``force``: it keeps nothing). The claim makes a copy harmless."""
    ids = ctx.write(lambda s: (lifecycle.due_dispatches(s, model, ctx.settings.requeue_after_seconds,
                                                        force=force), {}))[0]
    if ids:
        log.info("re-sending %d broker messages of %s%s", len(ids), model,
                 " (the broker restarted)" if force else "")
    for task_id in ids:
        dispatch(ctx.celery, queue_name(model), {"task_id": task_id}, BACKGROUND)


def enforce_retention(ctx: WorkerContext) -> None:
    """Events past their retention (spec 11.2), then tasks, responses and idempotency records past theirs.
    On Postgres events go by whole partitions (common/partitions.py), direct responses' with the rest; on
    SQLite by rows, a task's once it is past its retention and a direct response's likewise."""
    s = ctx.settings
    engine = ctx.sessions.kw["bind"]
    by_partition = partitions.partitioned(engine)
    if by_partition:
        partitions.maintain(engine, retention=s.event_retention_seconds, width=s.event_partition_seconds,
                            ahead=s.event_partitions_ahead_seconds)
    with ctx.sessions() as session:
        now = session.execute(select(db_now())).scalar()
        if not by_partition:
            expired = list(session.execute(select(Task.id, Task.response_id).where(
                Task.ended_at < now - s.event_retention_seconds, ~Task.events_expired).limit(500)).all())
            if expired:
                eventlog.purge(session, [rid for _, rid in expired])
                session.execute(update(Task).where(Task.id.in_([tid for tid, _ in expired]))
                                .values(events_expired=True))
            eventlog.purge_direct(session, now - s.event_retention_seconds)
        old = list(session.execute(select(Task.id, Task.response_id).where(
            Task.ended_at < now - s.record_retention_seconds).limit(500)).all())
        if old:
            session.execute(delete(Task).where(Task.id.in_([tid for tid, _ in old])))
            session.execute(delete(Response).where(Response.id.in_([rid for _, rid in old])))
        # Direct responses: unstored ones only live for their stream; stored ones as long as tasks. On
        # SQLite one whose events are still there waits for purge_direct (500 a sweep).
        direct = ~exists().where(Task.response_id == Response.id)
        logged = () if by_partition else (~exists().where(Event.response_id == Response.id),)
        session.execute(delete(Response).where(direct, Response.stored.is_(False),
                                               Response.updated_at < now - s.event_retention_seconds, *logged))
        session.execute(delete(Response).where(direct, Response.updated_at < now - s.record_retention_seconds))
        session.execute(delete(IdempotencyRecord).where(
            IdempotencyRecord.created_at < now - s.idempotency_retention_seconds))
        session.commit()


def heartbeat(ctx: WorkerContext, stopped: bool = False, boot: bool = False) -> None:
    if not ctx.writer.alive and not stopped:
        return  # a worker that cannot log events must look dead, so its tasks are taken over
    try:
        with transaction(ctx.sessions) as session:
            liveness.heartbeat(session, ctx.worker_id, ctx.hosts.servable(), ctx.started_at,
                               running=ctx.hosts.running(), ready=ctx.ready(), loaded=ctx.hosts.loaded(),
                               state=ctx.state(), tokens_per_second=ctx.tokens.per_second(),
                               stopped=stopped, boot=boot)
    except SQLAlchemyError:
        ctx.db_ok_since = None
        raise
    except liveness.Replaced:
        if stopped:
            return  # ending anyway; the row is the other process's now
        # Paused (or cut off) past its lease while another process booted with this id: its tasks were
        # handed on and its writes are fenced already; heartbeating on would make two of one worker.
        log.critical("another process took worker id %s over; this one exits (give each worker its own "
                     "LMSP_WORKER_ID)", ctx.worker_id)
        ctx.stopping.set()
        ctx.hosts.close()
        os._exit(72)
    if ctx.db_ok_since is None:
        ctx.db_ok_since = time.monotonic()


def announce(ctx: WorkerContext) -> None:
    """The loaded models changed: the worker's row says so now, not at the next heartbeat."""
    try:
        heartbeat(ctx)
    except SQLAlchemyError:
        log.warning("the database is away; the next heartbeat records the loaded models")


ENGINE_RELOAD_SECONDS = 600  # a dead engine not replaced by then: the process exits (code 71)


def watch_engine(ctx: WorkerContext) -> None:
    """A writer that died ends the process. A worker of one model: a dead engine makes it stop claiming
    (its running attempts are handed on by their policy, in their own threads), then a new engine is
    loaded. A worker of several: a dead engine is unloaded once its attempts are handed on (work for
    its model loads it again), and a model idle for the keep-alive is unloaded."""
    if not ctx.writer.alive:
        log.critical("event writer is gone; exiting so a supervisor restarts this worker")
        ctx.stopping.set()
        ctx.hosts.close()
        os._exit(70)
    if ctx.stopping.is_set():
        return
    if not ctx.hosts.pinned:
        for model in ctx.hosts.drop_dead():
            log.error("the engine of %s died; unloaded (work for it loads it again)", model)
            kill_stale_engines(ctx.worker_id)  # what the dead core left behind (its model worker) holds memory
        ctx.hosts.expire()
        return
    slot = ctx.hosts.primary
    if slot.engine is not None and not slot.engine.dead:
        return  # (None: the last load failed; load again)
    # Every pass until a new engine is loaded: one that failed half-way (the database away, a stale
    # engine that would not die) must not leave the worker alive, healthy-looking and engineless.
    now = time.monotonic()
    if ctx.engine_ok.is_set():
        log.error("the engine died; not claiming until a new one is loaded")
        ctx.engine_ok.clear()
        ctx.engine_lost_at = now
    elif now - (ctx.engine_lost_at or now) > ENGINE_RELOAD_SECONDS:
        log.critical("no new engine for %d s; exiting so a supervisor restarts this worker", ENGINE_RELOAD_SECONDS)
        ctx.stopping.set()
        os._exit(71)
    try:
        heartbeat(ctx)  # /models shows it unavailable now
    except SQLAlchemyError:
        log.warning("the database is away; reloading the engine anyway")
    deadline = time.monotonic() + 60
    while ctx.running_ids() and time.monotonic() < deadline:
        time.sleep(0.2)  # each attempt sees the engine error and hands its task on
    try:
        # What the dead core left behind (its model worker) holds memory: ended before the new load.
        ctx.hosts.replace(slot, cleanup=lambda: kill_stale_engines(ctx.worker_id))
    except Exception:  # noqa: BLE001 - e.g. its core killed while it started: the next pass loads again
        log.error("loading a new engine failed; trying again (without one for %d s the process exits)",
                  ENGINE_RELOAD_SECONDS, exc_info=True)
        return
    ctx.engine_ok.set()
    log.info("a new engine is loaded; claiming again")
    heartbeat(ctx)


def drain(ctx: WorkerContext) -> None:
    """SIGTERM (a scale-down, a rolling update): claim nothing more; hand on the tasks that lose nothing
    by moving (on_restart retry/resume) at once, so another worker takes them now; let the others
    (``fail``, which moving would fail) finish within the grace; then hand on what is left (no lease wait)."""
    started = time.monotonic()
    ctx.draining.set()
    try:
        heartbeat(ctx)
    except SQLAlchemyError:
        pass
    early = _hand_on_own(ctx, ("retry", "resume"))
    deadline = started + ctx.settings.drain_seconds
    while ctx.running_ids() and time.monotonic() < deadline:
        time.sleep(0.2)
    late = _hand_on_own(ctx, None)
    fail_direct(ctx, [ctx.worker_id])  # a direct stream cannot move: its client retries elsewhere
    metrics.DRAIN_SECONDS.labels(model=ctx.label).observe(time.monotonic() - started)
    log.info("drained in %.1f s; %d tasks handed on at once, %d at the end", time.monotonic() - started,
             early, late)


def _hand_on_own(ctx: WorkerContext, policies: tuple[str, ...] | None) -> int:
    query = select(Task.id, Task.attempt).where(Task.worker_id == ctx.worker_id, Task.status.in_(LIVE))
    if policies is not None:
        query = query.where(Task.on_restart.in_(policies))
    with ctx.sessions() as session:
        rows = session.execute(query).all()
    for task_id, attempt in rows:
        runner.hand_on(ctx, task_id, attempt, "The worker running this task was stopped before it finished")
    return len(rows)


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


def my_turn(ctx: WorkerContext, name: str) -> bool:
    """Whether this worker runs the sweep ``name`` now. Every worker ticks, but of all those that do, one
    runs a cluster-wide sweep per sweep interval (by the database's clock): a hundred workers cost the
    database what one does. The row of the sweep is claimed by one conditional UPDATE, so two never both
    win one interval."""
    interval = ctx.settings.sweep_seconds * 0.8  # ticks drift: never skip a whole interval
    with transaction(ctx.sessions) as session:
        if session.execute(update(Sweep).where(Sweep.name == name, Sweep.swept_at < db_now() - interval)
                           .values(swept_at=db_now())).rowcount:
            return True
        if session.get(Sweep, name) is not None:
            return False
    try:
        with transaction(ctx.sessions) as session:
            session.execute(Sweep.__table__.insert().values(name=name, swept_at=db_now()))
        return True
    except IntegrityError:
        return False  # another worker made it first


def sweep(ctx: WorkerContext) -> None:
    if ctx.settled() and my_turn(ctx, "takeover"):
        take_over_dead(ctx)
    hand_on_orphans(ctx)  # this worker's own tasks (and cancellations nobody runs, by an index)
    if my_turn(ctx, "abandoned-direct"):
        fail_abandoned_direct(ctx)
    force = ctx.broker_restarted()  # each worker notices that itself: never gated
    for model in ctx.hosts.slots:
        if force or my_turn(ctx, f"dispatch:{model}"):
            redispatch_lost(ctx, model, force)
    if my_turn(ctx, "retention"):
        enforce_retention(ctx)


def watch_cancellations(ctx: WorkerContext) -> None:
    """Stop what was cancelled. The api's hint on Redis (_control_listener) stops it at once; this poll
    catches hints Redis lost: every tick while the hint channel is down, every heartbeat while it is up
    (a hundred workers polling twice a second would be the database's busiest query)."""
    running = ctx.running_ids()
    now = time.monotonic()
    if not running or (ctx.hints_live.is_set() and now - ctx.cancels_polled_at < ctx.settings.heartbeat_seconds):
        return
    ctx.cancels_polled_at = now
    cancelled = select(Response.id).where(Response.id.in_(running), Response.status == "cancelled")
    cancelling = select(Task.response_id).where(Task.worker_id == ctx.worker_id, Task.status == CANCELLING,
                                                Task.response_id.in_(running))
    with ctx.sessions() as session:
        ids = list(session.execute(union_all(cancelled, cancelling)).scalars())
    for rid in ids:
        ctx.cancel(rid)


def start_heartbeat(ctx: WorkerContext) -> threading.Thread:
    """From boot, before the engine loads: the id stays held and the workers list shows "loading"."""
    return _every(ctx, ctx.settings.heartbeat_seconds, heartbeat, "lmsp-heartbeat")


def start_background(ctx: WorkerContext) -> list[threading.Thread]:
    threads = [
        _every(ctx, ctx.settings.sweep_seconds, sweep, "lmsp-sweeper"),
        _every(ctx, 0.5, watch_cancellations, "lmsp-cancel-watch"),
        _every(ctx, 1.0, watch_engine, "lmsp-engine-watch"),
    ]
    if ctx.publisher.live:
        threads.append(threading.Thread(target=_control_listener, args=(ctx,), name="lmsp-control", daemon=True))
        threads[-1].start()
    return threads


def _control_listener(ctx: WorkerContext) -> None:
    """Redis hint from the api: abort this response now (the watcher catches it anyway)."""
    while not ctx.stopping.is_set():
        try:
            pubsub = ctx.publisher.client.pubsub(ignore_subscribe_messages=True)
            pubsub.subscribe(CONTROL)
            ctx.hints_live.set()
            while not ctx.stopping.is_set():
                message = pubsub.get_message(timeout=1.0)
                if message and message["type"] == "message":
                    ctx.cancel(aborted(message["data"]))
        except (redis.RedisError, OSError):
            ctx.hints_live.clear()  # hints sent from now until resubscribed are lost: poll often
            time.sleep(1)
