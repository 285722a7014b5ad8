"""GET /lmsp/v1/workers: who serves what, in what state, at what rate (the dashboard's workers panel).

Every token with models:read sees the aggregate (per model and in total), as it sees /models; the
per-worker list needs scope admin, as /metrics does: worker ids name hosts and pods."""

from flask import Blueprint, g

from api.extensions import services
from api.operations import json_answer, operation
from api.services.workers import worker_list
from common import wire

bp = Blueprint("workers", __name__, url_prefix=wire.API)


@bp.get("/workers")
@operation("listWorkers", "The workers: state, running requests, tokens per second, models loaded (an extension "
           "of LMSP 1.0)", tag="models", scope="models:read",
           answers={200: json_answer("Per model and in total; each worker with scope admin", wire.WorkerList)},
           description="Read from the workers' last heartbeats. Every token sees the figures per model and in "
                       "total; `data`, each worker by id, is there only for a token with scope admin (worker ids "
                       "name hosts).")
def list_workers():
    return worker_list(services(), each="admin" in g.identity.scopes).wire()
