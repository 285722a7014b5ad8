"""Typed settings, read once from ``LMSP_*`` environment variables.

The defaults give the embedded mode (`lmsp dev`): a SQLite file, a broker
on the filesystem and no Redis, all under ``LMSP_HOME``.
"""

from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class ConfigError(Exception):
    """The operator's configuration (environment, models file, database) is wrong. The message is one
    line saying what is wrong and what to do; entry points print it and exit non-zero, no traceback."""


def _home() -> Path:
    return Path.home() / ".cache" / "lmsp"


# A period something runs at (0 would spin a loop), and a size or limit (0 would refuse everything).
Interval = Annotated[float, Field(gt=0)]
Count = Annotated[int, Field(ge=1)]


class Settings(BaseSettings):
    # nan and inf are no period or limit: nan passed every comparison (a drain of "nan" seconds drained nothing).
    model_config = SettingsConfigDict(env_prefix="LMSP_", extra="ignore", allow_inf_nan=False)

    home: Path = Field(default_factory=_home)
    database_url: str = ""            # default: sqlite file under home
    broker_url: str = ""              # default: filesystem broker under home
    redis_url: str = ""               # empty: no Redis (events are polled from the log)
    models_file: Path | None = None   # default: home/models.yaml
    worker_id: str = ""               # default: hostname:model
    # A worker serving several models (worker/residency.py): their ids, comma-separated (`--model a,b` too).
    # It loads one when work for it arrives and unloads the least recently used ones so that the loaded
    # models' memory estimates (models.yaml `memory_gib`) fit the budget; one model always fits alone.
    worker_models: str = ""
    worker_memory_budget_gib: float = Field(0.0, ge=0)  # 0: one model (of those with an estimate) at a time
    worker_keep_alive_seconds: float = 300.0  # a model idle this long is unloaded (Ollama's keep_alive); < 0: never
    # Postgres connections per process: a pool, plus overflow while it is all in use. Every worker and
    # api process holds its own, so a fleet needs sum(pool + overflow) within max_connections (or a pooler).
    db_pool_size: Count = 10
    db_max_overflow: int = Field(20, ge=0)
    db_pool_recycle_seconds: Interval = 300.0  # a pooled connection older than this is replaced at checkout
    # Retention (spec 11.2).
    # 0: gone as soon as allowed (a test of 410, say); negative is refused, not taken for "for ever".
    event_retention_seconds: int = Field(24 * 3600, ge=0)
    record_retention_seconds: int = Field(30 * 24 * 3600, ge=0)
    idempotency_retention_seconds: int = Field(24 * 3600, ge=0)
    # The event log's partitions on Postgres: each holds the responses made in this period, and they are
    # made this far ahead (common/partitions.py). A partition is dropped whole, so events are kept for
    # up to one period more than the event retention.
    event_partition_seconds: Count = 3600
    event_partitions_ahead_seconds: Count = 24 * 3600
    # Worker liveness.
    lease_seconds: Count = 30
    heartbeat_seconds: Interval = 5.0
    sweep_seconds: Interval = 10.0
    requeue_after_seconds: int = Field(60, ge=0)  # a queued task older than this with no claim is dispatched again
    direct_requeue_after_seconds: Interval = 5.0  # the same for a direct response: a person is waiting
    max_attempts: Count = 3           # engine deaths while a task is prefilled before it fails (a poison request)
    drain_seconds: float = Field(120.0, ge=0)     # SIGTERM: running generations get this long before they are handed on
    # Event pipeline.
    delta_window_ms: float = Field(20.0, ge=0)    # coalesce token deltas over this window ...
    task_delta_window_ms: float = Field(200.0, ge=0)  # ... this one for tasks and non-streamed responses (read by polls)
    delta_max_tokens: Count = 16      # ... or this many tokens, whichever first
    task_quiet_window_ms: float = Field(1000.0, ge=0)  # a task's window while nobody follows it live (its cap grows as much)
    sse_heartbeat_seconds: Interval = 0.5
    poll_interval_seconds: Interval = 0.05  # how often followers re-read the log without Redis
    max_task_wait_seconds: int = Field(30, ge=0)     # cap of GET /tasks/{id}?wait=N (long poll)
    # Limits (spec 10).
    max_body_bytes: Count = 1024 * 1024
    max_json_depth: Count = 32
    max_input_items: Count = 1024
    max_tools: int = Field(128, ge=0)
    max_string_chars: Count = 512 * 1024
    rate_limit_per_second: float = Field(50.0, ge=0)  # 0: no limit
    rate_limit_burst: int = Field(100, ge=0)
    max_queued_tasks_per_principal: int = Field(1000, ge=0)  # 0: every task refused (a closed door)
    max_queue_depth: int = Field(10000, ge=0)
    # Requests that hold an api thread while they wait (direct responses, long polls, WebSocket-mode
    # connections, and event streams where the socket cannot be handed over: api/live/).
    stream_reserved_threads: int = Field(16, ge=0)  # per process, kept for health probes and short requests
    max_streams_per_principal: Count = 32  # per process
    # Followers of task events handed to the process's fan-out thread: memory, not a thread, each.
    max_followers_per_process: int = Field(10000, ge=1)  # also kept under the process's open-file limit
    max_followers_per_principal: int = Field(1000, ge=1)  # per process
    # A task follower whose unsent frames pass this reads the log at its reader's pace instead of
    # taking live batches (a direct stream is cut: it resumes); its socket's kernel send buffer is
    # capped to the same.
    follower_buffer_bytes: Count = 256 * 1024
    follower_stall_seconds: Interval = 60.0  # a client that took none of its pending bytes this long is cut
    follower_heartbeat_seconds: Interval = 15.0  # an idle SSE follower's keep-alive (a vanished one is seen at once)
    stream_auth_recheck_seconds: Interval = 5.0  # how often an open stream checks its token is not revoked
    # An api process answers a token it looked up this recently from memory; a revoke reaches every
    # process at once over Redis, so this only bounds a revoke made while Redis is away (0: no cache;
    # without Redis there is none).
    token_cache_seconds: float = Field(5.0, ge=0)
    ws_ping_seconds: Interval = 10.0        # a WebSocket client that misses a pong for this long is dropped
    # WebSocket mode of the Responses API (api/views/realtime.py): each connection holds an api thread (and a
    # stream slot) for its life, plus one thread per lane while the lane generates.
    ws_max_connection_seconds: Interval = 3600.0  # a connection is closed (1001) after this long; reconnect
    ws_max_connections_per_principal: Count = 8   # per process
    ws_max_lanes: Count = 4            # lanes (stream_id) of one connection with work queued or running
    ws_max_queued: Count = 32          # response.create events of one connection waiting for their lane
    ws_memory_responses: Count = 16    # finished responses a connection keeps for previous_response_id
    auth_failures_per_minute: int = Field(30, ge=0)  # bad tokens per client address before 429 (no database lookup)
    # Reverse proxies in front of the api that append the client's address to X-Forwarded-For: behind
    # one, every client has its address, and one client's bad tokens would lock out everyone's new ones.
    trusted_proxies: int = Field(0, ge=0)  # 0: the peer's address is the client's (the header is ignored)
    idempotency_heartbeat_seconds: Interval = 10.0  # an in-flight key unrefreshed for 3 beats is abandoned
    # Structured-output grammars (the constrained-decoding compile budget).
    grammar_max_nodes: Count = 4096        # JSON values in the schema
    grammar_max_depth: Count = 24          # JSON nesting within the schema
    grammar_max_alternatives: Count = 256  # anyOf/oneOf branches, a nested one counted once per enclosing branch
    grammar_compile_timeout_seconds: Interval = 5.0
    grammar_compile_seconds_per_minute: Interval = 15.0  # per principal and api process: then 429
    grammar_helpers: Count = 2  # compile helpers per api process (each imports torch: ~0.5 GB)
    # Server.
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=1, le=65535)
    api_workers: int = Field(2, ge=1)
    api_threads: int = Field(256, ge=1, le=10000) # one per direct stream or WebSocket-mode connection (gthread)
    # An idle kept-alive connection is closed after this. gunicorn's own 2 s is shorter than clients' and
    # load balancers' idle expiry (httpx 5 s, nginx and cloud balancers 60 s): a request sent as the server
    # closes its connection is reset unanswered (seen in a chaos run: a POST /responses reset with no fault).
    api_keepalive_seconds: int = Field(75, ge=1)
    # Operations: logs, the worker's /readyz + /metrics port, the drain on SIGTERM.
    log_format: Literal["text", "json"] = "text"  # "json": one object a line with task, response and worker ids
    worker_metrics_host: str = "127.0.0.1"
    worker_metrics_port: int = Field(9400, ge=0, le=65535)  # 0: no port; a supervisor gives its Nth child port + N

    @field_validator("redis_url", "broker_url")
    @classmethod
    def _url(cls, value: str, info) -> str:
        """Empty (the default) or a URL: a typo would otherwise be a traceback at start (redis) or a
        broker that never answers (kombu)."""
        if value and "://" not in value:
            raise ValueError("must be a URL such as redis://host:6379/0, or empty for the default")
        if info.field_name == "redis_url" and value and not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must be a redis://, rediss:// or unix:// URL, or empty for no Redis")
        return value

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


def load_settings() -> Settings:
    """The settings as the environment has them now; ``ConfigError`` for a value that does not parse."""
    try:
        return Settings()
    except ValidationError as exc:
        raise ConfigError("; ".join(
            f"LMSP_{'_'.join(map(str, err['loc'])).upper()}={err['input']!r} is not valid ({err['msg'].removeprefix('Value error, ')})"
            for err in exc.errors()) + ": fix or unset it") from None


@lru_cache
def get_settings() -> Settings:
    return load_settings()
