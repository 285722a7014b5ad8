"""The engine watch: a dead writer ends the process; a dead engine stops claiming and a new one is loaded
(a worker of one model), or is unloaded until work for it comes (a worker of several)."""

import logging
import os
import time

from sqlalchemy.exc import SQLAlchemyError

from worker.context import WorkerContext
from worker.heart import beat
from worker.procs import kill_stale_engines
from worker.steps import Loop

log = logging.getLogger("lmsp.recovery")
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
        beat(ctx)  # /models shows it unavailable now
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
    beat(ctx)


class EngineWatch(Loop):
    name, seconds = "lmsp-engine-watch", 1.0
    tick = staticmethod(watch_engine)
