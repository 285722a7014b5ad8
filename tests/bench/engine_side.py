"""The engine-alone baseline: one vLLM ``AsyncLLM`` with the worker's engine settings, in a process
of its own, pinned exactly as the worker pins itself (``EngineHost(pin=True)``: this process's
threads on the CPUs the engine's compute threads are not bound to).

Two ways in, on the same engine:

* ``bare``: coroutines on the engine's loop call ``AsyncLLM.generate`` with the prompt's token ids
  and the worker's sampling parameters. Nothing of ours in between: B1's and B2's baseline.
* ``host``: one thread per request calls ``EngineHost.generate``, as the worker's pool threads do
  (its admission gate and hand-offs): the wrapper's own cost, a separate figure.

The bench talks to it over stdin/stdout, one JSON object a line (vLLM's logs go to stderr).
"""

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict

from tests.bench.util import descendants, log

BATCH_PRIORITY, SINGLE_PRIORITY = 1, 0  # as the worker: tasks 1, a person's stream 0


# -- the bench's side of the pipe --------------------------------------------------------------------
class EngineSide:
    def __init__(self, stack, checkpoint: str, settings, log_name: str = "engine-alone.log"):
        """``settings``: what worker/main.py resolves for the model (common.registry.resolve_engine)."""
        t = time.monotonic()
        err = open(stack.tmp / log_name, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.bench.engine_side", checkpoint],
                                     env={**stack.env, **settings.env}, cwd=stack_root(), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
        stack.procs.append(self.proc)
        self.log = stack.tmp / log_name
        ready = self._call({"settings": {**asdict(settings), "cpus": list(settings.cpus)}}, timeout=900)
        self.pinned = ready["pinned"]
        log(f"engine-alone: loaded in {time.monotonic() - t:.0f}s; pinned {ready['pinned']}")

    def _call(self, cmd: dict, timeout: float = 1800) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the engine-alone process exited:\n"
                               + self.log.read_text(errors="replace")[-3000:])
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"engine-alone: {out['error']}")
        return out

    def batch(self, prompts: list[list[int]], max_tokens: int, mode: str = "bare") -> dict:
        """All prompts (token ids) at once; tokens/s from the first submission to the last token."""
        return self._call({"op": "batch", "mode": mode, "prompts": prompts, "max_tokens": max_tokens})

    def one(self, prompt: list[int], max_tokens: int, mode: str = "bare") -> dict:
        """One request to the end: seconds to its first token and to its first non-blank text."""
        return self._call({"op": "one", "mode": mode, "prompt": prompt, "max_tokens": max_tokens})

    def pids(self) -> list[int]:
        return [self.proc.pid] + descendants(self.proc.pid)

    def shutdown(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # the child shuts its engine down at end of input
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def stack_root():
    from tests.harness import ROOT
    return ROOT


# -- the child ------------------------------------------------------------------------------------------
def _bare(host, prompts: list[list[int]], max_tokens: int, priority: int) -> list[dict]:
    from vllm.inputs import TokensPrompt

    from worker.engine import GenParams
    params = host._sampling_params(GenParams(max_tokens=max_tokens, temperature=0))

    async def one(ids):
        start = time.perf_counter()
        r = {"first_token": None, "first_text": None, "tokens": 0, "text": ""}
        async for res in host._llm.generate(TokensPrompt(prompt_token_ids=ids), params, uuid.uuid4().hex,
                                            priority=priority):
            c = res.outputs[0]
            now = time.perf_counter()
            if c.token_ids and r["first_token"] is None:
                r["first_token"] = now - start
            if c.text.strip() and r["first_text"] is None:
                r["first_text"] = now - start
            r["tokens"] += len(c.token_ids)
            r["text"] += c.text
        r["end"] = time.perf_counter()
        r["elapsed"] = r["end"] - start
        return r

    async def all_of():
        return await asyncio.gather(*(one(p) for p in prompts))

    return asyncio.run_coroutine_threadsafe(all_of(), host._loop).result()


def _host(host, prompts: list[list[int]], max_tokens: int, priority: int) -> list[dict]:
    from worker.engine import GenParams
    results: list[dict | None] = [None] * len(prompts)
    errors: list[BaseException] = []

    def run(i):
        try:
            start = time.perf_counter()
            r = {"first_token": None, "first_text": None, "tokens": 0, "text": ""}
            for d in host.generate(f"bench-{uuid.uuid4().hex}", prompts[i],
                                   GenParams(max_tokens=max_tokens, temperature=0, priority=priority)):
                now = time.perf_counter()
                if d.token_ids and r["first_token"] is None:
                    r["first_token"] = now - start
                if d.text.strip() and r["first_text"] is None:
                    r["first_text"] = now - start
                r["tokens"] += d.token_ids
                r["text"] += d.text
            r["end"] = time.perf_counter()
            r["elapsed"] = r["end"] - start
            results[i] = r
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def _serve(checkpoint: str) -> None:
    out = os.fdopen(os.dup(1), "w")  # replies; everything else (vLLM's logs) to stderr
    os.dup2(2, 1)

    def reply(obj):
        out.write(json.dumps(obj) + "\n")
        out.flush()

    from common.registry import EngineSettings
    from worker.engine import EngineHost
    raw = json.loads(sys.stdin.readline())["settings"]
    host = EngineHost(checkpoint, EngineSettings(**{**raw, "cpus": tuple(raw["cpus"])}), pin=True)
    host.start()
    reply({"pinned": sorted(os.sched_getaffinity(0)) if host._pinned else None})
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            try:
                fn = _bare if cmd["mode"] == "bare" else _host
                if cmd["op"] == "batch":
                    start = time.perf_counter()
                    done = fn(host, cmd["prompts"], cmd["max_tokens"], BATCH_PRIORITY)
                    elapsed = max(r["end"] for r in done) - start
                    tokens = sum(r["tokens"] for r in done)
                    reply({"elapsed": elapsed, "tokens": tokens, "tokens_per_s": tokens / elapsed,
                           "texts": [r["text"] for r in done]})
                else:
                    (r,) = fn(host, [cmd["prompt"]], cmd["max_tokens"], SINGLE_PRIORITY)
                    reply(r)
            except Exception as exc:  # noqa: BLE001 - the bench makes it a FAIL row
                reply({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        host.shutdown()


if __name__ == "__main__":
    _serve(sys.argv[1])
