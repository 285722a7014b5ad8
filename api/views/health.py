from flask import Blueprint
from sqlalchemy import text

from api.extensions import services
from api.operations import json_answer, operation
from api.problems import problem_response
from common import wire
from common.broker import queue_length
from common.errors import problem

bp = Blueprint("health", __name__)


@bp.get("/healthz")
@operation("healthz", "Liveness probe", tag="health", scope=None,
           answers={200: json_answer("The process is alive", wire.Health)})
def healthz():
    return wire.Health().wire()


@bp.get("/readyz")
@operation("readyz", "Readiness probe: database and broker reachable", tag="health", scope=None,
           answers={200: json_answer("Ready", wire.Readiness)},
           errors=[(503, "overloaded", "Not ready: `checks` says which dependency failed.")])
def readyz():
    svc = services()
    checks = {}
    try:
        with svc.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as exc:  # noqa: BLE001 - any failure means not ready
        checks["database"] = f"error: {type(exc).__name__}"
    try:
        queue_length(svc.celery, "lmsp.readyz")
        checks["broker"] = "ok"
    except Exception as exc:  # noqa: BLE001
        checks["broker"] = f"error: {type(exc).__name__}"
    if all(v == "ok" for v in checks.values()):
        return wire.Readiness(checks=wire.Checks(**checks)).wire()
    doc = problem("overloaded", "Not ready: " + ", ".join(f"{k} {v}" for k, v in checks.items()),
                  instance="/readyz", checks=checks)
    return problem_response(doc, {"Retry-After": "5"})
