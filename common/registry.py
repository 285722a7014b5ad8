"""The served models (``models.yaml``): checkpoint, engine arguments, limits, capabilities."""

import re
from pathlib import Path

import yaml
from pydantic import BaseModel, Field

from common.errors import LMSPError


class Capabilities(BaseModel):
    streaming: bool = True
    tools: bool = True
    structured_output: bool = True
    reasoning: bool = False
    conversations: bool = True
    event_resume: bool = True
    resume_snapshots: bool = True


class ModelSpec(BaseModel):
    id: str
    checkpoint: str
    context_window: int
    max_output_tokens: int
    engine: dict = Field(default_factory=dict)   # vLLM engine arguments (dtype, max_model_len, max_num_seqs, ...)
    kv_cache_gib: float = 4                       # VLLM_CPU_KVCACHE_SPACE on CPU machines
    capabilities: Capabilities = Field(default_factory=Capabilities)
    tool_call_parser: str | None = None           # "hermes": <tool_call>{json}</tool_call>
    reasoning_parser: str | None = None           # "think": <think>...</think> (Qwen3, DeepSeek-R1)
    default_temperature: float = 0.7
    queue_depth: int = 10000                      # beyond this many queued tasks: 503 overloaded

    def public_capabilities(self) -> dict:
        caps = self.capabilities.model_dump()
        # Never advertise what the backend cannot deliver.
        caps["reasoning"] = caps["reasoning"] and self.reasoning_parser is not None
        return caps

    @property
    def queue(self) -> str:
        return queue_name(self.id)

    @property
    def interactive_queue(self) -> str:
        """Where ``POST /responses`` work goes: drained at once, never behind background tasks."""
        return self.queue + ".interactive"

    @property
    def max_num_seqs(self) -> int:
        return int(self.engine.get("max_num_seqs", 64))


def queue_name(model_id: str) -> str:
    return "lmsp.model." + re.sub(r"[^A-Za-z0-9_.-]", "_", model_id)


class Registry:
    def __init__(self, models: list[ModelSpec]):
        self.models = {m.id: m for m in models}

    @classmethod
    def load(cls, path: Path) -> "Registry":
        if not path.exists():
            return cls([])
        raw = yaml.safe_load(path.read_text()) or {}
        return cls([ModelSpec(**entry) for entry in raw.get("models", [])])

    def get(self, model_id: str) -> ModelSpec:
        try:
            return self.models[model_id]
        except KeyError:
            raise LMSPError("model_not_found", f"No model {model_id!r}; GET /lmsp/v1/models lists them",
                            param="model") from None

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        body = {"models": [m.model_dump(exclude_defaults=False) for m in self.models.values()]}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(body, sort_keys=False))
        tmp.replace(path)

    def put(self, spec: ModelSpec) -> None:
        self.models[spec.id] = spec
