"""common.registry.resolve_engine: dtype auto, KV cache and threads for the machine at hand."""

import json
from pathlib import Path

import pytest

from common.registry import Machine, ModelSpec, detect_machine, resolve_engine

GiB = 1 << 30


def machine(device="cpu", flags=("avx2", "avx512f"), cpus=(0, 1), mem=16 * GiB, cuda_bf16=False):
    return Machine(device, frozenset(flags), tuple(cpus), mem, cuda_bf16)


@pytest.fixture
def checkpoint(tmp_path):
    # SmolLM2-135M's shape: 30 layers, 3 KV heads of 64.
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64}))
    return str(tmp_path)


def spec(checkpoint, **kw):
    engine = {"max_model_len": 2048, "max_num_seqs": 64, **kw.pop("engine", {})}
    return ModelSpec(id="m", checkpoint=checkpoint, context_window=2048, max_output_tokens=512, engine=engine, **kw)


@pytest.mark.parametrize("m, dtype", [
    (machine(flags=("avx2", "avx512f")), "float32"),          # bf16 would be emulated
    (machine(flags=("avx512f", "avx512_bf16")), "bfloat16"),
    (machine(flags=("amx_bf16", "amx_tile")), "bfloat16"),
    (machine(device="cuda", cuda_bf16=True), "bfloat16"),
    (machine(device="cuda", cuda_bf16=False), "float16"),
])
def test_dtype_auto_per_device(checkpoint, m, dtype):
    assert resolve_engine(spec(checkpoint), m, environ={}).args["dtype"] == dtype  # auto is the default
    assert resolve_engine(spec(checkpoint, engine={"dtype": "auto"}), m, environ={}).args["dtype"] == dtype


def test_an_explicit_dtype_wins(checkpoint):
    got = resolve_engine(spec(checkpoint, engine={"dtype": "bfloat16"}), machine(), environ={})
    assert got.args["dtype"] == "bfloat16" and "(model)" in got.resolved["dtype"]


def test_kv_cache_sized_from_the_model_and_free_memory(checkpoint):
    # 64 sequences x 2048 tokens x (2 x 30 x 3 x 64 x 4 bytes) = 5.6 GiB at float32 ...
    roomy = resolve_engine(spec(checkpoint), machine(mem=64 * GiB), environ={})
    assert roomy.env["VLLM_CPU_KVCACHE_SPACE"] == "6"
    # ... capped at a quarter of what is free, never below 1 GiB.
    assert resolve_engine(spec(checkpoint), machine(mem=8 * GiB), environ={}).env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert resolve_engine(spec(checkpoint), machine(mem=GiB), environ={}).env["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_explicit_kv_cache_wins_environment_first(checkpoint):
    cpu = {"LMSP_ENGINE_NO_SPIN": "1"}  # every CPU engine's (worker/vllm_plugin.py)
    assert resolve_engine(spec(checkpoint, kv_cache_gib=3), machine(), environ={}).env == \
        {"VLLM_CPU_KVCACHE_SPACE": "3", **cpu}
    got = resolve_engine(spec(checkpoint, kv_cache_gib=3), machine(), environ={"VLLM_CPU_KVCACHE_SPACE": "7"})
    assert got.env == {"VLLM_CPU_KVCACHE_SPACE": "7", **cpu} and "environment" in got.resolved["kv_cache"]


def test_a_part_of_a_gib_goes_to_vllm_as_bytes(checkpoint):
    # VLLM_CPU_KVCACHE_SPACE takes whole GiB (and would override the argument): a fraction travels in bytes.
    got = resolve_engine(spec(checkpoint, kv_cache_gib=0.5), machine(), environ={})
    assert "VLLM_CPU_KVCACHE_SPACE" not in got.env and got.args["kv_cache_memory_bytes"] == GiB // 2
    assert "0.5 GiB (model)" in got.resolved["kv_cache"]
    assert "kv_cache_memory_bytes" not in resolve_engine(spec(checkpoint, kv_cache_gib=2), machine(), environ={}).args


def test_gpu_leaves_memory_to_vllm(checkpoint):
    got = resolve_engine(spec(checkpoint), machine(device="cuda", cuda_bf16=True), environ={})
    assert got.env == {} and "kv_cache" not in got.resolved


def test_threads_keep_a_core_for_the_worker(checkpoint):
    assert resolve_engine(spec(checkpoint), machine(cpus=range(8)), environ={}).resolved["omp_threads"].startswith(
        "0,1,2,3,4,5,6 (auto), 7 left")
    one = resolve_engine(spec(checkpoint), machine(cpus=(0,)), environ={}).resolved["omp_threads"]
    assert "too few CPUs" in one
    bound = resolve_engine(spec(checkpoint), machine(), environ={"VLLM_CPU_OMP_THREADS_BIND": "0-1"})
    assert bound.resolved["omp_threads"] == "0-1 (environment)"


def test_this_machine():
    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    native = "avx512_bf16" in flags.split() or "amx_bf16" in flags.split()
    m = detect_machine()
    assert m.device == "cpu" and m.mem_available > 0 and m.cpus
    got = resolve_engine(ModelSpec(id="m", checkpoint="/nonexistent", context_window=2048, max_output_tokens=512),
                         m, environ={})
    assert got.args["dtype"] == ("bfloat16" if native else "float32")
