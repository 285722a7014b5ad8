"""`lmsp dev` (what `make run` serves): SQLite, a filesystem broker, no Redis, the real engine."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import requests

from common.events import FINAL
from tests.harness import ROOT, Client, Stack, engine_pids, free_port, model_entry, user, wait_for


@pytest.fixture(scope="module")
def dev(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dev")
    stack = _dev_stack(tmp, "smollm2:dev")
    port = 18000 + int(time.time()) % 1000
    stack.env["LMSP_PORT"] = str(port)
    proc, client = _start_dev(stack, "dev.log")
    base, token_file = client.base, tmp / "home" / "dev-token"
    line = next(li for li in (tmp / "dev.log").read_text(errors="replace").splitlines() if "ready on" in li)
    assert f"ready on {base} (dashboard: {base}/)" in line and str(token_file) in line
    assert f'ask --url {base} "' in line
    yield proc, client
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)


def _dev_stack(tmp, model_id: str) -> Stack:
    served = model_entry(model_id, engine={  # dtype auto, as `make run` serves it
        "dtype": "auto", "max_model_len": 2048, "max_num_seqs": 32, "enforce_eager": True})
    stack = Stack(tmp, f"sqlite:///{tmp / 'home' / 'lmsp.db'}", redis=False, models=[served])
    for name in ("LMSP_BROKER_URL", "LMSP_REDIS_URL"):
        stack.env.pop(name, None)
    return stack


def _start_dev(stack: Stack, log_name: str) -> tuple[subprocess.Popen, Client]:
    """`lmsp dev` in a process group of its own, once it has said it is ready."""
    log = stack.tmp / log_name
    proc = subprocess.Popen([sys.executable, "-m", "lmsp", "dev"], env=stack.env, cwd=ROOT, stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{stack.env['LMSP_PORT']}"
    token_file = stack.tmp / "home" / "dev-token"
    try:
        # It says so itself, in one line with all a newcomer needs (what `make run` prints).
        wait_for(lambda: "ready on" in log.read_text(errors="replace") or proc.poll() is not None, 600,
                 "no ready line")
        assert proc.poll() is None and _ready(base, token_file.read_text().strip()), log.read_text()[-3000:]
    except BaseException:
        _stop_group(proc)
        raise
    return proc, Client(base, token_file.read_text().strip())


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to a `lmsp dev` and whatever of its group is left."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    if proc.poll() is None:
        proc.wait(120)


def _ready(base, token):
    try:
        models = requests.get(f"{base}/lmsp/v1/models", headers={"Authorization": f"Bearer {token}"},
                              timeout=5).json()["data"]
        return all(model["status"] == "ready" for model in models)
    except (requests.RequestException, ValueError):
        return False


def test_dev_serves_responses_and_tasks_without_redis(dev):
    _, client = dev
    sync = client.post("/lmsp/v1/responses", {"model": "smollm2:dev", "input": user("Say hi."),
                                              "max_output_tokens": 10, "temperature": 0})
    assert sync.status_code == 200 and sync.json()["output"][0]["content"][0]["text"]
    with client.stream_post("/lmsp/v1/responses", {"model": "smollm2:dev", "input": user("Say hi."),
                                                   "max_output_tokens": 10, "stream": True}) as resp:
        names = [line[7:] for line in resp.iter_lines(decode_unicode=True) if line.startswith("event: ")]
    assert names[0] == "response.created" and names[-1] in ("response.completed", "response.incomplete")
    task = client.post("/lmsp/v1/tasks", {"type": "response", "input": {
        "model": "smollm2:dev", "input": user("Write a haiku."), "max_output_tokens": 20}}).json()
    events = client.sse(task["events_url"])
    assert [e[0] for e in events] == list(range(1, len(events) + 1))
    assert events[-1][1] == "response.incomplete"
    long = client.post("/lmsp/v1/tasks", {"type": "response", "input": {
        "model": "smollm2:dev", "input": user("Write a long essay."), "max_output_tokens": 1000}}).json()
    wait_for(lambda: client.get(f"/lmsp/v1/tasks/{long['id']}").json()["status"] == "running", 120, "run")
    client.post(f"/lmsp/v1/tasks/{long['id']}/cancel")
    assert client.sse(long["events_url"])[-1][1] == "response.cancelled"


def test_dev_stops_everything_on_sigterm(dev):
    proc, client = dev
    tag = f"{socket.gethostname()}:smollm2:dev"
    assert engine_pids(tag)
    # With a generation running: the worker drains briefly, hands it on and ends its engine (killed
    # while draining a rolling update's 120 s, it would leave its engine running).
    _running_task(client, "smollm2:dev", "fail")
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(120)
    assert time.monotonic() - started < 45
    wait_for(lambda: engine_pids(tag) == [], 10, "engine left behind after lmsp dev stopped")


def _running_task(client: Client, model: str, on_restart: str, max_tokens: int = 1000) -> dict:
    task = client.post("/lmsp/v1/tasks", {"type": "response", "on_restart": on_restart, "input": {
        "model": model, "input": user("Write a long essay about rivers."), "max_output_tokens": max_tokens}}).json()
    wait_for(lambda: client.get(f"/lmsp/v1/tasks/{task['id']}").json()["status"] == "running", 120, "run")
    return task


def _serving(base: str) -> bool:
    try:
        requests.get(base + "/healthz", timeout=2)
        return True
    except requests.RequestException:
        return False


def test_a_killed_dev_leaves_nothing_running_and_a_restarted_one_says_ready_only_when_it_is(tmp_path):
    model = "smollm2:crash"
    stack = _dev_stack(tmp_path, model)
    stack.env.update(LMSP_PORT=str(free_port()), LMSP_LEASE_SECONDS="30")
    tag = f"{socket.gethostname()}:{model}"
    runs = []
    try:
        _crash_and_restart(stack, model, runs)
    finally:
        for proc in runs:
            _stop_group(proc)
    wait_for(lambda: engine_pids(tag) == [], 10, "engine left behind after lmsp dev stopped")


def _crash_and_restart(stack: Stack, model: str, runs: list) -> None:
    tag = f"{socket.gethostname()}:{model}"
    first, client = _start_dev(stack, "dev-1.log")
    runs.append(first)
    # Still running when the kill comes right after the second starts; the retried one runs again in full.
    failing, retried = (_running_task(client, model, policy, max_tokens=300) for policy in ("fail", "retry"))
    # All of it at once, as a power cut would: the killed worker's heartbeat looks live for a lease,
    # yet the next run says ready only once its own engine serves; each task follows its policy.
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(10)
    second, client = _start_dev(stack, "dev-2.log")
    runs.append(second)
    started = time.monotonic()
    answer = client.post("/lmsp/v1/responses", {"model": model, "input": user("Hi."), "max_output_tokens": 1})
    assert answer.status_code == 200 and time.monotonic() - started < 15
    got = client.get(f"/lmsp/v1/tasks/{failing['id']}").json()
    assert got["status"] == "failed" and got["error"]["code"] == "server_restarted"
    events = client.sse(retried["events_url"])
    assert [e[0] for e in events] == list(range(1, len(events) + 1))
    assert [e[1] for e in events if e[1] in FINAL] == [events[-1][1]]
    assert events[-1][1] in ("response.completed", "response.incomplete")
    assert [e[2]["attempt"] for e in events if e[1] == "response.attempt.started"][-1] >= 2
    # SIGKILL to `lmsp dev` alone: its api and worker must not serve on as orphans (the port and the
    # worker id would refuse the next `lmsp dev`).
    second.kill()
    wait_for(lambda: not _serving(client.base) and engine_pids(tag) == [], 90, "lmsp dev's children outlived it")
