"""The LMSP api: a Flask app factory with one blueprint per resource."""

import logging
import signal
from concurrent.futures import ThreadPoolExecutor

from flask import Flask
from werkzeug.middleware.proxy_fix import ProxyFix

from common.broker import make_celery
from common.bus import Publisher
from common.db import autocommit, ensure_migrated, make_engine, session_factory
from common.prompt import load_tokenizer
from common.registry import Registry, local_checkpoint
from common.settings import Settings, get_settings

log = logging.getLogger("lmsp.api")


def create_app(settings: Settings | None = None) -> Flask:
    from api import auth, openapi, problems
    from api.extensions import Services
    from api.grammar import GrammarGate
    from api.live import Hub, fd_budget
    from api.ratelimit import AuthFailures, RateLimiter, StreamSlots
    from api.services.idempotency import Claims
    from api.views import (
        chat,
        dashboard,
        events,
        health,
        metrics,
        models,
        realtime,
        responses,
        stored,
        tasks,
        workers,
    )

    settings = settings or get_settings()
    engine = make_engine(settings.db_url)
    ensure_migrated(engine)
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    if settings.trusted_proxies:
        # The client's address as the nearest trusted proxy saw it (what per-address limits count): the
        # entries a client wrote itself, left of those, are not read.
        app.wsgi_app = ProxyFix(app.wsgi_app, x_for=settings.trusted_proxies, x_proto=0)
    app.json.sort_keys = False
    # Werkzeug answers a path with "//" with a 308 to the merged one: an HTML body and a Location built
    # from the client's Host. Such a path is one we do not serve (404, a problem document).
    app.url_map.merge_slashes = False
    sessions, reads, publisher = session_factory(engine), autocommit(engine), Publisher(settings.redis_url)
    app.extensions["lmsp"] = Services(
        settings=settings, engine=engine, sessions=sessions, reads=reads,
        registry=Registry.load(settings.models_path), celery=make_celery(settings),
        publisher=publisher, hub=Hub(settings, reads, publisher),
        limiter=RateLimiter(settings.rate_limit_per_second, settings.rate_limit_burst, settings.redis_url),
        sender=ThreadPoolExecutor(1, "lmsp-dispatch"),
        auth_failures=AuthFailures(settings.auth_failures_per_minute, settings.redis_url),
        streams=StreamSlots(settings.api_threads - settings.stream_reserved_threads,
                            settings.max_streams_per_principal),
        followers=StreamSlots(min(settings.max_followers_per_process, fd_budget()),
                              settings.max_followers_per_principal),
        grammars=GrammarGate(settings),
        claims=Claims(sessions, settings.idempotency_heartbeat_seconds))
    # Tokenizers count input tokens on every request: load them now, once, not inside the first
    # requests (transformers' lazy imports are not safe to race from many threads).
    for spec in app.extensions["lmsp"].registry.models.values():
        try:
            load_tokenizer(local_checkpoint(spec))
        except (OSError, ValueError) as exc:
            log.warning("model %s: no tokenizer at %s (%s); its requests will be refused",
                        spec.id, spec.checkpoint, exc)
    problems.init_app(app)
    auth.init_app(app)
    for module in (health, metrics, models, responses, stored, chat, realtime, tasks, events, openapi, workers,
                   dashboard):
        app.register_blueprint(module.bp)
    _end_streams_on_sigterm(app.extensions["lmsp"].hub)
    return app


def _end_streams_on_sigterm(hub) -> None:
    """gunicorn stops accepting on SIGTERM and waits for open requests; event streams would hold it
    until its graceful timeout, so they end at once and their clients resume on another process."""
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum, frame):
        hub.begin_shutdown()
        if callable(previous):
            previous(signum, frame)

    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:
        pass  # not the main thread (an app built inside tests): no signals to take
