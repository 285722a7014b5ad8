"""`lmsp tail` in a real terminal (tmux): what a person sees, through an api crash and restart."""

import json
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid

import pytest

from lmsp.client import Client, output_text
from tests.harness import ROOT, free_port, wait_for

ARTIFACTS = ROOT / "artifacts" / "terminal"
STATUS = re.compile(r"(queued|loading|running) · ~\d+ tokens · \d+\.\d tok/s · \d+:\d\d · task_\w+")


class Terminal:
    """One tmux session on a private server (never the user's, never another test's)."""

    def __init__(self, command: str, env: dict[str, str]):
        self.socket = f"lmsp-test-{uuid.uuid4().hex[:8]}"
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        script = f"cd {shlex.quote(str(ROOT))} && {exports} {command}; echo EXIT=$?; sleep 600"
        self.tmux("new-session", "-d", "-s", "t", "-x", "110", "-y", "30", script)
        self.tmux("set-option", "-t", "t", "history-limit", "10000")

    def tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], check=True, capture_output=True,
                              text=True).stdout

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "t")

    def everything(self) -> str:
        return self.tmux("capture-pane", "-p", "-J", "-S", "-", "-t", "t")

    def wait(self, predicate, timeout: float, what: str) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            screen = self.screen()
            if predicate(screen):
                return screen
            time.sleep(0.2)
        raise AssertionError(f"{what}; the terminal shows:\n{self.everything()}")

    def close(self):
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True)


@pytest.fixture
def tail_env(stack, api, worker):
    return {"LMSP_TOKEN": stack.token("terminal"), "TERM": "xterm-256color", "PYTHONUNBUFFERED": "1",
            "LMSP_HOME": stack.env["LMSP_HOME"]}


def _lmsp(*args: str) -> str:
    return " ".join([shlex.quote(sys.executable), "-m", "lmsp", *map(shlex.quote, args)])


def test_tail_survives_an_api_restart(stack, tail_env, model_id):
    port = free_port()
    url = stack.start_api(port=port)
    own_api = stack.procs[-1]
    http = Client(url, tail_env["LMSP_TOKEN"])
    task = http.create_task("Write a long story about a lighthouse keeper and the sea.", model=model_id,
                            max_output_tokens=300)
    term = Terminal(_lmsp("tail", task["id"]), {**tail_env, "LMSP_URL": url})
    try:
        screen = term.wait(lambda s: (m := STATUS.search(s)) and m.group(1) == "running"
                           and not re.search(r"· ~0 tokens", s), 240, "no running status line with tokens")
        assert task["id"] in screen
        stack.stop(own_api, signal.SIGKILL)  # the api dies mid-stream
        term.wait(lambda s: "reconnecting in" in s, 30, "the status line did not say it was reconnecting")
        stack.start_api(port=port)  # a new api process on the same port and database
        screen = term.wait(lambda s: "EXIT=" in s, 300, "tail did not finish")
        history = term.everything()
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        (ARTIFACTS / "tail-through-api-restart.txt").write_text(history)
        final = http.get_task(task["id"])
    finally:
        term.close()
        stack.stop(stack.procs[-1])
    assert final["status"] == "succeeded"
    assert "EXIT=0" in screen
    usage = final["response"]["usage"]
    assert re.search(rf"succeeded · {usage['output_tokens']} tokens · \d+\.\d tok/s · \d+:\d\d · {task['id']}",
                     history), history
    # Everything generated is on the screen once, in order, whatever the drop cut.
    shown = " ".join(line for line in history.splitlines()
                     if "EXIT=" not in line and task["id"] not in line)
    assert " ".join(output_text(final["response"]).split()) in " ".join(shown.split())


def test_ctrl_c_stops_tailing_not_the_task(stack, tail_env, api, model_id):
    http = Client(api, tail_env["LMSP_TOKEN"])
    task = http.create_task("Write a very long essay on the history of tea.", model=model_id,
                            max_output_tokens=1000)
    term = Terminal(_lmsp("tail", task["id"]), {**tail_env, "LMSP_URL": api})
    try:
        term.wait(lambda s: (m := STATUS.search(s)) and m.group(1) == "running", 240, "no running status line")
        term.tmux("send-keys", "-t", "t", "C-c")
        screen = term.wait(lambda s: "EXIT=" in s, 30, "Ctrl-C did not stop tail")
    finally:
        term.close()
    assert "EXIT=130" in screen and "the task keeps running" in screen
    assert http.get_task(task["id"])["status"] == "running"
    assert http.cancel_task(task["id"])["status"] in ("cancelling", "cancelled")
    wait_for(lambda: http.get_task(task["id"])["status"] == "cancelled", 60, "cancel")


def test_client_commands_against_the_stack(stack, tail_env, api, model_id, tmp_path):
    """The commands the README and the ready line show, as a script would run them."""
    env = {**stack.env, **tail_env, "LMSP_URL": api}

    def lmsp(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "lmsp", *args], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=300)

    asked = lmsp("ask", "Say hello in one sentence.", "--model", model_id, "--max-output-tokens", "16")
    assert asked.returncode == 0 and asked.stdout.strip(), asked.stderr
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"name": {"type": "string"}},
                                  "required": ["name"], "additionalProperties": False}))
    structured = lmsp("ask", "Invent a person.", "--model", model_id, "--json-schema", str(schema),
                      "--max-output-tokens", "100", "--temperature", "0")  # sampled, it may pad until the budget
    assert structured.returncode == 0, structured.stderr
    assert isinstance(json.loads(structured.stdout)["name"], str)
    models = lmsp("models", "list", "--json")
    assert {"id": model_id, "status": "ready"}.items() <= next(
        m for m in json.loads(models.stdout) if m["id"] == model_id).items()
    task_id = lmsp("submit", "Write a haiku.", "--model", model_id, "--max-output-tokens", "12").stdout.strip()
    assert task_id.startswith("task_")
    followed = lmsp("tail", task_id)
    assert followed.returncode == 0 and "succeeded" in followed.stderr
    assert task_id in [t["id"] for t in json.loads(lmsp("tasks", "list", "--json").stdout)]
    shown = lmsp("tasks", "show", task_id)
    assert "succeeded" in shown.stdout and shown.returncode == 0
    assert "timeline" in shown.stdout and "decode" in shown.stdout and "framework" in shown.stdout
    refused = lmsp("ask", "hi", "--model", "no:such-model")
    assert refused.returncode == 1 and "lmsp models list" in refused.stderr
