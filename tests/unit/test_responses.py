"""POST /responses end to end without an engine: the fake worker answers through the real output builder."""

from common import events, wire
from tests.harness import parse_sse
from tests.unit.conftest import MODEL, problem, request_body
from tests.unit.fake import FakeWorker


def test_sync_answer_is_a_response_object(unit, alice):
    with FakeWorker(unit.sessions, MODEL, text="Hello there"):
        resp = alice.post("/lmsp/v1/responses", request_body(store=True))
    assert resp.status_code == 200 and resp.mimetype == "application/json"
    body = wire.Response.model_validate(resp.get_json())
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
    for _, name, data in received:
        wire.EVENTS[name].model_validate(data)


def test_no_worker_no_response(unit, alice):
    resp = alice.post("/lmsp/v1/responses", request_body())
    problem(resp, 503, "model_unavailable")
    assert int(resp.headers["Retry-After"]) >= 1
