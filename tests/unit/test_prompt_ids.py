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
    (_celery, _queue, _rid, ids), = sent
    tok = load_tokenizer(str(CHECKPOINT))
    req = ResponseRequest.model_validate(request_body())
    assert ids == tok.encode(render(tok, req))
    body = interactive_wire.encode("resp_x", ids)
    assert interactive_wire.decode(body) == "resp_x" and interactive_wire.prompt_ids(body) == ids
    plain = interactive_wire.encode("resp_x")  # DirectWatch's copy: the worker renders it
    assert interactive_wire.decode(plain) == "resp_x" and interactive_wire.prompt_ids(plain) is None
    assert interactive_wire.prompt_ids({**plain, "prompt_ids": ["1"]}) is None
