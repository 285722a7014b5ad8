"""The OpenAPI document: valid 3.1, complete, and true to what the api answers (no engine needed)."""

import json
import re
import time

import jsonschema
import pytest
import yaml
from openapi_spec_validator import OpenAPIV31SpecValidator, validate

from common import eventlog, events
from common.db import make_engine, session_factory, upgrade
from common.ids import new_id
from common.protocol import ResponseRequest, TaskRequest
from common.settings import Settings
from common.tables import Response, Task
from common.tokens import create_token

MODEL = "tiny:openapi"
SPEC = "/lmsp/v1/openapi.json"
IGNORED_METHODS = {"HEAD", "OPTIONS"}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from api import create_app

    home = tmp_path_factory.mktemp("openapi")
    models = home / "models.yaml"
    models.write_text(yaml.safe_dump({"models": [
        {"id": MODEL, "checkpoint": str(home / "no-checkpoint"), "context_window": 256, "max_output_tokens": 64}]}))
    # Explicit database/broker/redis so LMSP_* variables of the surrounding shell cannot leak in.
    settings = Settings(home=home, models_file=models, database_url=f"sqlite:///{home / 'lmsp.db'}",
                        broker_url="", redis_url="")
    upgrade(settings.db_url)
    app = create_app(settings)
    sessions = session_factory(make_engine(settings.db_url))
    with sessions() as session:
        _, token = create_token(session, "alice", ("models:read", "responses:read", "tasks:read",
                                                   "tasks:write", "tasks:cancel", "responses:write"))
        _, narrow = create_token(session, "bob", ("tasks:read",))
        session.commit()
    client = app.test_client()
    resp = client.get(SPEC, headers={"Authorization": f"Bearer {token}"})
    assert resp.status_code == 200, resp.get_data(as_text=True)
    return {"app": app, "client": client, "sessions": sessions, "token": token, "narrow": narrow,
            "doc": resp.get_json(), "resp": resp}


def auth(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def schema_of(doc: dict, schema: dict) -> dict:
    """A standalone JSON Schema whose #/components/... references resolve inside ``doc``."""
    return {**schema, "components": doc["components"]}


def check(env, method: str, template: str, path: str, status: int, *, token: str | None = "token", **kwargs):
    """Call the api; the answer's status, media type and body must be what the document declares."""
    headers = kwargs.pop("headers", {})
    if token:
        headers.update(auth(env[token]))
    resp = env["client"].open(path, method=method, headers=headers, **kwargs)
    assert resp.status_code == status, resp.get_data(as_text=True)
    assert resp.headers.get("LMSP-Version") == "1.0"
    declared = env["doc"]["paths"][template][method.lower()]["responses"]
    assert str(status) in declared, f"{method} {template} answered {status}, which is not documented"
    content = declared[str(status)]["content"]
    assert resp.mimetype in content, f"{method} {template} {status} answered {resp.mimetype}, documented {list(content)}"
    if resp.mimetype.endswith("json"):
        body = resp.get_json()
        jsonschema.Draft202012Validator(schema_of(env["doc"], content[resp.mimetype]["schema"])).validate(body)
        return resp, body
    return resp, resp.get_data(as_text=True)


# -- the document ---------------------------------------------------------------------------------
def test_document_is_valid_openapi_31(env):
    doc = env["doc"]
    assert env["resp"].mimetype == "application/json"
    assert doc["openapi"].startswith("3.1")
    validate(doc, cls=OpenAPIV31SpecValidator)


def test_validator_rejects_a_broken_document(env):
    """The validation above can fail: a dangling reference is caught."""
    broken = json.loads(json.dumps(env["doc"]))
    broken["paths"]["/healthz"]["get"]["responses"]["200"]["content"]["application/json"]["schema"] = {
        "$ref": "#/components/schemas/NoSuchSchema"}
    with pytest.raises(Exception):  # noqa: B017 - the validator's error types vary by version
        validate(broken, cls=OpenAPIV31SpecValidator)


def _template(rule: str) -> str:
    return re.sub(r"<(?:[^:<>]+:)?([^<>]+)>", r"{\1}", rule)


def test_every_route_is_documented_and_every_documented_route_exists(env):
    routes: dict[str, set[str]] = {}
    for rule in env["app"].url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        routes.setdefault(_template(rule.rule), set()).update(
            m.lower() for m in rule.methods - IGNORED_METHODS)
    documented = {path: {m for m in item if m in {"get", "post", "put", "patch", "delete"}}
                  for path, item in env["doc"]["paths"].items()}
    assert {"/healthz", "/readyz", "/lmsp/v1", SPEC, "/lmsp/v1/tasks/{task_id}/ws"} <= set(routes)
    assert routes == documented


def test_security(env):
    doc = env["doc"]
    assert doc["components"]["securitySchemes"]["bearer"] == {
        **doc["components"]["securitySchemes"]["bearer"], "type": "http", "scheme": "bearer"}
    assert doc["security"] == [{"bearer": []}]
    for path, item in doc["paths"].items():
        for method, op in item.items():
            public = path in ("/healthz", "/readyz", "/")
            assert op["security"] == [] if public else op["security"][0]["bearer"], (method, path)
            if not public:
                assert "401" in op["responses"], (method, path)
                # The WebSocket view checks its scope after the handshake (flask-sock), so no 403 there.
                assert ("403" in op["responses"]) != path.endswith("/ws"), (method, path)
            for status, response in op["responses"].items():
                if int(status) >= 400 and not (path == "/readyz" and status == "503"):
                    assert list(response["content"]) == ["application/problem+json"], (method, path, status)
                    assert response["content"]["application/problem+json"]["schema"] == {
                        "$ref": "#/components/schemas/Problem"}


def test_request_bodies_are_the_pydantic_models(env):
    doc = env["doc"]
    schemas = doc["components"]["schemas"]
    for path, model in (("/lmsp/v1/responses", ResponseRequest), ("/lmsp/v1/tasks", TaskRequest)):
        op = doc["paths"][path]["post"]
        body = op["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model.__name__}"}
        generated = model.model_json_schema(by_alias=True, ref_template="#/components/schemas/{model}")
        for name, sub in {**generated.pop("$defs", {}), model.__name__: generated}.items():
            # Identical but for discriminator tags, which the document marks required.
            assert {**schemas[name], "required": sorted(schemas[name].get("required", []))} == {
                **sub, "required": sorted(set(sub.get("required", [])) | ({"type"} if name.endswith("Item") else set()))}
        names = {p.get("$ref", "").rsplit("/", 1)[-1] for p in op["parameters"]}
        assert "IdempotencyKey" in names
        assert {"413", "415", "422"} <= set(op["responses"])
    assert doc["components"]["parameters"]["IdempotencyKey"]["name"] == "Idempotency-Key"
    # A request the document accepts is one the api accepts, and the other way round.
    ok = {"model": MODEL, "input": [{"type": "message", "role": "user", "content": "hi"}]}
    validator = jsonschema.Draft202012Validator(schema_of(doc, {"$ref": "#/components/schemas/TaskRequest"}))
    assert validator.is_valid({"type": "response", "input": ok})
    assert not validator.is_valid({"type": "response", "input": {**ok, "unknown": 1}})
    untagged = {"type": "response", "input": {**ok, "input": [{"role": "user", "content": "hi"}]}}
    assert not validator.is_valid(untagged)  # the api needs the discriminator too:
    _, body = check(env, "POST", "/lmsp/v1/tasks", "/lmsp/v1/tasks", 400, json=untagged)
    assert body["param"] == "input.input[0]"


def test_events_endpoint_parameters(env):
    op = env["doc"]["paths"]["/lmsp/v1/tasks/{task_id}/events"]["get"]
    params = [env["doc"]["components"]["parameters"][p["$ref"].rsplit("/", 1)[-1]] for p in op["parameters"]]
    after = next(p for p in params if p["name"] == "after")
    assert after["in"] == "query" and after["schema"]["type"] == "integer" and after["schema"]["minimum"] == 0
    assert any(p["name"] == "Last-Event-ID" and p["in"] == "header" for p in params)
    assert "text/event-stream" in op["responses"]["200"]["content"]
    assert "410" in op["responses"]
    assert "101" in env["doc"]["paths"]["/lmsp/v1/tasks/{task_id}/ws"]["get"]["responses"]


# -- answers match the schemas -------------------------------------------------------------------
def test_openapi_needs_a_token(env):
    resp, body = check(env, "GET", SPEC, SPEC, 401, token=None)
    assert resp.mimetype == "application/problem+json"
    assert body["code"] == "unauthorized" and body["status"] == 401 and body["instance"] == SPEC
    assert resp.headers["WWW-Authenticate"].startswith("Bearer")
    _, body = check(env, "GET", SPEC, SPEC, 403, token="narrow")
    assert body["code"] == "insufficient_scope"


def test_public_and_model_answers(env):
    check(env, "GET", "/healthz", "/healthz", 200, token=None)
    resp = env["client"].get("/readyz")
    check(env, "GET", "/readyz", "/readyz", resp.status_code, token=None)
    _, body = check(env, "GET", "/lmsp/v1", "/lmsp/v1", 200)
    assert body["paths"]["openapi"] == SPEC
    _, body = check(env, "GET", "/lmsp/v1/models", "/lmsp/v1/models", 200)
    assert [m["id"] for m in body["data"]] == [MODEL]
    check(env, "GET", "/lmsp/v1/models/{model_id}", f"/lmsp/v1/models/{MODEL}", 200)
    _, body = check(env, "GET", "/lmsp/v1/models/{model_id}", "/lmsp/v1/models/nope:1", 404)
    assert body["code"] == "model_not_found"
    _, body = check(env, "GET", "/lmsp/v1/models", "/lmsp/v1/models", 400, headers={"LMSP-Version": "2.0"})
    assert body["code"] == "unsupported_version"


def _rows(env, task_status: str, response_status: str, **response_values):
    now = time.time()
    with env["sessions"]() as session:
        row = Response(id=new_id("response"), principal_id="alice", model=MODEL,
                       request={"model": MODEL, "input": []}, status=response_status, stored=True,
                       created_at=now, updated_at=now, **response_values)
        session.add(row)
        session.flush()
        task = Task(id=new_id("task"), principal_id="alice", response_id=row.id, type="response", model=MODEL,
                    status=task_status, on_restart="fail", attempt=1, created_at=now, updated_at=now,
                    ended_at=now if task_status in ("succeeded", "failed", "cancelled") else None,
                    events_expired=False,
                    error={"type": "/lmsp/v1/errors#server_restarted", "title": "Server restarted",
                           "status": 500, "code": "server_restarted", "detail": "restarted"}
                    if task_status == "failed" else None)
        session.add(task)
        session.commit()
    return row.id, task.id


OUTPUT = [{"id": "msg_1", "type": "message", "role": "assistant",
           "content": [{"type": "output_text", "text": "Hello"}]},
          {"id": "fc_1", "type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}]
USAGE = {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5}


def test_task_and_response_answers(env):
    rid, tid = _rows(env, "succeeded", "completed", output=OUTPUT, usage=USAGE)
    _, body = check(env, "GET", "/lmsp/v1/tasks/{task_id}", f"/lmsp/v1/tasks/{tid}", 200)
    assert body["response"]["output"] == OUTPUT
    _, body = check(env, "GET", "/lmsp/v1/responses/{response_id}", f"/lmsp/v1/responses/{rid}", 200)
    assert body["usage"] == USAGE and body["previous_response_id"] is None
    _, body = check(env, "POST", "/lmsp/v1/tasks/{task_id}/cancel", f"/lmsp/v1/tasks/{tid}/cancel", 409)
    assert body["code"] == "task_not_cancelable"

    rid, tid = _rows(env, "queued", "in_progress")  # nothing generated yet: usage, response, error null
    _, body = check(env, "GET", "/lmsp/v1/tasks/{task_id}", f"/lmsp/v1/tasks/{tid}", 200)
    assert body["response"] is None and body["error"] is None
    _, body = check(env, "GET", "/lmsp/v1/responses/{response_id}", f"/lmsp/v1/responses/{rid}", 200)
    assert body["usage"] is None and body["output"] == []
    _, body = check(env, "POST", "/lmsp/v1/tasks/{task_id}/cancel", f"/lmsp/v1/tasks/{tid}/cancel", 200)
    assert body["status"] == "cancelled"

    _, tid = _rows(env, "failed", "failed", output=[], usage=None)
    _, body = check(env, "GET", "/lmsp/v1/tasks/{task_id}", f"/lmsp/v1/tasks/{tid}", 200)
    assert body["error"]["code"] == "server_restarted"

    # A plain GET (no Upgrade) on the WebSocket route is refused before the view runs.
    check(env, "GET", "/lmsp/v1/tasks/{task_id}/ws", f"/lmsp/v1/tasks/{tid}/ws", 400)

    _, body = check(env, "GET", "/lmsp/v1/tasks/{task_id}", "/lmsp/v1/tasks/task_nope", 404)
    assert body["code"] == "task_not_found"
    _, body = check(env, "GET", "/lmsp/v1/responses/{response_id}", "/lmsp/v1/responses/resp_nope", 404)
    assert body["code"] == "response_not_found"


def test_task_creation_errors(env):
    _, body = check(env, "POST", "/lmsp/v1/tasks", "/lmsp/v1/tasks", 400, json={"type": "response"})
    assert body["code"] == "invalid_request" and body["param"] == "input"
    _, body = check(env, "POST", "/lmsp/v1/tasks", "/lmsp/v1/tasks", 415, data="x", content_type="text/plain")
    assert body["code"] == "unsupported_media_type"
    _, body = check(env, "POST", "/lmsp/v1/tasks", "/lmsp/v1/tasks", 404, json={
        "type": "response", "input": {"model": "nope:1", "input": [{"type": "message", "role": "user", "content": "hi"}]}})
    assert body["code"] == "model_not_found"
    _, body = check(env, "POST", "/lmsp/v1/responses", "/lmsp/v1/responses", 400, json={"model": MODEL})
    assert body["code"] == "invalid_request"


def _sse(text: str) -> list[tuple[int | None, str, dict]]:
    out = []
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.split("\n") if line and not line.startswith(":"))
        if fields:
            out.append((int(fields["id"]) if "id" in fields else None, fields["event"], json.loads(fields["data"])))
    return out


def test_event_stream_matches_the_event_schemas(env):
    rid, tid = _rows(env, "succeeded", "completed", output=OUTPUT[:1], usage=USAGE)
    item = {"id": "msg_1", "type": "message", "role": "assistant", "content": []}
    name, final = events.final(rid, "completed", usage=USAGE)
    log = [(events.CREATED, events.created(rid)), (events.ITEM_ADDED, events.item_added(rid, 0, item)),
           (events.TEXT_DELTA, events.text_delta(rid, 0, "msg_1", "Hello")),
           (events.ITEM_DONE, events.item_done(rid, 0, OUTPUT[0])), (name, final)]
    with env["sessions"]() as session:
        eventlog.append(session, rid, [(i + 1, n, events.dumps(d)) for i, (n, d) in enumerate(log)])
        session.commit()
    path = f"/lmsp/v1/tasks/{tid}/events"
    template = "/lmsp/v1/tasks/{task_id}/events"
    _, text = check(env, "GET", template, path, 200)
    media = env["doc"]["paths"][template]["get"]["responses"]["200"]["content"]["text/event-stream"]
    received = _sse(text)
    assert [e[0] for e in received] == [1, 2, 3, 4, 5]
    for _, event_name, data in received:
        schema = media["x-lmsp-events"][event_name]
        jsonschema.Draft202012Validator(schema_of(env["doc"], schema)).validate(data)
    _, text = check(env, "GET", template, path + "?after=3", 200)
    assert [e[0] for e in _sse(text)] == [4, 5]
    _, body = check(env, "GET", template, path + "?after=-1", 400)
    assert body["param"] == "after"
    with env["sessions"]() as session:
        session.get(Task, tid).events_expired = True
        session.commit()
    _, body = check(env, "GET", template, path, 410)
    assert body["code"] == "event_history_expired"


def test_schemas_reject_wrong_answers(env):
    """The response schemas are strict enough to catch a wrong answer."""
    doc = env["doc"]

    def valid(name, value):
        return jsonschema.Draft202012Validator(schema_of(doc, {"$ref": f"#/components/schemas/{name}"})
                                               ).is_valid(value)

    assert not valid("Problem", {"title": "x", "status": 400})
    assert not valid("Task", {"id": "task_1", "object": "task"})
    assert not valid("Model", {"id": "m", "object": "model", "context_window": 1, "max_output_tokens": 1,
                               "capabilities": {}, "status": "ready", "workers": 1})
