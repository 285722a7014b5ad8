"""A worker is a list of steps, started in order and stopped in reverse (Celery's bootsteps are the
model): worker/main.py declares the list. A step that runs for the process's life has a ``start`` and a
``stop``; one done once at boot has a ``start`` only. This module holds the step types and the steps that
wrap other modules (the event writer, the engines, the metrics port, the interactive lane); each
long-running part has its step beside its code (worker/heart.py, worker/sweeper.py, ...).
"""

import logging
import threading

from sqlalchemy.exc import SQLAlchemyError

from worker import identity, interactive, metrics
from worker.context import WorkerContext
from worker.procs import kill_stale_engines
from worker.writer import EventWriter

log = logging.getLogger("lmsp.worker")


class Step:
    """One part of the worker. ``start`` may block (the consumer, the last step, does until Celery returns)."""

    def start(self, ctx: WorkerContext) -> None:
        pass

    def stop(self, ctx: WorkerContext) -> None:
        pass

    def __repr__(self) -> str:
        return type(self).__name__


class Loop(Step):
    """``tick(ctx)`` every ``every(ctx)`` seconds on a daemon thread, until ``stop``. A tick under way when
    it stops ends by itself: the process is ending, and a tick may wait on the database or an engine."""

    name = ""
    seconds = 1.0

    def every(self, ctx: WorkerContext) -> float:
        return self.seconds

    def tick(self, ctx: WorkerContext) -> None:
        raise NotImplementedError

    def start(self, ctx: WorkerContext) -> None:
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self._loop, args=(ctx,), name=self.name, daemon=True)
        self.thread.start()

    def stop(self, ctx: WorkerContext) -> None:
        self.halt.set()

    def _loop(self, ctx: WorkerContext) -> None:
        seconds = self.every(ctx)
        while not self.halt.wait(seconds):
            try:
                self.tick(ctx)
            except SQLAlchemyError as exc:
                log.warning("%s: database unavailable (%s)", self.name, exc.__class__.__name__)
            except Exception:  # noqa: BLE001 - keep the loop alive
                log.exception("%s failed", self.name)


class Blueprint:
    """The steps of one worker process: ``start`` runs them in order (a failing one stops those started
    before it, in reverse, and raises); ``stop`` stops the started ones in reverse, each once."""

    def __init__(self, steps: list[type[Step]]):
        self.steps = [step() for step in steps]
        self.started: list[Step] = []

    def start(self, ctx: WorkerContext) -> None:
        for step in self.steps:
            try:
                step.start(ctx)
            except BaseException:  # a failed load, or SIGTERM while loading (worker/main.py Stopped)
                ctx.stopping.set()
                self.stop(ctx)
                raise
            self.started.append(step)

    def stop(self, ctx: WorkerContext, through: type[Step] | None = None) -> None:
        """``through``: stop down to that step (included) only; the rest at the next call. A step that fails
        to stop is logged: the ones after it stop all the same (the last heartbeat, the writer's flush)."""
        while self.started:
            step = self.started.pop()
            try:
                step.stop(ctx)
            except Exception:  # noqa: BLE001 - e.g. the database away for the last heartbeat
                log.warning("stopping %r failed", step, exc_info=True)
            if through is not None and isinstance(step, through):
                return


# -- the steps of other modules ---------------------------------------------------------------------------
class SoleHolder(Step):
    """Refuse to start beside a live process of this worker id (worker/identity.py)."""

    def start(self, ctx: WorkerContext) -> None:
        identity.ensure_sole(ctx.sessions, ctx.worker_id, ctx.settings.lease_seconds, ctx.settings.heartbeat_seconds)


class StaleEngines(Step):
    """End the engines a killed predecessor of this id left behind (they hold the GPU's memory)."""

    def start(self, ctx: WorkerContext) -> None:
        killed = kill_stale_engines(ctx.worker_id)
        if killed:
            log.warning("ended %d engine processes left by a previous run of %s", len(killed), ctx.worker_id)


class Writer(Step):
    """The event log's group commit (worker/writer.py); stopped after the engines, so it flushes their last
    events."""

    def start(self, ctx: WorkerContext) -> None:
        ctx.writer = EventWriter(ctx.sessions, ctx.publisher, ctx.lose, ctx.stopping, heard=ctx.heard)

    def stop(self, ctx: WorkerContext) -> None:
        ctx.writer.stop()


class Engines(Step):
    """The first model's engine is loaded at boot (a minute or more); the others when work for them comes.
    Stopping ends every engine and the processes it started."""

    def start(self, ctx: WorkerContext) -> None:
        ctx.hosts.load(next(iter(ctx.hosts.slots)), ctx.stopping)
        ctx.engine_ok.set()

    def stop(self, ctx: WorkerContext) -> None:
        ctx.stopping.set()  # the process is ending: every loop and retry of it gives up
        ctx.hosts.close()


class Metrics(Step):
    """The readiness probe and /metrics, once the engine loaded: the startup probe means "loaded". It answers
    until the process exits (not ready from the drain on)."""

    def start(self, ctx: WorkerContext) -> None:
        metrics.start_metrics_server(ctx)


class Interactive(Step):
    """The interactive lane (worker/interactive.py); it stops consuming once ``ctx.stopping`` is set (the
    drain's end)."""

    def start(self, ctx: WorkerContext) -> None:
        interactive.start(ctx)
