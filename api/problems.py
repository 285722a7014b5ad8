"""Every error the api emits is a problem document (9.3); every response carries LMSP-Version (9.1)."""

import json
import logging
import re

from flask import Flask, Response, current_app, request
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from werkzeug.exceptions import HTTPException, MethodNotAllowed
from werkzeug.http import HTTP_STATUS_CODES
from werkzeug.routing import WebsocketMismatch

from api.body import refuse_too_large
from common.errors import CODES, Code, LMSPError, Problem
from common.wire import VERSION

log = logging.getLogger("lmsp.api")
_SPOKEN = re.compile(r"1(\.[0-9]+)?")  # any 1.x: minor versions only add

# HTTP's own refusals (werkzeug's, gunicorn's) that 9.3 has no code for, named in the same form so that
# every problem's type is /lmsp/v1/errors#<code>. By status, not by reason phrase: werkzeug's 414 is
# "Request URI Too Long", gunicorn's "URI Too Long", and a client must see one code.
HTTP_CODES: dict[str, Code] = {
    "precondition_failed": Code(412, "Precondition failed"),
    "uri_too_long": Code(414, "URI too long"),
    "range_not_satisfiable": Code(416, "Range not satisfiable"),
    "expectation_failed": Code(417, "Expectation failed"),
    "request_header_fields_too_large": Code(431, "Request header fields too large"),
}
ALL_CODES = {**CODES, **HTTP_CODES}  # every code a problem document of the api can carry
_BY_STATUS = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed", 413: "payload_too_large",
              415: "unsupported_media_type", 500: "server_error",
              **{code.status: name for name, code in HTTP_CODES.items()}}


def problem_response(doc: Problem, headers: dict | None = None, body: str | None = None) -> Response:
    """``body``: ``doc`` as already serialized (a stored outcome, replayed byte for byte)."""
    resp = Response(json.dumps(doc.answer()) if body is None else body, status=doc.status,
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


def status_problem(status: int, reason: str, detail: str, instance: str | None = None) -> Problem:
    """The problem document of an HTTP status werkzeug or gunicorn answers: its code of ``ALL_CODES``, or for
    a status none has, a code made of its reason phrase ("I'm a teapot" -> ``i_m_a_teapot``)."""
    code = _BY_STATUS.get(status) or re.sub(r"[^a-z0-9]+", "_", reason.lower()).strip("_")
    known = ALL_CODES.get(code)
    return Problem(type=f"/lmsp/v1/errors#{code}", title=known.title if known else reason, status=status,
                   code=code, detail=detail, instance=instance)


def _allowed(exc: HTTPException) -> list[str] | None:
    """A 405's Allow: the methods of the path that take a request like this one (an upgrade or not).
    werkzeug lists every route's, so a plain GET /lmsp/v1/responses (GET is its WebSocket mode; POST takes
    plain requests) was refused with an Allow that listed GET."""
    methods = getattr(exc, "valid_methods", None)
    if not methods:
        return None
    adapter = current_app.create_url_adapter(request)

    def takes(method: str) -> bool:
        try:
            adapter.match(method=method)
        except MethodNotAllowed:
            return False
        except HTTPException:  # (WebsocketMismatch: taken, as the other kind: its answer says how)
            return True
        return True
    return sorted(method for method in methods if takes(method))


def _takes_an_upgrade() -> bool:
    """Whether this method and path are served as a WebSocket upgrade (this request is not one)."""
    try:
        current_app.create_url_adapter(request).match(method=request.method, websocket=True)
    except HTTPException:
        return False
    return True


def _upgrade_only() -> str:
    # A proxy that does not pass the two headers on is the usual cause (README, "Behind a reverse proxy").
    return (f"{request.method} {request.path} is served only as a WebSocket upgrade (Connection: Upgrade, "
            "Upgrade: websocket); a proxy in front must pass both headers on")


def _upgrade_detail() -> str:
    if request.environ.get("HTTP_UPGRADE", "").lower() != "websocket":
        return _upgrade_only()
    from api.operations import path_template  # here, not above: api.operations imports this module

    routes = sorted(f"{method} {path_template(rule.rule)}" for rule in current_app.url_map.iter_rules()
                    if rule.websocket for method in rule.methods - {"HEAD", "OPTIONS"})
    return f"Only {' and '.join(routes)} take a WebSocket upgrade"


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
        # Before authentication, as declared: a chunked body's size is known only once read (api/body.py).
        length = request.content_length
        if length is not None and length > app.config["MAX_CONTENT_LENGTH"]:
            refuse_too_large(length)

    @app.after_request
    def _stamp(resp: Response) -> Response:
        if resp.status_code >= 400 and resp.mimetype != "application/problem+json":
            # An answer werkzeug makes itself, not through an error handler: a static file's failed
            # If-Match (412) or unsatisfiable Range (416) comes with the file's own body and type.
            status = resp.status_code
            resp = problem_response(status_problem(status, HTTP_STATUS_CODES.get(status, "Error"), "A "
                                                   "precondition or range of this request does not hold",
                                                   instance=request.path))
        resp.headers["LMSP-Version"] = VERSION
        return resp


def _answer_problems(app: Flask) -> None:
    """Every error, ours, HTTP's, the database's or a bug, answered as a problem document."""
    @app.errorhandler(LMSPError)
    def _lmsp(exc: LMSPError):
        return error_response(exc)

    @app.errorhandler(HTTPException)
    def _http(exc: HTTPException):
        if isinstance(exc, WebsocketMismatch):  # werkzeug's own words blame "the browser (or proxy)"
            if request.method == "OPTIONS":  # what Flask answers on every other route
                return app.make_default_options_response()
            return problem_response(Problem.of("invalid_request", _upgrade_detail(), instance=request.path))
        detail = {404: f"No route {request.path}; the API lives under /lmsp/v1",
                  405: _upgrade_only() if exc.code == 405 and _takes_an_upgrade() else
                  f"{request.method} is not allowed on {request.path}",
                  413: "The request body is larger than the limit"}.get(exc.code, exc.description)
        allowed = _allowed(exc)
        headers = {"Allow": ", ".join(allowed)} if allowed else None
        return problem_response(status_problem(exc.code, exc.name, detail, instance=request.path), headers)

    @app.errorhandler(DBAPIError)
    @app.errorhandler(PoolTimeout)
    def _database(exc: Exception):
        # The database is down, restarting or out of connections: the client should retry, as for a
        # 503 (and the lmsp client does), not take it for a bug of ours.
        if isinstance(exc, DBAPIError) and not (isinstance(exc, OperationalError) or exc.connection_invalidated):
            return _unexpected(exc)
        log.warning("database unavailable on %s %s: %s", request.method, request.path,
                    str(getattr(exc, "orig", None) or exc).strip().splitlines()[0])
        detail = ("Every database connection of this api process is in use; retry shortly"
                  if isinstance(exc, PoolTimeout) else "The database is unavailable right now; retry shortly")
        return error_response(LMSPError("overloaded", detail, retry_after=5))

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.path)
        return problem_response(Problem.of("server_error", "The server failed; the error is logged",
                                           instance=request.path))
