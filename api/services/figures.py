"""The service's figures for Prometheus (api/views/metrics.py), read from the database at each
scrape so every api replica answers the same."""

from dataclasses import dataclass

from sqlalchemy import func, select

from api.extensions import Services
from common import liveness
from common.tables import QueueCount, Task


@dataclass
class Figures:
    tasks: list[tuple[str, str, int]]           # (model, status, tasks)
    queued: dict[str, int]                      # model -> tasks waiting for a worker
    workers: list[liveness.WorkerState]


def service_figures(svc: Services) -> Figures:
    """Every served model has a queue depth, also when nothing counted it yet."""
    with svc.sessions() as session:
        tasks = [tuple(row) for row in session.execute(
            select(Task.model, Task.status, func.count()).group_by(Task.model, Task.status))]
        queued = dict.fromkeys(svc.registry.models, 0)
        # the counts the queue limits read, kept by triggers (migration 0003): no count of the queue
        queued.update(session.execute(select(QueueCount.name, QueueCount.queued).where(
            QueueCount.kind == "model")).all())
        return Figures(tasks, queued, liveness.worker_states(session, svc.settings.lease_seconds))
