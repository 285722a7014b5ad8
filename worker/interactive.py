"""The interactive lane: ``POST /responses`` work bypasses the Celery pool.

Background tasks may hold every pool thread (one per engine slot) for minutes;
a person at a screen must not wait for one of them to finish. Interactive
messages (common/interactive_wire.py) go to their own queue, which a dedicated
consumer thread drains at once into a pool as large as the engine's batch; the
engine host admits them ahead of background requests, pausing those if the batch
is full (worker/engine.py), so people are never limited to a reserve of slots.
"""

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

from sqlalchemy.exc import SQLAlchemyError

from common import interactive_wire, liveness
from worker import runner
from worker.context import WorkerContext

log = logging.getLogger("lmsp.interactive")


def start(ctx: WorkerContext) -> threading.Thread:
    pool = ThreadPoolExecutor(max(slot.spec.max_num_seqs for slot in ctx.hosts.slots.values()), "lmsp-interactive")
    thread = threading.Thread(target=_consume, args=(ctx, pool), name="lmsp-interactive", daemon=True)
    thread.start()
    return thread


class _Lanes:
    """Which models' interactive queues this worker drains (a worker of several models, worker/residency.py):
    those it has loaded, and a cold one only while no live worker has it loaded. A person should not wait
    for a load here when another worker serves the model now; when none does, this worker loads it for
    them (the request stays queued, unclaimed, meanwhile: worker/runner.py run_direct)."""

    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx
        self.elsewhere: set[str] = set()  # models loaded on other live workers, as last read
        self.read_at = -1e18

    def models(self) -> tuple[str, ...]:
        ctx = self.ctx
        loaded = ctx.hosts.loaded()
        if len(loaded) < len(ctx.hosts.slots) and time.monotonic() - self.read_at >= ctx.settings.heartbeat_seconds:
            self.read_at = time.monotonic()
            try:
                with ctx.sessions() as session:
                    where = liveness.loaded_on(session, ctx.settings.lease_seconds)
                self.elsewhere = {m for m, ids in where.items() if set(ids) - {ctx.worker_id}}
            except SQLAlchemyError:
                pass  # the database is away: go by what was read last
        return tuple(m for m in ctx.hosts.slots if m in loaded or m not in self.elsewhere)


def _consume(ctx: WorkerContext, pool: ThreadPoolExecutor) -> None:
    def on_message(model):
        def on(body, message):
            # Acked on receipt: an interactive request lives only as long as its HTTP stream, and a
            # worker that dies with it fails it (recovery.fail_direct_of) rather than running it twice.
            message.ack()
            try:
                response_id = interactive_wire.decode(body)
            except ValueError:
                log.warning("dropped a message that is not interactive work", exc_info=True)
                return
            pool.submit(_run, ctx, model, response_id, interactive_wire.prompt_ids(body),
                        interactive_wire.logged(body))
        return on

    lanes = _Lanes(ctx)
    while not ctx.stopping.is_set():
        try:
            with ctx.celery.connection_for_read() as conn:
                while not ctx.stopping.is_set():
                    if not ctx.ready():
                        # Engine dead or reloading, or draining: leave the messages to ready workers
                        # (or to us once ready) rather than fail them or make a drain wait for them.
                        ctx.stopping.wait(0.2)
                        continue
                    _drain(ctx, conn, lanes, on_message)
        except Exception:  # noqa: BLE001 - the broker restarted: reconnect
            # Not serving until it consumes again (its heartbeat says so: no direct request waits for it);
            # the whole traceback once an outage, not every second of it.
            first = ctx.broker_lost_at is None
            ctx.broker_lost_at = ctx.broker_lost_at or time.monotonic()
            log.warning("interactive consumer lost the broker; reconnecting", exc_info=first)
            ctx.stopping.wait(1)


def _drain(ctx: WorkerContext, conn, lanes: _Lanes, on_message) -> None:
    """Drain the lanes' queues until the set of lanes changes, or the worker is not ready."""
    models = lanes.models()
    with ExitStack() as consumers:
        for model in models:
            consumers.enter_context(conn.Consumer(interactive_wire.queue(ctx.spec(model).interactive_queue),
                                                  callbacks=[on_message(model)], accept=["json"]))
        conn.ensure_connection(max_retries=1, interval_start=0)  # (no consumer declared it without a model)
        if ctx.broker_lost_at is not None:
            log.info("interactive consumer has the broker again")
            ctx.broker_lost_at = None
        while not ctx.stopping.is_set() and ctx.ready() and lanes.models() == models:
            if not models:
                ctx.stopping.wait(0.2)
                continue
            try:
                conn.drain_events(timeout=1)
            except TimeoutError:
                continue


def _run(ctx: WorkerContext, model: str, response_id: str, prompt_ids: list[int] | None = None,
         logged: bool = False) -> None:
    if not ctx.ready():
        # Taken just before the engine died or a drain began: back to the queue, for a ready worker.
        interactive_wire.send(ctx.celery, ctx.spec(model).interactive_queue, response_id, prompt_ids, logged)
        return
    try:
        runner.run_direct(ctx, model, response_id, prompt_ids, logged)
    except runner.EngineStopped:
        pass
    except Exception:  # noqa: BLE001
        log.exception("interactive response %s failed", response_id)
