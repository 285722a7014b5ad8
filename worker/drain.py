"""The drain: what a worker does on SIGTERM before its loops and engines stop."""

import logging
import time

from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError

from common.states import LIVE
from common.tables import Task
from worker import metrics, runner
from worker.context import WorkerContext
from worker.heart import beat
from worker.recovery import fail_direct_of
from worker.steps import Step

log = logging.getLogger("lmsp.recovery")


class Drain(Step):
    """Started once the worker serves; stopping it is the drain, before any loop or engine stops (a task
    finishing within the grace needs its engine, its heartbeat and its cancel watch)."""

    def stop(self, ctx: WorkerContext) -> None:
        drain(ctx)


def drain(ctx: WorkerContext) -> None:
    """SIGTERM (a scale-down, a rolling update): claim nothing more; hand on the tasks that lose nothing
    by moving (on_restart retry/resume) at once, so another worker takes them now; let the others
    (``fail``, which moving would fail) finish within the grace; then hand on what is left (no lease wait)."""
    started = time.monotonic()
    ctx.draining.set()
    try:
        beat(ctx)
    except SQLAlchemyError:
        pass
    early = _hand_on_own(ctx, ("retry", "resume"))
    deadline = started + ctx.settings.drain_seconds
    while ctx.running_ids() and time.monotonic() < deadline:
        time.sleep(0.2)
    late = _hand_on_own(ctx, None)
    fail_direct_of(ctx, [ctx.worker_id])  # a direct stream cannot move: its client retries elsewhere
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
        runner.apply_restart_policy(ctx, task_id, attempt, "The worker running this task was stopped before it finished")
    return len(rows)
