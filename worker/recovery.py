"""Restart semantics (7.5): work whose worker is gone is handed on by its ``on_restart`` policy.

Every non-final state has an owner that moves it on (docs/architecture.md, invariant 8): at boot a
worker hands on its own unfinished tasks (the ``RecoverOwn`` step); its sweeper (worker/sweeper.py) does
the same for workers whose lease expired, finishes cancellations nobody runs and direct responses nobody
will, and re-sends broker messages that may be lost.
"""

import logging

from sqlalchemy import select, text
from sqlalchemy.exc import SQLAlchemyError

from common import lifecycle, liveness
from common.broker import BACKGROUND, dispatch
from common.db import transaction
from common.registry import queue_name
from common.states import CANCELLING, LIVE
from common.tables import Task
from worker import metrics, runner
from worker.context import WorkerContext
from worker.steps import Step

log = logging.getLogger("lmsp.recovery")


class RecoverOwn(Step):
    """At boot, before the engine loads (a minute or more on a busy host): whatever this worker id ran
    before it restarted is handed on by its policy, so its fail tasks end now and its retry/resume tasks go
    to a ready peer meanwhile."""

    def start(self, ctx: WorkerContext) -> None:
        recover_own(ctx)


def recover_own(ctx: WorkerContext) -> None:
    fail_direct_of(ctx, [ctx.worker_id])
    with ctx.sessions() as session:
        rows = session.execute(select(Task.id, Task.attempt).where(
            Task.worker_id == ctx.worker_id, Task.status.in_(LIVE))).all()
    for task_id, attempt in rows:
        log.info("applying on_restart to %s", task_id)
        runner.apply_restart_policy(ctx, task_id, attempt, "The worker running this task restarted")


def fail_direct_of(ctx: WorkerContext, worker_ids: list[str]) -> None:
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
    fail_direct_of(ctx, dead)
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
            runner.apply_restart_policy(ctx, task_id, attempt, "The worker running this task lost track of it")
    ctx.orphans = suspects


def sweep_abandoned_direct(ctx: WorkerContext) -> None:
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


