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
import yaml

from worker.supervisor import parse_gpus

ROOT = Path(__file__).resolve().parents[2]

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


def test_real_worker_under_the_supervisor_has_its_gpu_and_id_and_a_sigterm_while_it_loads_stops_it_at_once(stack,
                                                                                                    tmp_path):
    """One real worker (vLLM on CPU) under the supervisor: the worker row and its engine carry the id
    host:gpu0. A pod or container stopped while its model loads (minutes on a big model) stops then: SIGTERM
    to the supervisor alone, which passes it on to the worker alone (as tini or the kubelet would), stops the
    worker at once and leaves no engine process holding the GPU. (The engine's and Celery's process titles
    overwrite /proc/PID/environ, so the pinning is checked above.) The row is written before the load, and
    a whole load is proven by every other worker of the run."""
    import uuid

    from sqlalchemy import create_engine, select

    from common.tables import Worker
    from tests.harness import engine_pids, model_entry

    model, host = f"sup:{uuid.uuid4().hex[:8]}", f"t{uuid.uuid4().hex[:8]}"
    worker_id = f"{host}:gpu0"
    models = tmp_path / "models.yaml"
    models.write_text(yaml.safe_dump({"models": [model_entry(model, engine={
        "dtype": "bfloat16", "max_model_len": 1024, "max_num_seqs": 4, "enforce_eager": True})]}))
    driver = ("import sys; from worker.supervisor import Supervisor, worker_argv; "
              "sys.exit(Supervisor(worker_argv(sys.argv[1]), [0], host=sys.argv[2]).run())")
    log = stack.tmp / f"supervisor-{host}.log"
    proc = stack.spawn([sys.executable, "-c", driver, model, host], log.name, LMSP_MODELS_FILE=str(models))
    engine = create_engine(stack.database_url)
    try:
        wait_for(lambda: engine_pids(worker_id) or proc.poll() is not None, timeout=300)
        assert proc.poll() is None, log.read_text()[-3000:]  # the engine is tagged with the worker's id
        with engine.connect() as conn:
            row = conn.execute(select(Worker.model, Worker.stopped_at).where(Worker.id == worker_id)).one()
        assert row == (model, None)
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert proc.wait(30) == 0, log.read_text()[-3000:]
        assert time.monotonic() - started < 10
        wait_for(lambda: engine_pids(worker_id) == [], timeout=10)  # the engine outlived its worker
        assert " ready." not in log.read_text()
        with engine.connect() as conn:
            assert conn.execute(select(Worker.stopped_at).where(Worker.id == worker_id)).scalar_one() is not None
    finally:
        if proc.poll() is None:
            stack.stop(proc, signal.SIGKILL)
        engine.dispose()


def test_a_second_worker_with_a_live_workers_id_refuses_to_start(stack, model_id, alice):
    """Two workers on one GPU, or a copied LMSP_WORKER_ID: the second would hand on the first's tasks
    and end its engine at boot. It refuses to start instead, and the first serves on."""
    from tests.harness import engine_pids, user

    worker_id = f"test-{model_id}"  # the session's live worker (tests/conftest.py)
    engines = engine_pids(worker_id)
    assert engines
    with pytest.raises(RuntimeError, match=f"another worker is running with id {worker_id}.*LMSP_WORKER_ID"):
        stack.start_worker(model_id, worker_id, timeout=120)
    assert engine_pids(worker_id) == engines
    r = alice.post("/lmsp/v1/responses", {"model": model_id, "input": user("Hi"), "max_output_tokens": 4})
    assert r.status_code == 200 and r.json()["status"] in ("completed", "incomplete")


def test_tensor_parallel_groups_gpus_one_worker_per_group(monkeypatch):
    from worker.supervisor import Supervisor, group_gpus, worker_argv

    assert group_gpus([0, 1, 2, 3], 2) == [(0, 1), (2, 3)]
    assert group_gpus([3, 1], 1) == [(3,), (1,)]
    with pytest.raises(ValueError, match="does not divide"):
        group_gpus([0, 1, 2], 2)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    sup = Supervisor(worker_argv("big:1", 2), group_gpus([0, 1, 2, 3], 2), host="box", metrics_port=9400)
    assert [(c.env["CUDA_VISIBLE_DEVICES"], c.worker_id, c.env["LMSP_WORKER_METRICS_PORT"]) for c in sup.children] \
        == [("0,1", "box:gpu0-1", "9400"), ("2,3", "box:gpu2-3", "9401")]
    assert all(c.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" for c in sup.children)  # nvidia-smi's numbering
    assert sup.argv[-2:] == ["--tensor-parallel", "2"]
