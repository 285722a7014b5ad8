"""worker/vllm_scheduler.py on vLLM's own scheduler, step by step (no engine: the steps' outputs are
appended by hand, as the engine's would be): a person's prompt gets a step no background decode
shares, people's decodes are never held, and a prompt that finds no KV blocks holds nobody."""

import time

import pytest

from tests.harness import CHECKPOINT

pytestmark = pytest.mark.skipif(not (CHECKPOINT / "config.json").exists(), reason="default model not imported")

PERSON, BACKGROUND = 0, 1
BLOCK = 16


def scheduler(num_blocks: int):
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from worker.vllm_scheduler import PersonFirstScheduler

    cache = CacheConfig(block_size=BLOCK, cache_dtype="auto", enable_prefix_caching=False)
    config = VllmConfig(
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=512,
                                         enable_chunked_prefill=True, policy="priority",
                                         is_encoder_decoder=False),
        model_config=ModelConfig(model=str(CHECKPOINT), dtype="float32", seed=0, skip_tokenizer_init=True,
                                 max_model_len=512),
        cache_config=cache)
    cache.num_gpu_blocks = num_blocks
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["layer"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32))])
    return PersonFirstScheduler(vllm_config=config, kv_cache_config=kv,
                                structured_output_manager=StructuredOutputManager(config), block_size=BLOCK)


def add(s, request_id: str, prompt_tokens: int, priority: int) -> None:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request
    s.add_request(Request(request_id=request_id, prompt_token_ids=[7] * prompt_tokens,
                          sampling_params=SamplingParams(max_tokens=100), pooling_params=None,
                          priority=priority, arrival_time=time.time()))


def step(s) -> dict[str, int]:
    """One schedule, and a token for each request whose prompt is all computed (the engine's output)."""
    scheduled = dict(s.schedule().num_scheduled_tokens)
    for r in s.running:
        if r.request_id in scheduled and r.num_computed_tokens >= r.num_tokens:
            r.append_output_token_ids(5)
    return scheduled


def test_a_persons_prompt_has_a_step_no_background_decode_shares():
    s = scheduler(num_blocks=200)
    for i in range(3):
        add(s, f"bg{i}", 20, BACKGROUND)
    assert step(s) == {"bg0": 20, "bg1": 20, "bg2": 20}
    assert step(s) == {"bg0": 1, "bg1": 1, "bg2": 1}
    add(s, "alice", 30, PERSON)
    assert step(s) == {"alice": 30}  # the background sat this step out ...
    assert [r.request_id for r in s.running] == ["alice", "bg0", "bg1", "bg2"]  # ... kept its slots and blocks
    assert step(s) == {"alice": 1, "bg0": 1, "bg1": 1, "bg2": 1}  # ... and decodes again
    add(s, "bob", 40, PERSON)
    assert step(s) == {"alice": 1, "bob": 40}  # a person's decode is never held for another's prompt
    assert step(s) == {"alice": 1, "bob": 1, "bg0": 1, "bg1": 1, "bg2": 1}


def test_a_persons_prompt_that_finds_no_kv_blocks_holds_nobody():
    s = scheduler(num_blocks=10)  # the background takes 6 of the 9 usable; the person's prompt needs 13
    for i in range(3):
        add(s, f"bg{i}", 20, BACKGROUND)
    step(s)
    add(s, "alice", 200, PERSON)
    steps = [step(s) for _ in range(4)]
    # At most one step lost finding out; then the background decodes as vLLM would let it, and the
    # person waits for blocks as vLLM would make it wait.
    assert sum("bg0" in got for got in steps) >= 3
    assert not any("alice" in got for got in steps)
