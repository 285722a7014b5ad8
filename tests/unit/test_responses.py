"""POST /responses end to end without an engine: the fake worker answers through the real output builder."""

import jsonschema

from common import events, wire
from tests.harness import parse_sse
from tests.unit.conftest import MODEL, problem, request_body
from tests.unit.fake import FakeWorker


def test_sync_answer_is_a_response_object(unit, alice):
    with FakeWorker(unit.sessions, MODEL, text="Hello there"):
        resp = alice.post("/lmsp/v1/responses", request_body(store=True))
    assert resp.status_code == 200 and resp.mimetype == "application/json"
    body = wire.ResponseObject.model_validate(resp.get_json())
    assert body.status == "completed" and body.output[0].content[0].text == "Hello there"
    assert alice.get(f"/lmsp/v1/responses/{body.id}").get_json() == resp.get_json()  # stored


def test_stream_sends_numbered_events_ending_with_the_final_one(unit, alice):
    with FakeWorker(unit.sessions, MODEL, text="Hello there"):
        resp = alice.post("/lmsp/v1/responses", request_body(stream=True))
        text = resp.get_data(as_text=True)
    assert resp.status_code == 200 and resp.mimetype == "text/event-stream"
    received = parse_sse(text.split("\n"))
    assert [seq for seq, _, _ in received] == list(range(1, len(received) + 1))
    assert received[0][1] == events.CREATED and received[-1][1] == events.COMPLETED
    assert "".join(data["delta"] for _, name, data in received if name == events.TEXT_DELTA) == "Hello there"
    doc = alice.get("/lmsp/v1/openapi.json").get_json()  # each event's data is what its struct documents
    named = doc["paths"]["/lmsp/v1/responses"]["post"]["responses"]["200"]["content"]["text/event-stream"]
    for _, name, data in received:
        jsonschema.Draft202012Validator({**named["x-lmsp-events"][name], "components": doc["components"]}).validate(data)


def test_no_worker_no_response(unit, alice):
    resp = alice.post("/lmsp/v1/responses", request_body())
    problem(resp, 503, "model_unavailable")
    assert int(resp.headers["Retry-After"]) >= 1


def test_a_direct_request_no_worker_takes_is_sent_again_then_fails(tmp_path, monkeypatch):
    """Its message is lost (a paused worker took it, or the broker restarted empty): it is sent again,
    and once no worker has served the model for a lease it ends with model_unavailable, not never."""
    import time as clock

    from common import interactive_wire
    from common.tables import Response, Worker
    from tests.unit.conftest import make_unit

    sent = []
    send = interactive_wire.send
    monkeypatch.setattr(interactive_wire, "send", lambda *args: (sent.append(args[2]), send(*args)))

    unit = make_unit(tmp_path, lease_seconds=2, direct_requeue_after_seconds=0.2)

    def heartbeat():  # alive when a request comes in, then it stops heartbeating
        with unit.sessions() as session:
            now = clock.time()
            session.merge(Worker(id="paused", model=MODEL, heartbeat_at=now, started_at=now, running=0))
            session.commit()

    caller = unit.as_("carol")
    heartbeat()
    started = clock.monotonic()
    resp = caller.post("/lmsp/v1/responses", request_body())
    problem(resp, 503, "model_unavailable")
    assert 2 <= clock.monotonic() - started < 10
    with unit.sessions() as session:
        row = session.query(Response).one()
    assert sent.count(row.id) >= 2  # the first message and a copy of it
    assert row.status == "failed" and row.error["code"] == "model_unavailable"

    heartbeat()
    streamed = caller.post("/lmsp/v1/responses", request_body(stream=True)).get_data(as_text=True)
    received = parse_sse(streamed.split("\n"))
    # 6.3/6.4: like any stream it starts with response.created at id 1, and ends with the final event.
    assert [(seq, name) for seq, name, _ in received] == [(1, events.CREATED), (2, events.FAILED)]
    assert received[-1][2]["error"]["code"] == "model_unavailable"


def test_a_direct_request_whose_worker_stopped_heartbeating_ends(tmp_path):
    """Its worker froze or died mid-generation and no other worker is left to sweep: the waiting
    client gets server_restarted once the lease expired, not a stream that never ends."""
    import threading

    from tests.unit.conftest import make_unit

    unit = make_unit(tmp_path, lease_seconds=2)
    frozen = threading.Event()
    with FakeWorker(unit.sessions, MODEL, gate=frozen) as worker:  # claims it, then never heartbeats
        try:
            resp = unit.as_("dave").post("/lmsp/v1/responses", request_body())
            assert worker.claimed.is_set()
            problem(resp, 500, "server_restarted")
        finally:
            frozen.set()


def test_a_direct_response_the_database_lost_ends(tmp_path):
    """Its row was committed lazily (lifecycle.create_direct) and a database crash lost it: the waiting
    client gets server_restarted, not a stream that waits for a row that will never change."""
    import threading

    from sqlalchemy import delete

    from common.tables import Response
    from tests.unit.conftest import make_unit

    unit = make_unit(tmp_path)
    frozen = threading.Event()

    def crash():
        worker.claimed.wait(10)
        with unit.sessions() as session:
            session.execute(delete(Response))
            session.commit()

    with FakeWorker(unit.sessions, MODEL, gate=frozen) as worker:
        threading.Thread(target=crash, daemon=True).start()
        try:
            resp = unit.as_("erin").post("/lmsp/v1/responses", request_body())
            problem(resp, 500, "server_restarted")
            assert "send the request again" in resp.get_json()["detail"]
        finally:
            frozen.set()


def test_a_sync_answer_of_503_carries_retry_after_also_when_replayed(tmp_path):
    """9.3: model_unavailable is a 503 with Retry-After, also when it is the problem a generation
    ended with (no worker took the request) and when the request is retried with its Idempotency-Key
    (which does not keep that transient outcome: the retry is answered afresh, issue 21 defect 8)."""
    import time as clock

    from common.tables import Worker
    from tests.unit.conftest import make_unit

    unit = make_unit(tmp_path, lease_seconds=2, direct_requeue_after_seconds=0.2)
    caller = unit.as_("erin")
    with unit.sessions() as session:  # alive when the request comes in, then never again
        now = clock.time()
        session.merge(Worker(id="gone", model=MODEL, heartbeat_at=now, started_at=now, running=0))
        session.commit()
    key = {"Idempotency-Key": "retry-after-1"}
    first = caller.post("/lmsp/v1/responses", request_body(), headers=key)
    assert problem(first, 503, "model_unavailable")["instance"] == "/lmsp/v1/responses"
    assert int(first.headers["Retry-After"]) >= 1
    again = caller.post("/lmsp/v1/responses", request_body(), headers=key)
    problem(again, 503, "model_unavailable")
    assert int(again.headers["Retry-After"]) >= 1


def test_a_tasks_response_is_retrievable_only_when_stored(alice):
    """6.1/6.2: GET /responses/{id} (and previous_response_id) has what was stored with store: true on a
    model with capability conversations; a task's response is no exception (its task object has it)."""
    from tests.unit.conftest import NARROW, task_body

    plain = alice.post("/lmsp/v1/tasks", task_body()).get_json()
    kept = alice.post("/lmsp/v1/tasks", task_body(store=True)).get_json()
    ignored = alice.post("/lmsp/v1/tasks", task_body(NARROW, store=True)).get_json()  # no conversations
    assert alice.get(f"/lmsp/v1/responses/{kept['response_id']}").get_json()["id"] == kept["response_id"]
    for task in (plain, ignored):
        problem(alice.get(f"/lmsp/v1/responses/{task['response_id']}"), 404, "response_not_found")
    doc = problem(alice.post("/lmsp/v1/responses", request_body(previous_response_id=plain["response_id"])),
                  404, "response_not_found")
    assert doc["param"] == "previous_response_id"


def test_a_tasks_response_is_not_deleted_on_its_own(unit, alice):
    """Found by a hostile client's probe: DELETE answered deleted, yet the task went on showing the
    response (GET /tasks/{id}, its events). It is refused; a direct stored response is deleted."""
    task = alice.post("/lmsp/v1/tasks", {"type": "response", "input": request_body(store=True)}).get_json()
    refused = alice.open("DELETE", f"/lmsp/v1/responses/{task['response_id']}")
    assert task["id"] in problem(refused, 400, "invalid_request")["detail"]
    assert alice.get(f"/lmsp/v1/responses/{task['response_id']}").status_code == 200
    with FakeWorker(unit.sessions, MODEL):
        made = alice.post("/lmsp/v1/responses", request_body(store=True)).get_json()
    assert alice.open("DELETE", f"/lmsp/v1/responses/{made['id']}").get_json()["deleted"] is True
    problem(alice.get(f"/lmsp/v1/responses/{made['id']}"), 404, "response_not_found")
