"""Models with their live serving state (spec 8)."""

from common import wire
from common.registry import ModelSpec


def model_object(spec: ModelSpec, workers: int) -> wire.Model:
    return wire.Model(id=spec.id, context_window=spec.context_window, max_output_tokens=spec.max_output_tokens,
                      capabilities=spec.public_capabilities(), status="ready" if workers else "unavailable",
                      workers=workers)
