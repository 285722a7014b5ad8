"""A direct request's message carries the prompt as the api tokenized it, so the worker need not
render and tokenize it again (worker/runner.py uses them); a copy without them still decodes."""

from common import interactive_wire
from common.prompt import load_tokenizer, render
from common.protocol import ResponseRequest
from tests.harness import CHECKPOINT
from tests.unit.conftest import MODEL, request_body
from tests.unit.fake import FakeWorker


def test_the_message_carries_the_tokens_the_worker_would_render(unit, alice, monkeypatch):
    sent = []
    send = interactive_wire.send
    monkeypatch.setattr(interactive_wire, "send", lambda *args: (sent.append(args), send(*args)))
    with FakeWorker(unit.sessions, MODEL, text="Hello there"):
        assert alice.post("/lmsp/v1/responses", request_body()).status_code == 200
    (_celery, _queue, _rid, ids, _logged), = sent
    tok = load_tokenizer(str(CHECKPOINT))
    req = ResponseRequest.model_validate(request_body())
    assert ids == tok.encode(render(tok, req))
    body = interactive_wire.encode("resp_x", ids)
    assert interactive_wire.decode(body) == "resp_x" and interactive_wire.prompt_ids(body) == ids
    plain = interactive_wire.encode("resp_x")  # DirectWatch's copy: the worker renders it
    assert interactive_wire.decode(plain) == "resp_x" and interactive_wire.prompt_ids(plain) is None
    assert interactive_wire.prompt_ids({**plain, "prompt_ids": ["1"]}) is None


def test_a_message_the_broker_fails_to_take_is_sent_again_not_a_500(unit, alice, monkeypatch):
    # Issue 21's chaos run (seed 4242): kombu's pooled connection, broken by a Redis fault, raised
    # AttributeError / IndexError from the send, after the response was committed: a 500.
    sent = []
    send = interactive_wire.send

    def broken_once(*args):
        sent.append(args)
        if len(sent) == 1:
            raise AttributeError("'NoneType' object has no attribute 'client'")
        send(*args)

    monkeypatch.setattr(interactive_wire, "send", broken_once)
    with FakeWorker(unit.sessions, MODEL, text="Hello there"):
        resp = alice.post("/lmsp/v1/responses", request_body())
    assert resp.status_code == 200, resp.get_data(as_text=True)
    assert resp.get_json()["status"] == "completed"  # the fake worker claims from the database
