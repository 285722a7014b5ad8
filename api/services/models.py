"""The service and its models with their live serving state (spec 8, 11.1)."""

from api.extensions import Services
from common import wire
from common.liveness import live_workers, loaded_on
from common.registry import ModelSpec


def discovery(svc: Services) -> wire.Discovery:
    models = svc.registry.models.values()
    # What at least one served model offers (spec 8: never advertise what none can do).
    offered = wire.Capabilities(**{name: any(spec.public_capabilities()[name] for spec in models)
                                   for name in wire.Capabilities.model_fields})
    return wire.Discovery(capabilities=offered, models=sorted(spec.id for spec in models))


def model_list(svc: Services) -> wire.ModelList:
    return wire.ModelList(data=_models(svc, *svc.registry.models.values()))


def model(svc: Services, model_id: str) -> wire.Model:
    return _models(svc, svc.registry.get(model_id))[0]


def _models(svc: Services, *specs: ModelSpec) -> list[wire.Model]:
    with svc.sessions() as session:
        workers = live_workers(session, svc.settings.lease_seconds)
        loaded = loaded_on(session, svc.settings.lease_seconds)
    return [_model(spec, workers.get(spec.id, 0), loaded.get(spec.id, [])) for spec in specs]


def _model(spec: ModelSpec, workers: int, loaded: list[str]) -> wire.Model:
    """``workers``: the live workers that serve it, loaded or not (a worker of several models loads
    one when work for it comes); ``loaded``: those that have it loaded now."""
    return wire.Model(id=spec.id, context_window=spec.context_window, max_output_tokens=spec.max_output_tokens,
                      capabilities=spec.public_capabilities(), status="ready" if workers else "unavailable",
                      workers=workers, extensions={"x-lmsp-residency": {"loaded_on": loaded}})
