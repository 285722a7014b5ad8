"""The Chat Completions translation (api/chat_completions.py), without servers."""

import json

import pytest

from api.chat_completions import DONE, Chunks, chat_param, completion, response_body
from common import events
from common.errors import LMSPError
from common.protocol import ResponseRequest

MESSAGE = {"id": "msg_1", "type": "message", "role": "assistant",
           "content": [{"type": "output_text", "text": "Hello there"}]}
CALL = {"id": "fc_1", "type": "function_call", "call_id": "call_1", "name": "f", "arguments": '{"a": 1}'}
USAGE = {"input_tokens": 7, "output_tokens": 3, "total_tokens": 10}


def response(status="completed", output=(MESSAGE,), **extra):
    return {"id": "resp_1", "object": "response", "created_at": 1700000000, "status": status, "model": "m",
            "output": list(output), "usage": USAGE, "error": None, "incomplete_details": None,
            "previous_response_id": None, **extra}


def test_messages_of_every_role_become_input_items():
    chat, body = response_body({"model": "m", "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "system", "content": [{"type": "text", "text": "Sys"}]},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "refusal": None, "annotations": [], "audio": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."}], "max_completion_tokens": 9, "stop": "x", "seed": 3,
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}}, "response_format": {"type": "json_object"},
        # OpenAI clients' hints: taken, not read
        "user": "u-1", "service_tier": "auto", "prompt_cache_key": "k-1", "safety_identifier": "s-1"})
    req = ResponseRequest.model_validate(body)
    assert [(i.type, getattr(i, "role", None)) for i in req.input] == [
        ("message", "system"), ("message", "system"), ("message", "user"), ("function_call", None),
        ("function_call_output", None), ("message", "assistant")]
    assert req.input[3].call_id == req.input[4].call_id == "c1"
    assert (req.max_output_tokens, req.stop, req.seed) == (9, ["x"], 3)
    assert req.tools[0].name == "f" and req.tool_choice.name == "f" and req.json_schema == {"type": "object"}
    assert chat_param("max_output_tokens", chat) == "max_completion_tokens"
    assert chat_param("tools[0].parameters", chat) == "tools[0].function.parameters"
    assert chat_param("input[2].content", chat) == "messages"


@pytest.mark.parametrize("fields, param", [({"n": 2}, "n"), ({"logprobs": True}, "logprobs"),
                                           ({"top_logprobs": 2}, "top_logprobs"),
                                           ({"messages": [{"role": "function", "content": "x"}]}, "messages[0]")])
def test_what_is_not_supported_names_its_field(fields, param):
    with pytest.raises(LMSPError) as err:
        response_body({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})
    assert err.value.code == "invalid_request" and err.value.param == param


def test_completion_of_a_response():
    done = completion(response())
    assert done["choices"][0]["message"]["content"] == "Hello there"
    assert done["choices"][0]["finish_reason"] == "stop"
    assert done["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    called = completion(response(output=[CALL]))["choices"][0]
    assert called["finish_reason"] == "tool_calls" and called["message"]["content"] is None
    assert called["message"]["tool_calls"] == [{"id": "call_1", "type": "function",
                                               "function": {"name": "f", "arguments": '{"a": 1}'}}]
    assert completion(response("incomplete"))["choices"][0]["finish_reason"] == "length"


def chunks_of(obj, include_usage):
    text = "".join(map(Chunks("m", include_usage), events.of_response(obj)))
    return [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: ")]


def test_chunks_of_a_stream():
    chunks = chunks_of(response(output=[MESSAGE, CALL]), include_usage=True)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[1]["choices"][0]["delta"] == {"content": "Hello there"}
    assert chunks[2]["choices"][0]["delta"]["tool_calls"] == [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]
    assert chunks[3]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 10
    assert all(c["usage"] is None for c in chunks[:-1]) and {c["id"] for c in chunks} == {"resp_1"}
    assert all("usage" not in c for c in chunks_of(response(), include_usage=False))
    # tool_choice required or named: no text can come, so content is null from the start, as in the completion
    forced = "".join(map(Chunks("m", False, calls_only=True), events.of_response(response(output=[CALL]))))
    assert json.loads(forced.split("\n")[0][6:])["choices"][0]["delta"] == {"role": "assistant", "content": None}
    failed = chunks_of(response("failed", output=[], error={"code": "generation_failed", "detail": "boom",
                                                            "status": 500}), include_usage=True)
    assert failed[-1]["error"]["code"] == "generation_failed" and failed[-1]["error"]["message"] == "boom"
    assert DONE == "data: [DONE]\n\n"
