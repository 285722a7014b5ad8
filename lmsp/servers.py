"""Running the service: `lmsp serve` (the api), `lmsp worker`, and `lmsp dev` (both on one machine)."""

import errno
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import click

from common.settings import get_settings
from lmsp import client as lc
from lmsp.admin import migrate
from lmsp.console import SAMPLE_PROMPT, cli, fail, say, sessions


# -- processes --------------------------------------------------------------------------------------
def _check_port(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                fail(f"port {port} on {host} is in use (another `lmsp dev` or `make run`?). Choose another "
                     f"with --port or LMSP_PORT, e.g. `make run LMSP_PORT={port + 1}`")
            fail(f"cannot listen on {host}:{port} ({exc.strerror or exc}); set LMSP_HOST to an address of "
                 "this machine (127.0.0.1, 0.0.0.0) and --port or LMSP_PORT to a free port above 1023")


def _server_settings(port: int | None):
    settings = get_settings()
    return settings if port is None else settings.model_copy(update={"port": port})


port_option = click.option("--port", type=click.IntRange(1, 65535), help="Listen here (default LMSP_PORT or 8080).")


@cli.command()
@port_option
def serve(port: int | None) -> None:
    """Run the api (gunicorn, gthread)."""
    settings = _server_settings(port)
    _check_port(settings.host, settings.port)
    # What every api process checks when it starts, checked once here: a mistake is one line now,
    # not a traceback per gunicorn worker.
    from common.registry import Registry
    sessions()
    if not Registry.load(settings.models_path).models:
        say(f"no models registered in {settings.models_path}: the api serves none "
            "(`lmsp models import-gguf FILE --id ID` registers one)")
    from api.serve import gunicorn_argv
    argv = gunicorn_argv(settings)
    os.execv(argv[0], argv)


@cli.command()
@click.option("--model", "model_id", help="The registry id of the model to serve, or several: a,b (loaded on "
              "demand within LMSP_WORKER_MEMORY_BUDGET_GIB). Default: LMSP_WORKER_MODELS.")
@click.option("--gpu", type=int, help="The GPU this worker owns (CUDA_VISIBLE_DEVICES).")
@click.option("--gpus", help="Supervise one worker per GPU of this host: 'all' or indices such as 0,1,2,3.")
@click.option("--tensor-parallel", type=click.IntRange(1), default=1, show_default=True,
              help="GPUs per worker: one engine spread over each group of this many GPUs of --gpus "
                   "(a model bigger than one GPU).")
def worker(model_id: str | None, gpu: int | None, gpus: str | None, tensor_parallel: int) -> None:
    """Run a worker: one engine for one model (or for several, loaded on demand), on one GPU (or one per
    GPU, or per group, with --gpus)."""
    if gpus is not None:
        if gpu is not None:
            fail("give --gpu (one worker) or --gpus (one per GPU), not both")
        from worker import supervisor
        sys.exit(supervisor.main(model_id, gpus, tensor_parallel))
    from worker.main import run
    run(model_id, gpu, tensor_parallel)


def _interrupt(*_):
    raise KeyboardInterrupt


def _dev_token(token_file: Path) -> None:
    """A token for principal 'dev' in ``token_file``; a new one if the file's is unknown to this database."""
    from common.tokens import DEFAULT_SCOPES, authenticate, create_token
    with sessions()() as session:
        if token_file.exists() and authenticate(session, token_file.read_text().strip()) is not None:
            return
        _, secret = create_token(session, "dev", DEFAULT_SCOPES, "dev")
        session.commit()
    token_file.unlink(missing_ok=True)
    token_file.touch(mode=0o600)
    token_file.write_text(secret + "\n")


def _command_name() -> str:
    """How to run this ``lmsp`` again from the same shell: ``lmsp`` if that is on PATH, else its path."""
    me = Path(sys.argv[0])
    if me.name == "__main__.py":  # python -m lmsp
        return f"{shlex.quote(sys.executable)} -m lmsp"
    on_path = shutil.which("lmsp")
    return "lmsp" if on_path and Path(on_path).resolve() == me.resolve() else str(me)


def _ready(url: str, token: str, since: float) -> bool:
    """The api answers and every registered model has a live worker started by this run: right after a
    crash the killed run's workers still look live (GET /lmsp/v1/models says ready) for a lease."""
    from common.liveness import live_workers
    try:
        with lc.Client(url, token, timeout=5, max_retries=0) as http:
            names = [m["id"] for m in http.models()]
    except lc.ClientError:
        return False
    with sessions()() as session:
        ours = live_workers(session, get_settings().lease_seconds, started_since=since)
    return all(ours.get(name) for name in names)


DEV_DRAIN_SECONDS = 5.0       # what running generations get when `lmsp dev` stops (LMSP_DRAIN_SECONDS overrides)
ENGINE_SHUTDOWN_SECONDS = 30  # after its drain, a worker hands its tasks on and ends its engine (~6 s on CPU)


@cli.command()
@port_option
def dev(port: int | None) -> None:
    """The api and one worker per model on this machine, with no Postgres or Redis."""
    from common.registry import Registry
    settings = _server_settings(port)
    _check_port(settings.host, settings.port)
    migrate()
    names = list(Registry.load(settings.models_path).models)
    if not names:
        fail("no models registered; run `make model` (or `lmsp models import-gguf FILE --id ID`)")
    token_file = settings.home / "dev-token"
    _dev_token(token_file)
    signal.signal(signal.SIGTERM, _interrupt)  # stop the children on SIGTERM too, not only Ctrl-C
    # Stopping `make run` should take seconds, not a rolling update's drain; the workers' drain must end
    # before the wait below does, or a killed worker would leave its engine running.
    drain = settings.drain_seconds if "LMSP_DRAIN_SECONDS" in os.environ else DEV_DRAIN_SECONDS
    env = {**os.environ, "LMSP_DRAIN_SECONDS": str(drain)}
    from worker.supervisor import die_with_parent  # a SIGKILLed `lmsp dev` must not leave them serving
    since = time.time()
    children = {f"the worker of {m}": subprocess.Popen([sys.executable, "-m", "lmsp", "worker", "--model", m],
                                                       env=env, preexec_fn=die_with_parent) for m in names}
    from api.serve import gunicorn_argv
    children["the api"] = subprocess.Popen(gunicorn_argv(settings), preexec_fn=die_with_parent)
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
    url = f"http://{host}:{settings.port}"
    say(f"starting on {url}: the api, and {len(names)} worker(s) loading {', '.join(names)} "
        "(about a minute); Ctrl-C stops")
    token = token_file.read_text().strip()
    ready = False
    try:
        while all(c.poll() is None for c in children.values()):
            if not ready and _ready(url, token, since):
                ready = True
                flag = "" if settings.port == 8080 and host == "127.0.0.1" else f" --url {url}"
                say(f"ready on {url} (dashboard: {url}/) · token in {token_file} · "
                    f"try: {_command_name()} ask{flag} \"{SAMPLE_PROMPT}\"")
            time.sleep(1)
    except KeyboardInterrupt:
        return
    finally:
        dead = next(((name, c.returncode) for name, c in children.items() if c.poll() is not None), None)
        for c in children.values():
            if c.poll() is None:
                c.send_signal(signal.SIGTERM)
        for c in children.values():
            try:
                c.wait(timeout=drain + ENGINE_SHUTDOWN_SECONDS)
            except subprocess.TimeoutExpired:
                c.kill()
    # Not stopped by Ctrl-C: a child ended by itself, so this run failed (a supervisor should know).
    fail(f"{dead[0]} exited with status {dead[1]} (its own message is above); the rest is stopped")
