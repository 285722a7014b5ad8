"""The bare engine (vLLM ``AsyncLLM``) at one dtype: 32 requests x 64 tokens at temperature 0.

``python -m tests.bench.dtype CHECKPOINT DTYPE`` prints one JSON line (tokens/s of the batch,
single-request time to first token). Each dtype runs in its own process, since an engine
cannot be unloaded cleanly from a process that then loads another.
"""

import asyncio
import json
import os
import sys
import time
import uuid

REQUESTS, TOKENS = 32, 64
PROMPT = "Write a long, detailed essay about the history of tea."


async def measure(checkpoint: str, dtype: str) -> dict:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=checkpoint, dtype=dtype, max_model_len=2048, max_num_seqs=64, enforce_eager=True))
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)

    async def one(llm) -> tuple[float, int]:
        start, first, tokens = time.perf_counter(), None, 0
        async for out in llm.generate(PROMPT, params, uuid.uuid4().hex):
            tokens += len(out.outputs[0].token_ids)
            if first is None and tokens:
                first = time.perf_counter() - start
        return first, tokens

    try:
        await asyncio.gather(*(one(llm) for _ in range(4)))  # warm-up
        ttft = sorted([(await one(llm))[0] for _ in range(5)])[2]
        start = time.perf_counter()
        done = await asyncio.gather(*(one(llm) for _ in range(REQUESTS)))
        elapsed = time.perf_counter() - start
        return {"dtype": dtype, "tokens_per_s": sum(t for _, t in done) / elapsed, "ttft_s": ttft}
    finally:
        llm.shutdown()
        del llm  # now: AsyncLLM.__del__ at interpreter exit fails ("'NoneType' object is not callable")


def main() -> None:
    checkpoint, dtype = sys.argv[1], sys.argv[2]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    result = asyncio.run(measure(checkpoint, dtype))
    print("LMSP_DTYPE_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
