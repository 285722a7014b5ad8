"""Reading a JSON request body within the limits of spec 10.

Every string (keys too) is checked once here, with ``param`` naming where it is: no NUL (Postgres
JSONB refuses it) and no lone surrogate (it cannot be encoded, so hashing or tokenizing it fails).
"""

import json
import math
from typing import NoReturn

from flask import current_app, request
from gunicorn.http.errors import ParseException

from api.extensions import services
from common.errors import LMSPError


def param_of(path: tuple) -> str:
    """("input", 0, "content") -> "input[0].content", the form ``param`` uses everywhere."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else ("." if out else "") + str(part)
    return out


class _Object(dict):
    """A JSON object as parsed, remembering a key it held twice: which value would win is a parser's
    whim (RFC 8259 4), and two requests that differ there must not hash alike for Idempotency-Key."""
    duplicate = None


def _object(pairs: list) -> _Object:
    out = _Object(pairs)
    if len(out) < len(pairs):
        seen = set()
        out.duplicate = next(k for k, _ in pairs if k in seen or seen.add(k))
    return out


MAX_INTEGER_DIGITS = 64


def _integer(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INTEGER_DIGITS:  # int() itself gives up at 4300, in words of its own
        raise ValueError(f"{text[:20]}... has more than {MAX_INTEGER_DIGITS} digits")
    return int(text)


def _number(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: no JSON (nor Postgres JSONB) can hold the infinity it becomes
        raise ValueError(f"{text[:20]} is out of range for a number")
    return value


def _check(value, settings, path: tuple, level: int) -> None:
    if level > settings.max_json_depth:
        raise LMSPError("invalid_request", f"JSON is nested deeper than {settings.max_json_depth} levels",
                        param=param_of(path) or None)
    if isinstance(value, str):
        _string(value, settings, path)
    elif isinstance(value, dict):
        if value.duplicate is not None:
            param = param_of(path + (value.duplicate,))
            raise LMSPError("invalid_request", f"{param} is given twice; give each member once", param=param)
        for k, v in value.items():
            _string(k, settings, path + (k,))
            _check(v, settings, path + (k,), level + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check(v, settings, path + (i,), level + 1)


def _string(text: str, settings, path: tuple) -> None:
    problem = None
    if len(text) > settings.max_string_chars:
        problem = f"is longer than {settings.max_string_chars} characters"
    elif "\x00" in text:
        problem = "contains U+0000 (NUL), which is not allowed"
    elif not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            problem = "contains a lone UTF-16 surrogate (\\ud800-\\udfff not in a pair)"
    if problem is not None:
        param = param_of(path)
        raise LMSPError("invalid_request", f"{param or 'A string'} {problem}", param=param or None)


def json_body():
    settings = services().settings
    mimetype = request.mimetype or ""
    if mimetype != "application/json" and not mimetype.endswith("+json"):
        raise LMSPError("unsupported_media_type", "Send the body as JSON with Content-Type: application/json")
    charset = request.mimetype_params.get("charset", "utf-8").strip().lower()
    if charset not in ("utf-8", "utf8"):  # RFC 8259 8.1: JSON between systems is UTF-8
        raise LMSPError("unsupported_media_type", f"A body in charset {charset} is not accepted; send it as "
                        "UTF-8 (Content-Type: application/json)")
    coding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if coding not in ("", "identity"):  # RFC 7694: else a gzip body reads as "not valid UTF-8"
        raise LMSPError("unsupported_media_type", f"Content-Encoding {coding} is not accepted; send the body "
                        "uncompressed")
    # gunicorn undoes "chunked" only: a transfer coding before it (gzip, chunked) would be read as JSON.
    transfer = [c.strip().lower() for c in request.headers.get("Transfer-Encoding", "").split(",") if c.strip()]
    if [c for c in transfer if c != "chunked"]:
        raise LMSPError("unsupported_media_type", f"Transfer-Encoding {', '.join(transfer)} is not accepted; "
                        "send the body uncompressed, chunked or with a Content-Length")
    try:
        raw = request.get_data(cache=True)
        # A declared length over the limit was refused before (api/problems.py); a chunked body werkzeug
        # ends at the limit, handing back what it read as if it were the whole body.
        if len(raw) >= current_app.config["MAX_CONTENT_LENGTH"] and request.environ["wsgi.input"].read(1):
            refuse_too_large(None)
    except ParseException as exc:  # gunicorn's: a chunked body whose framing is broken
        raise LMSPError("invalid_request", f"The body cannot be read: {exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise LMSPError("invalid_request", "The body is not valid UTF-8") from None
    return json_object(text, settings)


def refuse_too_large(length: int | None) -> NoReturn:
    """413 for a body over the limit: ``length`` as declared, or None for a chunked one read up to the limit.

    The rest of a body up to twice the limit is read and dropped first, so that a keep-alive client gets
    its 413 and can go on (gunicorn drains at most 64 KiB of a body left unread, then closes the
    connection), under gunicorn for a few seconds at most (api/serve.py ``DRAIN_SECONDS``); a larger one
    is refused at once, unread: nobody gets to make us read 16 MiB."""
    limit = current_app.config["MAX_CONTENT_LENGTH"]
    rest = limit if length is None else length if length <= 2 * limit else 0
    stream = request.environ["wsgi.input"]
    if hasattr(stream, "discard"):
        stream.discard(rest)
    else:  # another WSGI server (the tests' own): no watch to bound the read with
        while rest > 0 and (chunk := stream.read(min(rest, 65536))):
            rest -= len(chunk)
    raise LMSPError("payload_too_large", f"The body is larger than the limit of {limit} bytes" if length is None
                    else f"The body is {length} bytes; the limit is {limit}")


def json_object(text: str, settings):
    """A request's JSON object from its text (a body, or a WebSocket message) within the limits."""
    try:
        body = json.loads(text, parse_constant=_reject_constant, parse_int=_integer,
                          parse_float=_number, object_pairs_hook=_object)
    except ValueError as exc:
        raise LMSPError("invalid_request", f"The body is not valid JSON: {exc}") from None
    except RecursionError:
        raise LMSPError("invalid_request", "JSON is nested too deeply") from None
    if not isinstance(body, dict):
        raise LMSPError("invalid_request", "The body must be a JSON object")
    _check(body, settings, (), 1)
    inner, prefix = (body["input"], "input.") if isinstance(body.get("input"), dict) else (body, "")
    items, tools = inner.get("input"), inner.get("tools")  # a task wraps the request
    if isinstance(items, list) and len(items) > settings.max_input_items:
        raise LMSPError("invalid_request", f"At most {settings.max_input_items} input items",
                        param=prefix + "input")
    if isinstance(tools, list) and len(tools) > settings.max_tools:
        raise LMSPError("invalid_request", f"At most {settings.max_tools} tools", param=prefix + "tools")
    return body


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")
