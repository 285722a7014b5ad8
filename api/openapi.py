"""The OpenAPI 3.1 description of the whole api, served at ``GET /lmsp/v1/openapi.json``.

Only the paths and their prose are written here. Every schema is generated from
the pydantic models that validate requests (common/protocol.py) and serialize
answers (common/wire.py), so the document cannot drift from what the api does.
"""

import copy
from functools import lru_cache

from flask import Blueprint
from pydantic.json_schema import models_json_schema

from api.auth import require
from common import wire
from common.errors import CODES
from common.protocol import ResponseRequest, TaskRequest
from common.states import STATES
from common.tokens import RESERVED_SCOPES, SCOPES
from common.wire import API, VERSION

bp = Blueprint("openapi", __name__, url_prefix=API)

PROBLEM_JSON = "application/problem+json"
SSE = "text/event-stream"
REF = "#/components/schemas/{model}"


def ref(name: str, kind: str = "schemas") -> dict:
    return {"$ref": f"#/components/{kind}/{name}"}


# -- schemas ------------------------------------------------------------------------------------
REQUESTS = (ResponseRequest, TaskRequest)
ANSWERS = (wire.Problem, wire.Response, wire.Task, wire.TaskList, wire.StreamTicket, wire.Model, wire.ModelList, wire.WorkerList, wire.Discovery, wire.Health,
           wire.Readiness, wire.WebSocketFrame, *dict.fromkeys(wire.EVENTS.values()))


def _schemas() -> dict:
    """The JSON Schemas of every request (as validated) and answer (as serialized), one namespace."""
    _, doc = models_json_schema([(m, "validation") for m in REQUESTS] + [(m, "serialization") for m in ANSWERS],
                                by_alias=True, ref_template=REF)
    schemas = doc["$defs"]
    codes = ", ".join(f"`{code}` ({c.status})" for code, c in CODES.items())
    schemas["Problem"]["properties"]["code"]["description"] += f": {codes}."
    return schemas


def _sse(description: str) -> dict:
    return {"schema": {"type": "string", "description": description},
            "x-lmsp-events": {name: ref(model.__name__) for name, model in wire.EVENTS.items()},
            "example": 'id: 1\nevent: response.created\ndata: {"type":"response.created","sequence_number":1,'
                       '"response_id":"resp_...","status":"in_progress"}\n\n'}


# -- parameters, headers, responses -------------------------------------------------------------
_STATES = "|".join(STATES)
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
    "State": {"name": "state", "in": "query", "required": False,
              "description": "Only tasks in these states (comma-separated)",
              "schema": {"type": "string", "pattern": f"^({_STATES})?(,({_STATES})?)*$"}},
    "Limit": {"name": "limit", "in": "query", "required": False,
              "schema": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20}},
    "Cursor": {"name": "cursor", "in": "query", "required": False,
               "description": "The `next_cursor` of the previous page",
               "schema": {"type": "string", "pattern": "^(task_[0-9A-HJKMNP-TV-Z]{26})?$"}},
    "Ticket": {"name": "ticket", "in": "query", "required": False,
               "description": "A stream ticket (POST .../events/ticket) instead of the Authorization header",
               "schema": {"type": "string"}},
    "Wait": {"name": "wait", "in": "query", "required": False,
             "description": "Long poll: answer when the task differs from If-None-Match (or from the task as it "
                            "was) or after this many seconds (at most LMSP_MAX_TASK_WAIT_SECONDS)",
             "schema": {"type": "number", "minimum": 0}},
    "IfNoneMatch": {"name": "If-None-Match", "in": "header", "required": False,
                    "description": "The ETag of the task (or page of tasks) the client has: 304 while it "
                                   "still holds",
                    "schema": {"type": "string"}},
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
    "ETag": {"description": "Changes whenever the task (or the page of tasks) does", "schema": {"type": "string"}},
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
        groups[503] = (["overloaded"], ["The database is unavailable for now (every token is checked there)."])
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
            {"200": {"description": "OpenAPI 3.1", "headers": _headers(),
                     "content": {"application/json": {"schema": {"type": "object"}}}}, **errors()})},
        f"{API}/models": {"get": operation(
            "listModels", "List the served models with their live state", "models", "models:read",
            {"200": json_response("The models", "ModelList"), **errors()})},
        f"{API}/models/{{model_id}}": {"get": operation(
            "getModel", "One model", "models", "models:read",
            {"200": json_response("The model", "Model"), **errors((404, "model_not_found"))},
            params=["ModelId"])},
        f"{API}/workers": {"get": operation(
            "listWorkers", "The workers: state, running requests, tokens per second, models loaded (an "
            "extension of LMSP 1.0)", "models", "models:read",
            {"200": json_response("Per model and in total; each worker with scope admin", "WorkerList"),
             **errors()},
            description="Read from the workers' last heartbeats. Every token sees the figures per model "
                        "and in total; `data`, each worker by id, is there only for a token with scope "
                        "admin (worker ids name hosts).")},
        f"{API}/responses": {"post": operation(
            "createResponse", "Generate a response, synchronously or as a stream", "responses",
            "responses:write",
            {"200": {"description": "With `stream: false`: the finished response object (status completed, "
                                    "incomplete or cancelled; a failed generation answers its problem instead). With "
                                    "`stream: true`: server-sent events (6.3), ids 1, 2, ... from "
                                    "response.created to the one final event. A direct stream cannot be resumed.",
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
                        "request: the response object, or the problem it failed with; a finished stream's "
                        "replay is a stream again, its items each in one delta, ending with the same final "
                        "event. A request that ended without "
                        "an outcome (its client went away) frees its key.\n\n"
                        "The OpenAI SDK's spellings are accepted too, and stored as LMSP's: `input` as a string "
                        "(one user message), items as `{role, content}` without `type` (messages), "
                        "`instructions` (a system message before the input) and `text.format` (another "
                        "spelling of `response_format`, its json_schema with `name` and `schema` at the top; "
                        "giving both is a 400 with param `text`). `background: true` is refused: create a "
                        "task. Every event's data starts with `type` (its name) and `sequence_number` (its id).",
            params=["IdempotencyKey"], body="ResponseRequest")},
        f"{API}/responses/{{response_id}}": {"get": operation(
            "getResponse", "A response stored with store: true", "responses", "responses:read",
            {"200": json_response("The response", "Response"), **errors((404, "response_not_found"))},
            params=["ResponseId"])},
        "/": {"get": operation(
            "dashboard", "The web dashboard (it asks for a token)", "dashboard", None, {
                "200": {"description": "The dashboard page", "headers": _headers(),
                        "content": {"text/html": {"schema": {"type": "string"}}}}, **errors(auth=False)})},
        f"{API}/tasks/{{task_id}}/events/ticket": {"post": operation(
            "createStreamTicket", "A short-lived ticket to open the task's event stream without a header",
            "events", "tasks:read",
            {"200": json_response("The ticket", "StreamTicket"), **errors((404, "task_not_found"))},
            params=["TaskId"])},
        f"{API}/tasks": {"get": operation(
            "listTasks", "The principal's tasks, newest first, by cursor (an extension of LMSP 1.0)", "tasks",
            "tasks:read", {"200": json_response("A page of tasks", "TaskList", "ETag"),
                           "304": {"description": "The page still matches If-None-Match: no task on it came, "
                                                  "went or changed state", "headers": _headers("ETag")},
                           **errors((400, "invalid_request", "A bad state, limit or cursor"))},
            description="A client that polls the list sends the ETag it has as If-None-Match; an unchanged "
                        "page answers 304 without a body.",
            params=["State", "Limit", "Cursor", "IfNoneMatch"]), "post": operation(
            "createTask", "Create a durable task (persisted before the answer)", "tasks", "tasks:write",
            {"202": json_response("The task, queued; replayed in its current state for a repeated "
                                  "Idempotency-Key", "Task", "Location"),
             **errors(prepare_400 + ("unsupported_capability is also on_restart resume on a model "
                                     "without resume_snapshots",),
                      (404, "model_not_found", "response_not_found", "task_not_found",
                       "task_not_found: the task of a replayed Idempotency-Key no longer exists"),
                      *BODY_ERRORS, (422, "idempotency_key_reused"),
                      (429, "rate_limited", "Too many queued tasks for this principal"),
                      (503, "overloaded", "model_unavailable", "overloaded: the model's queue is full; "
                       "model_unavailable: the api cannot read the model's tokenizer"))},
            description="The key is recorded in the task's own transaction, so a task request is never "
                        "seen in flight (no 409).",
            params=["IdempotencyKey"], body="TaskRequest")},
        f"{API}/tasks/{{task_id}}": {"get": operation(
            "getTask", "A task (long poll with wait, conditional with If-None-Match)", "tasks", "tasks:read",
            {"200": json_response("The task", "Task", "ETag"),
             "304": {"description": "The task still matches If-None-Match", "headers": _headers("ETag")},
             **errors((400, "invalid_request", "`wait` is not a number of seconds >= 0"),
                      (404, "task_not_found"))},
            params=["TaskId", "Wait", "IfNoneMatch"])},
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
                                                "Fetch the final result with GET /lmsp/v1/tasks/{task_id}"))},
            params=["TaskId", "After", "LastEventId", "Ticket"])},
        f"{API}/tasks/{{task_id}}/ws": {"get": operation(
            "taskEventsWebSocket", "Follow a task's events over a WebSocket, resumable", "events",
            "tasks:read",
            {"101": {"description": "Switching protocols. One text frame per event (WebSocketFrame: "
                                    "`{\"id\":n,\"event\":name,\"data\":{...}}`); the server closes with "
                                    "1000 after the final event; 1008 when the token is revoked, 1012 when "
                                    "the server restarts, 1011 when the stream fails (reconnect with `after`).",
                     "headers": _headers(),
                     "x-lmsp-frame": ref("WebSocketFrame")},
             # Scope, task, capability, retention and `after` are checked before the handshake (events.py's
             # _ws_preflight), so they answer with a status, as on the SSE endpoint.
             **errors((400, "invalid_request", "unsupported_capability",
                       "Not a WebSocket handshake (param names the header), or a bad `after`"),
                      (404, "task_not_found"), (410, "event_history_expired"))},
            description="Same events and resumption (`after`, Last-Event-ID) as the SSE endpoint.",
            params=["TaskId", "After", "LastEventId"])},
    }


def build() -> dict:
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
        "tags": [{"name": n} for n in ("health", "discovery", "models", "responses", "tasks", "events", "dashboard")],
        "security": [{"bearer": []}],
        "paths": _paths(),
        "components": {
            "schemas": _schemas(),
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
