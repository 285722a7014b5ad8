"""The data model. Times are Unix seconds (float) so SQLite and Postgres agree."""

from sqlalchemy import JSON, Boolean, Float, ForeignKey, Index, Integer, String, Text, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

Json = JSON().with_variant(JSONB(), "postgresql")


def _partial(name: str, *columns: str, where: str) -> Index:
    """An index of only the rows a sweep looks for, so the sweep costs what it finds, not the table."""
    return Index(name, *columns, postgresql_where=text(where), sqlite_where=text(where))


# The states a sweep looks for (literal: a partial index's predicate must be implied by the query's).
UNOWNED = "worker_id IS NULL AND status IN ('queued', 'loading', 'running', 'cancelling')"
OPEN_RESPONSE = "status IN ('queued', 'in_progress')"


class Base(DeclarativeBase):
    pass


class Principal(Base):
    __tablename__ = "principals"
    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    created_at: Mapped[float] = mapped_column(Float)
    weight: Mapped[float] = mapped_column(Float, server_default="1")  # its share of each model (common/fairshare.py)


class ApiToken(Base):
    __tablename__ = "api_tokens"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    principal_id: Mapped[str] = mapped_column(ForeignKey("principals.id"), index=True)
    name: Mapped[str | None] = mapped_column(String(200))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 of the secret, never the secret
    scopes: Mapped[str] = mapped_column(Text)                          # space-separated
    created_at: Mapped[float] = mapped_column(Float)
    revoked_at: Mapped[float | None] = mapped_column(Float)


class Response(Base):
    __tablename__ = "responses"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    principal_id: Mapped[str] = mapped_column(ForeignKey("principals.id"), index=True)
    model: Mapped[str] = mapped_column(String(200))
    request: Mapped[dict] = mapped_column(Json)
    # The request's members its response object repeats (common/resources.py), apart from the request:
    # a response's final event is built from a few columns, and a request may be a megabyte.
    echo: Mapped[dict | None] = mapped_column(Json)
    output: Mapped[list | None] = mapped_column(Json)
    usage: Mapped[dict | None] = mapped_column(Json)
    status: Mapped[str] = mapped_column(String(20))
    error: Mapped[dict | None] = mapped_column(Json)
    incomplete_details: Mapped[dict | None] = mapped_column(Json)
    stored: Mapped[bool] = mapped_column(Boolean, default=False)
    previous_response_id: Mapped[str | None] = mapped_column(String(40))
    worker_id: Mapped[str | None] = mapped_column(String(200))  # who generates a direct response
    input_tokens: Mapped[int | None] = mapped_column(Integer)   # counted at the door with the model's tokenizer
    max_tokens: Mapped[int | None] = mapped_column(Integer)     # the output budget the door granted
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)

    __table_args__ = (
        Index("ix_responses_updated", "updated_at"),                                  # retention
        _partial("ix_responses_generating", "worker_id", where="status = 'in_progress'"),  # dead workers'
        _partial("ix_responses_open", "created_at", where=OPEN_RESPONSE),  # what holds a partition back
    )


class Task(Base):
    __tablename__ = "tasks"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    principal_id: Mapped[str] = mapped_column(ForeignKey("principals.id"), index=True)
    response_id: Mapped[str] = mapped_column(ForeignKey("responses.id"), unique=True)
    type: Mapped[str] = mapped_column(String(20), default="response")
    model: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(20))
    on_restart: Mapped[str] = mapped_column(String(10))
    attempt: Mapped[int] = mapped_column(Integer, default=0)       # the fencing token: +1 per claim
    worker_id: Mapped[str | None] = mapped_column(String(200))      # None while queued or handed on
    error: Mapped[dict | None] = mapped_column(Json)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
    dispatched_at: Mapped[float | None] = mapped_column(Float)      # last broker message (database clock)
    dispatches: Mapped[int] = mapped_column(Integer, default=1)     # messages sent: spaces out re-sends
    crashes: Mapped[int] = mapped_column(Integer, server_default="0")  # engine deaths while it was prefilled
    ended_at: Mapped[float | None] = mapped_column(Float)
    events_expired: Mapped[bool] = mapped_column(Boolean, default=False)
    # Fair share (common/fairshare.py): tokens charged (input + max output), and the virtual times the
    # charge spans on its principal's clock; the claim takes the queued task that finishes first.
    cost: Mapped[int] = mapped_column(Integer, server_default="0")
    virtual_start: Mapped[float] = mapped_column(Float, server_default="0")
    virtual_finish: Mapped[float] = mapped_column(Float, server_default="0")

    __table_args__ = (
        Index("ix_tasks_status_model", "status", "model"),
        Index("ix_tasks_worker_status", "worker_id", "status"),
        Index("ix_tasks_principal_status", "principal_id", "status"),  # the per-principal queue limit
        Index("ix_tasks_principal_newest", "principal_id", "id"),  # a principal's list, newest first (polled)
        Index("ix_tasks_ended", "ended_at"),                              # record retention
        _partial("ix_tasks_unowned", "model", "dispatched_at", where=UNOWNED),  # broker re-sends
        _partial("ix_tasks_fair", "model", "virtual_finish", "id", where="status = 'queued'"),  # the claim's order
        # Tasks whose events are still kept, by creation time: what holds an event partition back.
        _partial("ix_tasks_events_kept", "created_at", where="NOT events_expired"),
    )


class VirtualTime(Base):
    """Fair share's clocks per model (common/fairshare.py): each principal's virtual finish time (the
    end of its last charge), and, in the row of principal ``""``, the model's system virtual time."""
    __tablename__ = "virtual_times"
    model: Mapped[str] = mapped_column(String(200), primary_key=True)
    principal_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    finish: Mapped[float] = mapped_column(Float)


class TaskAttempt(Base):
    """When one attempt of a task reached each step (worker clock, Unix seconds): written in the
    transactions that claim, start and finish it (common/timeline.py reads them)."""
    __tablename__ = "task_attempts"
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    worker_id: Mapped[str] = mapped_column(String(200))
    delivered_at: Mapped[float] = mapped_column(Float)             # the broker message reached the worker
    claimed_at: Mapped[float] = mapped_column(Float)               # the claim's transaction began
    submitted_at: Mapped[float | None] = mapped_column(Float)      # prompt rendered, handed to the engine
    admitted_at: Mapped[float | None] = mapped_column(Float)       # the engine took it into its batch
    first_token_at: Mapped[float | None] = mapped_column(Float)
    last_token_at: Mapped[float | None] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float)       # the final event's transaction began
    commit_batches: Mapped[int | None] = mapped_column(Integer)    # event batches committed, and their lag
    commit_lag_sum: Mapped[float | None] = mapped_column(Float)    # from generated to committed (seconds)
    commit_lag_max: Mapped[float | None] = mapped_column(Float)


class QueueCount(Base):
    """Queued tasks per principal and per model, kept by triggers on ``tasks`` (migration 0003) in the
    transaction that changes them: a queue limit reads one row instead of counting its queue."""
    __tablename__ = "queue_counts"
    kind: Mapped[str] = mapped_column(String(10), primary_key=True)   # "principal" or "model"
    name: Mapped[str] = mapped_column(String(200), primary_key=True)  # its id
    queued: Mapped[int] = mapped_column(Integer)


class Event(Base):
    """The log. On Postgres it is partitioned by range of ``response_id`` (ids sort by creation time, so
    a partition holds the events of the responses made in one period, and every event of a response is
    in one partition: the primary key stays global and a response's reads touch one partition), in the
    byte order of collation "C". Retention drops whole partitions (common/partitions.py)."""
    __tablename__ = "events"
    response_id: Mapped[str] = mapped_column(String(40).with_variant(String(40, collation="C"), "postgresql"),
                                             primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64))
    data: Mapped[str] = mapped_column(Text)  # JSON text, written once and served as is
    created_at: Mapped[float] = mapped_column(Float)


class Sweep(Base):
    """When a cluster-wide sweep last ran: of all the workers ticking, one runs it per interval."""
    __tablename__ = "sweeps"
    name: Mapped[str] = mapped_column(String(250), primary_key=True)
    swept_at: Mapped[float] = mapped_column(Float)


class IdempotencyRecord(Base):
    __tablename__ = "idempotency_records"
    principal_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    method: Mapped[str] = mapped_column(String(10), primary_key=True)
    path: Mapped[str] = mapped_column(String(200), primary_key=True)
    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    request_hash: Mapped[str] = mapped_column(String(64))
    status_code: Mapped[int | None] = mapped_column(Integer)   # None while in flight
    body: Mapped[str | None] = mapped_column(Text)
    task_id: Mapped[str | None] = mapped_column(String(40))    # tasks replay their current state
    created_at: Mapped[float] = mapped_column(Float, index=True)


class Worker(Base):
    __tablename__ = "workers"
    id: Mapped[str] = mapped_column(String(200), primary_key=True)
    model: Mapped[str] = mapped_column(String(200), index=True)
    heartbeat_at: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float] = mapped_column(Float)
    stopped_at: Mapped[float | None] = mapped_column(Float)
    running: Mapped[int] = mapped_column(Integer, default=0)  # engine requests in flight at the last heartbeat
    ready: Mapped[bool] = mapped_column(Boolean, default=True)  # engine loaded and claiming
    state: Mapped[str | None] = mapped_column(String(20))  # ready | loading | reloading | draining
    tokens_per_second: Mapped[float | None] = mapped_column(Float)  # generated, over the last seconds
    # A worker of several models (worker/residency.py): the ones it serves (None: just ``model``), and
    # the ones loaded at its last heartbeat (ids, in the order it serves them).
    models: Mapped[list | None] = mapped_column(JSON)
    models_loaded: Mapped[list | None] = mapped_column(JSON)


class ModelRevision(Base):
    """The commit a hub model resolved to at its first pull (common/revisions.py): every host uses it."""
    __tablename__ = "model_revisions"
    model_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    checkpoint: Mapped[str] = mapped_column(String(400))  # the repo id it was resolved for
    commit: Mapped[str] = mapped_column(String(64))
    recorded_at: Mapped[float] = mapped_column(Float)
