"""``lmsp worker --model ID``: one Celery worker (threads pool) hosting one vLLM engine.

Order matters: end any engine a killed predecessor left behind, load the engine,
apply restart policies to this worker's unfinished tasks, announce the worker
(heartbeat), and only then consume the model's queue.
"""

import argparse
import logging
import os
import socket
import sys

from celery.signals import worker_shutting_down

from common.broker import RUN_TASK, make_celery
from common.bus import Publisher
from common.db import NotMigrated, ensure_migrated, make_engine, session_factory
from common.errors import LMSPError
from common.registry import Registry
from common.settings import get_settings
from worker import interactive, recovery, runner
from worker.context import WorkerContext
from worker.interactive import interactive_reserve
from worker.writer import EventWriter

log = logging.getLogger("lmsp.worker")


def build(model_id: str, gpu: int | None) -> WorkerContext:
    from worker.engine import EngineHost, kill_stale_engines

    settings = get_settings()
    try:
        spec = Registry.load(settings.models_path).get(model_id)
    except LMSPError:
        sys.exit(f"lmsp worker: no model {model_id!r} in {settings.models_path}; "
                 "`lmsp models list` shows them, `make model` imports the default")
    worker_id = settings.worker_id or f"{socket.gethostname()}:{model_id}" + (f":gpu{gpu}" if gpu is not None else "")
    engine = make_engine(settings.db_url)
    try:
        ensure_migrated(engine)
    except NotMigrated as exc:
        sys.exit(f"lmsp worker: {exc}")
    if gpu is not None:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", str(gpu))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(spec.kv_cache_gib)))
    killed = kill_stale_engines(worker_id)
    if killed:
        log.warning("ended %d engine processes left by a previous run of %s", len(killed), worker_id)
    log.info("loading %s from %s", spec.id, spec.checkpoint)
    # Background tasks fill at most max_num_seqs engine slots (the Celery pool's size); the engine
    # has a few more, so an interactive request is admitted at once even under a full queue.
    engine_args = {**spec.engine, "max_num_seqs": spec.max_num_seqs + interactive_reserve(spec.max_num_seqs)}
    host = EngineHost(spec.checkpoint, engine_args, tag=worker_id)
    host.start()
    sessions = session_factory(engine)
    publisher = Publisher(settings.redis_url)
    return WorkerContext(settings=settings, worker_id=worker_id, spec=spec, sessions=sessions,
                         celery=make_celery(settings), publisher=publisher,
                         writer=EventWriter(sessions, publisher), engine=host)


def serve(ctx: WorkerContext) -> None:
    app = ctx.celery

    @app.task(name=RUN_TASK)
    def run(task_id: str) -> None:
        try:
            runner.run_task(ctx, task_id)
        except runner.EngineStopped:
            pass  # the task stays unfinished; its restart policy applies when a worker comes back

    @worker_shutting_down.connect
    def _stop(**_):
        # Celery's warm shutdown would wait for generations that may run for hours (and hangs while
        # the engine lives): stop the engine now; unfinished tasks get their on_restart policy.
        ctx.stopping.set()
        ctx.engine.shutdown()

    recovery.heartbeat(ctx)
    recovery.recover_own(ctx)
    recovery.start_background(ctx)
    interactive.start(ctx)
    concurrency = ctx.spec.max_num_seqs
    try:
        app.worker_main(["worker", "-P", "threads", "-c", str(concurrency), "-Q", ctx.spec.queue,
                         "-n", f"{ctx.worker_id}@{socket.gethostname()}", "--without-gossip",
                         "--without-mingle", "--without-heartbeat", "-l", "INFO"])
    finally:
        ctx.stopping.set()
        ctx.engine.shutdown()
        ctx.writer.stop()
        recovery.heartbeat(ctx, stopped=True)


def run(model_id: str, gpu: int | None = None) -> None:
    """The worker's entry point (`lmsp worker` calls it with its parsed options)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(build(model_id, gpu))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lmsp worker")
    parser.add_argument("--model", required=True)
    parser.add_argument("--gpu", type=int)
    args = parser.parse_args(argv)
    run(args.model, args.gpu)


if __name__ == "__main__":
    main()
