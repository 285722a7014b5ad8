"""The workers panel's figures (GET /lmsp/v1/workers): from one read of the workers table
(common/liveness.py); each worker's tokens per second is what it reported with its heartbeat."""

from api.extensions import Services
from common import wire
from common.liveness import WorkerState, worker_states


def worker_list(svc: Services, each: bool) -> wire.WorkerList:
    """Per model and in total; ``each``: every worker too (scope admin: ids name hosts)."""
    with svc.sessions() as session:
        states = worker_states(session, svc.settings.lease_seconds)
    return _figures(states, each)


def _figures(states: list[WorkerState], each: bool) -> wire.WorkerList:
    models: dict[str, dict] = {}
    for w in states:
        for model in dict.fromkeys([*w.models, *w.models_loaded]):
            entry = models.setdefault(model, {"workers": dict.fromkeys(wire.WorkerStates.model_fields, 0),
                                              "loaded_on": 0})
            entry["workers"][w.state] += 1
            entry["loaded_on"] += model in w.models_loaded and w.state != "lost"
    live = [w for w in states if w.state != "lost"]
    return wire.WorkerList(
        running=sum(w.running for w in live),
        tokens_per_second=round(sum(w.tokens_per_second for w in live), 2),
        models=[wire.ModelWorkers(model=m, workers=wire.WorkerStates(**e["workers"]), loaded_on=e["loaded_on"])
                for m, e in sorted(models.items())],
        data=[wire.WorkerInfo(id=w.id, model=w.model, models_loaded=w.models_loaded, state=w.state,
                              running=w.running, tokens_per_second=w.tokens_per_second)
              for w in states] if each else None)
