"""What each route says of itself, written next to it: the ``operation`` decorator.

A view's decorator names its OpenAPI operation (id, summary, tag), the scope a token needs (checked
here, so a scope is written once), its request model, its answers and the problems it can give.
api/openapi.py assembles the document from the app's registered routes; a route without an
operation is refused there. Parameters and headers are shared by name (``PARAMETERS``, ``HEADERS``).
"""

import re
from dataclasses import dataclass
from functools import wraps

from pydantic import BaseModel

from api.auth import check_scope
from api.problems import ALL_CODES
from common import events
from common.states import STATES
from common.wire import VERSION

PROBLEM_JSON = "application/problem+json"
SSE = "text/event-stream"


def path_template(rule: str) -> str:
    """A werkzeug rule as OpenAPI (and the spec) write a path: /tasks/<task_id> -> /tasks/{task_id}."""
    return re.sub(r"<(?:[^:<>]+:)?([^<>]+)>", r"{\1}", rule)


def ref(name: str, kind: str = "schemas") -> dict:
    return {"$ref": f"#/components/{kind}/{name}"}


# -- parameters and headers, referred to by name ------------------------------------------------
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
    "Stream": {"name": "stream", "in": "query", "required": False,
               "description": "true: the events of a background response (SSE) from its start, or after "
                              "`starting_after`; only background responses can be streamed again",
               "schema": {"type": "string", "enum": ["true", "false"]}},
    "StartingAfter": {"name": "starting_after", "in": "query", "required": False,
                      "description": "With stream=true: only events with a greater sequence number",
                      "schema": {"type": "integer", "minimum": 0, "maximum": 999999999999}},
    "ItemAfter": {"name": "after", "in": "query", "required": False,
                  "description": "The id of an input item: the page starts after it (in the order asked)",
                  "schema": {"type": "string"}},
    "Order": {"name": "order", "in": "query", "required": False,
              "schema": {"type": "string", "enum": ["asc", "desc"], "default": "desc"}},
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


def _headers(*extra: str) -> dict:
    out = {"LMSP-Version": ref("LMSPVersion", "headers")}
    for name in extra:
        out[name] = ref(name.replace("-", ""), "headers")
    return out


# -- answers ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Answer:
    """One documented answer: its OpenAPI response object and the models its schemas name."""
    doc: dict
    models: tuple[type, ...] = ()  # pydantic models, or event structs (common/events.py)


def json_answer(description: str, model: type[BaseModel], *headers: str, also: "Answer | None" = None) -> Answer:
    """``model`` as JSON; ``also``: another media type the same answer can take (an event stream)."""
    content, models = {"application/json": {"schema": ref(model.__name__)}}, (model,)
    if also is not None:
        content, models = {**content, **also.doc["content"]}, models + also.models
    return Answer({"description": description, "headers": _headers(*headers), "content": content}, models)


def media_answer(description: str, media: str, schema: dict | None = None) -> Answer:
    """An answer that is not a model: Prometheus text, an HTML page, the OpenAPI document itself."""
    return Answer({"description": description, "headers": _headers(),
                   "content": {media: {"schema": schema or {"type": "string"}}}})


def bare_answer(description: str, *headers: str, models: tuple = (), **extra) -> Answer:
    """An answer without a body (304), or one whose body is not HTTP's (the WebSocket's, in ``extra``)."""
    return Answer({"description": description, "headers": _headers(*headers), **extra}, models)


# Each event's data by its struct (common/events.py): an event stream's, a WebSocket's frames'.
EVENTS = {"x-lmsp-events": {name: ref(kind.__name__) for name, kind in events.KINDS.items()}}
EVENT_KINDS = tuple(dict.fromkeys(events.KINDS.values()))


def sse_answer(description: str, media: str) -> Answer:
    """An event stream (``text/event-stream``): each event's data by its struct (``x-lmsp-events``)."""
    return Answer({"description": description, "headers": _headers(), "content": {SSE: {
        "schema": {"type": "string", "description": media}, **EVENTS,
        "example": 'id: 1\nevent: response.created\ndata: {"type":"response.created","sequence_number":1,'
                   '"response_id":"resp_...","status":"in_progress"}\n\n'}}}, EVENT_KINDS)


# -- problems -----------------------------------------------------------------------------------
TITLES = {400: "Bad request", 401: "Unauthorized", 403: "Forbidden", 404: "Not found", 405: "Method not allowed",
          409: "Conflict", 410: "Gone", 413: "Payload too large", 415: "Unsupported media type",
          422: "Unprocessable content", 414: "URI too long", 429: "Too many requests",
          431: "Request header fields too large", 500: "Server error", 503: "Service unavailable"}
RETRY = {429, 503}
PREPARE_ERRORS = (400, "invalid_request", "unsupported_capability", "context_length_exceeded")  # validation.prepare
BODY_ERRORS = ((413, "payload_too_large", "Body larger than the limit (default 1 MiB)"),
               (415, "unsupported_media_type", "Send Content-Type: application/json"))


def problem_answer(status: int, *codes: str, note: str = "") -> dict:
    for code in codes:
        if ALL_CODES[code].status != status:
            raise RuntimeError(f"{code} is a {ALL_CODES[code].status}, not a {status}")
    headers = []
    if status in RETRY or "idempotency_key_in_use" in codes:
        headers.append("Retry-After")
    if status in (401, 403):
        headers.append("WWW-Authenticate")
    named = ", ".join(f"`{c}`" for c in codes)
    text = TITLES[status] + (f": {named}." if named else ".") + (f" {note}" if note else "")
    return {"description": text, "headers": _headers(*headers),
            "content": {PROBLEM_JSON: {"schema": ref("Problem")}}}


def problems(extra: tuple = (), auth: bool = True) -> dict:
    """The problems an operation can give: those of every route plus ``extra``.

    Each of ``extra`` is (status, code or note, ...); a string that is not an error code is a note.
    """
    groups: dict[int, tuple[list, list]] = {
        400: (["unsupported_version"], []),
        # HTTP's own refusals, answered by gunicorn before any route (api/serve.py): RFC 9112 3 says a
        # request-target too long to parse MUST be a 414.
        414: (["uri_too_long"], ["The request line is longer than 4094 bytes: send fewer or shorter query "
                                 "parameters."]),
        431: (["request_header_fields_too_large"], ["A header is longer than 8190 bytes, or there are more "
                                                    "than 100."]),
    }
    if auth:
        groups[401] = (["unauthorized"], ["Missing, unknown or revoked token."])
        groups[403] = (["insufficient_scope"], ["The token lacks the operation's scope."])
        groups[429] = (["rate_limited"], ["Too many requests for this principal, or too many bad tokens "
                                          "from this address."])
        groups[503] = (["overloaded"], ["The database is unavailable for now (every token is checked there)."])
    for status, *items in extra:
        codes, notes = groups.setdefault(status, ([], []))
        for item in items:
            (codes if item in ALL_CODES else notes).append(item)
    groups.setdefault(500, (["server_error"], []))
    return {str(status): problem_answer(status, *dict.fromkeys(codes), note=" ".join(notes))
            for status, (codes, notes) in sorted(groups.items())}


# -- the operation ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Operation:
    op_id: str
    summary: str
    tag: str
    scope: str | None  # None: a public route, no token asked
    answers: dict[int, Answer]
    errors: tuple = ()
    description: str | None = None
    params: tuple[str, ...] = ()
    body: type[BaseModel] | None = None

    def document(self) -> dict:
        out: dict = {"operationId": self.op_id, "summary": self.summary, "tags": [self.tag]}
        if self.description:
            out["description"] = self.description
        out["parameters"] = [ref(p, "parameters") for p in self.params] + [ref("LMSPVersion", "parameters")]
        if self.body is not None:
            out["requestBody"] = {"required": True,
                                  "content": {"application/json": {"schema": ref(self.body.__name__)}}}
        out["responses"] = {**{str(status): answer.doc for status, answer in self.answers.items()},
                            **problems(self.errors, auth=self.scope is not None)}
        # OpenAPI 3.1 lets a non-OAuth requirement name roles: here, the scope the token needs (spec 10.3).
        out["security"] = [] if self.scope is None else [{"bearer": [self.scope]}]
        if self.scope is not None:
            out["x-lmsp-scope"] = self.scope
        return out

    def answer_models(self) -> tuple[type[BaseModel], ...]:
        return tuple(m for answer in self.answers.values() for m in answer.models)


def operation(op_id: str, summary: str, *, tag: str, scope: str | None, answers: dict[int, Answer],
              errors: tuple = (), description: str | None = None, params: tuple[str, ...] = (),
              body: type[BaseModel] | None = None):
    """Describe a view for the OpenAPI document and ask its token for ``scope`` (None: public)."""
    described = Operation(op_id, summary, tag, scope, answers, tuple(errors), description, tuple(params), body)

    def decorate(view):
        if scope is None:
            wrapper = view
        else:
            @wraps(view)
            def wrapper(*args, **kwargs):
                check_scope(scope)
                return view(*args, **kwargs)
        wrapper.operation = described
        return wrapper
    return decorate

