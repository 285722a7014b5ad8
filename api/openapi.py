"""The OpenAPI 3.1 description of the whole api, built in code, served at ``GET /lmsp/v1/openapi.json``.

Request bodies come from the pydantic models that validate them (common/protocol.py),
so the document cannot drift from what the api accepts; response schemas follow
common/resources.py, api/services/models.py, api/views/* and common/errors.py.
tests/test_openapi.py checks that every url rule is documented and that real
answers match their schemas.
"""

import copy
from functools import lru_cache

from flask import Blueprint

from api.auth import require
from api.problems import VERSION
from common.errors import CODES
from common.protocol import ResponseRequest, TaskRequest
from common.states import STATES
from common.tokens import RESERVED_SCOPES, SCOPES

bp = Blueprint("openapi", __name__, url_prefix="/lmsp/v1")

API = "/lmsp/v1"
PROBLEM_JSON = "application/problem+json"
SSE = "text/event-stream"
REF = "#/components/schemas/{model}"


def ref(name: str, kind: str = "schemas") -> dict:
    return {"$ref": f"#/components/{kind}/{name}"}


def nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def obj(properties: dict, required: list[str] | None = None, *, description: str | None = None,
        extra: bool = True) -> dict:
    out: dict = {"type": "object", "properties": properties,
                 "required": list(properties) if required is None else required}
    if not extra:
        out["additionalProperties"] = False
    if description:
        out["description"] = description
    return out


# -- schemas ------------------------------------------------------------------------------------
def _request_schemas() -> dict:
    """The pydantic request models, with their ``$defs`` hoisted into components/schemas."""
    out: dict = {}
    for model in (ResponseRequest, TaskRequest):
        schema = model.model_json_schema(by_alias=True, ref_template=REF)
        for name, sub in {**schema.pop("$defs", {}), model.__name__: schema}.items():
            if name in out and out[name] != sub:
                raise RuntimeError(f"two different request schemas are named {name}")
            out[name] = sub
    _require_discriminators(out)
    return out


def _require_discriminators(schemas: dict) -> None:
    """pydantic's discriminated unions need the tag even where the model has a default for it
    (MessageItem.type): mark it required, as the api enforces and OpenAPI asks of a discriminator."""

    def walk(node):
        if isinstance(node, dict):
            disc = node.get("discriminator")
            if isinstance(disc, dict) and "mapping" in disc:
                for target in disc["mapping"].values():
                    schema = schemas[target.rsplit("/", 1)[-1]]
                    if disc["propertyName"] not in schema.setdefault("required", []):
                        schema["required"].insert(0, disc["propertyName"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(list(schemas.values()))


def _problem() -> dict:
    codes = ", ".join(f"`{code}` ({c.status})" for code, c in CODES.items())
    return obj({
        "type": {"type": "string", "format": "uri-reference",
                 "description": "`/lmsp/v1/errors#<code>`; `about:blank` for an HTTP error without an LMSP code",
                 "examples": ["/lmsp/v1/errors#task_not_found"]},
        "title": {"type": "string", "examples": ["Task not found"]},
        "status": {"type": "integer", "minimum": 100, "maximum": 599},
        "code": {"type": "string", "description": f"Machine-readable error code: {codes}.",
                 "examples": ["task_not_found"]},
        "detail": {"type": "string"},
        "instance": {"type": "string", "description": "The request path; absent in problems stored "
                                                      "inside failed responses and tasks"},
        "param": {"type": "string", "description": "The offending field or parameter (invalid_request, "
                                                   "unsupported_capability, ...)"},
        "scope": {"type": "string", "description": "The missing scope (insufficient_scope)"},
    }, ["type", "title", "status", "code", "detail"],
        description="An RFC 9457 problem document (spec 9.3). Other members may appear.")


def _response_schemas() -> dict:
    status = {"type": "string", "enum": ["in_progress", "completed", "incomplete", "failed", "cancelled"]}
    caps = ["streaming", "tools", "structured_output", "reasoning", "conversations", "event_resume",
            "resume_snapshots"]
    unix = {"type": "integer", "description": "Unix seconds"}
    return {
        "Problem": _problem(),
        "Usage": obj({"input_tokens": {"type": "integer", "minimum": 0},
                      "output_tokens": {"type": "integer", "minimum": 0},
                      "total_tokens": {"type": "integer", "minimum": 0}}),
        "IncompleteDetails": obj({"reason": {"type": "string", "examples": ["max_output_tokens"]}}),
        "OutputTextPart": obj({"type": {"const": "output_text"}, "text": {"type": "string"}}),
        "OutputMessage": obj({
            "id": {"type": "string", "examples": ["msg_01J8M6Q4W5C8H2K9P3S7Y1A6ZE"]},
            "type": {"const": "message"},
            "role": {"const": "assistant"},
            "content": {"type": "array", "items": ref("OutputTextPart")}}),
        "OutputFunctionCall": obj({
            "id": {"type": "string"},
            "type": {"const": "function_call"},
            "call_id": {"type": "string"},
            "name": {"type": "string"},
            "arguments": {"type": "string", "description": "JSON-encoded arguments"}}),
        "OutputReasoning": obj({
            "id": {"type": "string"},
            "type": {"const": "reasoning"},
            "summary": {"type": "array", "items": ref("SummaryPart")}}),
        "OutputItem": {
            "oneOf": [ref("OutputMessage"), ref("OutputFunctionCall"), ref("OutputReasoning")],
            "discriminator": {"propertyName": "type", "mapping": {
                "message": REF.format(model="OutputMessage"),
                "function_call": REF.format(model="OutputFunctionCall"),
                "reasoning": REF.format(model="OutputReasoning")}}},
        "Response": obj({
            "id": {"type": "string", "examples": ["resp_01J8M6Q4W2T7N5R3V9X1Z8B0DF"]},
            "object": {"const": "response"},
            "created_at": unix,
            "status": status,
            "model": {"type": "string"},
            "output": {"type": "array", "items": ref("OutputItem")},
            "usage": {**nullable(ref("Usage")), "description": "null until the response has finished, "
                                                                "and for one cancelled before it started"},
            "error": {**nullable(ref("Problem")), "description": "A problem when status is failed"},
            "incomplete_details": {**nullable(ref("IncompleteDetails")),
                                   "description": "An object when status is incomplete"},
            "previous_response_id": nullable({"type": "string"}),
        }, description="The response object (spec 6.2)."),
        "Task": obj({
            "id": {"type": "string", "examples": ["task_01J8M8R5X3V7B2N4Q9T1W6Y0ZC"]},
            "object": {"const": "task"},
            "type": {"const": "response"},
            "status": {"type": "string", "enum": list(STATES)},
            "created_at": unix,
            "updated_at": unix,
            "response_id": {"type": "string"},
            "events_url": {"type": "string", "examples": [f"{API}/tasks/task_01J8M8R5X3V7B2N4Q9T1W6Y0ZC/events"],
                           "description": "Absent when the task's model lacks capability event_resume"},
            "on_restart": {"type": "string", "enum": ["fail", "retry", "resume"]},
            "response": {**nullable(ref("Response")), "description": "The response once status is succeeded"},
            "error": {**nullable(ref("Problem")), "description": "A problem when status is failed"},
        }, required=["id", "object", "type", "status", "created_at", "updated_at", "response_id", "on_restart",
               "response", "error"], description="The task object (spec 7.1)."),
        "Capabilities": obj({c: {"type": "boolean"} for c in caps}),
        "Model": obj({
            "id": {"type": "string", "examples": ["qwen3:14b-q4_k_m"]},
            "object": {"const": "model"},
            "context_window": {"type": "integer", "minimum": 1},
            "max_output_tokens": {"type": "integer", "minimum": 1},
            "capabilities": ref("Capabilities"),
            "status": {"type": "string", "enum": ["ready", "unavailable"],
                       "description": "ready when at least one live worker serves the model"},
            "workers": {"type": "integer", "minimum": 0},
        }, description="A model (spec 8)."),
        "ModelList": obj({"object": {"const": "list"}, "data": {"type": "array", "items": ref("Model")}}),
        "Discovery": obj({
            "object": {"const": "service"},
            "version": {"type": "string", "examples": [VERSION]},
            "protocol": {"const": "LMSP"},
            "capabilities": {"type": "object", "additionalProperties": {"type": "boolean"}},
            "paths": {"type": "object", "additionalProperties": {"type": "string"}},
            "models": {"type": "array", "items": {"type": "string"}},
        }, description="Service discovery (spec 11.1)."),
        "Health": obj({"status": {"const": "ok"}}),
        "Readiness": obj({
            "status": {"type": "string", "enum": ["ready", "not_ready"]},
            "checks": obj({"database": {"type": "string"}, "broker": {"type": "string"}},
                          description="`ok` or `error: <ExceptionName>` per dependency"),
        }),
        "OpenAPIDocument": {"type": "object", "description": "This OpenAPI 3.1 document"},
        # Event payloads (spec 6.3): the JSON in an SSE `data:` line or a WebSocket frame's `data`.
        "ResponseCreatedData": obj({"response_id": {"type": "string"}, "status": {"const": "in_progress"}}),
        "OutputItemData": obj({"response_id": {"type": "string"}, "output_index": {"type": "integer"},
                               "item": ref("OutputItem")}),
        "TextDeltaData": obj({"response_id": {"type": "string"}, "output_index": {"type": "integer"},
                              "item_id": {"type": "string"}, "delta": {"type": "string"}}),
        "CompletedData": obj({"response_id": {"type": "string"}, "status": {"const": "completed"},
                              "usage": ref("Usage")}),
        "IncompleteData": obj({"response_id": {"type": "string"}, "status": {"const": "incomplete"},
                               "incomplete_details": ref("IncompleteDetails"), "usage": ref("Usage")}),
        "FailedData": obj({"response_id": {"type": "string"}, "status": {"const": "failed"},
                           "error": ref("Problem")}),
        "CancelledData": obj({"response_id": {"type": "string"}, "status": {"const": "cancelled"}}),
        "ErrorData": obj({"error": ref("Problem")}),
        "WebSocketFrame": obj({
            "id": {"type": "integer", "minimum": 1}, "event": {"type": "string"},
            "data": {"type": "object"}}, description="One text frame per event"),
    }


EVENTS = {
    "response.created": "ResponseCreatedData",
    "response.output_item.added": "OutputItemData",
    "response.output_text.delta": "TextDeltaData",
    "response.reasoning_summary_text.delta": "TextDeltaData",
    "response.output_item.done": "OutputItemData",
    "response.completed": "CompletedData",
    "response.incomplete": "IncompleteData",
    "response.failed": "FailedData",
    "response.cancelled": "CancelledData",
    "error": "ErrorData",
}


def _sse(description: str) -> dict:
    return {"schema": {"type": "string", "description": description},
            "x-lmsp-events": {name: ref(schema) for name, schema in EVENTS.items()},
            "example": 'id: 1\nevent: response.created\ndata: {"response_id":"resp_...","status":"in_progress"}\n\n'}


# -- parameters, headers, responses -------------------------------------------------------------
PARAMETERS = {
    "LMSPVersion": {"name": "LMSP-Version", "in": "header", "required": False,
                    "description": "Protocol version the client speaks; another major version answers "
                                   "400 unsupported_version (spec 9.1)",
                    "schema": {"type": "string", "pattern": r"^1(\.[0-9]+)?$", "examples": [VERSION]}},
    "IdempotencyKey": {"name": "Idempotency-Key", "in": "header", "required": False,
                       "description": "Scoped to principal + method + path; the same key with the same body "
                                      "returns the original outcome, with another body 422 (spec 9.2)",
                       "schema": {"type": "string", "pattern": "^[!-~]{1,255}$"}},
    "ModelId": {"name": "model_id", "in": "path", "required": True,
                "description": "Model id; may contain `:` and `/` (clients percent-encode it)",
                "schema": {"type": "string"}},
    "ResponseId": {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}},
    "TaskId": {"name": "task_id", "in": "path", "required": True, "schema": {"type": "string"}},
    "After": {"name": "after", "in": "query", "required": False,
              "description": "Replay only events with a greater id; wins over Last-Event-ID (spec 6.4)",
              "schema": {"type": "integer", "minimum": 0, "maximum": 999999999999}},
    "LastEventId": {"name": "Last-Event-ID", "in": "header", "required": False,
                    "description": "The last event id received; used when `after` is absent",
                    "schema": {"type": "string", "pattern": "^[0-9]{0,12}$"}},
}

HEADERS = {
    "LMSPVersion": {"description": "Every answer carries the protocol version", "required": True,
                    "schema": {"type": "string", "const": VERSION}},
    "RetryAfter": {"description": "Seconds to wait before retrying", "schema": {"type": "integer", "minimum": 0}},
    "WWWAuthenticate": {"description": "Bearer challenge", "schema": {"type": "string"}},
    "Location": {"description": "Path of the created task", "schema": {"type": "string"}},
}

TITLES = {400: "Bad request", 401: "Unauthorized", 403: "Forbidden", 404: "Not found", 409: "Conflict",
          410: "Gone", 413: "Payload too large", 415: "Unsupported media type", 422: "Unprocessable content",
          429: "Too many requests", 500: "Server error", 503: "Service unavailable"}
RETRY = {429, 503}


def _headers(*extra: str) -> dict:
    out = {"LMSP-Version": ref("LMSPVersion", "headers")}
    for name in extra:
        out[name] = ref(name.replace("-", ""), "headers")
    return out


def problem_response(status: int, *codes: str, note: str = "") -> dict:
    for code in codes:
        if CODES[code].status != status:
            raise RuntimeError(f"{code} is a {CODES[code].status}, not a {status}")
    headers = []
    if status in RETRY or "idempotency_key_in_use" in codes:
        headers.append("Retry-After")
    if status in (401, 403):
        headers.append("WWW-Authenticate")
    text = f"{TITLES[status]}: " + ", ".join(f"`{c}`" for c in codes) + (f". {note}" if note else ".")
    return {"description": text, "headers": _headers(*headers),
            "content": {PROBLEM_JSON: {"schema": ref("Problem")}}}


def json_response(description: str, schema: str, *headers: str) -> dict:
    return {"description": description, "headers": _headers(*headers),
            "content": {"application/json": {"schema": ref(schema)}}}


def errors(*extra: tuple, auth: bool = True) -> dict:
    """The problems an operation can give: those of every route plus ``extra``.

    Each of ``extra`` is (status, code or note, ...); a string that is not an error code is a note.
    """
    groups: dict[int, tuple[list, list]] = {400: (["unsupported_version"], [])}
    if auth:
        groups[401] = (["unauthorized"], ["Missing, unknown or revoked token."])
        groups[403] = (["insufficient_scope"], ["The token lacks the operation's scope."])
        groups[429] = (["rate_limited"], ["Too many requests for this principal, or too many bad tokens "
                                          "from this address."])
    for status, *items in extra:
        codes, notes = groups.setdefault(status, ([], []))
        for item in items:
            (codes if item in CODES else notes).append(item)
    groups.setdefault(500, (["server_error"], []))
    return {str(status): problem_response(status, *dict.fromkeys(codes), note=" ".join(notes))
            for status, (codes, notes) in sorted(groups.items())}


# -- operations ---------------------------------------------------------------------------------
def operation(op_id: str, summary: str, tag: str, scope: str | None, responses: dict, *,
              description: str | None = None, params: list[str] = (), body: str | None = None) -> dict:
    out: dict = {"operationId": op_id, "summary": summary, "tags": [tag]}
    if description:
        out["description"] = description
    out["parameters"] = [ref(p, "parameters") for p in params] + [ref("LMSPVersion", "parameters")]
    if body:
        out["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref(body)}}}
    out["responses"] = responses
    # OpenAPI 3.1 lets a non-OAuth requirement name roles: here, the scope the token needs (spec 10.3).
    out["security"] = [] if scope is None else [{"bearer": [scope]}]
    if scope is not None:
        out["x-lmsp-scope"] = scope
    return out


BODY_ERRORS = ((413, "payload_too_large", "Body larger than the limit (default 1 MiB)"),
               (415, "unsupported_media_type", "Send Content-Type: application/json"))


def _paths() -> dict:
    prepare_400 = (400, "invalid_request", "unsupported_capability", "context_length_exceeded")
    return {
        "/healthz": {"get": operation(
            "healthz", "Liveness probe", "health", None,
            {"200": json_response("The process is alive", "Health"), **errors(auth=False)})},
        "/readyz": {"get": operation(
            "readyz", "Readiness probe: database and broker reachable", "health", None,
            {"200": json_response("Ready", "Readiness"),
             **errors((503, "overloaded", "Not ready: `checks` says which dependency failed."), auth=False)})},
        "/metrics": {"get": operation(
            "metrics", "Prometheus metrics of all tenants: tasks by state, queues, workers", "health", "admin",
            {"200": {"description": "Prometheus text exposition format", "headers": _headers(),
                     "content": {"text/plain": {"schema": {"type": "string"}}}}, **errors()})},
        API: {"get": operation(
            "discovery", "Service discovery: version, capabilities, base paths, model ids", "discovery",
            "models:read", {"200": json_response("The service", "Discovery"), **errors()})},
        f"{API}/openapi.json": {"get": operation(
            "openapi", "This OpenAPI document", "discovery", "models:read",
            {"200": json_response("OpenAPI 3.1", "OpenAPIDocument"), **errors()})},
        f"{API}/models": {"get": operation(
            "listModels", "List the served models with their live state", "models", "models:read",
            {"200": json_response("The models", "ModelList"), **errors()})},
        f"{API}/models/{{model_id}}": {"get": operation(
            "getModel", "One model", "models", "models:read",
            {"200": json_response("The model", "Model"), **errors((404, "model_not_found"))},
            params=["ModelId"])},
        f"{API}/responses": {"post": operation(
            "createResponse", "Generate a response, synchronously or as a stream", "responses",
            "responses:write",
            {"200": {"description": "With `stream: false`: the finished response object (status completed, "
                                    "incomplete or cancelled). With `stream: true`: server-sent events (6.3); "
                                    "the final event has no id when it was recovered from the database. "
                                    "A direct stream cannot be resumed.",
                     "headers": _headers(),
                     "content": {"application/json": {"schema": ref("Response")},
                                 SSE: _sse("Server-sent events: `id:`, `event:` and a JSON `data:` line "
                                           "per event; `: keep-alive` comments in between")}},
             **errors(prepare_400,
                      (404, "model_not_found", "response_not_found",
                       "response_not_found names previous_response_id"),
                      (409, "idempotency_key_in_use"), *BODY_ERRORS, (422, "idempotency_key_reused"),
                      (500, "server_error", "generation_failed", "server_restarted",
                       "A synchronous request whose generation failed answers the response's problem"),
                      (429, "rate_limited", "Too many open streams (or requests waiting for a model) "
                       "for this principal or this server"),
                      (503, "model_unavailable", "No live worker serves the model"))},
            description="An Idempotency-Key replays the stored outcome (status and body) of a finished "
                        "synchronous request.",
            params=["IdempotencyKey"], body="ResponseRequest")},
        f"{API}/responses/{{response_id}}": {"get": operation(
            "getResponse", "A response stored with store: true", "responses", "responses:read",
            {"200": json_response("The response", "Response"), **errors((404, "response_not_found"))},
            params=["ResponseId"])},
        f"{API}/tasks": {"post": operation(
            "createTask", "Create a durable task (persisted before the answer)", "tasks", "tasks:write",
            {"202": json_response("The task, queued; replayed in its current state for a repeated "
                                  "Idempotency-Key", "Task", "Location"),
             **errors(prepare_400 + ("unsupported_capability is also on_restart resume on a model "
                                     "without resume_snapshots",),
                      (404, "model_not_found", "response_not_found", "task_not_found",
                       "task_not_found: the task of a replayed Idempotency-Key no longer exists"),
                      *BODY_ERRORS, (422, "idempotency_key_reused"),
                      (429, "rate_limited", "Too many queued tasks for this principal"),
                      (503, "overloaded", "The model's queue is full"))},
            description="The key is recorded in the task's own transaction, so a task request is never "
                        "seen in flight (no 409).",
            params=["IdempotencyKey"], body="TaskRequest")},
        f"{API}/tasks/{{task_id}}": {"get": operation(
            "getTask", "A task", "tasks", "tasks:read",
            {"200": json_response("The task", "Task"), **errors((404, "task_not_found"))},
            params=["TaskId"])},
        f"{API}/tasks/{{task_id}}/cancel": {"post": operation(
            "cancelTask", "Cancel a task (idempotent)", "tasks", "tasks:cancel",
            {"200": json_response("The task in its current state: cancelled, or cancelling until the "
                                  "backend stops", "Task"),
             **errors((404, "task_not_found"), (409, "task_not_cancelable", "The task already succeeded "
                                                                          "or failed"))},
            params=["TaskId"])},
        f"{API}/tasks/{{task_id}}/events": {"get": operation(
            "taskEvents", "Follow a task's events (SSE), resumable", "events", "tasks:read",
            {"200": {"description": "The missed events, then live ones; closed after the final event",
                     "headers": _headers(),
                     "content": {SSE: _sse("Server-sent events, each with an integer `id` (1, 2, ...), "
                                           "an `event` name and a JSON `data` line")}},
             **errors((400, "invalid_request", "unsupported_capability",
                       "`after` or Last-Event-ID is not a non-negative integer; unsupported_capability: "
                       "the task's model lacks event_resume"),
                      (404, "task_not_found"), (410, "event_history_expired",
                                                "Fetch the final result with GET /lmsp/v1/tasks/{task_id}"),
                      (429, "rate_limited", "Too many open streams for this principal or this server"))},
            params=["TaskId", "After", "LastEventId"])},
        f"{API}/tasks/{{task_id}}/ws": {"get": operation(
            "taskEventsWebSocket", "Follow a task's events over a WebSocket, resumable", "events",
            "tasks:read",
            {"101": {"description": "Switching protocols. One text frame per event (WebSocketFrame: "
                                    "`{\"id\":n,\"event\":name,\"data\":{...}}`); the server closes with "
                                    "1000 after the final event. Problems found after the handshake "
                                    "(missing scope, unknown task, expired history, bad `after`) end the "
                                    "connection instead of answering with a status.",
                     "headers": _headers(),
                     "x-lmsp-frame": ref("WebSocketFrame")},
             # flask-sock runs the view (and so the scope check) after the handshake: no 403 status.
             **{k: v for k, v in errors((400, "invalid_request", "Not a WebSocket handshake")).items()
                if k != "403"}},
            description="Same events and resumption (`after`, Last-Event-ID) as the SSE endpoint.",
            params=["TaskId", "After", "LastEventId"])},
    }


def build() -> dict:
    schemas = _request_schemas()
    for name, schema in _response_schemas().items():
        if name in schemas:
            raise RuntimeError(f"response schema {name} clashes with a request schema")
        schemas[name] = schema
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "LMSP task service",
            "version": VERSION,
            "summary": "LMSP 1.0: language-model responses and durable tasks on GPU workers",
            "description": "Every error is a problem document (application/problem+json). Every answer "
                           "carries `LMSP-Version`. All routes but the health probes need "
                           "`Authorization: Bearer <token>`; an operation's `security` names the scope "
                           f"it needs. Scopes: {', '.join(SCOPES)} ({', '.join(RESERVED_SCOPES)} is reserved). "
                           "A method a path does not allow answers 405 `method_not_allowed`.",
            "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"},
        },
        "tags": [{"name": n} for n in ("health", "discovery", "models", "responses", "tasks", "events")],
        "security": [{"bearer": []}],
        "paths": _paths(),
        "components": {
            "schemas": schemas,
            "parameters": PARAMETERS,
            "headers": HEADERS,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "`lmsp tokens create` makes a token"}},
        },
    }


@lru_cache(maxsize=1)
def _cached() -> dict:
    return build()


def document() -> dict:
    return copy.deepcopy(_cached())


@bp.get("/openapi.json")
@require("models:read")
def openapi_json():
    return _cached()
