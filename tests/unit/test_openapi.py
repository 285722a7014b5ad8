"""The generated OpenAPI document: valid 3.1, every route in it, and true to what the api answers."""

import json
import re

import jsonschema
import pytest
from openapi_spec_validator import OpenAPIV31SpecValidator, validate

from common import events, wire
from tests.harness import parse_sse
from tests.unit.conftest import MODEL, task_body

SPEC = "/lmsp/v1/openapi.json"
USAGE = {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5}
OUTPUT = [{"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
           "content": [{"type": "output_text", "text": "Hi", "annotations": []}]},
          {"id": "fc_1", "type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}",
           "status": "completed"},
          {"id": "rs_1", "type": "reasoning", "summary": [{"type": "summary_text", "text": "hm"}],
           "status": "completed"}]


def response(rid: str = "resp_1", status: str = "completed", **kw) -> dict:
    """A response object as lifecycle events carry it."""
    return wire.ResponseObject(**{
        "id": rid, "created_at": 1, "status": status, "model": MODEL, "output": OUTPUT, "usage": USAGE,
        "error": None, "incomplete_details": None, "previous_response_id": None, **kw}).wire()


@pytest.fixture(scope="module")
def doc(unit):
    resp = unit.client.get(SPEC, headers={"Authorization": f"Bearer {unit.token('openapi', 'models:read')}"})
    assert resp.status_code == 200 and resp.mimetype == "application/json"
    return resp.get_json()


def _validator(doc, schema: dict):
    """A JSON Schema validator whose #/components/... references resolve inside ``doc``."""
    return jsonschema.Draft202012Validator({**schema, "components": doc["components"]})


def schema(doc, name: str):
    return _validator(doc, {"$ref": f"#/components/schemas/{name}"})


def check(doc, caller, method: str, template: str, path: str, status: int, **kwargs):
    """Call the api; the status, media type and body must be what the document declares for them."""
    resp = caller.open(method, path, **kwargs)
    assert resp.status_code == status, resp.get_data(as_text=True)
    declared = doc["paths"][template][method.lower()]["responses"]
    assert str(status) in declared, f"{method} {template} answered {status}, which is not documented"
    content = declared[str(status)]["content"]
    assert resp.mimetype in content, f"{method} {template} {status}: {resp.mimetype} is not in {list(content)}"
    if resp.mimetype.endswith("json"):
        body = resp.get_json()
        _validator(doc, content[resp.mimetype]["schema"]).validate(body)
        return body
    return resp.get_data(as_text=True)


def test_document_is_valid_openapi_31(doc):
    assert doc["openapi"].startswith("3.1")
    validate(doc, cls=OpenAPIV31SpecValidator)
    broken = json.loads(json.dumps(doc))  # and the check can fail: a dangling reference is caught
    broken["paths"]["/healthz"]["get"]["responses"]["200"]["content"]["application/json"]["schema"] = {
        "$ref": "#/components/schemas/NoSuchSchema"}
    with pytest.raises(Exception):  # noqa: B017 - the validator's error types vary by version
        validate(broken, cls=OpenAPIV31SpecValidator)


def test_every_route_is_documented_and_every_documented_route_exists(unit, doc):
    routes: dict[str, set[str]] = {}
    for rule in unit.app.url_map.iter_rules():
        if rule.endpoint != "static":
            template = re.sub(r"<(?:[^:<>]+:)?([^<>]+)>", r"{\1}", rule.rule)
            routes.setdefault(template, set()).update(m.lower() for m in rule.methods - {"HEAD", "OPTIONS"})
    documented = {path: set(item) for path, item in doc["paths"].items()}
    assert routes == documented


def test_the_problem_schema_names_every_code_the_api_answers_with(doc):
    from api.problems import ALL_CODES
    described = doc["components"]["schemas"]["Problem"]["properties"]["code"]["description"]
    for code in ("not_found", "method_not_allowed", "uri_too_long", "request_header_fields_too_large", *ALL_CODES):
        assert f"`{code}`" in described, code


def test_every_operation_declares_its_security_and_problems(doc):
    for path, item in doc["paths"].items():
        for method, op in item.items():
            public = path in ("/healthz", "/readyz", "/")
            assert op["security"] == ([] if public else [{"bearer": [op["x-lmsp-scope"]]}]), (method, path)
            if not public:
                assert "401" in op["responses"] and "403" in op["responses"], (method, path)
            # gunicorn refuses an overlong request line or header before any route (api/serve.py)
            assert "`uri_too_long`" in op["responses"]["414"]["description"], (method, path)
            assert "`request_header_fields_too_large`" in op["responses"]["431"]["description"], (method, path)
            for status, response in op["responses"].items():
                if int(status) >= 400:
                    assert response["content"] == {"application/problem+json": {
                        "schema": {"$ref": "#/components/schemas/Problem"}}}, (method, path, status)


def test_public_and_model_answers(unit, doc, alice):
    check(doc, unit.anonymous, "GET", "/healthz", "/healthz", 200)
    check(doc, unit.anonymous, "GET", "/readyz", "/readyz", 200)
    body = check(doc, alice, "GET", "/lmsp/v1", "/lmsp/v1", 200)
    assert body["paths"]["openapi"] == SPEC and MODEL in body["models"]
    body = check(doc, alice, "GET", "/lmsp/v1/models", "/lmsp/v1/models", 200)
    assert MODEL in [m["id"] for m in body["data"]]
    check(doc, alice, "GET", "/lmsp/v1/models/{model_id}", f"/lmsp/v1/models/{MODEL}", 200)
    check(doc, alice, "GET", "/lmsp/v1/models/{model_id}", "/lmsp/v1/models/nope:1", 404)
    check(doc, alice, "GET", "/lmsp/v1/models", "/lmsp/v1/models", 400, headers={"LMSP-Version": "2.0"})
    check(doc, unit.anonymous, "GET", SPEC, SPEC, 401)


def test_task_and_response_answers(doc, alice):
    task = alice.task("succeeded", response={"status": "completed", "output": OUTPUT, "usage": USAGE})
    body = check(doc, alice, "GET", "/lmsp/v1/tasks/{task_id}", f"/lmsp/v1/tasks/{task.id}", 200)
    assert body["response"]["output"] == OUTPUT
    body = check(doc, alice, "GET", "/lmsp/v1/responses/{response_id}", f"/lmsp/v1/responses/{task.response_id}", 200)
    assert body["usage"] == wire.ResponseUsage(**USAGE).wire() and body["previous_response_id"] is None
    check(doc, alice, "POST", "/lmsp/v1/tasks/{task_id}/cancel", f"/lmsp/v1/tasks/{task.id}/cancel", 409)

    task = alice.task("queued")  # nothing generated yet: usage, response and error are null
    body = check(doc, alice, "GET", "/lmsp/v1/tasks/{task_id}", f"/lmsp/v1/tasks/{task.id}", 200)
    assert body["response"] is None and body["error"] is None
    body = check(doc, alice, "GET", "/lmsp/v1/responses/{response_id}", f"/lmsp/v1/responses/{task.response_id}", 200)
    assert body["usage"] is None and body["output"] == [] and body["status"] == "in_progress"

    created = check(doc, alice, "POST", "/lmsp/v1/tasks", "/lmsp/v1/tasks", 202, json=task_body())
    assert created["status"] == "queued" and created["events_url"] == f"/lmsp/v1/tasks/{created['id']}/events"
    check(doc, alice, "POST", "/lmsp/v1/tasks", "/lmsp/v1/tasks", 400, json={"type": "response"})
    check(doc, alice, "POST", "/lmsp/v1/tasks", "/lmsp/v1/tasks", 415, data="x", content_type="text/plain")
    check(doc, alice, "POST", "/lmsp/v1/responses", "/lmsp/v1/responses", 503, json=task_body()["input"])
    check(doc, alice, "GET", "/lmsp/v1/tasks/{task_id}/ws", f"/lmsp/v1/tasks/{task.id}/ws", 400)  # no Upgrade
    upgrade = {"Connection": "Upgrade", "Upgrade": "websocket"}  # refused before the handshake, with a status
    check(doc, alice, "GET", "/lmsp/v1/tasks/{task_id}/ws", "/lmsp/v1/tasks/task_nope/ws", 404, headers=upgrade)
    reader = alice.unit.as_(alice.principal, "models:read")
    check(doc, reader, "GET", "/lmsp/v1/tasks/{task_id}/ws", f"/lmsp/v1/tasks/{task.id}/ws", 403, headers=upgrade)


def test_failed_task_carries_its_problem(doc, alice):
    error = {"type": "/lmsp/v1/errors#server_restarted", "title": "Server restarted", "status": 500,
             "code": "server_restarted", "detail": "restarted"}
    task = alice.task("failed", error=error, response={"status": "failed", "error": error})
    body = check(doc, alice, "GET", "/lmsp/v1/tasks/{task_id}", f"/lmsp/v1/tasks/{task.id}", 200)
    assert body["error"] == {**error, "message": "restarted"}  # absent members stay absent, never null


def test_event_stream_matches_the_event_schemas(doc, alice):
    task = alice.task("succeeded")
    rid = task.response_id
    script = [events.ResponseCreated(response_id=rid, response=events.started(response(rid))),
              events.OutputItemAdded(response_id=rid, output_index=0, item={**OUTPUT[0], "content": []}),
              events.ContentPartAdded(response_id=rid, output_index=0, item_id="msg_1"),
              events.TextDelta(response_id=rid, output_index=0, item_id="msg_1", delta="Hi"),
              events.OutputItemDone(response_id=rid, output_index=0, item=OUTPUT[0]),
              events.AttemptStarted(response_id=rid, attempt=2),
              events.SummaryDelta(response_id=rid, output_index=1, item_id="rs_1", delta="hm"),
              events.final(rid, "completed", usage=USAGE, response=response(rid))]
    alice.log(task, script)
    template = "/lmsp/v1/tasks/{task_id}/events"
    text = check(doc, alice, "GET", template, f"/lmsp/v1/tasks/{task.id}/events", 200)
    media = doc["paths"][template]["get"]["responses"]["200"]["content"]["text/event-stream"]
    received = parse_sse(text.split("\n"))
    assert [name for _, name, _ in received] == [event.name for event in script]
    for _, name, data in received:
        _validator(doc, media["x-lmsp-events"][name]).validate(data)
    check(doc, alice, "GET", template, f"/lmsp/v1/tasks/{task.id}/events?after=-1", 400)


def test_every_final_event_and_problem_matches_its_schema(doc):
    from common.errors import CODES, problem
    media = doc["paths"]["/lmsp/v1/tasks/{task_id}/events"]["get"]["responses"]["200"]["content"]
    named = media["text/event-stream"]["x-lmsp-events"]
    for status, kw in (("completed", {"usage": USAGE}), ("failed", {"error": problem("generation_failed", "x")}),
                       ("incomplete", {"usage": USAGE, "incomplete_details": {"reason": "max_output_tokens"}}),
                       ("cancelled", {})):
        ending = events.final("resp_1", status, **kw, response=response(status=status, **kw))
        data = events.encode(ending)
        _validator(doc, named[ending.name]).validate(json.loads(events.typed(7, ending.name, data)))
        assert not _validator(doc, named[ending.name]).is_valid(json.loads(data))  # type and sequence_number are always sent
    for code in CODES:
        schema(doc, "Problem").validate(problem(code, "detail", instance="/x", param="p"))


def test_schemas_reject_wrong_answers(doc):
    """The answer schemas are strict enough to catch a wrong answer."""
    assert not schema(doc, "Problem").is_valid({"title": "x", "status": 400})
    assert not schema(doc, "Problem").is_valid({"type": "t", "title": "x", "status": 400, "code": "c",
                                                 "detail": "d", "param": None})
    assert not schema(doc, "TaskObject").is_valid({"id": "task_1", "object": "task"})
    assert not schema(doc, "Model").is_valid({"id": "m", "object": "model", "context_window": 1,
                                              "max_output_tokens": 1, "capabilities": {}, "status": "ready",
                                              "workers": 1})
    assert not schema(doc, "OutputMessage").is_valid({**OUTPUT[0], "role": "user"})
    assert not schema(doc, "Completed").is_valid({"response_id": "r", "status": "completed"})


def test_every_code_a_task_creation_answers_is_documented(doc, alice, monkeypatch):
    """A problem's code is in its operation's documented answers, not just its status."""
    from api.services import validation

    def unreadable(path):
        raise OSError(f"no tokenizer at {path}")

    monkeypatch.setattr(validation, "load_tokenizer", unreadable)
    body = check(doc, alice, "POST", "/lmsp/v1/tasks", "/lmsp/v1/tasks", 503, json=task_body())
    assert body["code"] == "model_unavailable"
    assert "`model_unavailable`" in doc["paths"]["/lmsp/v1/tasks"]["post"]["responses"]["503"]["description"]


def test_a_route_without_its_operation_is_refused():
    """The document is assembled from the routes: one that does not describe itself (api/operations.py)
    cannot slip out of it, and so out of the fuzzer's reach, unnoticed."""
    from flask import Flask

    from api.openapi import operations
    app = Flask(__name__)
    app.add_url_rule("/undescribed", "undescribed", lambda: "")
    with pytest.raises(RuntimeError, match="undescribed"):
        operations(app)
