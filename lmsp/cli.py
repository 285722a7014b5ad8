"""The ``lmsp`` command: admin (serve, worker, dev, migrate, models, tokens) and client commands
(ask, submit, tail, tasks, models list) in one click group.

Results go to stdout, progress and messages to stderr. Admin commands import the server side
lazily, so client commands start fast.
"""

import errno
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from functools import wraps
from pathlib import Path

import click

from common.settings import ConfigError, get_settings
from lmsp import client as lc

DEFAULT_MODEL = "smollm2:135m"
SAMPLE_PROMPT = "Say hello in one sentence."


def say(message: str) -> None:
    click.echo(f"lmsp: {message}", err=True)


def fail(message: str, code: int = 1):
    say(message)
    sys.exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """LMSP 1.0 task service: run it (dev, serve, worker) and use it (ask, submit, tail, tasks)."""


def main(argv: list[str] | None = None) -> None:
    try:
        cli.main(args=argv, prog_name="lmsp")
    except ConfigError as exc:  # the environment, the models file or the database: one line, no traceback
        fail(str(exc))


# == admin ========================================================================================
def _sessions():
    from common.db import ensure_migrated, make_engine, session_factory
    engine = make_engine(get_settings().db_url)
    ensure_migrated(engine)
    return session_factory(engine)


def migrate() -> None:
    from common.db import shown_url, upgrade
    url = get_settings().db_url
    say(f"migrating {shown_url(url)}")
    upgrade(url)
    say("database is at the latest migration")


cli.command("migrate", help="Apply database migrations.")(migrate)


@cli.group()
def tokens() -> None:
    """API tokens."""


@tokens.command("create")
@click.option("--principal", required=True, help="The tenant the token acts for: 1-128 visible characters.")
@click.option("--scopes", help="Comma-separated; default: every 1.0 scope but admin.")
@click.option("--name", help="A label for `lmsp tokens list`: at most 200 characters.")
def tokens_create(principal: str, scopes: str | None, name: str | None) -> None:
    """Create a token; prints it once."""
    from common.tokens import check_principal, create_token, parse_scopes
    try:
        granted = parse_scopes(scopes)
        check_principal(principal, name)
    except ValueError as exc:
        fail(str(exc))
    with _sessions()() as session:
        token_id, secret = create_token(session, principal, granted, name)
        session.commit()
    say(f"created token {token_id} for principal {principal} with scopes {' '.join(granted)}; "
        "it is shown only now")
    click.echo(secret)


@tokens.command("list")
def tokens_list() -> None:
    """List tokens (never their secrets)."""
    from common.tokens import list_tokens
    with _sessions()() as session:
        rows = list_tokens(session)
    click.echo(f"{'ID':32} {'PRINCIPAL':20} {'NAME':16} {'STATE':8} SCOPES")
    for t in rows:
        state = "revoked" if t.revoked_at else "active"
        click.echo(f"{t.id:32} {t.principal_id:20} {(t.name or '-'):16} {state:8} {t.scopes.replace(' ', ',')}")


@tokens.command("revoke")
@click.argument("token_id")
def tokens_revoke(token_id: str) -> None:
    """Revoke a token at once."""
    from common.tokens import revoke_token
    with _sessions()() as session:
        found = revoke_token(session, token_id)
        session.commit()
    if not found:
        fail(f"no token {token_id}; `lmsp tokens list` shows them")
    say(f"revoked {token_id}")


@cli.group()
def models() -> None:
    """Models: the served ones, the local registry, importing GGUF files."""


def import_gguf(path: Path, model_id: str, *, reasoning_parser=None, tool_call_parser=None) -> None:
    from common.gguf import convert_gguf
    from common.registry import Capabilities, ModelSpec, Registry, imported_dir

    settings = get_settings()
    out = imported_dir(model_id)
    info = convert_gguf(path, out, say)
    window = min(info["context_window"], 8192)
    registry = Registry.load(settings.models_path)
    registry.put(ModelSpec(
        id=model_id, checkpoint=str(out), context_window=window, max_output_tokens=min(window, 4096),
        engine={"dtype": "auto", "max_model_len": window, "max_num_seqs": 64, "enforce_eager": True},
        capabilities=Capabilities(reasoning=reasoning_parser is not None),
        reasoning_parser=reasoning_parser, tool_call_parser=tool_call_parser))
    registry.save(settings.models_path)
    say(f"registered {model_id} in {settings.models_path}")


@models.command("import-gguf")
@click.argument("file", type=click.Path(path_type=Path))
@click.option("--id", "model_id", required=True)
@click.option("--reasoning-parser", type=click.Choice(["think"]))
@click.option("--tool-call-parser", type=click.Choice(["hermes"]))
def models_import(file: Path, model_id: str, reasoning_parser, tool_call_parser) -> None:
    """Convert a GGUF file (Ollama, llama.cpp) to a checkpoint vLLM loads, and register it."""
    if not file.is_file():
        fail(f"no file {file}")
    try:
        import_gguf(file, model_id, reasoning_parser=reasoning_parser, tool_call_parser=tool_call_parser)
    except (OSError, ValueError) as exc:  # not a GGUF file, an architecture transformers cannot read, ...
        fail(f"cannot import {file}: {str(exc).rstrip('.')}; give a GGUF file as Ollama or llama.cpp keep them")


@models.command("pull")
@click.argument("model_ids", metavar="[ID]...", nargs=-1)
@click.option("--all", "every", is_flag=True, help="Every model of the registry.")
@click.option("--tokenizer-only", is_flag=True,
              help="Only what the api needs (tokenizer, chat template, config): no weights.")
def models_pull(model_ids: tuple[str, ...], every: bool, tokenizer_only: bool) -> None:
    """Bring models' files onto this machine: a Hugging Face repo id into the shared cache (HF_HOME;
    resumable, HF_TOKEN for gated repos, HF_HUB_OFFLINE=1 uses the cache alone), a GGUF file converted.
    Prints each model's local folder; the api and the workers load from that same folder."""
    from common.errors import LMSPError
    from common.registry import CheckpointMissing, Registry, pull, source_of
    registry = Registry.load(get_settings().models_path)
    if every == bool(model_ids):
        fail("name the models to pull, or give --all (`lmsp models list --registry` shows them)")
    specs = list(registry.models.values()) if every else []
    for model_id in model_ids:
        try:
            specs.append(registry.get(model_id))
        except LMSPError as exc:
            fail(f"{exc.detail.split(';')[0]} in {get_settings().models_path}; "
                 "`lmsp models list --registry` shows them")
    for spec in specs:
        say(f"{spec.id}: {source_of(spec).describe()}")
        try:
            folder = pull(spec, tokenizer_only=tokenizer_only, progress=say)
        except CheckpointMissing as exc:
            fail(str(exc))
        click.echo(f"{spec.id}\t{folder}")


@models.command("fetch-default", help=f"Fetch and import the default model, {DEFAULT_MODEL}.")
def models_default() -> None:
    from common.gguf import fetch_default_gguf
    import_gguf(fetch_default_gguf(get_settings().home / "downloads", say), DEFAULT_MODEL)


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
    _sessions()
    if not Registry.load(settings.models_path).models:
        say(f"no models registered in {settings.models_path}: the api serves none "
            "(`lmsp models import-gguf FILE --id ID` registers one)")
    from api.serve import gunicorn_argv
    argv = gunicorn_argv(settings)
    os.execv(argv[0], argv)


@cli.command()
@click.option("--model", "model_id", required=True, help="The registry id of the model to serve.")
@click.option("--gpu", type=int, help="The GPU this worker owns (CUDA_VISIBLE_DEVICES).")
@click.option("--gpus", help="Supervise one worker per GPU of this host: 'all' or indices such as 0,1,2,3.")
@click.option("--tensor-parallel", type=click.IntRange(1), default=1, show_default=True,
              help="GPUs per worker: one engine spread over each group of this many GPUs of --gpus "
                   "(a model bigger than one GPU).")
def worker(model_id: str, gpu: int | None, gpus: str | None, tensor_parallel: int) -> None:
    """Run a worker: one engine for one model, on one GPU (or one per GPU, or per group, with --gpus)."""
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
    with _sessions()() as session:
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
    from common.lifecycle import live_workers
    try:
        with lc.Client(url, token, timeout=5, max_retries=0) as http:
            names = [m["id"] for m in http.models()]
    except lc.ClientError:
        return False
    with _sessions()() as session:
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


# == client =======================================================================================
HINTS = {
    "unauthorized": "Pass --token or set LMSP_TOKEN; `make run` writes a dev token to {token_path}, "
                    "`lmsp tokens create --principal NAME` makes others.",
    "insufficient_scope": "Use a token with that scope (`lmsp tokens create --principal NAME --scopes ...`).",
    "model_not_found": "`lmsp models list` shows the models this service serves.",
    "model_unavailable": "No worker serves the model yet: wait for `make run` to say it is ready, or start "
                         "`lmsp worker --model ID`; `lmsp submit` queues a task that waits for one.",
    "task_not_found": "`lmsp tasks list` shows your tasks.",
    "context_length_exceeded": "Shorten the prompt, or pick a model with a larger context window "
                               "(`lmsp models list`).",
    "rate_limited": "Wait a moment and retry.",
    "overloaded": "The queue is full: retry later.",
    "task_not_cancelable": "It has already finished: `lmsp tasks show ID` shows the result.",
}


def with_client(fn):
    """Run ``fn(client, **kwargs)`` with a client for ``url``/``token``; its errors become messages that
    say what to do next."""

    @wraps(fn)
    def run(url=None, token=None, **kwargs):
        token = token or lc.default_token()
        if not token:
            fail(f"no token: pass --token, set LMSP_TOKEN, or start the service with `make run` "
                 f"(it writes {lc.dev_token_path()})")
        try:
            # Few retries: a person waits for an answer (tail reconnects on its own for longer).
            with lc.Client(url, token, max_retries=3) as http:
                return fn(http, **kwargs)
        except lc.ProblemError as exc:
            hint = HINTS.get(exc.code, "").format(token_path=lc.dev_token_path())
            where = f" [{exc.param}]" if exc.param else ""
            fail(f"{exc.detail} ({exc.status} {exc.code}){where}" + (f"\n  {hint}" if hint else ""))
        except lc.ServiceUnreachable as exc:
            fail(f"{exc}\n  Is the service running? `make run` starts it; --url or LMSP_URL points elsewhere.")
        except lc.ClientError as exc:
            fail(str(exc))

    return run


def connection_options(fn):
    fn = click.option("--json", "as_json", is_flag=True, help="JSON for scripts.")(fn)
    fn = click.option("--token", envvar="LMSP_TOKEN",
                      help="API token (default LMSP_TOKEN, then the dev token of `make run`).")(fn)
    return click.option("--url", envvar="LMSP_URL",
                        help="Service URL (default LMSP_URL, else where `lmsp dev` serves).")(fn)


def client_command(group, name: str):
    """A client command: --url/--token/--json options and a ``lc.Client`` as first argument."""
    return lambda fn: group.command(name)(connection_options(with_client(fn)))


def _print_json(value) -> None:
    click.echo(json.dumps(value, indent=2, ensure_ascii=False))


def _console():
    from rich.console import Console
    return Console(highlight=False)


def _ago(unix: float) -> str:
    seconds = max(0, int(time.time() - unix))
    for size, unit in ((86400, "d"), (3600, "h"), (60, "m")):
        if seconds >= size:
            return f"{seconds // size}{unit} ago"
    return f"{seconds}s ago"


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 \
        else f"{seconds // 60}:{seconds % 60:02d}"


def _duration(task: dict) -> str:
    end = task["updated_at"] if task["status"] in lc.TERMINAL_STATES else time.time()
    return _clock(end - task["created_at"])


def _tokens(task: dict) -> str:
    usage = (task.get("response") or {}).get("usage")
    return str(usage["output_tokens"]) if usage else "-"


STATE_STYLE = {"succeeded": "green", "failed": "red", "cancelled": "yellow", "cancelling": "yellow",
               "running": "cyan", "loading": "cyan", "queued": "blue", "ready": "green", "unavailable": "red"}


def _styled(state: str):
    from rich.text import Text
    return Text(state, style=STATE_STYLE.get(state, ""))


# -- models list ----------------------------------------------------------------------------------
@models.command("list")
@click.option("--registry", is_flag=True, help="The local registry file instead of the service (no token).")
@connection_options
def models_list(registry: bool, url, token, as_json: bool) -> None:
    """The models the service serves, with their state (--registry: the local registry)."""
    if not registry:
        return _served_models(url=url, token=token, as_json=as_json)
    from common.registry import Registry, detect_machine, local_checkpoint, resolve_engine, source_of
    specs = list(Registry.load(get_settings().models_path).models.values())
    if as_json:
        return _print_json([s.model_dump(mode="json") for s in specs])
    machine = detect_machine()  # engine settings as a worker on this machine resolves them
    for spec in specs:
        try:
            present = "present " + local_checkpoint(spec)
        except FileNotFoundError:
            present = f"missing (`lmsp models pull {spec.id}`)"
        click.echo(f"{spec.id}\t{source_of(spec).describe()}\t{present}\tcontext={spec.context_window}\t"
                   f"{resolve_engine(spec, machine).summary()}")


@with_client
def _served_models(http: lc.Client, as_json: bool) -> None:
    data = http.models()
    if as_json:
        return _print_json(data)
    from rich.table import Table
    table = Table("MODEL", "STATE", "WORKERS", "CONTEXT", "MAX OUTPUT", "CAPABILITIES", box=None)
    for m in data:
        caps = ",".join(k for k, v in m["capabilities"].items() if v)
        table.add_row(m["id"], _styled(m["status"]), str(m["workers"]), str(m["context_window"]),
                      str(m["max_output_tokens"]), caps)
    _console().print(table)


# -- ask --------------------------------------------------------------------------------------------
@client_command(cli, "ask")
@click.argument("prompt")
@click.option("--model", help="Model id (default: the first ready one).")
@click.option("--json-schema", "schema_file", type=click.File("r"),
              help="Answer as JSON that matches this JSON Schema file.")
@click.option("--max-output-tokens", type=click.IntRange(1))
@click.option("--temperature", type=click.FloatRange(0, 2), help="0 for the most likely answer, every time.")
def ask(http: lc.Client, prompt: str, model, schema_file, max_output_tokens, temperature, as_json: bool) -> None:
    """Ask once; the answer streams to the terminal as it is generated."""
    fields = {"max_output_tokens": max_output_tokens, "temperature": temperature}
    if schema_file is not None:
        try:
            schema = json.load(schema_file)
        except ValueError as exc:
            fail(f"{schema_file.name} is not JSON: {exc}")
        name = re.sub(r"[^A-Za-z0-9_-]", "_", Path(schema_file.name).stem)[:64] or "answer"
        fields["response_format"] = lc.json_schema_format(schema, name)
    if as_json:
        return _print_json(http.create_response(prompt, model=model, **fields))
    final = None
    for event in http.stream_response(prompt, model=model, **fields):
        if event.name == lc.TEXT_DELTA:
            click.echo(event.data["delta"], nl=False)
            sys.stdout.flush()
        elif event.final:
            final = event
    click.echo()
    if final.name == "response.failed":
        error = final.data.get("error") or {}
        fail(f"generation failed: {error.get('detail', 'no detail')} ({error.get('code')})")
    if final.name == "response.incomplete":
        say(f"stopped early: {(final.data.get('incomplete_details') or {}).get('reason', 'incomplete')}")
    if final.name == "response.cancelled":
        fail("the response was cancelled")


# -- submit and tail ----------------------------------------------------------------------------------
@client_command(cli, "submit")
@click.argument("prompt")
@click.option("--model", help="Model id (default: the first ready one).")
@click.option("--max-output-tokens", type=click.IntRange(1))
@click.option("--on-restart", type=click.Choice(["fail", "retry", "resume"]),
              help="What a service restart does to the task (default: fail).")
@click.option("--follow", "-f", is_flag=True, help="Tail the task until it ends.")
@click.option("--idempotency-key", help="Default: a new random key.")
def submit(http: lc.Client, prompt, model, max_output_tokens, on_restart, follow, idempotency_key,
           as_json: bool) -> None:
    """Create a durable task; prints its id (with --follow, tails it)."""
    task = http.create_task(prompt, model=model, on_restart=on_restart, idempotency_key=idempotency_key,
                            max_output_tokens=max_output_tokens)
    if as_json and not follow:
        return _print_json(task)
    if not follow:
        click.echo(task["id"])
        say(f"queued; `lmsp tail {task['id']}` follows it")
        return
    sys.exit(_tail(http, task["id"], as_json))


@client_command(cli, "tail")
@click.argument("task_id")
def tail(http: lc.Client, task_id: str, as_json: bool) -> None:
    """Follow a task until it ends: its text and a live status line. Survives dropped connections and api
    restarts; exits 0 when the task succeeded, 1 otherwise. Ctrl-C stops tailing, not the task."""
    sys.exit(_tail(http, task_id, as_json))


class TailView:
    """What ``lmsp tail`` shows under the text: the current partial line and a status line."""

    def __init__(self, task: dict):
        self.task_id = task["id"]
        self.state = task["status"]
        self.created = task["created_at"]
        self.started: float | None = None     # when the first text of this attempt arrived
        self.chars = 0
        self.tokens: int | None = None        # exact, once the final event gives usage
        self.partial = ""
        self.note = ""
        self.ended: float | None = None

    def add(self, text: str) -> list[str]:
        """Take a delta; return the lines it completed."""
        if self.started is None:
            self.started = time.time()
        self.chars += len(text)
        lines = (self.partial + text).split("\n")
        self.partial = lines.pop()
        return lines

    def restart(self) -> None:
        self.started, self.chars, self.partial = None, 0, ""

    def status(self) -> str:
        now = self.ended or time.time()
        tokens = self.tokens if self.tokens is not None else round(self.chars / 4)
        approx = "" if self.tokens is not None else "~"
        rate = tokens / (now - self.started) if self.started and now > self.started else 0.0
        parts = [self.state, f"{approx}{tokens} tokens", f"{rate:.1f} tok/s", _clock(now - self.created),
                 self.task_id]
        return " · ".join(parts) + (f" · {self.note}" if self.note else "")

    def __rich__(self):
        from rich.console import Group
        from rich.text import Text
        line = Text(self.status(), style=f"bold {STATE_STYLE.get(self.state, '')}")
        return Group(Text(self.partial), line) if self.partial else line


FINAL_STATE = {"response.completed": "succeeded", "response.incomplete": "succeeded",
               "response.failed": "failed", "response.cancelled": "cancelled"}


def _tail(http: lc.Client, task_id: str, as_json: bool) -> int:
    task = http.get_task(task_id)
    if as_json:
        return _tail_json(http, task)
    replay = task["status"] in lc.TERMINAL_STATES  # the events come from the log, not as generated
    console = _console()
    view = TailView(task)
    live = None
    if console.is_terminal:
        from rich.live import Live
        live = Live(view, console=console, refresh_per_second=4, transient=True)
        live.start()

    def out(text: str) -> None:  # text above the status line (or plain, when not a terminal)
        if live is not None:
            live.console.print(text, markup=False, highlight=False, emoji=False, soft_wrap=True)
        else:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()

    def dropped(why: str, delay: float) -> None:
        view.note = f"reconnecting in {delay:.0f}s: {why}"

    final = None
    try:
        for event in http.follow(task_id, on_disconnect=dropped):
            view.note = ""
            if event.name == lc.TEXT_DELTA:
                for line in view.add(event.data["delta"]):
                    out(line)
                if live is None and view.partial:
                    sys.stdout.write(view.partial)
                    sys.stdout.flush()
                    view.partial = ""
            elif event.name == lc.ATTEMPT_STARTED:
                if view.partial:
                    out(view.partial)
                view.restart()
                out(f"↻ attempt {event.data.get('attempt', '?')} started: the text above is discarded")
            elif event.name == "response.output_item.added" and view.state in ("queued", "loading"):
                view.state = "running"
            elif event.final:
                final = event
    except KeyboardInterrupt:
        if live is not None:
            live.stop()
        if view.partial:
            click.echo(view.partial)
        say(f"stopped following; the task keeps running (`lmsp tasks cancel {task_id}` cancels it)")
        return 130
    except lc.Gone:
        task = http.get_task(task_id)  # events past their retention: the task still has the result
        if live is not None:
            live.stop()
        click.echo(lc.output_text(task.get("response")))
        say(f"{task['status']} (its events are past retention; this is the stored result)")
        return 0 if task["status"] == "succeeded" else 1
    finally:
        if live is not None and live.is_started:
            view.ended = time.time()
            live.stop()
    if view.partial:
        click.echo(view.partial)
    elif live is None and view.chars:
        click.echo()
    task = http.get_task(task_id)
    view.state = task["status"] if task["status"] in lc.TERMINAL_STATES else FINAL_STATE[final.name]
    view.tokens = ((final.data.get("usage") or {}).get("output_tokens")) if final else None
    view.ended = time.time()
    if replay:
        view.started, view.ended = task["created_at"], task["updated_at"]
    view.note = ""
    if view.state == "failed" and task.get("error"):
        view.note = f"{task['error'].get('code')}: {task['error'].get('detail')}"
    if console.is_terminal:
        console.print(view.status(), style=f"bold {STATE_STYLE.get(view.state, '')}")
    else:
        say(view.status())
    return 0 if view.state == "succeeded" else 1


def _tail_json(http: lc.Client, task: dict) -> int:
    """One JSON object per event, then the final task: for scripts."""
    try:
        for event in http.follow(task["id"]):
            click.echo(json.dumps({"id": event.id, "event": event.name, "data": event.data}, ensure_ascii=False))
    except KeyboardInterrupt:
        return 130
    task = http.get_task(task["id"])
    click.echo(json.dumps({"event": "task", "data": task}, ensure_ascii=False))
    return 0 if task["status"] == "succeeded" else 1


# -- tasks --------------------------------------------------------------------------------------------
@cli.group()
def tasks() -> None:
    """Your tasks: list, show, cancel."""


@client_command(tasks, "list")
@click.option("--state", help="Only these states, comma-separated (e.g. queued,running).")
@click.option("--limit", type=click.IntRange(1, 1000), default=20, show_default=True)
def tasks_list(http: lc.Client, state, limit: int, as_json: bool) -> None:
    """Your tasks, newest first."""
    rows = []
    for task in http.iter_tasks(state=state):
        rows.append(task)
        if len(rows) >= limit:
            break
    if as_json:
        return _print_json(rows)
    from rich.table import Table
    table = Table("TASK", "STATE", "TOKENS", "DURATION", "CREATED", "ON RESTART", box=None)
    for t in rows:
        table.add_row(t["id"], _styled(t["status"]), _tokens(t), _duration(t), _ago(t["created_at"]),
                      t["on_restart"])
    _console().print(table)
    if not rows:
        say("no tasks yet; `lmsp submit \"...\"` creates one")


@client_command(tasks, "show")
@click.argument("task_id")
def tasks_show(http: lc.Client, task_id: str, as_json: bool) -> None:
    """One task and, once it succeeded, its result."""
    task = http.get_task(task_id)
    if as_json:
        return _print_json(task)
    console = _console()
    from rich.table import Table
    facts = Table.grid(padding=(0, 2))
    facts.add_row("task", task["id"])
    facts.add_row("state", _styled(task["status"]))
    facts.add_row("created", f"{_ago(task['created_at'])} · took {_duration(task)}")
    facts.add_row("on restart", task["on_restart"])
    usage = (task.get("response") or {}).get("usage")
    if usage:
        facts.add_row("tokens", f"{usage['output_tokens']} output, {usage['input_tokens']} input")
    if task.get("error"):
        facts.add_row("error", f"{task['error'].get('code')}: {task['error'].get('detail')}")
    if line := _timeline_line(task):
        facts.add_row("timeline", line)
    console.print(facts)
    if task["status"] == "succeeded":
        console.print()
        console.print(lc.output_text(task["response"]), markup=False)
    elif task["status"] not in lc.TERMINAL_STATES:
        say(f"not finished; `lmsp tail {task_id}` follows it")


TIMELINE_PHASES = ("queue", "retries", "dispatch", "load", "prefill", "decode", "write_lag")


def _timeline_line(task: dict) -> str | None:
    """Where a finished task's time went (its x-lmsp-timeline extension), the phases that took any."""
    timeline = (task.get("extensions") or {}).get("x-lmsp-timeline") or {}
    durations = timeline.get("durations")
    if not durations:
        return None
    parts = [f"{name.replace('_', ' ')} {_seconds(durations[name])}" for name in TIMELINE_PHASES
             if durations.get(name, 0) >= 0.0005]
    share = durations["framework_overhead"] / timeline["wall"] if timeline["wall"] else 0
    return " · ".join(parts) + f" (framework {_seconds(durations['framework_overhead'])}, {share:.1%})"


def _seconds(value: float) -> str:
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


@client_command(tasks, "cancel")
@click.argument("task_id")
def tasks_cancel(http: lc.Client, task_id: str, as_json: bool) -> None:
    """Cancel a task (a running one stops within moments)."""
    task = http.cancel_task(task_id)
    if as_json:
        return _print_json(task)
    say(f"{task_id} is {task['status']}")


if __name__ == "__main__":
    main()
