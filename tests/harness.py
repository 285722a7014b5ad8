"""Real processes for tests and benchmarks: a fresh Postgres database, workers, the api."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psycopg
import requests
import yaml

from common.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
PG_URL = os.environ.get("LMSP_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("LMSP_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
CHECKPOINT = Path(os.environ.get("LMSP_TEST_CHECKPOINT",
                                 Settings().model_cache / "smollm2-135m"))


def _with_db(url: str, name: str) -> str:
    return url.rsplit("/", 1)[0] + "/" + name


def create_database(prefix: str = "lmsp_test", server: str = PG_URL) -> str:
    """A new database on ``server`` (the URL of any database there)."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(server.replace("postgresql+psycopg", "postgresql"), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return _with_db(server, name)


def drop_database(url: str) -> None:
    name = url.rsplit("/", 1)[1]
    admin = _with_db(url, "postgres").replace("postgresql+psycopg", "postgresql")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_entry(model_id: str, **overrides) -> dict:
    entry = {
        "id": model_id, "checkpoint": str(CHECKPOINT), "context_window": 2048, "max_output_tokens": 1024,
        # float32, not auto: tests compare greedy texts, and bf16 (chosen on CPUs with AMX/AVX-512-BF16)
        # gives other texts and is not batch-invariant. `lmsp dev`'s test serves auto (test_embedded.py).
        "engine": {"dtype": "float32", "max_model_len": 2048, "max_num_seqs": 32, "enforce_eager": True},
        # Half a GiB holds ~11,000 float32 tokens of this model, more than any test has in flight; a run holds
        # up to six engines at once, and with a whole GiB each a 24 GiB machine had 5-6 GiB left while they loaded.
        "kv_cache_gib": 0.5,
    }
    entry.update(overrides)
    return entry


def api_argv(port: int, workers: int, threads: int) -> list[str]:
    from api.serve import gunicorn_argv
    return gunicorn_argv(Settings(host="127.0.0.1", port=port, api_workers=workers, api_threads=threads))


class Stack:
    """One test run's configuration: its database, its models file, its processes."""

    def __init__(self, tmp: Path, database_url: str, *, redis: bool = True, models: list[dict],
                 redis_url: str = REDIS_URL):
        self.tmp = tmp
        self.database_url = database_url
        self.redis_url = redis_url
        self.models_file = tmp / "models.yaml"
        self.models_file.write_text(yaml.safe_dump({"models": models}))
        self.env = {
            **os.environ,
            "LMSP_HOME": str(tmp / "home"),
            "LMSP_DATABASE_URL": database_url,
            "LMSP_MODELS_FILE": str(self.models_file),
            "LMSP_LEASE_SECONDS": "6",
            "LMSP_HEARTBEAT_SECONDS": "1",
            "LMSP_SWEEP_SECONDS": "1",
            "LMSP_REQUEUE_AFTER_SECONDS": "3",
            # Tests count a task's deltas as it runs (the fault tests stop it after a few): one a token.
            "LMSP_TASK_DELTA_WINDOW_MS": "20",
            # An idle follower's keep-alive comes every 15 s in production; tests that wait for one need not.
            "LMSP_FOLLOWER_HEARTBEAT_SECONDS": "1",
            "PYTHONUNBUFFERED": "1",
        }
        if redis:
            self.env["LMSP_BROKER_URL"] = redis_url
            self.env["LMSP_REDIS_URL"] = redis_url
        self.procs: list[subprocess.Popen] = []

    def lmsp(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "lmsp", *args], env=self.env, cwd=ROOT,
                              capture_output=True, text=True, check=check)

    def token(self, principal: str, scopes: str | None = None) -> str:
        args = ["tokens", "create", "--principal", principal]
        if scopes is not None:
            args += ["--scopes", scopes]
        return self.lmsp(*args).stdout.strip()

    def spawn(self, argv: list[str], log_name: str, **env) -> subprocess.Popen:
        log = open(self.tmp / log_name, "ab")
        proc = subprocess.Popen(argv, env={**self.env, **env}, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def start_worker(self, model_id: str, worker_id: str, timeout: float = 600, **env) -> subprocess.Popen:
        log = self.tmp / f"worker-{worker_id}.log"
        start = log.stat().st_size if log.exists() else 0  # a restarted worker appends to its log
        proc = self.spawn([sys.executable, "-m", "worker", "--model", model_id], log.name,
                          LMSP_WORKER_ID=worker_id, **env)
        deadline = time.time() + timeout
        while time.time() < deadline:
            text = log.read_bytes()[start:].decode(errors="replace")
            if proc.poll() is not None:
                raise RuntimeError(f"worker {worker_id} exited:\n{text[-4000:]}")
            if " ready." in text:
                return proc
            time.sleep(0.5)
        raise TimeoutError(f"worker {worker_id} not ready:\n{text[-4000:]}")

    def start_api(self, workers: int = 1, threads: int = 64, port: int | None = None, **env) -> str:
        """The api as `lmsp serve` launches it, on ``port`` (a free one by default)."""
        port = port or free_port()
        self.spawn(api_argv(port, workers, threads), f"api-{port}.log",
                   **{"LMSP_API_THREADS": str(threads), **env})  # its stream slots
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if requests.get(base + "/healthz", timeout=5).ok:
                    return base
            except requests.RequestException:
                time.sleep(0.2)
        raise TimeoutError((self.tmp / f"api-{port}.log").read_text()[-3000:])

    def stop(self, proc: subprocess.Popen, sig=signal.SIGTERM, timeout: float = 60) -> None:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)

    def close(self) -> None:
        for proc in reversed(self.procs):
            self.stop(proc)


class Client:
    def __init__(self, base: str, token: str):
        self.base = base
        self.http = requests.Session()
        self.http.headers["Authorization"] = f"Bearer {token}"

    def url(self, path: str) -> str:
        return self.base + path

    def get(self, path: str, **kw):
        return self.http.get(self.url(path), timeout=kw.pop("timeout", 120), **kw)

    def post(self, path: str, body=None, **kw):
        return self.http.post(self.url(path), json=body, timeout=kw.pop("timeout", 300), **kw)

    def sse(self, path: str, **kw) -> list[tuple[int | None, str, dict]]:
        """Read a whole SSE stream; return (id, event, data) tuples."""
        with self.http.get(self.url(path), stream=True, timeout=kw.pop("timeout", 300), **kw) as resp:
            assert resp.status_code == 200, resp.text
            return parse_sse(resp.iter_lines(decode_unicode=True))

    def stream_post(self, path: str, body, **kw):
        return self.http.post(self.url(path), json=body, stream=True, timeout=300, **kw)


def parse_sse(lines) -> list[tuple[int | None, str, dict]]:
    return list(iter_sse(lines))


def iter_sse(lines):
    seq, name, data = None, None, None
    for line in lines:
        if line is None:
            continue
        if line == "":
            if name is not None:
                yield seq, name, json.loads(data)
            seq, name, data = None, None, None
        elif line.startswith(":"):
            continue
        elif line.startswith("id: "):
            seq = int(line[4:])
        elif line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data = line[6:]


def user(text: str) -> list[dict]:
    return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}]


def wait_for(predicate, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise TimeoutError(what)


def engine_pids(tag: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            marks = [e for e in (proc / "environ").read_bytes().split(b"\0") if e.startswith(b"LMSP_ENGINE_TAG=")]
            if (proc / "cmdline").read_bytes().startswith(b"VLLM::") and \
                    any(m.split(b"=", 1)[1].split(b"@")[0] == tag.encode() for m in marks) and \
                    (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids
