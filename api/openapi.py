"""The OpenAPI 3.1 description of the whole api, served at ``GET /lmsp/v1/openapi.json``.

Assembled from the app's registered routes: each view carries its operation (api/operations.py,
written next to the route). Every schema is generated from the pydantic models those operations
name, the requests as validated (common/protocol.py) and the answers as serialized (common/wire.py),
so the document cannot drift from what the api does.
"""

from flask import Blueprint, Flask, current_app
from pydantic.json_schema import models_json_schema

from api.operations import HEADERS, PARAMETERS, Operation, media_answer, operation, path_template
from api.problems import ALL_CODES
from common import events, wire
from common.tokens import RESERVED_SCOPES, SCOPES
from common.wire import API, VERSION

bp = Blueprint("openapi", __name__, url_prefix=API)

REF = "#/components/schemas/{model}"
_CACHE = "lmsp.openapi"


def operations(app: Flask) -> list[tuple[str, str, Operation]]:
    """(path template, method, operation) of every route but the static files; a route that does
    not describe itself is a bug, refused here (and so by the document's tests)."""
    out = []
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        described = getattr(app.view_functions[rule.endpoint], "operation", None)
        if described is None:
            raise RuntimeError(f"route {rule.rule} ({rule.endpoint}) has no @operation (api/operations.py)")
        out += [(path_template(rule.rule), method.lower(), described)
                for method in sorted(rule.methods - {"HEAD", "OPTIONS"})]
    return out


def _schemas(described: list[Operation]) -> dict:
    """The JSON Schemas of every request (as validated) and answer (as serialized), one namespace."""
    requests = dict.fromkeys(op.body for op in described if op.body is not None)
    answers = dict.fromkeys((wire.Problem, *(m for op in described for m in op.answer_models())))
    kinds = [m for m in answers if issubclass(m, events.EventData)]  # msgspec structs: their own schemas
    event_schemas, nested = events.schemas(REF) if kinds else ({}, [])
    answers = dict.fromkeys([*(m for m in answers if m not in kinds), *nested])
    _, doc = models_json_schema([(m, "validation") for m in requests] + [(m, "serialization") for m in answers],
                                by_alias=True, ref_template=REF)
    schemas = {**doc["$defs"], **event_schemas}
    codes = ", ".join(f"`{code}` ({c.status})" for code, c in ALL_CODES.items())
    schemas["Problem"]["properties"]["code"]["description"] += f": {codes}."
    return schemas


def build(app: Flask) -> dict:
    routes = operations(app)
    paths: dict[str, dict] = {}
    for template, method, described in routes:
        paths.setdefault(template, {})[method] = described.document()
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
        "paths": paths,
        "components": {
            "schemas": _schemas([op for _, _, op in routes]),
            "parameters": PARAMETERS,
            "headers": HEADERS,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "`lmsp tokens create` makes a token"}},
        },
    }


def _cached() -> dict:
    app = current_app._get_current_object()
    if _CACHE not in app.extensions:
        app.extensions[_CACHE] = build(app)
    return app.extensions[_CACHE]


@bp.get("/openapi.json")
@operation("openapi", "This OpenAPI document", tag="discovery", scope="models:read",
           answers={200: media_answer("OpenAPI 3.1", "application/json", {"type": "object"})})
def openapi_json():
    return _cached()
