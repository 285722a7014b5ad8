"""GET /lmsp/v1/workers: who serves what, in what state, at what rate (the dashboard's workers panel).

Every token with models:read sees the aggregate (per model and in total), as it sees /models; the
per-worker list needs scope admin, as /metrics does: worker ids name hosts and pods."""

from flask import Blueprint, g

from api.auth import require
from api.extensions import services
from api.services.workers import worker_list
from common import wire
from common.liveness import worker_states

bp = Blueprint("workers", __name__, url_prefix=wire.API)
LOST_SHOWN_SECONDS = 3600  # a worker that stopped heartbeating is shown as lost for an hour, then left out


@bp.get("/workers")
@require("models:read")
def list_workers():
    svc = services()
    with svc.sessions() as session:
        states = worker_states(session, svc.settings.lease_seconds, lost_for=LOST_SHOWN_SECONDS)
    return worker_list(states, each="admin" in g.identity.scopes).wire()
