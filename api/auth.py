"""Bearer-token authentication and scopes on every route but the health probes (spec 10)."""

from functools import wraps

from flask import Flask, g, request

from api.extensions import services
from api.services import tickets
from common.errors import LMSPError
from common.tokens import authenticate

PUBLIC = {"health.healthz", "health.readyz", "static", "dashboard.index"}


def init_app(app: Flask) -> None:
    @app.before_request
    def _authenticate():
        if request.endpoint in PUBLIC or tickets.admit():  # admit: EventSource's stream ticket
            return
        header = request.headers.get("Authorization", "")
        scheme, _, secret = header.partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            raise LMSPError("unauthorized", "Send Authorization: Bearer <token>; "
                                            "`lmsp tokens create` makes one")
        with services().sessions() as session:
            identity = authenticate(session, secret.strip())
        if identity is None:
            raise LMSPError("unauthorized", "The token is unknown or revoked")
        g.identity = identity
        services().limiter.check(identity.principal)


def check_scope(scope: str) -> None:
    if scope not in g.identity.scopes:
        raise LMSPError("insufficient_scope", f"This needs scope {scope}", scope=scope,
                        headers={"WWW-Authenticate": f'Bearer error="insufficient_scope", scope="{scope}"'})


def require(scope: str):
    def decorate(view):
        @wraps(view)
        def wrapper(*args, **kwargs):
            check_scope(scope)
            return view(*args, **kwargs)
        return wrapper
    return decorate


def principal() -> str:
    return g.identity.principal
