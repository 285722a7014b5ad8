"""Idempotency-Key (spec 9.2): the same body replays the outcome, another body is 422, in flight is 409."""

import threading
import time

import pytest
from sqlalchemy import func, select

from common.tables import Response, Task
from tests.unit.conftest import MODEL, problem, request_body, task_body
from tests.unit.fake import FakeWorker


def _tasks(unit, principal: str) -> int:
    with unit.sessions() as session:
        return session.execute(select(func.count()).where(Task.principal_id == principal)).scalar_one()


def _responses(unit, principal: str) -> int:
    with unit.sessions() as session:
        return session.execute(select(func.count()).where(Response.principal_id == principal)).scalar_one()


def test_task_replay_returns_the_same_task_in_its_current_state(unit, alice):
    key = {"Idempotency-Key": "task-1"}
    first = alice.post("/lmsp/v1/tasks", task_body(), headers=key)
    assert first.status_code == 202
    task = first.get_json()
    again = alice.post("/lmsp/v1/tasks", task_body(), headers=key)
    assert again.status_code == 202 and again.get_json() == task
    assert again.headers["Location"] == first.headers["Location"] == f"/lmsp/v1/tasks/{task['id']}"
    assert alice.post(f"/lmsp/v1/tasks/{task['id']}/cancel").get_json()["status"] == "cancelled"
    replay = alice.post("/lmsp/v1/tasks", task_body(), headers=key).get_json()
    assert replay["id"] == task["id"] and replay["status"] == "cancelled"
    assert _tasks(unit, alice.principal) == 1


def test_the_body_hash_is_canonical(unit, alice):
    key = {"Idempotency-Key": "task-order"}
    body = task_body(temperature=0.5)
    reordered = {"input": dict(reversed(list(body["input"].items()))), "type": "response"}
    first = alice.post("/lmsp/v1/tasks", body, headers=key).get_json()
    assert alice.post("/lmsp/v1/tasks", reordered, headers=key).get_json()["id"] == first["id"]
    assert _tasks(unit, alice.principal) == 1


def test_another_body_with_the_key_is_422(unit, alice):
    key = {"Idempotency-Key": "task-2"}
    assert alice.post("/lmsp/v1/tasks", task_body(), headers=key).status_code == 202
    problem(alice.post("/lmsp/v1/tasks", task_body(temperature=1.0), headers=key), 422, "idempotency_key_reused")
    assert _tasks(unit, alice.principal) == 1


def test_keys_are_scoped_to_principal_and_path(unit, alice, bob):
    key = {"Idempotency-Key": "shared"}
    mine = alice.post("/lmsp/v1/tasks", task_body(), headers=key).get_json()
    theirs = bob.post("/lmsp/v1/tasks", task_body(), headers=key).get_json()
    assert mine["id"] != theirs["id"]
    assert _tasks(unit, alice.principal) == _tasks(unit, bob.principal) == 1
    # The same key on POST /responses is another key: no worker, so 503, not a replay or a 422.
    problem(alice.post("/lmsp/v1/responses", request_body(), headers=key), 503, "model_unavailable")


def test_a_refused_request_does_not_hold_its_key(unit, alice):
    key = {"Idempotency-Key": "no-worker"}
    problem(alice.post("/lmsp/v1/responses", request_body(), headers=key), 503, "model_unavailable")
    with FakeWorker(unit.sessions, MODEL):
        assert alice.post("/lmsp/v1/responses", request_body(), headers=key).status_code == 200


def test_response_replay_and_in_flight(unit, alice):
    key = {"Idempotency-Key": "resp-1"}
    gate = threading.Event()
    first: dict = {}

    def send():
        client = unit.app.test_client()  # its own client: the test's is busy meanwhile
        resp = client.post("/lmsp/v1/responses", json=request_body(),
                           headers={"Authorization": f"Bearer {alice.secret}", **key})
        first["resp"] = resp

    with FakeWorker(unit.sessions, MODEL, gate=gate) as worker:
        thread = threading.Thread(target=send)
        thread.start()
        assert worker.claimed.wait(10)
        busy = alice.post("/lmsp/v1/responses", request_body(), headers=key)
        problem(busy, 409, "idempotency_key_in_use")
        assert int(busy.headers["Retry-After"]) >= 1
        gate.set()
        thread.join(30)
    resp = first["resp"]
    assert resp.status_code == 200
    body = resp.get_json()
    assert body["status"] == "completed" and body["output"][0]["content"][0]["text"] == "Hello there"
    replay = alice.post("/lmsp/v1/responses", request_body(), headers=key)  # no worker now: a replay
    assert replay.status_code == 200 and replay.get_data() == resp.get_data()
    problem(alice.post("/lmsp/v1/responses", request_body(temperature=0.1), headers=key), 422,
            "idempotency_key_reused")
    assert _responses(unit, alice.principal) == 1


def test_a_streams_replay_is_the_same_outcome_as_a_stream(unit, alice):
    """9.2: same key, same body -> the original outcome again, as it was asked for: an event stream
    with the same items and the same final event; nothing runs twice."""
    from common import events
    from tests.harness import parse_sse

    key = {"Idempotency-Key": "stream-1"}
    with FakeWorker(unit.sessions, MODEL, text="Hello there"):
        first = alice.post("/lmsp/v1/responses", request_body(stream=True), headers=key)
        original = parse_sse(first.get_data(as_text=True).split("\n"))
    replay = alice.post("/lmsp/v1/responses", request_body(stream=True), headers=key)  # no worker now
    assert replay.status_code == 200 and replay.mimetype == events.SSE_TYPE
    again = parse_sse(replay.get_data(as_text=True).split("\n"))
    assert [seq for seq, _, _ in again] == list(range(1, len(again) + 1))
    assert again[0] == original[0] and again[-1][1:] == original[-1][1:] == (
        events.COMPLETED, original[-1][2])
    done = lambda received: [d["item"] for _, n, d in received if n == events.ITEM_DONE]  # noqa: E731
    assert done(again) == done(original)
    text = lambda received: "".join(d["delta"] for _, n, d in received if n == events.TEXT_DELTA)  # noqa: E731
    assert text(again) == text(original) == "Hello there"
    assert _responses(unit, alice.principal) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["sync", "stream"])
def test_a_transient_failure_is_not_kept_for_the_key(tmp_path, stream):
    """Issue 21 defect 8: a 503 model_unavailable (no worker served the model for a lease) is not an
    outcome to replay for 24 h: the client retries with the same key and, once a worker is back, gets
    its response (the Python client retries 503s with the same key)."""
    from common.tables import Worker
    from tests.unit.conftest import make_unit

    unit = make_unit(tmp_path, lease_seconds=1, direct_requeue_after_seconds=0.2)
    with unit.sessions() as session:  # alive when the request comes in, then silent
        now = time.time()
        session.merge(Worker(id="silent", model=MODEL, heartbeat_at=now, started_at=now, running=0))
        session.commit()
    caller = unit.as_("dana")
    body, key = request_body(stream=stream), {"Idempotency-Key": "retry-me"}
    first = caller.post("/lmsp/v1/responses", body, headers=key)
    text = first.get_data(as_text=True)
    assert ("model_unavailable" in text) and (first.status_code == (200 if stream else 503)), text
    with FakeWorker(unit.sessions, MODEL):
        again = caller.post("/lmsp/v1/responses", body, headers=key)
    assert again.status_code == 200 and "model_unavailable" not in again.get_data(as_text=True), \
        again.get_data(as_text=True)
