"""The sweeper: every ``sweep_seconds`` a worker hands on what nobody moves on (worker/recovery.py), re-sends
broker messages that may be lost, and enforces retention; of all the workers ticking, one runs each
cluster-wide sweep per interval (``my_turn``)."""

from sqlalchemy import update
from sqlalchemy.exc import IntegrityError

from common.db import db_now, transaction
from common.tables import Sweep
from worker import recovery, retention
from worker.context import WorkerContext
from worker.steps import Loop


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
        recovery.take_over_dead(ctx)
    recovery.hand_on_orphans(ctx)  # this worker's own tasks (and cancellations nobody runs, by an index)
    if my_turn(ctx, "abandoned-direct"):
        recovery.sweep_abandoned_direct(ctx)
    force = ctx.broker_restarted()  # each worker notices that itself: never gated
    for model in ctx.hosts.slots:
        if force or my_turn(ctx, f"dispatch:{model}"):
            recovery.redispatch_lost(ctx, model, force)
    if my_turn(ctx, "retention"):
        retention.enforce_retention(ctx)


class Sweeper(Loop):
    name = "lmsp-sweeper"

    def every(self, ctx: WorkerContext) -> float:
        return ctx.settings.sweep_seconds

    tick = staticmethod(sweep)
