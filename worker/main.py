"""``lmsp worker --model ID``: one Celery worker (threads pool) hosting one vLLM engine; with
``--model a,b`` (or ``LMSP_WORKER_MODELS``) the engines of several models, loaded on demand within a
memory budget (worker/residency.py).

The worker is the list of steps ``STEPS`` (worker/steps.py), started in order and stopped in reverse:
end any engine a killed predecessor left behind, announce the worker (heartbeat) and hand on its
unfinished tasks by their restart policy, load the (first) engine, and only then consume the models'
queues. SIGTERM stops them from the last: the drain, the loops, the engines, then the writer and the
last heartbeat.
"""

import argparse
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
from worker import cancels, drain, engine_watch, heart, identity, recovery, runner, steps, sweeper
from worker.context import WorkerContext
from worker.procs import mark_deployment
from worker.residency import Residency, Slot
from worker.steps import Step

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
                 "`lmsp models list --registry` shows them, `make model` imports the default")
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
    """What the worker holds, connected to nothing yet but the database (migrated): the steps do the rest."""
    settings = get_settings()
    if settings.heartbeat_seconds * 2 > settings.lease_seconds:
        # A beat late by a little (a paused process, a slow commit) would have its tasks taken over: beat
        # three times a lease (a short lease set alone, as a test of takeovers may, keeps its meaning).
        log.warning("LMSP_HEARTBEAT_SECONDS=%g is more than half of LMSP_LEASE_SECONDS=%d: a worker would look "
                    "dead between its heartbeats; beating every %g s", settings.heartbeat_seconds,
                    settings.lease_seconds, settings.lease_seconds / 3)
        settings.heartbeat_seconds = settings.lease_seconds / 3
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
    if gpu is not None:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", str(gpu))
    mark_deployment(str(engine.url))
    machine = detect_machine()
    # One model: its threads kept off the engine's CPUs. Several come and go: the kernel decides.
    hosts = Residency([_slot(spec, checkpoint, machine, worker_id, pin=len(models) == 1)
                       for spec, checkpoint in models],
                      budget_gib=settings.worker_memory_budget_gib, keep_alive=settings.worker_keep_alive_seconds)
    return WorkerContext(settings=settings, worker_id=worker_id, sessions=session_factory(engine),
                         celery=make_celery(settings), publisher=Publisher(settings.redis_url), writer=None,
                         hosts=hosts)


class Consumer(Step):
    """Celery's consumer of the models' queues (threads pool): ``start`` returns when Celery does."""

    def start(self, ctx: WorkerContext) -> None:
        app = ctx.celery
        models_of = {slot.spec.queue: model for model, slot in ctx.hosts.slots.items()}

        @app.task(name=RUN_TASK, bind=True)
        def run(self, task_id: str) -> None:
            try:
                runner.run_task(ctx, task_id, models_of.get(self.request.delivery_info.get("routing_key")))
            except runner.EngineStopped:
                pass  # the drain (or the next boot) hands the task on

        concurrency = max(slot.spec.max_num_seqs for slot in ctx.hosts.slots.values())
        queues = ",".join(slot.spec.queue for slot in ctx.hosts.slots.values())
        app.worker_main(["worker", "-P", "threads", "-c", str(concurrency), "-Q", queues,
                         "-n", f"{ctx.worker_id}@{socket.gethostname()}", "--without-gossip",
                         "--without-mingle", "--without-heartbeat", "-l", "INFO"])


# The worker, in order; it stops in reverse. Each step says what it does and why it comes where it does.
STEPS = [
    steps.SoleHolder,          # refuse to start beside a live process of this id
    steps.StaleEngines,        # end the engines a killed predecessor of this id left behind
    steps.Writer,              # the event log's group commit
    heart.Heart,               # take the id, heartbeat from now on ("loading"); the last beat says stopped
    recovery.RecoverOwn,       # hand on what this id ran before it restarted, while the engine loads
    steps.Engines,             # load the (first) engine; stopping ends every engine
    steps.Metrics,             # readiness and /metrics: the startup probe means "loaded"
    sweeper.Sweeper,           # takeovers, orphans, lost broker messages, retention
    cancels.CancelWatch,       # cancellations the Redis hint missed
    cancels.ControlListener,   # the api's cancellation hints
    engine_watch.EngineWatch,  # a dead engine: stop claiming, load a new one
    steps.Interactive,         # the interactive lane
    drain.Drain,               # stopping it is the drain: first, while everything above still runs
    Consumer,                  # the models' queues, last: nothing is claimed before the rest runs
]


def serve(ctx: WorkerContext) -> None:
    worker = steps.Blueprint(STEPS)

    @worker_shutting_down.connect
    def _stop(**_):
        # Celery's warm shutdown would wait for generations that may run for hours, and it waits for its
        # pool's threads once this returns: drain within the grace, hand the rest on and end the engines
        # now; the writer's flush and the last heartbeat once those threads ended.
        worker.stop(ctx, through=steps.Engines)

    worker.start(ctx)  # returns when Celery does (a SIGTERM before Celery takes the signals over: Stopped)
    clean = ctx.stopping.is_set()  # the shutdown above ran
    worker.stop(ctx)
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
        logs.bind_process(worker_id=ctx.worker_id)
        serve(ctx)
    except ConfigError as exc:  # the environment, the models file or the database: one line, no traceback
        if not hasattr(exc, "exit_code"):
            sys.exit(f"lmsp worker: {exc}")
        print(f"lmsp worker: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)   # one a supervisor must not restart (identity.DuplicateWorker)
    except Stopped as exc:
        log.info("stopped before serving")
        logging.shutdown()
        os._exit(exc.code)  # handed on and stopped already; the interpreter's teardown (torch) takes seconds


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
