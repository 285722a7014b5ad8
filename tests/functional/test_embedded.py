"""`lmsp dev` (what `make run` serves): SQLite, a filesystem broker, no Redis, the real engine."""

import signal
import socket
import subprocess
import sys
import time

import pytest
import requests

from tests.harness import ROOT, Client, Stack, engine_pids, model_entry, user, wait_for


@pytest.fixture(scope="module")
def dev(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dev")
    served = model_entry("smollm2:dev", engine={  # dtype auto, as `make run` serves it
        "dtype": "auto", "max_model_len": 2048, "max_num_seqs": 32, "enforce_eager": True})
    stack = Stack(tmp, f"sqlite:///{tmp / 'home' / 'lmsp.db'}", redis=False, models=[served])
    for name in ("LMSP_BROKER_URL", "LMSP_REDIS_URL"):
        stack.env.pop(name, None)
    port = 18000 + int(time.time()) % 1000
    stack.env["LMSP_PORT"] = str(port)
    log = open(tmp / "dev.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "lmsp", "dev"], env=stack.env, cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    token_file = tmp / "home" / "dev-token"
    wait_for(lambda: token_file.exists() and _ready(base, token_file.read_text().strip()), 600,
             "lmsp dev did not serve the model")
    # It says so itself, in one line with all a newcomer needs (what `make run` prints).
    wait_for(lambda: "ready on" in (tmp / "dev.log").read_text(errors="replace"), 30, "no ready line")
    line = next(li for li in (tmp / "dev.log").read_text(errors="replace").splitlines() if "ready on" in li)
    assert f"ready on {base} (dashboard: {base}/)" in line and str(token_file) in line
    assert f'ask --url {base} "' in line
    yield proc, Client(base, token_file.read_text().strip())
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)


def _ready(base, token):
    try:
        model = requests.get(f"{base}/lmsp/v1/models/smollm2:dev", headers={"Authorization": f"Bearer {token}"},
                             timeout=5).json()
        return model.get("status") == "ready"
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
    proc, _ = dev
    tag = f"{socket.gethostname()}:smollm2:dev"
    assert engine_pids(tag)
    proc.send_signal(signal.SIGTERM)
    proc.wait(120)
    wait_for(lambda: engine_pids(tag) == [], 60, "engine left behind after lmsp dev stopped")
