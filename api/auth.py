"""Bearer-token authentication and scopes on every route but the health probes (spec 10)."""

import threading
import time

from flask import Flask, Response, current_app, g, request
from sqlalchemy.exc import DBAPIError

from api.extensions import end_request_session, request_session, services
from api.services import tickets
from api.token_cache import TokenCache
from common.errors import LMSPError
from common.tokens import authenticate, hash_secret, is_active, well_formed

# Short requests whose view goes on in the session authentication opened (one connection checkout).
ONE_SESSION = {"tasks.create", "responses.create"}


def init_app(app: Flask) -> None:
    settings = app.extensions["lmsp"].settings
    cache = TokenCache(settings.redis_url, settings.token_cache_seconds, on_revoked=_ended)

    @app.before_request
    def _authenticate():
        if _public(request.endpoint) or tickets.admit():  # admit: EventSource's stream ticket
            return
        svc = services()
        header = request.headers.get("Authorization", "")
        scheme, _, secret = header.partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            raise LMSPError("unauthorized", "Send Authorization: Bearer <token>; "
                                            "`lmsp tokens create` makes one")
        secret = secret.strip()
        if not well_formed(secret):  # refused without a lookup: it costs nothing, so it is not counted
            raise LMSPError("unauthorized", "The token is unknown or revoked")
        address, digest = request.remote_addr or "unknown", hash_secret(secret)
        svc.auth_failures.check(address, digest)  # an address that keeps guessing costs no lookup
        identity = cache.get(digest)
        if identity is None:
            begun = cache.begin()
            identity = _look_up(secret)
            if request.endpoint not in ONE_SESSION:
                end_request_session()  # a stream must not hold a connection (and a transaction) for its life
            if identity is not None:
                cache.put(digest, identity, begun)
        if identity is None:
            svc.auth_failures.failed(address)
            raise LMSPError("unauthorized", "The token is unknown or revoked")
        svc.auth_failures.succeeded(digest)
        g.identity = identity
        svc.limiter.check(identity.principal)

    @app.teardown_request
    def _release_stream(_exc):
        end_request_session()
        release = g.pop("release_stream", None)
        if release is not None:
            release()


def _look_up(secret: str):
    """The token's identity from the database. A pooled connection that died unseen (the pool drops
    one whose server closed it) gets one more try on a new one, rather than a 503."""
    try:
        return authenticate(request_session(), secret)
    except DBAPIError as exc:
        if not exc.connection_invalidated:
            raise
        end_request_session()
        return authenticate(request_session(), secret)


def _public(endpoint: str | None) -> bool:
    """The static files, and the routes whose operation (api/operations.py) asks no scope."""
    described = getattr(current_app.view_functions.get(endpoint), "operation", None)
    return endpoint == "static" or (described is not None and described.scope is None)


def check_scope(scope: str) -> None:
    if scope not in g.identity.scopes:
        raise LMSPError("insufficient_scope", f"This needs scope {scope}", scope=scope,
                        headers={"WWW-Authenticate": f'Bearer error="insufficient_scope", scope="{scope}"'})


def principal() -> str:
    return g.identity.principal


def hold_stream() -> None:
    """Take one of this process's stream slots for the rest of the request (429 when none is
    left); it is given back when the request ends, however it ends (teardown above), or, for a
    streamed body, when the server closes it (``streamed``)."""
    g.release_stream = services().streams.acquire(principal())


def hold_follower() -> None:
    """``hold_stream`` for a follower handed to the fan-out thread: it holds no thread, so its slots
    are many (``max_followers_per_process``); ``api.handover.Handover`` takes it from the request."""
    g.release_stream = services().followers.acquire(principal())


def streamed(resp: Response) -> Response:
    """Move the request's stream slot to ``resp``: Flask tears a request down as soon as its view
    returns, long before a streamed body ends; the WSGI server closes the body when it is done
    or the client is gone, even if it never started."""
    release = g.pop("release_stream", None)
    if release is not None:
        resp.call_on_close(release)
    return resp


_checked: dict[str, tuple[float, bool]] = {}  # token id -> (when, still valid): one lookup per token
_checked_lock = threading.Lock()             # per interval, however many streams it holds open


def _ended(token_id: str) -> None:
    """A revoke announced: open streams of the token end at their next check, without a lookup."""
    with _checked_lock:
        _checked[token_id] = (time.monotonic(), False)


def still_authorized():
    """For a long stream: a function telling whether its token is still valid (not revoked)."""
    svc, token_id = services(), g.identity.token_id

    def peek() -> bool | None:
        """The last answer while it is fresh, else None: without a database lookup (the fan-out
        thread asks this of thousands of followers, and ``check`` only for a stale one)."""
        with _checked_lock:
            when, valid = _checked.get(token_id, (-1e9, True))
        return valid if time.monotonic() - when < svc.settings.stream_auth_recheck_seconds else None

    def check() -> bool:
        now = time.monotonic()
        valid = peek()
        if valid is not None:
            return valid
        with svc.sessions() as session:
            valid = is_active(session, token_id)
        with _checked_lock:
            _checked[token_id] = (now, valid)
            for stale in [t for t, (w, _) in _checked.items() if now - w > 60]:
                del _checked[stale]
        return valid
    check.peek = peek
    return check
