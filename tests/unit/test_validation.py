"""Bad input (spec 6.1, 7.1, 9, 10): one problem document naming the field, and nothing written."""

import json
import re

import pytest
from sqlalchemy import func, select

from common.tables import IdempotencyRecord, Response, Task
from tests.harness import user
from tests.unit.conftest import NARROW, problem, request_body, task_body

TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}

# common/protocol.py's _param mistakes union labels for fields and back: it answers response_format.schema
# and tool_choice.literal['auto','none','required'].

# (request fields, param): the same request is refused by POST /responses and, inside a task, by POST /tasks.
INVALID = [
    ({"model": None}, "model"),
    ({"model": ""}, "model"),
    ({"input": 5}, "input"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"content": "x"}]}, "input[0]"),
    ({"input": [{"role": "user"}]}, "input[0].content"),
    ({"input": [{"type": "message", "role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "message", "role": "user", "content": 5}]}, "input[0].content"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "image", "url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "function_call", "call_id": "", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
    ({"temperature": 9}, "temperature"),
    ({"temperature": "0.5"}, "temperature"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": "5"}, "max_output_tokens"),
    ({"max_output_tokens": True}, "max_output_tokens"),
    ({"max_output_tokens": 5000}, "max_output_tokens"),            # above the model's maximum
    ({"stream": "yes"}, "stream"),
    ({"store": 1}, "store"),
    ({"surprise": 1}, "surprise"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    pytest.param({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
                 "response_format.json_schema.schema"),
    pytest.param({"response_format": {"type": "json_schema", "json_schema": {"name": "bad!", "schema": {}}}},
                 "response_format.json_schema.name"),
    ({"tools": [{**TOOL, "name": "no spaces"}]}, "tools[0].name"),
    ({"tools": [{**TOOL, "parameters": {"type": "nope"}}]}, "tools[0].parameters"),
    pytest.param({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"previous_response_id": 5}, "previous_response_id"),
    # the OpenAI SDK's spellings (6.1 has the LMSP ones): named as the client spelled them
    ({"text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"top_p": 0.5}, "top_p"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["message.output_text.logprobs"]}, "include[0]"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"input": [{"role": "root", "content": "hi"}]}, "input[0].role"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}}, "text.format.schema"),
    ({"text": {"format": {"type": "text"}}, "response_format": {"type": "text"}}, "text"),
    ({"text": {"format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}}, "text.format.name"),
    ({"background": True}, "background"),
    ({"instructions": 5}, "instructions"),
]


def _written(unit) -> tuple[int, int, int]:
    with unit.sessions() as session:
        return tuple(session.execute(select(func.count()).select_from(t)).scalar_one()
                     for t in (Response, Task, IdempotencyRecord))


@pytest.mark.parametrize("fields,param", INVALID)
def test_invalid_request_names_the_field(unit, alice, fields, param):
    before = _written(unit)
    doc = problem(alice.post("/lmsp/v1/responses", request_body(**fields),
                             headers={"Idempotency-Key": f"k-{param}"}), 400, "invalid_request")
    assert doc["param"] == param and param.split("[")[0].split(".")[0] in doc["detail"]
    doc = problem(alice.post("/lmsp/v1/tasks", task_body(**fields)), 400, "invalid_request")
    assert doc["param"] == f"input.{param}"
    assert _written(unit) == before


@pytest.mark.parametrize("envelope,param", [
    ({"type": "batch"}, "type"),
    ({"on_restart": "sometimes"}, "on_restart"),
    ({"input": "hi"}, "input"),
    ({"extra": 1}, "extra"),
])
def test_invalid_task_envelope(unit, alice, envelope, param):
    before = _written(unit)
    doc = problem(alice.post("/lmsp/v1/tasks", {**task_body(), **envelope}), 400, "invalid_request")
    assert doc["param"] == param
    assert _written(unit) == before


def test_missing_task_input(alice):
    assert problem(alice.post("/lmsp/v1/tasks", {"type": "response"}), 400, "invalid_request")["param"] == "input"


@pytest.mark.parametrize("fields,param,capability", [
    ({"tools": [TOOL]}, "tools", "tools"),
    ({"tools": [TOOL], "tool_choice": "auto"}, "tools", "tools"),
    ({"response_format": SCHEMA_FORMAT}, "response_format", "structured_output"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}}, "text.format",
     "structured_output"),
    ({"previous_response_id": "resp_x"}, "previous_response_id", "conversations"),
])
def test_unsupported_capability(unit, alice, fields, param, capability):
    """param names the offending field (9.3), as for invalid_request; capability names what it needs."""
    before = _written(unit)
    doc = problem(alice.post("/lmsp/v1/responses", request_body(NARROW, **fields)), 400, "unsupported_capability")
    assert (doc["param"], doc["capability"]) == (param, capability)
    doc = problem(alice.post("/lmsp/v1/tasks", task_body(NARROW, **fields)), 400, "unsupported_capability")
    assert (doc["param"], doc["capability"]) == (f"input.{param}", capability)
    assert _written(unit) == before


def test_tools_with_choice_none_need_no_capability(alice):
    assert alice.post("/lmsp/v1/tasks", task_body(NARROW, tools=[TOOL], tool_choice="none")).status_code == 202


def test_resume_needs_resume_snapshots(unit, alice):
    before = _written(unit)
    doc = problem(alice.post("/lmsp/v1/tasks", {**task_body(NARROW), "on_restart": "resume"}), 400,
                  "unsupported_capability")
    assert (doc["param"], doc["capability"]) == ("on_restart", "resume_snapshots")
    assert _written(unit) == before


def test_context_length_is_counted_with_the_real_tokenizer(unit, alice):
    before = _written(unit)
    # The window is 64 tokens: a few words fit, two hundred do not.
    assert alice.post("/lmsp/v1/tasks", task_body(NARROW, input=user("word " * 5))).status_code == 202
    doc = problem(alice.post("/lmsp/v1/responses", request_body(NARROW, input=user("word " * 200))), 400,
                  "context_length_exceeded")
    assert doc["param"] == "input" and "64" in doc["detail"]
    assert _written(unit)[1] == before[1] + 1


def test_unknown_model_and_previous_response(unit, alice, bob):
    assert problem(alice.post("/lmsp/v1/responses", request_body("no-such:model")), 404,
                   "model_not_found")["param"] == "model"
    assert problem(alice.post("/lmsp/v1/tasks", task_body("no-such:model")), 404,
                   "model_not_found")["param"] == "input.model"
    assert problem(alice.post("/lmsp/v1/responses", request_body(previous_response_id="resp_nope")), 404,
                   "response_not_found")["param"] == "previous_response_id"
    # Another principal's stored response does not exist for alice; an unfinished one cannot be continued.
    theirs = bob.task("queued")
    problem(alice.post("/lmsp/v1/responses", request_body(previous_response_id=theirs.response_id)), 404,
            "response_not_found")
    mine = alice.task("running")
    assert problem(alice.post("/lmsp/v1/responses", request_body(previous_response_id=mine.response_id)), 400,
                   "invalid_request")["param"] == "previous_response_id"


def _raw(caller, data: bytes, content_type: str = "application/json"):
    return caller.post("/lmsp/v1/tasks", data=data, content_type=content_type)


def test_body_and_limits(unit, alice):
    before = _written(unit)
    settings = unit.settings
    problem(_raw(alice, b"x" * (settings.max_body_bytes + 1)), 413, "payload_too_large")
    problem(_raw(alice, b"model=x", "application/x-www-form-urlencoded"), 415, "unsupported_media_type")
    for bad in (b'{"type": "response",', b'{"type": "\xff\xfe"}', b"[1, 2]", b'{"a": NaN}', b"{}"):
        problem(_raw(alice, bad), 400, "invalid_request")
    deep = node = {}
    for _ in range(settings.max_json_depth + 5):
        node["a"] = node = {}
    problem(alice.post("/lmsp/v1/tasks", task_body(extensions={"x-deep": deep})), 400, "invalid_request")
    many = task_body(input=user("x") * (settings.max_input_items + 1))
    # A task's request sits in the envelope's input: its fields are named from there.
    assert problem(alice.post("/lmsp/v1/tasks", many), 400, "invalid_request")["param"] == "input.input"
    tools = [{**TOOL, "name": f"t{i}"} for i in range(settings.max_tools + 1)]
    assert problem(alice.post("/lmsp/v1/tasks", task_body(tools=tools)), 400, "invalid_request")["param"] == \
        "input.tools"
    long_text = task_body(input=user("a" * (settings.max_string_chars + 1)))
    problem(alice.post("/lmsp/v1/tasks", long_text), 400, "invalid_request")
    assert problem(alice.post("/lmsp/v1/tasks", task_body(), headers={"Idempotency-Key": "a b"}), 400,
                   "invalid_request")["param"] == "Idempotency-Key"
    # Two keys (two header lines arrive joined by a comma) are not one key "a1,a2".
    two = alice.unit.client.post("/lmsp/v1/tasks", json=task_body(), headers=[
        ("Authorization", f"Bearer {alice.secret}"), ("Idempotency-Key", "a1"), ("Idempotency-Key", "a2")])
    assert problem(two, 400, "invalid_request")["param"] == "Idempotency-Key"
    assert _written(unit) == before


def test_unknown_extensions_are_ignored(alice):
    extensions = {"x-trace": {"a": 1}, "com.example.priority": "high"}
    assert alice.post("/lmsp/v1/tasks", task_body(extensions=extensions)).status_code == 202
    # On the task envelope too, beside its input (9.1 is the rule of every object)
    assert alice.post("/lmsp/v1/tasks", {**task_body(), "extensions": extensions}).status_code == 202


def test_openai_spellings_are_stored_as_lmsp(unit, alice):
    """A string input, instructions, {role, content} items and text.format are other spellings: the task
    keeps (and its worker reads) the LMSP request they stand for."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    sdk = alice.post("/lmsp/v1/tasks", task_body(input="Hi", instructions="Be brief.", text={"format": {
        "type": "json_schema", "name": "x", "schema": schema, "strict": True}}))
    lmsp = alice.post("/lmsp/v1/tasks", task_body(
        input=[{"role": "system", "content": "Be brief."}, {"type": "message", "role": "user", "content": "Hi"}],
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}))
    assert sdk.status_code == lmsp.status_code == 202
    with unit.sessions() as session:
        stored = [session.get(Response, resp.get_json()["response_id"]).request for resp in (sdk, lmsp)]
    assert stored[0] == stored[1] and stored[0]["input"][0] == {"type": "message", "role": "system",
                                                               "content": "Be brief."}


def test_versioning(alice):
    assert alice.get("/lmsp/v1/models", headers={"LMSP-Version": "1.4"}).status_code == 200
    for asked in ("2.0", "0.9", "one"):
        problem(alice.get("/lmsp/v1/models", headers={"LMSP-Version": asked}), 400, "unsupported_version")


@pytest.mark.parametrize("query,header,param", [
    ("?after=-1", None, "after"), ("?after=x", None, "after"), ("?after=1234567890123", None, "after"),
    ("", "abc", "Last-Event-ID"),
])
def test_bad_event_cursor(alice, query, header, param):
    task = alice.task("queued")
    headers = {"Last-Event-ID": header} if header else {}
    doc = problem(alice.get(f"/lmsp/v1/tasks/{task.id}/events{query}", headers=headers), 400, "invalid_request")
    assert doc["param"] == param


def test_framework_errors_are_problems(unit, alice):
    problem(alice.get("/lmsp/v1/nothing-here"), 404, "not_found")
    resp = alice.open("DELETE", "/lmsp/v1/models")
    problem(resp, 405, "method_not_allowed")
    assert "GET" in resp.headers["Allow"]


def test_allow_lists_the_methods_that_work_and_no_other(unit, alice):
    """RFC 9110 15.5.6: a 405's Allow lists the methods the target takes. Flask adds HEAD and OPTIONS to each
    route, and a path can have a WebSocket route beside a plain one (/lmsp/v1/responses: its Allow listed GET,
    and a plain GET was a 405 too)."""
    methods = {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"}
    for rule in unit.app.url_map.iter_rules():
        path = re.sub(r"<[^>]+>", "x", rule.rule)
        answers = {method: alice.open(method, path) for method in methods}
        refused = {method for method, resp in answers.items() if resp.status_code == 405}
        assert refused, path
        for method in refused:
            assert set(answers[method].headers["Allow"].split(", ")) == methods - refused, (path, method)


def test_problem_documents_are_json(alice):
    resp = alice.post("/lmsp/v1/tasks", {"type": "response"})
    assert json.loads(resp.get_data(as_text=True))["instance"] == "/lmsp/v1/tasks"
