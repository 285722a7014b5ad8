from flask import Blueprint

from api.auth import require
from api.extensions import services
from api.services.models import model_object
from common import wire
from common.liveness import live_workers, loaded_on

bp = Blueprint("models", __name__, url_prefix=wire.API)


@bp.get("")
@require("models:read")
def discovery():
    models = services().registry.models.values()
    # What at least one served model offers (spec 8: never advertise what none can do).
    offered = wire.Capabilities(**{name: any(spec.public_capabilities()[name] for spec in models)
                                   for name in wire.Capabilities.model_fields})
    return wire.Discovery(capabilities=offered, models=sorted(spec.id for spec in models)).wire()


def _models(*specs) -> list[wire.Model]:
    svc = services()
    with svc.sessions() as session:
        workers = live_workers(session, svc.settings.lease_seconds)
        loaded = loaded_on(session, svc.settings.lease_seconds)
    return [model_object(spec, workers.get(spec.id, 0), loaded.get(spec.id, [])) for spec in specs]


@bp.get("/models")
@require("models:read")
def list_models():
    return wire.ModelList(data=_models(*services().registry.models.values())).wire()


@bp.get("/models/<path:model_id>")
@require("models:read")
def get_model(model_id: str):
    return _models(services().registry.get(model_id))[0].wire()
