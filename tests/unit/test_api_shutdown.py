"""SIGTERM to an api process (api/live/hub.py ``begin_shutdown``). Found by an operator's probe: a held
long poll was reset when the process exited, and a direct stream was cut with no final or error event
while its generation ran on. Now a long poll answers at once, and a direct request, which cannot move to
another process, ends after DIRECT_GRACE_SECONDS with a 503 or an error event, its generation aborted."""

import threading
import time

import pytest

from api.live import hub as hub_module
from common.tables import Response
from tests.harness import parse_sse
from tests.unit.conftest import MODEL, make_unit, problem, request_body, task_body
from tests.unit.fake import FakeWorker


@pytest.fixture
def unit(tmp_path, monkeypatch):
    monkeypatch.setattr(hub_module, "DIRECT_GRACE_SECONDS", 1.0)
    return make_unit(tmp_path)


def shut_down_when(unit, ready: threading.Event) -> list[float]:
    """SIGTERM's handler, once ``ready`` is set (in another thread, as a signal comes); the list gets the
    moment (monotonic)."""
    at: list[float] = []

    def run():
        assert ready.wait(60)
        at.append(time.monotonic())
        unit.app.extensions["lmsp"].hub.begin_shutdown()
    threading.Thread(target=run, daemon=True).start()
    return at


def test_a_long_poll_answers_at_once(unit):
    alice = unit.as_("alice")
    task = alice.post("/lmsp/v1/tasks", task_body()).get_json()  # stays queued: no worker
    tag = alice.get(f"/lmsp/v1/tasks/{task['id']}").headers["ETag"]
    waiting = threading.Event()
    threading.Timer(0.5, waiting.set).start()
    at = shut_down_when(unit, waiting)
    resp = alice.get(f"/lmsp/v1/tasks/{task['id']}?wait=30", headers={"If-None-Match": tag})
    assert resp.status_code == 304 and time.monotonic() - at[0] < 5


@pytest.mark.parametrize("stream", [True, False])
def test_a_direct_request_ends_said_and_its_generation_aborted(unit, stream):
    alice = unit.as_("alice")
    gate = threading.Event()
    with FakeWorker(unit.sessions, MODEL, gate=gate) as worker:  # claims it, then generates nothing yet
        at = shut_down_when(unit, worker.claimed)
        resp = alice.post("/lmsp/v1/responses", request_body(stream=stream))
        body = resp.get_data(as_text=True)
        took = time.monotonic() - at[0]
        gate.set()
    assert 1 <= took < 5  # DIRECT_GRACE_SECONDS after the SIGTERM, not gunicorn's cut
    if stream:
        received = parse_sse(body.split("\n"))
        assert received[-1][1] == "error", received  # (the fake worker had sent nothing yet)
        assert received[-1][2]["error"]["code"] == "overloaded"
    else:
        assert "restarting" in problem(resp, 503, "overloaded")["detail"]
        assert resp.headers["Retry-After"] == "1"
    with unit.sessions() as session:
        assert session.query(Response.status).scalar() == "cancelled"  # aborted: its worker stops
