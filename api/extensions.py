"""Everything the api shares across requests, initialised in one place."""

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from celery import Celery
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from common.bus import Publisher
from common.registry import Registry
from common.settings import Settings


@dataclass
class Services:
    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    reads: Engine  # engine's pool in autocommit (db.autocommit): a follower's one-query reads
    registry: Registry
    celery: Celery
    publisher: Publisher
    hub: "object"      # api.live.Hub
    limiter: "object"  # api.ratelimit.RateLimiter
    sender: ThreadPoolExecutor  # sends broker messages after the commit, off the request threads
    auth_failures: "object"  # api.ratelimit.AuthFailures
    streams: "object"        # api.ratelimit.StreamSlots: requests that hold a thread
    followers: "object"      # api.ratelimit.StreamSlots: followers on the fan-out thread
    grammars: "object"       # api.grammar.GrammarGate
    claims: "object"         # api.services.idempotency.Claims
    # model -> when this process last found a live worker for it (api.services.work.ensure_available)
    available: dict = field(default_factory=dict)


def services() -> Services:
    from flask import current_app
    return current_app.extensions["lmsp"]


def request_session() -> Session:
    """The request's one database session: authentication opens it and a short request's view goes
    on in it (api.auth.ONE_SESSION), so the request checks out one pooled connection,
    not one per step. Closed at the end of the request, or by the view's ``with``."""
    from flask import g
    session = g.get("db_session")
    if session is None:
        session = g.db_session = services().sessions()
    return session


def end_request_session() -> None:
    from flask import g
    session = g.pop("db_session", None)
    if session is not None:
        session.close()
