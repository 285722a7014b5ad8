"""The served models (``models.yaml``): checkpoint, engine arguments, limits, capabilities,
and the engine settings they resolve to on the machine at hand (``resolve_engine``)."""

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from common.errors import LMSPError
from common.settings import ConfigError, get_settings

ENGINE_KINDS = ("vllm", "sim")
SIM_ARGS = ("ttft_ms", "tokens_per_s", "max_num_seqs", "tick_ms", "stop_after")  # what worker/sim.py reads


class Capabilities(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt key must not leave its default in force unseen

    streaming: bool = True
    tools: bool = True
    structured_output: bool = True
    reasoning: bool = False
    conversations: bool = True
    event_resume: bool = True
    resume_snapshots: bool = True


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt key must not leave its default in force unseen

    # Bounded here, so that a bad value fails the file when it loads (one line) and never a request later.
    id: str = Field(min_length=1, pattern=r"^\S+$")  # a request names it; no space
    checkpoint: str            # a local folder, a .gguf file, or a Hugging Face repo id ("org/name")
    revision: str | None = None  # of a repo id: a branch, tag or commit (pin a commit: every host gets the same)
    context_window: int = Field(ge=1)
    max_output_tokens: int = Field(ge=1)
    # vLLM engine arguments (dtype, max_model_len, max_num_seqs, ...), or the simulated engine: `sim`, or
    # {kind: sim, ttft_ms, tokens_per_s, max_num_seqs, ...} (worker/sim.py; for load tests, no GPU, no vLLM).
    engine: dict = Field(default_factory=dict)
    kv_cache_gib: float | None = Field(None, gt=0)  # CPU KV cache (a part of a GiB too); None: from free memory
    # What the model holds once loaded, for a worker of several models (LMSP_WORKER_MEMORY_BUDGET_GIB);
    # None: estimated (memory_gib below). Set it on a GPU, with the engine's gpu_memory_utilization to match.
    memory_gib: float | None = Field(None, ge=0)
    capabilities: Capabilities = Field(default_factory=Capabilities)
    tool_call_parser: str | None = None           # "hermes": <tool_call>{json}</tool_call>
    reasoning_parser: str | None = None           # "think": <think>...</think> (Qwen3, DeepSeek-R1)
    default_temperature: float = Field(0.7, ge=0, le=2)  # the range a request may ask for
    queue_depth: int = Field(10000, ge=0)         # beyond this many queued tasks: 503 overloaded

    @field_validator("engine", mode="before")
    @classmethod
    def _engine_kind(cls, value):
        if isinstance(value, str):
            return {"kind": value}
        return value

    @field_validator("engine")
    @classmethod
    def _known_kind(cls, value: dict) -> dict:
        if value.get("kind", "vllm") not in ENGINE_KINDS:
            raise ValueError(f"engine kind must be one of {', '.join(ENGINE_KINDS)}, not {value['kind']!r}")
        return value

    @field_validator("engine")
    @classmethod
    def _sim_args(cls, value: dict) -> dict:
        # vLLM refuses an argument it does not know when it loads; the simulator would run on its default.
        unknown = sorted(set(value) - {"kind", *SIM_ARGS}) if value.get("kind") == "sim" else []
        if unknown:
            raise ValueError(f"the simulated engine takes {', '.join(SIM_ARGS)}; not {', '.join(unknown)}")
        return value

    @field_validator("engine")
    @classmethod
    def _sim_values(cls, value: dict) -> dict:
        if value.get("kind") != "sim":
            return value
        for key, zero_ok in (("ttft_ms", True), ("tokens_per_s", False), ("tick_ms", False)):
            number = value.get(key)
            if number is not None and (type(number) not in (int, float) or not math.isfinite(number)
                                       or number < 0 or (number == 0 and not zero_ok)):
                raise ValueError(f"sim's {key} must be a number {'at least' if zero_ok else 'above'} 0, "
                                 f"not {number!r}")
        stop = value.get("stop_after")
        if stop is not None and not (isinstance(stop, list) and len(stop) == 2 and all(
                type(n) is int and n >= 1 for n in stop) and stop[0] <= stop[1]):
            raise ValueError(f"sim's stop_after must be [lo, hi], whole numbers 1 <= lo <= hi, not {stop!r}")
        return value

    @field_validator("engine")
    @classmethod
    def _whole_counts(cls, value: dict) -> dict:
        # Sized from here (the KV cache, the batch): a bad value fails the file, not a later int().
        for key in ("max_model_len", "max_num_seqs"):
            count = value.get(key)
            if count is not None and (type(count) is not int or count < 1):
                raise ValueError(f"{key} must be a whole number of at least 1, not {count!r}")
        return value

    @model_validator(mode="after")
    def _output_fits(self) -> "ModelSpec":
        if self.max_output_tokens > self.context_window:
            raise ValueError(f"max_output_tokens ({self.max_output_tokens}) is above context_window "
                             f"({self.context_window}): no request could get that many")
        return self

    @property
    def engine_kind(self) -> str:
        return self.engine.get("kind", "vllm")

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


# -- where a model's files come from ----------------------------------------------------------------
# A repo's files vLLM and the api need: config, tokenizer, chat template, safetensors weights (never the
# .bin / .gguf / onnx copies many repos also carry, which would double the download).
HUB_WEIGHTS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.tiktoken", "*.txt"]
HUB_TOKENIZER = ["*.json", "*.jinja", "*.model", "*.tiktoken", "*.txt"]  # the api's share: no weights
# The hub's rule (else snapshot_download raises): ASCII, each part 1-96 characters that start and end
# with a letter, digit or "_", no "--" or "..", no ".git" at the end.
_REPO_ID = re.compile(r"(?!.*(?:--|\.\.))(?!.*\.git$)(?=[^/]{1,96}/[^/]{1,96}$)"
                      r"[A-Za-z0-9](?:[\w.-]*\w)?/\w(?:[\w.-]*\w)?", re.ASCII)


class CheckpointMissing(FileNotFoundError):
    """A model's files are not on this machine; the message says how to get them."""


@dataclass(frozen=True)
class Source:
    kind: str                 # "folder", "gguf" or "hub"
    checkpoint: str
    revision: str | None = None

    def describe(self) -> str:
        return {"folder": "folder ", "gguf": "gguf "}.get(self.kind, "hub ") + self.checkpoint + \
            (f"@{self.revision}" if self.revision else "")


def source_of(spec: ModelSpec) -> Source:
    path = Path(spec.checkpoint).expanduser()
    if path.suffix == ".gguf":
        return Source("gguf", str(path))
    if not path.is_absolute() and not path.exists() and not spec.checkpoint.startswith((".", "~")) \
            and _REPO_ID.fullmatch(spec.checkpoint):
        return Source("hub", spec.checkpoint, spec.revision)
    return Source("folder", str(path))


def imported_dir(model_id: str) -> Path:
    """Where a GGUF model's converted checkpoint lives (``lmsp models import-gguf`` / ``pull``)."""
    return get_settings().model_cache / re.sub(r"[^A-Za-z0-9_.-]", "-", model_id)


_resolved: dict[tuple, str] = {}  # found once, found for good: requests must not stat a cache each time


def local_checkpoint(spec: ModelSpec) -> str:
    """The folder on this machine that holds ``spec``'s files: the api's tokenizer and the worker's engine
    both load from it, so a repo id resolves to one snapshot of the shared cache (``HF_HOME``) for both.
    Never downloads: raises CheckpointMissing with what to run."""
    source = source_of(spec)
    key = (spec.id, source)
    if key in _resolved:
        return _resolved[key]
    pull_hint = f"run `lmsp models pull {spec.id}`"
    if source.kind == "folder":
        if not Path(source.checkpoint).is_dir():
            raise CheckpointMissing(f"model {spec.id}: {source.checkpoint} is not a checkpoint folder (there is no "
                                    "such folder); fix its checkpoint in the models file, or mount the folder here")
        found = source.checkpoint
    elif source.kind == "gguf":
        found = str(imported_dir(spec.id))
        if not (Path(found) / "config.json").is_file():
            raise CheckpointMissing(f"model {spec.id}: {source.checkpoint} is not imported yet; {pull_hint}")
    else:
        found = _hub_snapshot(spec, source, local_only=True, patterns=HUB_WEIGHTS)
    _resolved[key] = found
    return found


def pull(spec: ModelSpec, *, tokenizer_only: bool = False, progress=print, update: bool = False) -> str:
    """Bring ``spec``'s files onto this machine (idempotent): download a repo id into the Hugging Face
    cache (resumable, with progress bars; ``HF_TOKEN`` for gated repos; ``HF_HUB_OFFLINE=1`` uses only
    the cache) at the commit every host uses (common/revisions.py; ``update``: the branch's newest,
    recorded for all), convert a GGUF file, check a folder. Returns the local folder."""
    source = source_of(spec)
    if source.kind == "hub":
        return _agreed_snapshot(spec, source, HUB_TOKENIZER if tokenizer_only else HUB_WEIGHTS, update)
    if source.kind == "gguf":
        if not Path(source.checkpoint).is_file():
            raise CheckpointMissing(f"model {spec.id}: no GGUF file {source.checkpoint}; copy it here or fix "
                                    "its checkpoint in the models file")
        from common.gguf import convert_gguf
        try:
            convert_gguf(Path(source.checkpoint), imported_dir(spec.id), progress)
        except ValueError as exc:  # not a GGUF file, a truncated one, an architecture transformers cannot read
            raise CheckpointMissing(f"model {spec.id}: cannot import {source.checkpoint}: {exc}; fix its "
                                    "checkpoint in the models file") from None
    return local_checkpoint(spec)


_COMMIT = re.compile(r"[0-9a-f]{40}")


def _agreed_snapshot(spec: ModelSpec, source: Source, patterns: list[str], update: bool) -> str:
    """A pinned commit as written; else the commit on record in the shared database (the first pull's,
    recorded now if there is none), with this host's branch pointed at it for the api and workers."""
    url = get_settings().database_url
    if not url or (source.revision and _COMMIT.fullmatch(source.revision)):
        return _hub_snapshot(spec, source, local_only=False, patterns=patterns)
    from sqlalchemy.exc import SQLAlchemyError

    from common import revisions
    try:
        commit = None if update else revisions.recorded(url, spec.id, source.checkpoint)
        if commit is None:
            folder = _hub_snapshot(spec, source, local_only=False, patterns=patterns)
            commit = revisions.record(url, spec.id, source.checkpoint, Path(folder).name, replace=update)
            if commit == Path(folder).name:
                return folder
    except (SQLAlchemyError, ConfigError) as exc:
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        # Not this model's problem but the host's: no model is pulled (--keep-going does not pass it over).
        raise ConfigError(f"model {spec.id}: cannot read or record the commit every host uses ({reason}); "
                          "check LMSP_DATABASE_URL and run `lmsp migrate`, or pin `revision:` to a "
                          "commit in the models file") from None
    folder = _hub_snapshot(spec, Source("hub", source.checkpoint, commit), local_only=False, patterns=patterns)
    revisions.point_branch(folder, source.revision)
    _resolved.pop((spec.id, source), None)
    return folder


def _hub_snapshot(spec: ModelSpec, source: Source, *, local_only: bool, patterns: list[str]) -> str:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    where = f"{source.checkpoint}" + (f"@{source.revision}" if source.revision else "")
    try:
        return snapshot_download(source.checkpoint, revision=source.revision, allow_patterns=patterns,
                                 local_files_only=local_only)
    except GatedRepoError:
        raise CheckpointMissing(f"model {spec.id}: {where} is gated: accept its terms on the hub, then set "
                                "HF_TOKEN to a token of that account") from None
    except RepositoryNotFoundError:
        raise CheckpointMissing(f"model {spec.id}: the hub has no repo {source.checkpoint} (or it is private: "
                                "set HF_TOKEN); fix its checkpoint in the models file") from None
    except RevisionNotFoundError:
        raise CheckpointMissing(f"model {spec.id}: {source.checkpoint} has no revision {source.revision}; "
                                "fix its revision in the models file") from None
    except (LocalEntryNotFoundError, OSError) as exc:  # offline, not cached; or the network failed mid-way
        cache = constants.HF_HUB_CACHE
        if local_only:
            raise CheckpointMissing(f"model {spec.id}: {where} is not in the Hugging Face cache {cache}; "
                                    f"run `lmsp models pull {spec.id}` (with the same HF_HOME)") from None
        if constants.HF_HUB_OFFLINE:
            raise CheckpointMissing(f"model {spec.id}: {where} is not in the Hugging Face cache {cache} and "
                                    "HF_HUB_OFFLINE=1 forbids downloading it: unset HF_HUB_OFFLINE, or pull it "
                                    "on a machine that reaches the hub and copy the cache here") from None
        raise CheckpointMissing(f"model {spec.id}: downloading {where} failed ({exc}); run "
                                f"`lmsp models pull {spec.id}` again: it resumes where it stopped") from None


class Registry:
    def __init__(self, models: list[ModelSpec]):
        self.models = {m.id: m for m in models}
        queues: dict[str, str] = {}
        for m in models:
            # Queue names keep [A-Za-z0-9_.-] only: a:b, a/b and a_b would share one queue (and one
            # model's workers run the other's work). Names stay as deployed; ids that collide are refused.
            if (other := queues.setdefault(m.queue, m.id)) != m.id:
                raise ConfigError(f"models {other!r} and {m.id!r} would share the queue {m.queue}; "
                                  "rename one (ids differing only in characters other than letters, digits, "
                                  "'_', '.' and '-' collide)")

    @classmethod
    def load(cls, path: Path) -> "Registry":
        if not path.exists():
            return cls([])
        fix = "fix it, or register models with `lmsp models import-gguf FILE --id ID`"
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read the models file {path} ({exc}): check LMSP_MODELS_FILE") from None
        except yaml.YAMLError as exc:
            where = getattr(exc, "problem_mark", None)
            at = f" at line {where.line + 1}" if where is not None else ""
            raise ConfigError(f"the models file {path} is not valid YAML{at}: {fix}") from None
        entries = raw.get("models") if isinstance(raw, dict) else None
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise ConfigError(f"the models file {path} must be a mapping with a `models:` list of models: {fix}")
        specs, places = [], {}  # places: each id's number in the file
        for i, entry in enumerate(entries):
            try:
                spec = ModelSpec.model_validate(entry)
            except ValidationError as exc:
                err = exc.errors()[0]
                field = ".".join(map(str, err["loc"])) + ": " if err["loc"] else ""  # none: of the whole model
                raise ConfigError(f"the models file {path}: model {i + 1} ({entry.get('id', 'no id')}): "
                                  f"{field}{err['msg'].removeprefix('Value error, ')}: {fix}") from None
            if spec.id in places:  # else the later would silently win
                raise ConfigError(f"the models file {path}: models {places[spec.id]} and {i + 1} have the same "
                                  f"id {spec.id!r}: {fix}")
            places[spec.id] = i + 1
            specs.append(spec)
        return cls(specs)

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


# -- engine settings for this machine ---------------------------------------------------------
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # without one of these, bf16 is emulated and ~5x slower
KV_MEMORY_FRACTION = 0.25  # of MemAvailable at most, for an auto-sized CPU KV cache
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Machine:
    device: str                    # "cpu" or "cuda"
    cpu_flags: frozenset[str]
    cpus: tuple[int, ...]          # the CPUs this process may run on
    mem_available: int             # bytes
    cuda_bf16: bool = False


def detect_machine() -> Machine:
    """What the engine will run on; imports torch only where a GPU driver is present."""
    flags: frozenset[str] = frozenset()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = frozenset(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    try:
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        mem = int(meminfo["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        mem = 0
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    if Path("/dev/nvidiactl").exists():
        import torch
        if torch.cuda.is_available():
            return Machine("cuda", flags, cpus, mem, cuda_bf16=torch.cuda.is_bf16_supported())
    return Machine("cpu", flags, cpus, mem)


@dataclass(frozen=True)
class EngineSettings:
    args: dict                                  # vLLM engine arguments, nothing left to "auto"
    env: dict = field(default_factory=dict)     # for the engine processes (VLLM_CPU_*)
    resolved: dict = field(default_factory=dict)  # what was chosen and why, for logs and `lmsp models list`
    cpus: tuple[int, ...] = ()                  # the CPUs the engine may bind its threads to (CPU device)

    def summary(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.resolved.items())


def resolve_dtype(requested: str, machine: Machine) -> tuple[str, str]:
    if requested != "auto":
        return requested, "model"
    if machine.device == "cuda":
        return ("bfloat16", "auto: GPU has bf16") if machine.cuda_bf16 else ("float16", "auto: GPU lacks bf16")
    native = [f for f in CPU_BF16_FLAGS if f in machine.cpu_flags]
    if native:
        return "bfloat16", f"auto: CPU has {native[0]}"
    return "float32", "auto: CPU has no " + "/".join(CPU_BF16_FLAGS)


def _kv_bytes_per_token(spec: ModelSpec, dtype: str) -> int | None:
    try:
        config = json.loads((Path(local_checkpoint(spec)) / "config.json").read_text())
        config = config.get("text_config", config)
        layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads", heads)
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None
    return 2 * layers * kv_heads * head_dim * DTYPE_BYTES.get(dtype, 4)  # K and V


ENGINE_NO_SPIN = "LMSP_ENGINE_NO_SPIN"  # set for the engine processes of a CPU device (worker/vllm_plugin.py)


def resolve_engine(spec: ModelSpec, machine: Machine, environ=None) -> EngineSettings:
    """``spec.engine`` made concrete for ``machine``. An explicit value wins: the operator's
    environment (VLLM_CPU_KVCACHE_SPACE, VLLM_CPU_OMP_THREADS_BIND), then the model's entry."""
    environ = os.environ if environ is None else environ
    args = {k: v for k, v in spec.engine.items() if k != "kind"}
    if spec.engine_kind == "sim":  # no device, no dtype, no KV cache: what it simulates is all in args
        return EngineSettings(args=args, resolved={"device": "sim", **args})
    dtype, why = resolve_dtype(str(args.get("dtype", "auto")), machine)
    args["dtype"] = dtype
    resolved = {"device": machine.device, "dtype": f"{dtype} ({why})"}
    env: dict[str, str] = {}
    if machine.device == "cpu":
        gib, resolved["kv_cache"] = _cpu_kv_cache(spec, args, machine, environ)
        if float(gib).is_integer():
            env["VLLM_CPU_KVCACHE_SPACE"] = str(int(gib))
        else:  # vLLM's variable takes whole GiB only (and overrides the argument, so it is left unset)
            args["kv_cache_memory_bytes"] = int(gib * (1 << 30))
        resolved["omp_threads"] = _cpu_threads(machine, environ)
        env[ENGINE_NO_SPIN] = "1"  # worker/vllm_plugin.py: no reader spins through a CPU forward pass
    return EngineSettings(args=args, env=env, resolved=resolved, cpus=machine.cpus if machine.device == "cpu" else ())


ENGINE_RUNTIME_GIB = 2.5  # a vLLM engine's processes on CPU beyond weights and KV cache (torch, measured)


def memory_gib(spec: ModelSpec, settings: EngineSettings) -> float:
    """What ``spec`` holds once loaded with ``settings`` (a worker of several models fits the loaded ones
    in its budget by it): the entry's ``memory_gib``; else none for the simulator; else its weights on disk,
    its CPU KV cache and the engine's runtime. A rough figure: on a GPU, say it in the models file."""
    if spec.memory_gib is not None:
        return spec.memory_gib
    if spec.engine_kind == "sim":
        return 0.0
    weights = sum(f.stat().st_size for f in Path(local_checkpoint(spec)).glob("*.safetensors"))
    kv = float(settings.env.get("VLLM_CPU_KVCACHE_SPACE", 0)) + settings.args.get("kv_cache_memory_bytes", 0) / (1 << 30)
    return weights / (1 << 30) + kv + ENGINE_RUNTIME_GIB


def _cpu_kv_cache(spec: ModelSpec, args: dict, machine: Machine, environ) -> tuple[float, str]:
    if (gib := _env_number(environ, "VLLM_CPU_KVCACHE_SPACE", float)) is not None:
        return gib, f"{gib:g} GiB (environment)"
    if spec.kv_cache_gib is not None:
        return spec.kv_cache_gib, f"{spec.kv_cache_gib:g} GiB (model)"
    # Enough for every sequence of a full batch at full length, within a share of free memory.
    per_token = _kv_bytes_per_token(spec, args["dtype"])
    length = int(args.get("max_model_len") or spec.context_window)
    want = per_token * length * spec.max_num_seqs if per_token else 4 << 30
    cap = int(machine.mem_available * KV_MEMORY_FRACTION)
    gib = max(1, math.ceil(min(want, cap) / (1 << 30)) if cap else math.ceil(want / (1 << 30)))
    return float(gib), (f"{gib} GiB (auto: full batch needs {want / (1 << 30):.1f} GiB, "
                      f"{machine.mem_available / (1 << 30):.0f} GiB free)")


def _env_number(environ, name: str, kind: type, default=None):
    """vLLM's variable ``name`` as a number (unset or empty: ``default``)."""
    if not environ.get(name):
        return default
    try:
        return kind(environ[name])
    except ValueError:
        raise ConfigError(f"{name}={environ[name]!r} is not a{' whole' if kind is int else ''} number: fix or "
                          "unset it") from None


def _cpu_threads(machine: Machine, environ) -> str:
    """vLLM's CPU backend binds its OpenMP threads itself ("auto": one per physical core of the
    first NUMA node) and keeps the last core (VLLM_CPU_NUM_OF_RESERVED_CPU, default 1) free for
    its scheduler; the worker pins its own threads off the cores the engine bound (worker/engine.py).
    Described here, not changed."""
    bind = environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if bind != "auto":
        return f"{bind} (environment)"
    reserved = _env_number(environ, "VLLM_CPU_NUM_OF_RESERVED_CPU", int, default=1)
    if len(machine.cpus) <= reserved:
        return f"{_cpus(machine.cpus)} (auto; too few CPUs to keep one free)"
    return (f"{_cpus(machine.cpus[:-reserved])} (auto), {_cpus(machine.cpus[-reserved:])} left for "
            "the scheduler and worker threads")


def _cpus(cpus) -> str:
    return ",".join(map(str, cpus))
