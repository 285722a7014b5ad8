"""The worker's heartbeat: its row in the workers table (common/liveness.py), written every
``heartbeat_seconds`` from boot, before the engine loads, so the id stays held and the workers list shows
"loading"; the last one says the worker stopped."""

import logging
import os
import time

from sqlalchemy.exc import SQLAlchemyError

from common import liveness
from common.db import transaction
from worker.context import WorkerContext
from worker.steps import Loop

log = logging.getLogger("lmsp.heart")


def beat(ctx: WorkerContext, stopped: bool = False, boot: bool = False) -> None:
    """One heartbeat. ``boot``: this process takes the worker id (every later one is fenced by it)."""
    if not ctx.writer.alive and not stopped:
        return  # a worker that cannot log events must look dead, so its tasks are taken over
    try:
        with transaction(ctx.sessions) as session:
            liveness.heartbeat(session, ctx.worker_id, ctx.hosts.servable(), ctx.started_at,
                               running=ctx.hosts.running(), ready=ctx.serving(), loaded=ctx.hosts.loaded(),
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
        beat(ctx)
    except SQLAlchemyError:
        log.warning("the database is away; the next heartbeat records the loaded models")


class Heart(Loop):
    """Takes the worker id at boot, holds it with a beat every ``heartbeat_seconds``; the last beat, once
    every later step stopped, says the worker stopped (the workers list shows it gone at once)."""

    name = "lmsp-heartbeat"

    def every(self, ctx: WorkerContext) -> float:
        return ctx.settings.heartbeat_seconds

    tick = staticmethod(beat)

    def start(self, ctx: WorkerContext) -> None:
        beat(ctx, boot=True)
        ctx.hosts.on_change = lambda: announce(ctx)
        super().start(ctx)

    def stop(self, ctx: WorkerContext) -> None:
        super().stop(ctx)
        self.thread.join(timeout=ctx.settings.heartbeat_seconds)  # a beat under way would undo the last one
        beat(ctx, stopped=True)
