"""Reading a JSON request body within the limits of spec 10."""

import json

from flask import request

from api.extensions import services
from common.errors import LMSPError


def _depth(value, limit: int, level: int = 1) -> None:
    if level > limit:
        raise LMSPError("invalid_request", f"JSON is nested deeper than {limit} levels")
    if isinstance(value, dict):
        for v in value.values():
            _depth(v, limit, level + 1)
    elif isinstance(value, list):
        for v in value:
            _depth(v, limit, level + 1)


def _sizes(value, settings) -> None:
    if isinstance(value, str):
        if len(value) > settings.max_string_chars:
            raise LMSPError("invalid_request", f"A string is longer than {settings.max_string_chars} characters")
    elif isinstance(value, dict):
        for v in value.values():
            _sizes(v, settings)
    elif isinstance(value, list):
        for v in value:
            _sizes(v, settings)


def json_body():
    settings = services().settings
    mimetype = request.mimetype or ""
    if mimetype != "application/json" and not mimetype.endswith("+json"):
        raise LMSPError("unsupported_media_type", "Send the body as JSON with Content-Type: application/json")
    raw = request.get_data(cache=True)  # werkzeug enforces MAX_CONTENT_LENGTH -> 413
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise LMSPError("invalid_request", "The body is not valid UTF-8") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:
        raise LMSPError("invalid_request", f"The body is not valid JSON: {exc}") from None
    except RecursionError:
        raise LMSPError("invalid_request", "JSON is nested too deeply") from None
    if not isinstance(body, dict):
        raise LMSPError("invalid_request", "The body must be a JSON object")
    _depth(body, settings.max_json_depth)
    _sizes(body, settings)
    inner = body["input"] if isinstance(body.get("input"), dict) else body  # a task wraps the request
    items, tools = inner.get("input"), inner.get("tools")
    if isinstance(items, list) and len(items) > settings.max_input_items:
        raise LMSPError("invalid_request", f"At most {settings.max_input_items} input items", param="input")
    if isinstance(tools, list) and len(tools) > settings.max_tools:
        raise LMSPError("invalid_request", f"At most {settings.max_tools} tools", param="tools")
    return body


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")
