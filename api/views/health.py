from flask import Blueprint

from api.extensions import services
from api.operations import json_answer, operation
from api.services.health import readiness
from common import wire

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
    return readiness(services()).wire()
