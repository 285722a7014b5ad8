"""Models with their live serving state (spec 8)."""

from common import wire
from common.registry import ModelSpec


def model_object(spec: ModelSpec, workers: int, loaded_on: list[str]) -> wire.Model:
    """``workers``: the live workers that serve it, loaded or not (a worker of several models loads
    one when work for it comes); ``loaded_on``: those that have it loaded now."""
    return wire.Model(id=spec.id, context_window=spec.context_window, max_output_tokens=spec.max_output_tokens,
                      capabilities=spec.public_capabilities(), status="ready" if workers else "unavailable",
                      workers=workers, extensions={"x-lmsp-residency": {"loaded_on": loaded_on}})
