"""`lmsp doctor` on the real Postgres and Redis (issue 35): every line ok on a configured host, exit 0;
a wrong URL, an unmigrated database or a missing model each give a FAIL line that says what to do, and
exit 1. The command runs as an operator runs it, in a process of its own (about 15 s in all)."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import yaml

from tests.harness import CHECKPOINT, create_database, drop_database

LMSP = str(Path(sys.executable).parent / "lmsp")
CHECKS = ["database", "schema", "clock", "broker", "redis"]


def doctor(env: dict, *args: str) -> tuple[int, dict[str, tuple[bool, str]], str]:
    done = subprocess.run([LMSP, "doctor", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **env})
    lines = {}
    for line in done.stdout.splitlines():
        state, rest = line.split(None, 1)
        name, message = rest.split(": ", 1)
        lines[name] = (state == "ok", message)
    return done.returncode, lines, done.stderr


def host_env(tmp_path: Path, pg_url: str, redis_url: str, models: list[dict]) -> dict:
    (tmp_path / "models.yaml").write_text(yaml.safe_dump({"models": models}))
    return {"LMSP_DATABASE_URL": pg_url, "LMSP_BROKER_URL": redis_url, "LMSP_REDIS_URL": redis_url,
            "LMSP_MODELS_FILE": str(tmp_path / "models.yaml"), "LMSP_HOME": str(tmp_path / "home"),
            "HF_HOME": str(tmp_path / "hf")}


PRESENT = {"id": "here:1", "checkpoint": str(CHECKPOINT), "context_window": 2048, "max_output_tokens": 256}
ABSENT = {"id": "absent:1", "checkpoint": "HuggingFaceTB/SmolLM2-360M-Instruct", "context_window": 2048,
          "max_output_tokens": 256}


def test_doctor_passes_on_a_configured_host(pg_url, redis_url, tmp_path):
    code, lines, err = doctor(host_env(tmp_path, pg_url, redis_url, [PRESENT]))
    assert code == 0, (lines, err)
    assert list(lines) == [*CHECKS, "model here:1", "gpu", "disk", "worker ids"]
    assert all(ok for ok, _ in lines.values()), lines
    assert "PostgreSQL" in lines["database"][1] and "Redis" in lines["redis"][1]
    assert str(CHECKPOINT) in lines["model here:1"][1]
    assert socket.gethostname() in lines["worker ids"][1]
    assert "every check passed" in err


def test_doctor_names_what_fails_and_what_to_do(pg_url, redis_url, tmp_path):
    env = host_env(tmp_path, pg_url, redis_url, [PRESENT, ABSENT])
    wrong_db = pg_url.rsplit("@", 1)[0] + "@127.0.0.1:1/lmsp"
    wrong_redis = redis_url.replace("://", "://:not-the-password@", 1).rsplit(":", 1)[0] + ":1/0"
    code, lines, err = doctor({**env, "LMSP_DATABASE_URL": wrong_db, "LMSP_REDIS_URL": wrong_redis})
    assert code == 1 and "checks failed" in err
    ok, message = lines["database"]
    assert not ok and "127.0.0.1:1" in message and "check LMSP_DATABASE_URL" in message
    assert not lines["schema"][0] and "no database" in lines["schema"][1]
    ok, message = lines["redis"]
    assert not ok and "check LMSP_REDIS_URL" in message and "not-the-password" not in message
    assert lines["broker"][0]   # the right one still passes
    ok, message = lines["model absent:1"]
    assert not ok and "lmsp models pull absent:1" in message
    assert lines["model here:1"][0]
    # --model: a worker host checks its own model only.
    code, lines, _ = doctor(env, "--model", "here:1")
    assert code == 0 and "model absent:1" not in lines
    fresh = create_database(prefix="lmsp_doctor")
    try:
        code, lines, _ = doctor({**env, "LMSP_DATABASE_URL": fresh}, "--model", "here:1")
        ok, message = lines["schema"]
        assert code == 1 and not ok and "run `lmsp migrate` first" in message
    finally:
        drop_database(fresh)


def test_a_duplicate_worker_id_is_refused_once_saying_where_the_live_one_runs(pg_url, redis_url, tmp_path):
    """A second host of the same hostname (or a copied id): its worker is refused with the address the live
    one connects from and what to change, and exits EX_CONFIG (its supervisor does not start it again).
    Simulated engines: the identity check is the worker's, not the engine's."""
    import uuid

    from tests.harness import Stack, model_entry
    model = f"sim:dup{uuid.uuid4().hex[:8]}"
    stack = Stack(tmp_path, pg_url, redis_url=redis_url, models=[
        model_entry(model, engine={"kind": "sim", "ttft_ms": 50, "tokens_per_s": 20, "max_num_seqs": 4})])
    try:
        stack.start_worker(model, f"box:{model}", timeout=120)
        proc = stack.spawn([sys.executable, "-m", "worker", "--model", model], "dup.log", LMSP_WORKER_ID=f"box:{model}")
        assert proc.wait(120) == 78
        text = (tmp_path / "dup.log").read_text()
        assert f"another worker is running with id box:{model}" in text
        assert "from 127.0.0.1; this process connects from 127.0.0.1" in text and "own name" in text, text[-2000:]
    finally:
        stack.close()


def test_the_supervisor_does_not_restart_a_refused_worker(monkeypatch):
    import time
    from collections import Counter

    from worker.supervisor import Supervisor

    # GPU 0's worker is refused (78), GPU 1's crashes (1): only the crashed one is started again.
    argv = [sys.executable, "-c", "import os, sys; sys.exit(78 if os.environ['CUDA_VISIBLE_DEVICES'] == '0' else 1)"]
    sup = Supervisor(argv, [0, 1], host="box", min_backoff=0.05, max_backoff=0.05)
    starts, start = Counter(), sup._start
    monkeypatch.setattr(sup, "_start", lambda child: (starts.update([child.worker_id]), start(child)))
    for child in sup.children:
        sup._start(child)
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:   # Supervisor.run's loop, without its signal handlers
        now = time.monotonic()
        for child in sup.children:
            if child.proc is not None and child.proc.poll() is not None:
                sup._reap(child, now)
            if child.proc is None and now >= child.restart_at:
                sup._start(child)
        time.sleep(0.05)
    assert starts["box:gpu0"] == 1 and starts["box:gpu1"] >= 3, starts
