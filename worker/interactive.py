"""The interactive lane: ``POST /responses`` work bypasses the Celery pool.

Background tasks may hold every pool thread (one per engine slot) for minutes;
a person at a screen must not wait for one of them to finish. Interactive
messages go to their own queue, which a dedicated consumer thread drains at
once into its own threads; inside the engine they run at a higher priority, so
vLLM admits them ahead of (and if needed by preempting) background requests.
"""

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

from kombu import Exchange, Queue

from worker import runner
from worker.context import WorkerContext

log = logging.getLogger("lmsp.interactive")


def interactive_reserve(max_num_seqs: int) -> int:
    """Engine slots kept beyond the background pool for people waiting at a screen."""
    return max(2, max_num_seqs // 8)


def queue_for(ctx: WorkerContext) -> Queue:
    name = ctx.spec.interactive_queue
    return Queue(name, Exchange(name, type="direct"), routing_key=name)


def start(ctx: WorkerContext) -> threading.Thread:
    pool = ThreadPoolExecutor(interactive_reserve(ctx.spec.max_num_seqs), "lmsp-interactive")
    thread = threading.Thread(target=_consume, args=(ctx, pool), name="lmsp-interactive", daemon=True)
    thread.start()
    return thread


def _consume(ctx: WorkerContext, pool: ThreadPoolExecutor) -> None:
    def on_message(body, message):
        # Acked on receipt: an interactive request lives only as long as its HTTP stream, and a
        # worker that dies with it fails it (recovery.fail_direct) rather than running it twice.
        message.ack()
        _args, kwargs, _embed = body
        pool.submit(_run, ctx, kwargs["response_id"])

    while not ctx.stopping.is_set():
        try:
            with ctx.celery.connection_for_read() as conn, \
                    conn.Consumer(queue_for(ctx), callbacks=[on_message], accept=["json"]):
                while not ctx.stopping.is_set():
                    try:
                        conn.drain_events(timeout=1)
                    except TimeoutError:
                        continue
        except Exception:  # noqa: BLE001 - the broker restarted: reconnect
            log.warning("interactive consumer lost the broker; reconnecting", exc_info=True)
            ctx.stopping.wait(1)


def _run(ctx: WorkerContext, response_id: str) -> None:
    try:
        runner.run_direct(ctx, response_id)
    except runner.EngineStopped:
        pass
    except Exception:  # noqa: BLE001
        log.exception("interactive response %s failed", response_id)
