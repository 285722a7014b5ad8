from flask import Blueprint

from api.auth import require
from api.extensions import services
from api.services.models import live_workers, model_object
from common.registry import Capabilities

bp = Blueprint("models", __name__, url_prefix="/lmsp/v1")


@bp.get("")
@require("models:read")
def discovery():
    svc = services()
    return {"object": "service", "version": "1.0", "protocol": "LMSP",
            # What at least one served model offers (spec 8: never advertise what none can do).
            "capabilities": {name: any(spec.public_capabilities()[name] for spec in svc.registry.models.values())
                             for name in Capabilities.model_fields},
            "paths": {"models": "/lmsp/v1/models", "responses": "/lmsp/v1/responses",
                      "tasks": "/lmsp/v1/tasks", "openapi": "/lmsp/v1/openapi.json"},
            "models": sorted(svc.registry.models)}


@bp.get("/models")
@require("models:read")
def list_models():
    svc = services()
    with svc.sessions() as session:
        workers = live_workers(session, svc.settings.lease_seconds)
    return {"object": "list",
            "data": [model_object(spec, workers.get(spec.id, 0)) for spec in svc.registry.models.values()]}


@bp.get("/models/<path:model_id>")
@require("models:read")
def get_model(model_id: str):
    svc = services()
    spec = svc.registry.get(model_id)
    with svc.sessions() as session:
        workers = live_workers(session, svc.settings.lease_seconds)
    return model_object(spec, workers.get(spec.id, 0))
