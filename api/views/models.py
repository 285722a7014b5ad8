from flask import Blueprint

from api.auth import require
from api.extensions import services
from api.services.models import model_object
from common.lifecycle import live_workers

bp = Blueprint("models", __name__, url_prefix="/lmsp/v1")


@bp.get("")
@require("models:read")
def discovery():
    svc = services()
    return {"object": "service", "version": "1.0", "protocol": "LMSP",
            "capabilities": {"streaming": True, "tools": True, "structured_output": True,
                             "conversations": True, "event_resume": True,
                             "resume_snapshots": True},
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
