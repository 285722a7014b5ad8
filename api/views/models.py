from flask import Blueprint

from api.extensions import services
from api.operations import json_answer, operation
from api.services.models import model_object
from common import wire
from common.liveness import live_workers, loaded_on

bp = Blueprint("models", __name__, url_prefix=wire.API)


@bp.get("")
@operation("discovery", "Service discovery: version, capabilities, base paths, model ids", tag="discovery",
           scope="models:read", answers={200: json_answer("The service", wire.Discovery)})
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
@operation("listModels", "List the served models with their live state", tag="models", scope="models:read",
           answers={200: json_answer("The models", wire.ModelList)})
def list_models():
    return wire.ModelList(data=_models(*services().registry.models.values())).wire()


@bp.get("/models/<path:model_id>")
@operation("getModel", "One model", tag="models", scope="models:read",
           answers={200: json_answer("The model", wire.Model)}, errors=[(404, "model_not_found")],
           params=["ModelId"])
def get_model(model_id: str):
    return _models(services().registry.get(model_id))[0].wire()
