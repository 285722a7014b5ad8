"""Every error the api emits is a problem document (9.3); every response carries LMSP-Version (9.1)."""

import json
import logging
import re

from flask import Flask, Response, request
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from werkzeug.exceptions import HTTPException
from werkzeug.http import HTTP_STATUS_CODES
from werkzeug.routing import WebsocketMismatch

from common.errors import CODES, LMSPError, Problem
from common.wire import VERSION

log = logging.getLogger("lmsp.api")
_SPOKEN = re.compile(r"1(\.[0-9]+)?")  # any 1.x: minor versions only add
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large",
               415: "unsupported_media_type", 400: "invalid_request", 500: "server_error"}


def problem_response(doc: Problem, headers: dict | None = None, body: str | None = None) -> Response:
    """``body``: ``doc`` as already serialized (a stored outcome, replayed byte for byte)."""
    resp = Response(json.dumps(doc.wire()) if body is None else body, status=doc.status,
                    mimetype="application/problem+json")
    for key, value in (headers or {}).items():
        resp.headers[key] = value
    code = CODES.get(doc.code)
    if code is not None and code.retry_after is not None and "Retry-After" not in resp.headers:
        resp.headers["Retry-After"] = str(code.retry_after)  # also for a problem stored in a response
    return resp


def error_response(exc: LMSPError) -> Response:
    headers = dict(exc.headers)
    if exc.retry_after is not None:
        headers["Retry-After"] = str(exc.retry_after)
    if exc.code == "unauthorized":
        headers["WWW-Authenticate"] = "Bearer"  # as 10 writes it (RFC 7235 allows a bare scheme)
    return problem_response(exc.as_problem(instance=request.path), headers)


def status_problem(status: int, name: str, detail: str, instance: str | None = None) -> Problem:
    """A problem document for an HTTP status: its LMSP code where it has one, else RFC 9457's about:blank."""
    if status in _HTTP_CODES:
        return Problem.of(_HTTP_CODES[status], detail, instance=instance)
    return Problem(type="about:blank", title=name, status=status, code=name.lower().replace(" ", "_"),
                   detail=detail, instance=instance)


def _unnamed(status: int, name: str, detail: str) -> Response:
    return problem_response(status_problem(status, name, detail, instance=request.path))


def init_app(app: Flask) -> None:
    _check_requests(app)
    _answer_problems(app)


def _check_requests(app: Flask) -> None:
    """Before anything else: the protocol version and the body's size; after: every answer stamped."""
    @app.before_request
    def _version():
        asked = request.headers.get("LMSP-Version")
        if asked is not None and not _SPOKEN.fullmatch(asked.strip()):
            raise LMSPError("unsupported_version",
                            f"LMSP-Version {asked!r} is not supported; this service speaks {VERSION}")

    @app.before_request
    def _body_size():
        # Before authentication. A body up to twice the limit is read and dropped, so a keep-alive
        # client gets its 413 and can go on (gunicorn closes a connection whose body was left
        # unread); a larger one is refused at once, unread: nobody gets to make us read 16 MiB.
        limit = app.config["MAX_CONTENT_LENGTH"]
        length = request.content_length
        if length is not None and length > limit:
            if length <= 2 * limit:
                stream = request.environ["wsgi.input"]
                while length > 0 and (chunk := stream.read(min(length, 65536))):
                    length -= len(chunk)
            raise LMSPError("payload_too_large", f"The body is {request.content_length} bytes; the limit "
                            f"is {limit}")

    @app.after_request
    def _stamp(resp: Response) -> Response:
        if resp.status_code >= 400 and resp.mimetype != "application/problem+json":
            # An answer werkzeug makes itself, not through an error handler: a static file's failed
            # If-Match (412) or unsatisfiable Range (416) comes with the file's own body and type.
            status = resp.status_code
            resp = _unnamed(status, HTTP_STATUS_CODES.get(status, "Error"), "A precondition or range of "
                            "this request does not hold")
        resp.headers["LMSP-Version"] = VERSION
        return resp


def _answer_problems(app: Flask) -> None:
    """Every error, ours, HTTP's, the database's or a bug, answered as a problem document."""
    @app.errorhandler(LMSPError)
    def _lmsp(exc: LMSPError):
        return error_response(exc)

    @app.errorhandler(HTTPException)
    def _http(exc: HTTPException):
        code = _HTTP_CODES.get(exc.code)
        if code is None:
            return _unnamed(exc.code, exc.name, exc.description)
        detail = {404: f"No route {request.path}; the API lives under /lmsp/v1",
                  405: f"{request.method} is not allowed on {request.path}",
                  413: "The request body is larger than the limit"}.get(exc.code, exc.description)
        if isinstance(exc, WebsocketMismatch):  # werkzeug's own words blame "the browser (or proxy)"
            detail = ("Only GET /lmsp/v1/tasks/{task_id}/ws takes a WebSocket upgrade" if request.environ.get(
                "HTTP_UPGRADE", "").lower() == "websocket" else "This route takes only a WebSocket upgrade "
                "(Connection: Upgrade, Upgrade: websocket); GET .../events streams the same events over SSE")
        headers = {"Allow": ", ".join(exc.valid_methods)} if getattr(exc, "valid_methods", None) else None
        return problem_response(Problem.of(code, detail, instance=request.path), headers)

    @app.errorhandler(DBAPIError)
    @app.errorhandler(PoolTimeout)
    def _database(exc: Exception):
        # The database is down, restarting or out of connections: the client should retry, as for a
        # 503 (and the lmsp client does), not take it for a bug of ours.
        if isinstance(exc, DBAPIError) and not (isinstance(exc, OperationalError) or exc.connection_invalidated):
            return _unexpected(exc)
        log.warning("database unavailable on %s %s: %s", request.method, request.path,
                    str(getattr(exc, "orig", None) or exc).strip().splitlines()[0])
        return error_response(LMSPError("overloaded", "The database is unavailable right now; retry shortly",
                                        retry_after=5))

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.path)
        return problem_response(Problem.of("server_error", "The server failed; the error is logged",
                                           instance=request.path))
