"""``lmsp worker --gpus``: the supervisor with real processes. The children are a small stand-in
command (two vLLM engines do not fit this CPU machine); what is checked is the supervisor's part:
pinning, ids, ports, restart with backoff, SIGTERM passed on and waited for, no orphans."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from worker.supervisor import parse_gpus

ROOT = Path(__file__).resolve().parent.parent

# Crashes on its first two starts on GPU 1; otherwise runs until SIGTERM, which it takes a moment to obey.
CHILD = """
import json, os, signal, sys, time
log = sys.argv[1]
gpu = os.environ["CUDA_VISIBLE_DEVICES"]
def note(what):
    with open(log, "a") as f:
        f.write(json.dumps({"what": what, "pid": os.getpid(), "t": time.monotonic(), "gpu": gpu,
                            "id": os.environ["LMSP_WORKER_ID"], "port": os.environ["LMSP_WORKER_METRICS_PORT"]}) + "\\n")
note("start")
if gpu == "1" and sum(1 for line in open(log) if '"start"' in line and '"gpu": "1"' in line) <= 2:
    sys.exit(3)
def term(*_):
    note("term"); time.sleep(0.5); note("exit"); sys.exit(0)
signal.signal(signal.SIGTERM, term)
while True:
    time.sleep(0.1)
"""

DRIVER = """
import sys
from worker.supervisor import Supervisor
child, log = sys.argv[1], sys.argv[2]
sys.exit(Supervisor([sys.executable, child, log], [0, 1], host="box", metrics_port=9500,
                    min_backoff=0.4, max_backoff=5, stable_after=30).run())
"""


def notes(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def wait_for(predicate, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError("timed out")


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@pytest.fixture
def supervised(tmp_path):
    (tmp_path / "child.py").write_text(CHILD)
    log = tmp_path / "children.log"
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path / "child.py"), str(log)], cwd=ROOT,
                            env={**os.environ, "LMSP_WORKER_ID": "ignored"}, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: sum(n["what"] == "start" for n in notes(log)) >= 4)  # gpu0 once, gpu1 three times
    yield proc, log
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_one_pinned_child_per_gpu_restarted_with_backoff_and_drained_on_sigterm(supervised):
    proc, log = supervised
    starts = [n for n in notes(log) if n["what"] == "start"]
    by_gpu = {g: [n for n in starts if n["gpu"] == g] for g in ("0", "1")}
    assert [n["id"] for n in by_gpu["0"]] == ["box:gpu0"] and by_gpu["0"][0]["port"] == "9500"
    assert {n["id"] for n in by_gpu["1"]} == {"box:gpu1"} and {n["port"] for n in by_gpu["1"]} == {"9501"}
    t = [n["t"] for n in by_gpu["1"]]
    assert len(t) == 3 and t[1] - t[0] >= 0.4 and t[2] - t[1] >= 0.8   # the backoff doubles
    live = {n["pid"] for n in starts[-2:]} | {by_gpu["0"][0]["pid"]}
    time.sleep(0.5)
    assert proc.poll() is None

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    ended = notes(log)
    assert {n["gpu"] for n in ended if n["what"] == "term"} == {"0", "1"}
    assert {n["gpu"] for n in ended if n["what"] == "exit"} == {"0", "1"}   # waited for, not killed
    assert not any(n["what"] == "start" for n in ended[len(starts):])       # no restart while stopping
    assert not any(alive(pid) for pid in live)
    stderr = proc.stderr.read()
    assert "box:gpu1 exited with 3" in stderr


def test_children_end_when_the_supervisor_is_killed(supervised):
    proc, log = supervised
    pids = {n["pid"] for n in notes(log) if n["what"] == "start"}
    proc.kill()
    proc.wait()
    wait_for(lambda: {n["gpu"] for n in notes(log) if n["what"] == "exit"} == {"0", "1"}, timeout=10)
    wait_for(lambda: not any(alive(pid) for pid in pids), timeout=10)


def test_gpus_all_are_the_ones_nvidia_smi_lists(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\n[ \"$1\" = -L ] || exit 2\n"
                    "echo 'GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-1)'\n"
                    "echo 'GPU 1: NVIDIA A100-SXM4-80GB (UUID: GPU-2)'\n"
                    "echo '  MIG 1g.10gb Device 0: (UUID: MIG-3)'\n"
                    "echo 'GPU 3: NVIDIA A100-SXM4-80GB (UUID: GPU-4)'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert parse_gpus("all") == [0, 1, 3]
    assert parse_gpus("2,0") == [2, 0]
    for bad in ("0,0", "-1", "0,x", ""):
        with pytest.raises(ValueError, match="--gpus"):
            parse_gpus(bad)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="nvidia-smi"):
        parse_gpus("all")


def test_supervisor_refuses_an_unknown_model_before_starting_anything(tmp_path):
    done = subprocess.run([sys.executable, "-m", "worker.supervisor", "--model", "nope:1", "--gpus", "0,1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "LMSP_HOME": str(tmp_path)})
    assert done.returncode == 1 and "nope:1" in done.stderr and "started" not in done.stderr
