"""Readiness: the database and the broker reachable (GET /readyz)."""

from sqlalchemy import text

from api.extensions import Services
from common import wire
from common.broker import check_reachable
from common.errors import LMSPError


def readiness(svc: Services) -> wire.Readiness:
    """Ready, or ``overloaded`` (503) whose ``checks`` member says which dependency failed."""
    checks = {}
    try:
        with svc.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as exc:  # noqa: BLE001 - any failure means not ready
        checks["database"] = f"error: {type(exc).__name__}"
    try:
        check_reachable(svc.celery)
        checks["broker"] = "ok"
    except Exception as exc:  # noqa: BLE001
        checks["broker"] = f"error: {type(exc).__name__}"
    if any(v != "ok" for v in checks.values()):
        raise LMSPError("overloaded", "Not ready: " + ", ".join(f"{k} {v}" for k, v in checks.items()),
                        retry_after=5, checks=checks)
    return wire.Readiness(checks=wire.Checks(**checks))
