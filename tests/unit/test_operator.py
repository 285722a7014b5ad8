"""What an operator gets wrong: the environment, the models file, the database. Every entry point
(`lmsp ...`, the worker, gunicorn's api.wsgi) says in one line what is wrong and what to do, and
exits non-zero; never a traceback. And while the database is away, clients are told to retry."""

import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from common.db import upgrade
from common.settings import get_settings
from lmsp import cli, servers
from tests.harness import free_port
from tests.unit.conftest import problem

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A clean LMSP_* environment under tmp_path, with a migrated SQLite database; returns a setter."""
    for name in [n for n in os.environ if n.startswith("LMSP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("LMSP_HOME", str(tmp_path))
    monkeypatch.setenv("LMSP_DATABASE_URL", f"sqlite:///{tmp_path / 'lmsp.db'}")
    upgrade(f"sqlite:///{tmp_path / 'lmsp.db'}")
    monkeypatch.setattr(os, "execv", lambda *a: pytest.fail(f"exec'd {a} despite a bad configuration"))
    get_settings.cache_clear()
    yield lambda **values: [monkeypatch.setenv(f"LMSP_{k.upper()}", v) for k, v in values.items()]
    get_settings.cache_clear()


def lmsp(capsys, *args: str) -> tuple[int, list[str], str]:
    """Exit status, stderr lines, stdout."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(list(args))
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return exit_.value.code, [line for line in err.splitlines() if line.strip()], out


def fails_with(capsys, args: tuple, *words: str) -> str:
    code, lines, _ = lmsp(capsys, *args)
    assert code not in (0, None) and lines, lines
    last = lines[-1]
    assert last.startswith("lmsp: ") and all(w in last for w in words), lines
    return last


@pytest.mark.parametrize("args", [("tokens", "list"), ("ask", "hi", "--token", "x"), ("serve",)])
def test_a_setting_that_does_not_parse_is_one_line(env, capsys, args):
    env(port="abc")
    fails_with(capsys, args, "LMSP_PORT='abc'", "fix or unset it")


@pytest.mark.parametrize("name, value", [("redis_url", "localhost:6379"), ("redis_url", "http://x"),
                                         ("broker_url", "redis")])
def test_a_redis_or_broker_url_that_is_not_one_is_one_line(env, capsys, name, value):
    env(**{name: value})
    fails_with(capsys, ("tokens", "list"), f"LMSP_{name.upper()}={value!r}", "URL")


def test_out_of_range_settings_are_named_together(env, capsys):
    # A zero heartbeat would spin every open stream's loop; a negative body limit refuses every body.
    env(port="99999", api_workers="0", sse_heartbeat_seconds="0", max_body_bytes="-1")
    fails_with(capsys, ("serve",), "LMSP_PORT='99999'", "LMSP_API_WORKERS='0'", "LMSP_SSE_HEARTBEAT_SECONDS='0'",
               "LMSP_MAX_BODY_BYTES='-1'")


@pytest.mark.parametrize("name, value", [
    # Each of these was taken: a drain of nan seconds failed every task at SIGTERM, and a negative retention
    # would have dropped what it is to keep (0 stays a value: gone as soon as allowed, or a closed door).
    ("drain_seconds", "nan"), ("drain_seconds", "-1"), ("rate_limit_burst", "-1"),
    ("max_queued_tasks_per_principal", "-1"), ("rate_limit_per_second", "-1"), ("max_task_wait_seconds", "-1"),
    ("event_retention_seconds", "-1"), ("record_retention_seconds", "-5"), ("api_threads", "9" * 20),
    ("worker_keep_alive_seconds", "inf"),
])
def test_a_setting_out_of_its_range_is_one_line(env, capsys, name, value):
    env(**{name: value})
    fails_with(capsys, ("tokens", "list"), f"LMSP_{name.upper()}={value!r}", "is not valid")


def test_a_heartbeat_slower_than_half_the_lease_is_made_faster_and_said(env, tmp_path, caplog):
    import yaml

    from common.settings import ConfigError
    from tests.harness import model_entry
    from worker import main as worker_main
    (tmp_path / "models.yaml").write_text(yaml.safe_dump({"models": [model_entry("m:1", checkpoint=str(tmp_path))]}))
    env(heartbeat_seconds="20", lease_seconds="30")
    with pytest.raises(ConfigError):  # (its checkpoint is not one: it stops after the settings' check)
        worker_main.build(["m:1"], None)
    assert get_settings().heartbeat_seconds == 10
    assert "LMSP_HEARTBEAT_SECONDS=20 is more than half of LMSP_LEASE_SECONDS=30" in caplog.text


@pytest.mark.parametrize("url, words", [
    ("postgresql://lmsp:hunter2@127.0.0.1:1/lmsp", ("cannot reach the database", "LMSP_DATABASE_URL")),
    ("not a url", ("is not a database URL", "postgresql://")),
    ("nosuchdb://host/x", ("is not a database URL",)),
    ("mysql://lmsp:hunter2@127.0.0.1/lmsp", ("is not a database URL", "MySQLdb", "postgresql://")),  # no driver
])
@pytest.mark.parametrize("args", [("tokens", "list"), ("migrate",), ("serve",)])
def test_a_database_that_cannot_be_reached_is_one_line(env, capsys, url, words, args):
    env(database_url=url)
    assert "hunter2" not in fails_with(capsys, args, *words)


def test_an_unmigrated_database_says_to_migrate(env, capsys, tmp_path):
    env(database_url=f"sqlite:///{tmp_path / 'new.db'}")
    fails_with(capsys, ("tokens", "list"), "lmsp migrate")


@pytest.mark.parametrize("text, words", [
    ("models: [1", ("not valid YAML", "line 2")),
    ("- a list", ("must be a mapping",)),
    ("models: [{id: x}]", ("model 1 (x)", "checkpoint")),
    # Each of these raised out of the loader or a later int(), or was taken silently.
    ("models: [{id: x, checkpoint: /x, context_window: 8, max_output_tokens: 8, 1: 1}]", ("model 1 (x)", "1: ")),
    ("models: [{id: x, checkpoint: /x, context_window: 8, max_output_tokens: 8, kv_cache_gb: 1}]",
     ("model 1 (x)", "kv_cache_gb", "Extra inputs")),
    ("models: [{id: x, checkpoint: /x, context_window: 8, max_output_tokens: 8, engine: {max_model_len: abc}}]",
     ("model 1 (x)", "max_model_len must be a whole number")),
    ("models: [{id: x, checkpoint: /x, context_window: 8, max_output_tokens: 8},\n"
     "         {id: x, checkpoint: /y, context_window: 8, max_output_tokens: 8}]", ("models 1 and 2", "'x'")),
    # Each of these loaded, and failed requests later: a 500 on GET /models, odd refusals, every task failed.
    ("models: [{id: x, checkpoint: /x, context_window: -5, max_output_tokens: 8}]", ("model 1 (x)", "context_window")),
    ("models: [{id: x, checkpoint: /x, context_window: 8, max_output_tokens: 0}]", ("model 1 (x)", "max_output_tokens")),
    ("models: [{id: x, checkpoint: /x, context_window: 8, max_output_tokens: 9}]",
     ("model 1 (x)", "above context_window")),
    ("models: [{id: '', checkpoint: /x, context_window: 8, max_output_tokens: 8}]", ("model 1", "id")),
    ("models: [{id: x, checkpoint: /x, context_window: 8, max_output_tokens: 8, engine: {kind: sim, "
     "stop_after: foo}}]", ("model 1 (x)", "stop_after must be [lo, hi]")),
    ("models: [{id: x, checkpoint: /x, context_window: 8, max_output_tokens: 8, engine: {kind: sim, "
     "tokens_per_s: 0}}]", ("model 1 (x)", "tokens_per_s must be a number above 0")),
])
@pytest.mark.parametrize("args", [("models", "list", "--registry"), ("serve",), ("dev",)])
def test_a_broken_models_file_is_one_line(env, capsys, tmp_path, text, words, args):
    (tmp_path / "models.yaml").write_text(text + "\n")
    env(port=str(free_port()))
    line = fails_with(capsys, args, str(tmp_path / "models.yaml"), *words)
    assert ": :" not in line and "Value error" not in line  # pydantic's wording of a check of the whole model


def test_a_models_file_that_is_a_folder_is_one_line(env, capsys, tmp_path):
    env(models_file=str(tmp_path))
    fails_with(capsys, ("models", "list", "--registry"), "cannot read the models file", "LMSP_MODELS_FILE")


@pytest.mark.parametrize("checkpoint", ["org/..", "org/a--b", "org/" + "b" * 97])
def test_a_checkpoint_the_hub_would_refuse_is_a_missing_folder(env, capsys, tmp_path, checkpoint):
    """Taken for a repo id, it raised huggingface_hub's HFValidationError out of `pull` and `list`."""
    (tmp_path / "models.yaml").write_text(f"models: [{{id: x, checkpoint: '{checkpoint}', context_window: 8, "
                                          "max_output_tokens: 8}]\n")
    fails_with(capsys, ("models", "pull", "x"), checkpoint, "there is no such folder")
    code, _, out = lmsp(capsys, "models", "list", "--registry")
    assert code in (0, None) and "missing" in out


@pytest.mark.parametrize("name", ["VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_NUM_OF_RESERVED_CPU"])
def test_a_vllm_variable_that_is_not_a_number_is_one_line(env, capsys, tmp_path, monkeypatch, name):
    (tmp_path / "models.yaml").write_text(f"models: [{{id: x, checkpoint: '{tmp_path}', context_window: 8, "
                                          "max_output_tokens: 8}]\n")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")  # else the reserved CPUs are not read
    monkeypatch.setenv(name, "abc")
    fails_with(capsys, ("models", "list", "--registry"), f"{name}='abc'", "fix or unset it")


def test_tokens_commands_refuse_what_the_database_cannot_hold(env, capsys):
    fails_with(capsys, ("tokens", "revoke", "tok_nope"), "no token tok_nope", "lmsp tokens list")
    fails_with(capsys, ("tokens", "revoke", "tok_\x00"), "no token")
    for principal in ("", "a b", "p" * 129, "tab\there"):
        fails_with(capsys, ("tokens", "create", "--principal", principal), "principal")
    fails_with(capsys, ("tokens", "create", "--principal", "p", "--name", "n" * 201), "name")
    code, _, out = lmsp(capsys, "tokens", "list")
    assert code in (0, None) and len(out.splitlines()) == 1  # the header: nothing was created


def test_an_address_that_cannot_be_listened_on_is_one_line(env, capsys):
    env(host="192.0.2.1")  # TEST-NET-1: never this machine's
    fails_with(capsys, ("serve", "--port", str(free_port())), "cannot listen on 192.0.2.1", "LMSP_HOST")


def test_the_worker_says_what_is_wrong(env, monkeypatch):
    from worker import main as worker_main
    env(log_format="text", port="abc")
    with pytest.raises(SystemExit) as exit_:
        worker_main.run("any")
    assert str(exit_.value.code).startswith("lmsp worker: LMSP_PORT='abc'")


@pytest.mark.parametrize("values, words", [
    ({"LMSP_MODELS_FILE": "models.yaml"}, "lmsp api: the models file"),
    ({"LMSP_LOG_FORMAT": "xml"}, "lmsp api: LMSP_LOG_FORMAT='xml'"),
])
def test_gunicorns_entry_point_stops_gunicorn_with_one_line(tmp_path, values, words):
    """gunicorn's master halts ("App failed to load") on exit status 4, instead of booting workers
    that fail the same way."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMSP_")}
    env.update(LMSP_HOME=str(tmp_path), HOME=str(tmp_path), **{k: str(tmp_path / v) if k.endswith("FILE") else v
                                                                for k, v in values.items()})
    (tmp_path / "models.yaml").write_text("models: [{id: x}]\n")
    upgrade(f"sqlite:///{tmp_path / 'lmsp.db'}")
    done = subprocess.run([sys.executable, "-c", "import api.wsgi"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 4 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines()[-1].startswith(words), done.stderr


def test_importing_a_file_that_is_not_gguf_is_one_line(env, capsys, tmp_path):
    (tmp_path / "notes.gguf").write_text("not a model")
    fails_with(capsys, ("models", "import-gguf", str(tmp_path / "notes.gguf"), "--id", "x"), "is not a GGUF file")
    (tmp_path / "models.yaml").write_text(f"models: [{{id: x, checkpoint: '{tmp_path / 'notes.gguf'}', "
                                          "context_window: 8, max_output_tokens: 8}]\n")
    fails_with(capsys, ("models", "pull", "x"), "model x: cannot import", "is not a GGUF file", "models file")


def test_importing_a_truncated_gguf_is_one_line(env, capsys, tmp_path):
    """gguf's parser raised struct.error when the bytes ran out (an interrupted download)."""
    (tmp_path / "cut.gguf").write_bytes(b"GGUF\x03\x00\x00\x00\x01")
    fails_with(capsys, ("models", "import-gguf", str(tmp_path / "cut.gguf"), "--id", "x"), "ends early")
    (tmp_path / "models.yaml").write_text(f"models: [{{id: x, checkpoint: '{tmp_path / 'cut.gguf'}', "
                                          "context_window: 8, max_output_tokens: 8}]\n")
    fails_with(capsys, ("models", "pull", "x"), "model x: cannot import", "ends early")


@pytest.fixture
def answering(request):
    """A server at a URL that answers every request with ``(status, content type, body)``: not LMSP."""
    status, kind, body = request.param

    class Handler(BaseHTTPRequestHandler):
        def answer(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = answer

        def log_message(self, *_):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("answering, words", [
    ((200, "text/html", b"<html>welcome</html>"), ("200 OK without a", "LMSP service", "LMSP_URL")),
    ((200, "application/json", b"[]"), ("200 OK without a",)),
    ((200, "application/json", b'{"object": "thing"}'), ("without", "LMSP service")),
    ((200, "text/event-stream", b"data: nonsense\n\n"), ("a JSON object",)),
    ((400, "application/problem+json", b'{"status": "bad", "detail": "refused"}'), ("refused (400",)),
], indirect=["answering"])
@pytest.mark.parametrize("args", [("models", "list"), ("tasks", "show", "task_x"), ("ask", "hi", "--model", "m")])
def test_a_url_that_is_not_the_service_is_one_line(env, capsys, answering, words, args):
    """Another server on that port (or a proxy's page): JSON errors, KeyError, int("bad") were raised."""
    fails_with(capsys, (*args, "--url", answering, "--token", "t"), *words)


class _Child:
    """A child process of `lmsp dev`: the api runs, the worker exits at once with status 3."""

    def __init__(self, argv, **_):
        self.returncode = 3 if "worker" in argv else None

    def poll(self):
        return self.returncode

    def send_signal(self, _sig):
        self.returncode = -15

    def wait(self, timeout=None):
        return self.returncode


def test_dev_exits_non_zero_when_a_child_dies(env, capsys, tmp_path, monkeypatch):
    import yaml

    from tests.harness import model_entry
    (tmp_path / "models.yaml").write_text(yaml.safe_dump({"models": [model_entry("m:1")]}))
    env(port=str(free_port()))
    monkeypatch.setattr(servers.subprocess, "Popen", _Child)
    monkeypatch.setattr(servers.signal, "signal", lambda *a: None)
    fails_with(capsys, ("dev",), "the worker of m:1 exited with status 3")


def test_a_database_migrated_by_a_newer_lmsp_says_so(env, capsys, tmp_path):
    import sqlite3
    with sqlite3.connect(tmp_path / "lmsp.db") as db:
        db.execute("UPDATE alembic_version SET version_num = '0999'")
    fails_with(capsys, ("tokens", "list"), "0999", "newer lmsp")
    fails_with(capsys, ("migrate",), "0999", "newer lmsp")


def test_while_the_database_is_away_clients_get_503_and_retry_after(unit, alice, monkeypatch):
    from sqlalchemy.exc import OperationalError

    import api.auth

    def down(*_):
        raise OperationalError("SELECT 1", {}, ConnectionRefusedError("connection refused"))

    monkeypatch.setattr(api.auth, "authenticate", down)
    resp = alice.get("/lmsp/v1/models")
    assert problem(resp, 503, "overloaded") and resp.headers["Retry-After"] == "5"
    assert "unavailable" in resp.get_json()["detail"]


def test_a_process_out_of_database_connections_says_so_with_a_503(unit, alice, monkeypatch):
    from sqlalchemy.exc import TimeoutError as PoolTimeout

    import api.auth

    def busy(*_):
        raise PoolTimeout("QueuePool limit of size 10 overflow 20 reached, connection timed out")

    monkeypatch.setattr(api.auth, "authenticate", busy)
    resp = alice.get("/lmsp/v1/models")
    assert problem(resp, 503, "overloaded") and resp.headers["Retry-After"] == "5"
    assert "connection of this api process is in use" in resp.get_json()["detail"]


def test_a_worker_whose_checkpoint_is_missing_says_so_before_loading(env, tmp_path):
    import yaml

    from tests.harness import model_entry
    from worker import main as worker_main
    (tmp_path / "models.yaml").write_text(yaml.safe_dump({"models": [
        model_entry("m:1", checkpoint=str(tmp_path / "gone"))]}))
    with pytest.raises(SystemExit) as exit_:
        worker_main.run("m:1")
    assert str(exit_.value.code).startswith(f"lmsp worker: model m:1: {tmp_path / 'gone'} is not a checkpoint")


def test_a_token_with_no_scope_is_refused(env, capsys):
    """``--scopes ,,,`` made a token that can do nothing, and said so only as "with scopes ;"."""
    fails_with(capsys, ("tokens", "create", "--principal", "x", "--scopes", ",,,"), "no scope in ',,,'")


def test_a_revoke_without_redis_says_an_api_with_redis_may_take_a_moment(env, capsys):
    code, lines, secret = lmsp(capsys, "tokens", "create", "--principal", "x")
    code, lines, listed = lmsp(capsys, "tokens", "list")
    token_id = listed.splitlines()[-1].split()[0]
    code, lines, _ = lmsp(capsys, "tokens", "revoke", token_id)
    assert code in (0, None) and "LMSP_REDIS_URL is not set here" in lines[-1], lines


def test_a_service_address_without_its_scheme_says_so(env, capsys, monkeypatch):
    """``LMSP_URL=127.0.0.1:8080`` was taken for a path: "Is the service running?"."""
    monkeypatch.setenv("LMSP_URL", "127.0.0.1:8080")
    fails_with(capsys, ("ask", "hi", "--token", "x"), "'127.0.0.1:8080' is not a URL", "http://")


def test_doctors_disk_check_reads_every_model_cache(tmp_path, capsys):
    """It read the hub's cache alone: LMSP_HOME's (imported GGUFs, the default model) may be another volume."""
    from common.settings import Settings
    from lmsp.doctor import Doctor

    home = tmp_path / "not-made-yet"
    ok, line = Doctor(Settings(home=home), min_free_gib=0).disk()
    assert ok and "GiB free under" in line
    ok, line = Doctor(Settings(home=home), min_free_gib=1e12).disk()
    assert not ok and "below 1e+12" in line
    for bad in ("-5", "nan", "inf"):  # a usage error, not a check that always passes (or always fails)
        code, lines, _ = lmsp(capsys, "doctor", "--min-free-gib", bad)
        assert code == 2 and any(bad in line for line in lines), lines


def test_an_empty_registry_listing_says_where_it_looked(env, capsys, tmp_path):
    """``lmsp models list --registry`` printed nothing and exited 0 for a models file that is not there."""
    env(models_file=str(tmp_path / "typo.yaml"))
    code, lines, out = lmsp(capsys, "models", "list", "--registry")
    assert code in (0, None) and out == ""
    assert "no model in" in lines[-1] and "there is no such file" in lines[-1] and "typo.yaml" in lines[-1]
