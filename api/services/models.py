"""Models with their live serving state (spec 8)."""

import time

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from common import wire
from common.registry import ModelSpec
from common.tables import Worker


def live_workers(session: Session, lease_seconds: int) -> dict[str, int]:
    rows = session.execute(
        select(Worker.model, func.count()).where(
            Worker.heartbeat_at > time.time() - lease_seconds, Worker.stopped_at.is_(None))
        .group_by(Worker.model))
    return dict(rows.all())


def model_object(spec: ModelSpec, workers: int) -> wire.Model:
    return wire.Model(id=spec.id, context_window=spec.context_window, max_output_tokens=spec.max_output_tokens,
                      capabilities=spec.public_capabilities(), status="ready" if workers else "unavailable",
                      workers=workers)
