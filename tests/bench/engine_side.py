"""The baseline: the same prompts sent straight to one ``worker.engine.EngineHost`` in this process.

The prompts are rendered exactly as the worker renders them (``common.prompt.render`` with the
engine's tokenizer), and sampled with the worker's parameters at temperature 0.
"""

import os
import threading
import time
import uuid

from common.protocol import ResponseRequest
from tests.bench.util import descendants, log, proc_name, user


class EngineSide:
    def __init__(self, checkpoint: str, settings):
        # ``settings``: what worker/main.py resolves for the model (common.registry.resolve_engine).
        from worker.engine import EngineHost, GenParams
        self.GenParams = GenParams
        self.host = EngineHost(checkpoint, settings)
        t = time.monotonic()
        self.host.start()
        log(f"engine-alone: EngineHost loaded in {time.monotonic() - t:.0f}s")
        self.tokenizer = self.host.tokenizer()

    def render(self, text: str) -> str:
        from common.prompt import render
        return render(self.tokenizer, ResponseRequest.model_validate({"model": "m", "input": user(text)}))

    def params(self, max_tokens: int):
        # The worker: GenParams(max_tokens, temperature=req.temperature, ...), ignore_eos False.
        return self.GenParams(max_tokens=max_tokens, temperature=0)

    def one(self, prompt: str, max_tokens: int) -> dict:
        """Generate to the end; times of the first token and of the first non-blank text."""
        start = time.perf_counter()
        first_token = first_text = None
        tokens, text = 0, ""
        for delta in self.host.generate(f"bench-{uuid.uuid4().hex}", prompt, self.params(max_tokens)):
            now = time.perf_counter()
            if delta.token_ids and first_token is None:
                first_token = now - start
            if delta.text.strip() and first_text is None:
                first_text = now - start
            tokens += delta.token_ids
            text += delta.text
        return {"first_token": first_token, "first_text": first_text, "tokens": tokens, "text": text,
                "end": time.perf_counter()}

    def batch(self, prompts: list[str], max_tokens: int) -> dict:
        """All prompts at once (one thread each, as the worker's pool threads do)."""
        results: list[dict | None] = [None] * len(prompts)
        errors: list[BaseException] = []

        def run(i):
            try:
                results[i] = self.one(prompts[i], max_tokens)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        elapsed = max(r["end"] for r in results) - start
        tokens = sum(r["tokens"] for r in results)
        return {"elapsed": elapsed, "tokens": tokens, "tokens_per_s": tokens / elapsed,
                "texts": [r["text"] for r in results]}

    def pids(self) -> list[int]:
        """The engine's processes (EngineCore and its Worker), for pausing them between reps."""
        roots = [p.pid for p in getattr(self.host, "_engine_procs", []) if p.pid]
        if not roots:  # fall back to names among this process's children
            roots = [p for p in descendants(os.getpid()) if proc_name(p).startswith("VLLM::EngineCore")]
        return roots + [d for r in roots for d in descendants(r)]

    def shutdown(self) -> None:
        self.host.shutdown()
