"""``lmsp worker --model ID``: one Celery worker (threads pool) hosting one vLLM engine; with
``--model a,b`` (or ``LMSP_WORKER_MODELS``) the engines of several models, loaded on demand within a
memory budget (worker/residency.py).

Order matters: end any engine a killed predecessor left behind, announce the worker (heartbeat)
and hand on its unfinished tasks by their restart policy, load the (first) engine, and only then
consume the models' queues.
"""

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from celery.signals import worker_shutting_down

from common import logs
from common.broker import RUN_TASK, make_celery
from common.bus import Publisher
from common.db import ensure_migrated, make_engine, session_factory
from common.errors import LMSPError
from common.registry import (
    CheckpointMissing,
    ModelSpec,
    Registry,
    detect_machine,
    memory_gib,
    pull,
    resolve_engine,
)
from common.settings import ConfigError, get_settings
from worker import identity, interactive, metrics, recovery, runner
from worker.context import WorkerContext
from worker.procs import kill_stale_engines, mark_deployment
from worker.residency import Residency, Slot
from worker.writer import EventWriter

log = logging.getLogger("lmsp.worker")


class Stopped(SystemExit):
    """SIGTERM or SIGINT before the consumer runs."""


def _stop_now(signum, _frame) -> None:
    """SIGTERM/SIGINT before the consumer runs (loading the engine takes minutes): stop at once. The
    engine's start ends the processes it had started; nothing is claimed yet, so nothing to hand on."""
    raise Stopped(128 + signum)


def _spec(registry: Registry, model_id: str, tensor_parallel: int) -> tuple[ModelSpec, str]:
    """A model this worker serves and its checkpoint folder on this host."""
    settings = get_settings()
    try:
        spec = registry.get(model_id)
    except LMSPError:
        sys.exit(f"lmsp worker: no model {model_id!r} in {settings.models_path}; "
                 "`lmsp models list` shows them, `make model` imports the default")
    try:
        # The same files the api's tokenizer reads; fetched here if this host has none yet (a no-op
        # when `lmsp models pull` or Kubernetes' init container already did).
        checkpoint = pull(spec, progress=log.info)
    except CheckpointMissing as exc:
        raise ConfigError(str(exc)) from None
    if not (Path(checkpoint) / "config.json").is_file():
        raise ConfigError(f"model {model_id}: {checkpoint} is not a checkpoint folder (no config.json); "
                          f"fix its checkpoint in {settings.models_path} or import it again with "
                          "`lmsp models import-gguf FILE --id ID`")
    if tensor_parallel > 1:
        spec = spec.model_copy(update={"engine": {**spec.engine, "tensor_parallel_size": tensor_parallel}})
    return spec, checkpoint


def _slot(spec: ModelSpec, checkpoint: str, machine, tag: str, pin: bool) -> Slot:
    resolved = resolve_engine(spec, machine)

    def load():
        if spec.engine_kind == "sim":  # never imports vLLM: dozens of simulated GPUs fit on one machine
            from worker.sim import SimEngine as Host
        else:
            from worker.engine import EngineHost as Host  # vLLM: seconds to import, the first time
        log.info("loading %s from %s: %s", spec.id, checkpoint, resolved.summary())
        host = Host(checkpoint, resolved, tag=tag, pin=pin)
        host.start()  # a failed load, or SIGTERM while loading (_stop_now), leaves no engine behind
        return host

    return Slot(spec, memory_gib(spec, resolved), load)


def build(model_ids: list[str], gpu: int | None, tensor_parallel: int = 1) -> WorkerContext:
    settings = get_settings()
    registry = Registry.load(settings.models_path)
    models = [_spec(registry, model_id, tensor_parallel) for model_id in model_ids]
    worker_id = settings.worker_id or f"{socket.gethostname()}:{','.join(model_ids)}" + \
        (f":gpu{gpu}" if gpu is not None else "")
    # A paused worker must not hold rows inside a transaction forever (a takeover waits on them).
    connect = {"connect_args": {"options": "-c idle_in_transaction_session_timeout=5000",
                                "application_name": identity.APPLICATION.format(worker_id)[:63]}} \
        if settings.db_url.startswith(("postgres", "postgresql")) else {}
    engine = make_engine(settings.db_url, **connect)
    ensure_migrated(engine)
    sessions = session_factory(engine)
    identity.ensure_sole(sessions, worker_id, settings.lease_seconds, settings.heartbeat_seconds)
    if gpu is not None:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", str(gpu))
    mark_deployment(str(engine.url))
    killed = kill_stale_engines(worker_id)
    if killed:
        log.warning("ended %d engine processes left by a previous run of %s", len(killed), worker_id)
    machine = detect_machine()
    # One model: its threads kept off the engine's CPUs. Several come and go: the kernel decides.
    hosts = Residency([_slot(spec, checkpoint, machine, worker_id, pin=len(models) == 1)
                       for spec, checkpoint in models],
                      budget_gib=settings.worker_memory_budget_gib, keep_alive=settings.worker_keep_alive_seconds)
    publisher = Publisher(settings.redis_url)
    ctx = WorkerContext(settings=settings, worker_id=worker_id, sessions=sessions, celery=make_celery(settings),
                        publisher=publisher, writer=None, hosts=hosts)
    ctx.writer = EventWriter(sessions, publisher, ctx.lose, ctx.stopping)
    # What this id ran before it restarted is handed on before the engine loads (a minute or more on a
    # busy host): its fail tasks end now and its retry/resume tasks go to a ready peer meanwhile. From
    # here the process holds the id (identity.ensure_sole) and heartbeats, "loading" until it is ready.
    recovery.heartbeat(ctx, boot=True)
    recovery.recover_own(ctx)
    recovery.start_heartbeat(ctx)
    try:
        hosts.load(model_ids[0], ctx.stopping)  # the first model at boot; the others when work for them comes
    except BaseException:  # a failed load or SIGTERM (Stopped): the workers list shows it gone at once
        ctx.stopping.set()
        with contextlib.suppress(Exception):
            recovery.heartbeat(ctx, stopped=True)
        raise
    hosts.on_change = lambda: recovery.announce(ctx)
    ctx.engine_ok.set()
    return ctx


def serve(ctx: WorkerContext) -> None:
    app = ctx.celery

    models_of = {slot.spec.queue: model for model, slot in ctx.hosts.slots.items()}

    @app.task(name=RUN_TASK, bind=True)
    def run(self, task_id: str) -> None:
        try:
            runner.run_task(ctx, task_id, models_of.get(self.request.delivery_info.get("routing_key")))
        except runner.EngineStopped:
            pass  # the drain (or the next boot) hands the task on

    @worker_shutting_down.connect
    def _stop(**_):
        # Celery's warm shutdown would wait for generations that may run for hours: drain within the
        # grace, hand the rest on, then stop the engine.
        recovery.drain(ctx)
        ctx.stopping.set()
        ctx.hosts.close()

    concurrency = max(slot.spec.max_num_seqs for slot in ctx.hosts.slots.values())
    queues = ",".join(slot.spec.queue for slot in ctx.hosts.slots.values())
    try:  # a SIGTERM before Celery takes the signals over (_stop_now) ends the engine here too
        recovery.start_background(ctx)
        interactive.start(ctx)
        app.worker_main(["worker", "-P", "threads", "-c", str(concurrency), "-Q", queues,
                         "-n", f"{ctx.worker_id}@{socket.gethostname()}", "--without-gossip",
                         "--without-mingle", "--without-heartbeat", "-l", "INFO"])
    finally:
        clean = ctx.stopping.is_set()
        ctx.stopping.set()
        ctx.hosts.close()
        ctx.writer.stop()
        recovery.heartbeat(ctx, stopped=True)
    if not clean:
        # Celery returned without being asked to stop: never exit 0 then, so a supervisor restarts us.
        sys.exit("lmsp worker: the Celery consumer stopped unexpectedly")


def run(models: str, gpu: int | None = None, tensor_parallel: int = 1) -> None:
    """The worker's entry point (`lmsp worker` calls it with its parsed options)."""
    # Honoured from the first instant: a pod or container stopped while the model loads stops now.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _stop_now)
    try:
        logs.setup()
        ctx = build(model_list(models), gpu, tensor_parallel)
    except ConfigError as exc:  # the environment, the models file or the database: one line, no traceback
        if not hasattr(exc, "exit_code"):
            sys.exit(f"lmsp worker: {exc}")
        print(f"lmsp worker: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)   # one a supervisor must not restart (identity.DuplicateWorker)
    except Stopped as exc:
        log.info("stopped while loading the model")
        logging.shutdown()
        os._exit(exc.code)  # nothing to hand on or flush; the interpreter's teardown (torch) takes seconds
    logs.bind_process(worker_id=ctx.worker_id)
    metrics.start_metrics_server(ctx)  # after the engine loaded: the startup probe means "loaded"
    serve(ctx)


def model_list(models: str | None) -> list[str]:
    """``a,b`` (``--model``, else ``LMSP_WORKER_MODELS``) as ids, each once."""
    ids = list(dict.fromkeys(m.strip() for m in (models or get_settings().worker_models).split(",") if m.strip()))
    if not ids:
        raise ConfigError("no model to serve: give --model ID (or several: --model a,b), or set LMSP_WORKER_MODELS")
    return ids


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lmsp worker")
    parser.add_argument("--model", help="a model id, or several: a,b (default: LMSP_WORKER_MODELS)")
    parser.add_argument("--gpu", type=int)
    parser.add_argument("--tensor-parallel", type=int, default=1)
    args = parser.parse_args(argv)
    run(args.model, args.gpu, args.tensor_parallel)


if __name__ == "__main__":
    main()
