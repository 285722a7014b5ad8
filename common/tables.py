"""The data model. Times are Unix seconds (float) so SQLite and Postgres agree."""

from sqlalchemy import JSON, Boolean, Float, ForeignKey, Index, Integer, String, Text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

Json = JSON().with_variant(JSONB(), "postgresql")


class Base(DeclarativeBase):
    pass


class Principal(Base):
    __tablename__ = "principals"
    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    created_at: Mapped[float] = mapped_column(Float)


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
    ended_at: Mapped[float | None] = mapped_column(Float)
    events_expired: Mapped[bool] = mapped_column(Boolean, default=False)

    __table_args__ = (
        Index("ix_tasks_status_model", "status", "model"),
        Index("ix_tasks_worker_status", "worker_id", "status"),
        Index("ix_tasks_principal_status", "principal_id", "status"),  # the per-principal queue limit
    )


class QueueCount(Base):
    """Queued tasks per principal and per model, kept by triggers on ``tasks`` (migration 0003) in the
    transaction that changes them: a queue limit reads one row instead of counting its queue."""
    __tablename__ = "queue_counts"
    kind: Mapped[str] = mapped_column(String(10), primary_key=True)   # "principal" or "model"
    name: Mapped[str] = mapped_column(String(200), primary_key=True)  # its id
    queued: Mapped[int] = mapped_column(Integer)


class Event(Base):
    __tablename__ = "events"
    response_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64))
    data: Mapped[str] = mapped_column(Text)  # JSON text, written once and served as is
    created_at: Mapped[float] = mapped_column(Float)


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
