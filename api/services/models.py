"""Models with their live serving state (spec 8)."""

from common.registry import ModelSpec


def model_object(spec: ModelSpec, workers: int) -> dict:
    return {
        "id": spec.id,
        "object": "model",
        "context_window": spec.context_window,
        "max_output_tokens": spec.max_output_tokens,
        "capabilities": spec.public_capabilities(),
        "status": "ready" if workers else "unavailable",
        "workers": workers,
    }
