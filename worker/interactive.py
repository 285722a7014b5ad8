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
from concurrent.futures import ThreadPoolExecutor

from common import interactive_wire
from worker import runner
from worker.context import WorkerContext

log = logging.getLogger("lmsp.interactive")


def start(ctx: WorkerContext) -> threading.Thread:
    pool = ThreadPoolExecutor(ctx.spec.max_num_seqs, "lmsp-interactive")
    thread = threading.Thread(target=_consume, args=(ctx, pool), name="lmsp-interactive", daemon=True)
    thread.start()
    return thread


def _consume(ctx: WorkerContext, pool: ThreadPoolExecutor) -> None:
    def on_message(body, message):
        # Acked on receipt: an interactive request lives only as long as its HTTP stream, and a
        # worker that dies with it fails it (recovery.fail_direct) rather than running it twice.
        message.ack()
        try:
            response_id = interactive_wire.decode(body)
        except ValueError:
            log.warning("dropped a message that is not interactive work", exc_info=True)
            return
        pool.submit(_run, ctx, response_id, interactive_wire.prompt_ids(body), interactive_wire.logged(body))

    while not ctx.stopping.is_set():
        try:
            with ctx.celery.connection_for_read() as conn, \
                    conn.Consumer(interactive_wire.queue(ctx.spec.interactive_queue), callbacks=[on_message], accept=["json"]):
                while not ctx.stopping.is_set():
                    if not ctx.ready():
                        # Engine dead or reloading, or draining: leave the messages to ready workers
                        # (or to us once ready) rather than fail them or make a drain wait for them.
                        ctx.stopping.wait(0.2)
                        continue
                    try:
                        conn.drain_events(timeout=1)
                    except TimeoutError:
                        continue
        except Exception:  # noqa: BLE001 - the broker restarted: reconnect
            log.warning("interactive consumer lost the broker; reconnecting", exc_info=True)
            ctx.stopping.wait(1)


def _run(ctx: WorkerContext, response_id: str, prompt_ids: list[int] | None = None, logged: bool = False) -> None:
    if not ctx.ready():
        # Taken just before the engine died or a drain began: back to the queue, for a ready worker.
        interactive_wire.send(ctx.celery, ctx.spec.interactive_queue, response_id, prompt_ids, logged)
        return
    try:
        runner.run_direct(ctx, response_id, prompt_ids, logged)
    except runner.EngineStopped:
        pass
    except Exception:  # noqa: BLE001
        log.exception("interactive response %s failed", response_id)
