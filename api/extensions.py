"""Everything the api shares across requests, initialised in one place."""

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

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


def services() -> Services:
    from flask import current_app
    return current_app.extensions["lmsp"]
