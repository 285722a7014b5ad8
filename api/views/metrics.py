"""Prometheus text (spec 11.1): every tenant's figures, so it needs scope admin."""

import time

from flask import Blueprint, Response
from sqlalchemy import func, select

from api.auth import require
from api.extensions import services
from common.tables import Task, Worker

bp = Blueprint("metrics", __name__)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@bp.get("/metrics")
@require("admin")
def metrics():
    svc = services()
    lines = ["# HELP lmsp_tasks Tasks by model and state.", "# TYPE lmsp_tasks gauge"]
    with svc.sessions() as session:
        for model, status, count in session.execute(
                select(Task.model, Task.status, func.count()).group_by(Task.model, Task.status)):
            lines.append(f'lmsp_tasks{{model="{_label(model)}",status="{status}"}} {count}')
        workers = session.execute(select(Worker.id, Worker.model, Worker.heartbeat_at, Worker.running).where(
            Worker.stopped_at.is_(None))).all()
    alive_after = time.time() - svc.settings.lease_seconds
    lines += ["# HELP lmsp_worker_up 1 while the worker's lease is fresh.", "# TYPE lmsp_worker_up gauge"]
    lines += [f'lmsp_worker_up{{worker="{_label(w)}",model="{_label(m)}"}} {int(hb > alive_after)}'
              for w, m, hb, _ in workers]
    lines += ["# HELP lmsp_worker_running_requests Engine requests in flight at the last heartbeat.",
              "# TYPE lmsp_worker_running_requests gauge"]
    lines += [f'lmsp_worker_running_requests{{worker="{_label(w)}",model="{_label(m)}"}} {running}'
              for w, m, _, running in workers]
    return Response("\n".join(lines) + "\n", mimetype="text/plain; version=0.0.4")
