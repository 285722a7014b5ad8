"""The OpenAI Node SDK (openai 6.x, tests/node), unchanged, against the api served over HTTP (werkzeug's
server in a thread, the fake worker): its errors, its stream helper and a history made of what the helper
returned. The Node SDK differs from the Python one where a probe found it broke: it reads an error only
from the body's ``error`` member, its accumulator throws on an event it cannot place (a reasoning delta
before its summary part), and its helpers add ``parsed`` to what they return."""

import json
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
from werkzeug.serving import make_server

from tests.unit.conftest import MODEL
from tests.unit.fake import FakeWorker

NODE = Path(__file__).resolve().parents[1] / "node"


@pytest.fixture
def served(unit):
    server = make_server("127.0.0.1", 0, unit.app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/lmsp/v1"
    server.shutdown()
    thread.join(10)


def _node(*args: str) -> dict:
    node = shutil.which("node")
    assert node and (NODE / "node_modules" / "openai").is_dir(), (
        "the Node SDK is not installed: `make test` installs Node.js and runs `npm ci` in tests/node")
    done = subprocess.run([node, str(NODE / "sdk.mjs"), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_node_sdk_reads_errors_follows_a_stream_and_sends_its_output_back(unit, alice, served):
    with FakeWorker(unit.sessions, MODEL, text="<think>Let me see.</think>Hello there", reasoning=True):
        out = _node(served, alice.secret, MODEL)
    missing, bad, unknown = out["missing"], out["bad"], out["unknown"]
    assert missing["name"] == "NotFoundError" and missing["code"] == "response_not_found"
    assert missing["type"] == "not_found_error" and missing["message"].startswith("404 No stored response")
    assert bad["status"] == 400 and bad["param"] == "max_output_tokens" and bad["type"] == "invalid_request_error"
    assert unknown["name"] == "AuthenticationError" and unknown["code"] == "unauthorized"
    # The helper placed every event (a reasoning item first), and its listeners fired.
    assert out["types"][:3] == ["response.created", "response.output_item.added",
                                "response.reasoning_summary_part.added"]
    assert "response.function_call_arguments.delta" not in out["types"] and out["textDone"] == "Hello there"
    reasoning, message = out["final"]["output"]
    assert reasoning["summary"] == [{"type": "summary_text", "text": "Let me see."}]
    assert out["final"]["output_text"] == out["retrieved"] == "Hello there"
    assert "parsed" in message["content"][0]  # what the helper added, and the next request sent back
    assert out["history"] is None, out["history"]
