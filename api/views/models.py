from flask import Blueprint

from api.extensions import services
from api.operations import json_answer, operation
from api.services import models
from common import wire

bp = Blueprint("models", __name__, url_prefix=wire.API)


@bp.get("")
@operation("discovery", "Service discovery: version, capabilities, base paths, model ids", tag="discovery",
           scope="models:read", answers={200: json_answer("The service", wire.Discovery)})
def discovery():
    return models.discovery(services()).wire()


@bp.get("/models")
@operation("listModels", "List the served models with their live state", tag="models", scope="models:read",
           answers={200: json_answer("The models", wire.ModelList)})
def list_models():
    return models.model_list(services()).wire()


@bp.get("/models/<path:model_id>")
@operation("getModel", "One model", tag="models", scope="models:read",
           answers={200: json_answer("The model", wire.Model)}, errors=[(404, "model_not_found")],
           params=["ModelId"])
def get_model(model_id: str):
    return models.model(services(), model_id).wire()
