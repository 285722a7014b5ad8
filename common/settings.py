"""Typed settings, read once from ``LMSP_*`` environment variables.

The defaults give the embedded mode (`lmsp dev`): a SQLite file, a broker
on the filesystem and no Redis, all under ``LMSP_HOME``.
"""

from functools import lru_cache
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


def _home() -> Path:
    return Path.home() / ".cache" / "lmsp"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LMSP_", extra="ignore")

    home: Path = Field(default_factory=_home)
    database_url: str = ""            # default: sqlite file under home
    broker_url: str = ""              # default: filesystem broker under home
    redis_url: str = ""               # empty: no Redis (events are polled from the log)
    models_file: Path | None = None   # default: home/models.yaml
    worker_id: str = ""               # default: hostname:model
    # Retention (spec 11.2).
    event_retention_seconds: int = 24 * 3600
    record_retention_seconds: int = 30 * 24 * 3600
    idempotency_retention_seconds: int = 24 * 3600
    # Worker liveness.
    lease_seconds: int = 30
    heartbeat_seconds: float = 5.0
    sweep_seconds: float = 10.0
    requeue_after_seconds: int = 60   # a queued task older than this with no claim is dispatched again
    drain_seconds: float = 120.0      # SIGTERM: running generations get this long before they are handed on
    # Event pipeline.
    delta_window_ms: float = 20.0     # coalesce token deltas over this window ...
    task_delta_window_ms: float = 200.0  # ... this one for tasks and non-streamed responses (no one reads them token by token)
    delta_max_tokens: int = 16        # ... or this many tokens, whichever first
    sse_heartbeat_seconds: float = 0.5
    poll_interval_seconds: float = 0.05  # how often followers re-read the log without Redis
    max_task_wait_seconds: int = 30      # cap of GET /tasks/{id}?wait=N (long poll)
    # Limits (spec 10).
    max_body_bytes: int = 1024 * 1024
    max_json_depth: int = 32
    max_input_items: int = 1024
    max_tools: int = 128
    max_string_chars: int = 512 * 1024
    rate_limit_per_second: float = 50.0
    rate_limit_burst: int = 100
    max_queued_tasks_per_principal: int = 1000
    max_queue_depth: int = 10000
    # Open streams and other long requests (SSE, WebSocket, direct responses): one api thread each.
    stream_reserved_threads: int = 16   # per process, kept for health probes and short requests
    max_streams_per_principal: int = 32  # per process
    stream_auth_recheck_seconds: float = 5.0  # how often an open stream checks its token is not revoked
    ws_ping_seconds: float = 10.0        # a WebSocket client that misses a pong for this long is dropped
    auth_failures_per_minute: int = 30   # bad tokens per client address before 429 (no database lookup)
    idempotency_heartbeat_seconds: float = 10.0  # an in-flight key unrefreshed for 3 beats is abandoned
    # Structured-output grammars (the constrained-decoding compile budget).
    grammar_max_nodes: int = 4096        # JSON values in the schema
    grammar_max_depth: int = 24          # JSON nesting within the schema
    grammar_max_alternatives: int = 256  # anyOf/oneOf branches, a nested one counted once per enclosing branch
    grammar_compile_timeout_seconds: float = 5.0
    # Server.
    host: str = "127.0.0.1"
    port: int = 8080
    api_workers: int = 2
    api_threads: int = 256  # one per open event stream (gthread)
    # Operations: logs, the worker's /readyz + /metrics port, the drain on SIGTERM.
    log_format: str = "text"          # "json": one object a line with task, response and worker ids
    worker_metrics_host: str = "127.0.0.1"
    worker_metrics_port: int = 9400   # 0: no port; a supervisor gives its Nth child port + N

    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite:///{self.home / 'lmsp.db'}"

    @property
    def broker(self) -> str:
        return self.broker_url or "filesystem://"

    @property
    def broker_folder(self) -> Path:
        return self.home / "broker"

    @property
    def models_path(self) -> Path:
        return self.models_file or self.home / "models.yaml"

    @property
    def model_cache(self) -> Path:
        return self.home / "models"


@lru_cache
def get_settings() -> Settings:
    return Settings()
