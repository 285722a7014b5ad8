"""S1-S3: many models on few GPUs (worker/residency.py), on the real vLLM engine.

One worker serves two models (the bench's checkpoint registered twice) within a memory budget that
holds one engine: the CPU here has room for one engine beside the rest of the bench, as a GPU has
room for one model of its size.

* S1 cold load: a task for a model loaded nowhere, submit -> first token, minus a warm task's. Judged on
  what the service adds to the engine's own load (the worker logs how long ``Host.start`` took):
  <= 5 s. The load itself is vLLM's (~20 s on this CPU idle, minutes on a crowded one; a person pays
  it once per keep-alive, as with Ollama), shown beside it.
* S2 switch: right after a task of model B, a task of model A: submit -> first token, minus a warm
  task's and A's engine load: what unloading B costs before A may load. Goal <= 10 s: vLLM's clean
  shutdown takes ~6 s on CPU, and the budget lets A load only once B's processes are gone.
* S3 two models alternating ÷ one: 32 tasks of each model submitted interleaved (A, B, A, ...), all
  at once / 64 tasks of one model; tokens per second of wall time. The worker must serve them in
  batches (each model loaded once per turn), never a load per task: its goal is 0.9 of what two
  switches allow, ``T1 / (T1 + 2 * switch)`` with T1 the one-model wall time and ``switch`` S2's whole
  time (A is loaded at the start; B's turn, then A's again for the A tasks that came after B's first).
"""

import re
import time
from concurrent.futures import ThreadPoolExecutor

from tests.bench import service as svc
from tests.bench.util import log

S3_TASKS, S3_TOKENS, WARM_TOKENS = 32, 64, 16
FIGURES = {
    "S1": ("cold load: first token of a task for a model loaded nowhere, beyond the engine's load",
           "<= 5 s"),
    "S2": ("switch: what unloading the other model first adds", "<= 10 s"),
    "S3": (f"2 models alternating ÷ 1 model ({2 * S3_TASKS} tasks x {S3_TOKENS} tok, tok/s)",
           ">= 0.9 x T1/(T1+2 switches)"),
}
BUDGET_GIB, MODEL_GIB = 4, 3  # one engine at a time


def entries(model_entry, tag: str, engine_args: dict, kv_cache_gib: int) -> list[dict]:
    return [model_entry(f"smollm2:m{side}{tag}", engine=dict(engine_args), kv_cache_gib=kv_cache_gib,
                        memory_gib=MODEL_GIB, queue_depth=10**7) for side in "ab"]


def first_token_after_submit(run, model: str, tokens: int) -> float:
    """Submit one task and wait for it: seconds from its creation to its first token (its timeline)."""
    task = svc.submit_task(run.api, run.token, model, "Write a haiku about rain.", tokens)
    while task["status"] not in ("succeeded", "failed", "cancelled"):
        time.sleep(0.2)
        task = svc.get_task(run.api, run.token, task["id"])
    if task["status"] != "succeeded":
        raise RuntimeError(f"a task for {model} ended {task['status']}: {task.get('error')}")
    timeline = task["extensions"]["x-lmsp-timeline"]
    return timeline["attempts"][-1]["first_token_at"] - timeline["queued_at"]


def wall(run, models: list[str]) -> dict:
    """One task per entry of ``models``, all submitted at once: wall time and tokens per second."""
    def one(model):
        task = svc.submit_task(run.api, run.token, model, "Write a long story about a dragon.", S3_TOKENS)
        while task["status"] not in ("succeeded", "failed", "cancelled"):
            r = svc.session_for(run.token).get(f"{run.api}/lmsp/v1/tasks/{task['id']}", params={"wait": 30},
                                               timeout=120)
            task = r.json()
        if task["status"] != "succeeded":
            raise RuntimeError(f"a task for {model} ended {task['status']}: {task.get('error')}")
        return task["response"]["usage"]["output_tokens"]

    start = time.perf_counter()
    with ThreadPoolExecutor(len(models)) as pool:
        tokens = sum(pool.map(one, models))
    elapsed = time.perf_counter() - start
    return {"elapsed": elapsed, "tokens": tokens, "tokens_per_s": tokens / elapsed}


def loads(log_text: str, model: str) -> list[float]:
    return [float(s) for s in re.findall(rf"loaded {re.escape(model)} in ([0-9.]+) s", log_text)]


def wait_unloaded(run, model: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = svc.session_for(run.token).get(f"{run.api}/lmsp/v1/models/{model}", timeout=30).json()
        if not got["extensions"]["x-lmsp-residency"]["loaded_on"]:
            return
        time.sleep(0.5)
    raise TimeoutError(f"{model} still loaded after {timeout} s")


def model_switch(run, table, a: str, b: str, keep_alive: float = 10.0) -> None:
    worker_id = f"bench-{a.split(':', 1)[1]}"
    log(f"models: a worker of {a} and {b}, a budget of {BUDGET_GIB} GiB ({MODEL_GIB} GiB each)")
    proc = run.stack.start_worker(f"{a},{b}", worker_id, LMSP_WORKER_MEMORY_BUDGET_GIB=str(BUDGET_GIB),
                                  LMSP_WORKER_KEEP_ALIVE_SECONDS=str(keep_alive), LMSP_WORKER_METRICS_PORT="0")
    worker_log = run.stack.tmp / f"worker-{worker_id}.log"
    try:
        warm = min(first_token_after_submit(run, a, WARM_TOKENS) for _ in range(3))
        wait_unloaded(run, a, keep_alive + 60)  # the keep-alive: nothing loaded now
        cold = first_token_after_submit(run, b, WARM_TOKENS) - warm
        load_b = loads(worker_log.read_text(), b)[-1]
        switch = first_token_after_submit(run, a, WARM_TOKENS) - warm
        load_a = loads(worker_log.read_text(), a)[-1]
        table.add("S1", FIGURES["S1"][0], f"{cold:.1f} s to first token", f"engine load {load_b:.1f} s",
                  cold - load_b, FIGURES["S1"][1], cold - load_b <= 5, unit=" s",
                  details={"warm_first_token_s": warm, "cold_s": cold, "engine_load_s": load_b})
        table.add("S2", FIGURES["S2"][0], f"{switch:.1f} s to switch", f"engine load {load_a:.1f} s",
                  switch - load_a, FIGURES["S2"][1], switch - load_a <= 10, unit=" s",
                  details={"switch_s": switch, "engine_load_s": load_a})
        one = wall(run, [a] * (2 * S3_TASKS))
        before = {m: len(loads(worker_log.read_text(), m)) for m in (a, b)}
        both = wall(run, [a, b] * S3_TASKS)
        after = {m: len(loads(worker_log.read_text(), m)) - before[m] for m in (a, b)}
        ratio = both["tokens_per_s"] / one["tokens_per_s"]
        bound = one["elapsed"] / (one["elapsed"] + 2 * switch)
        table.add("S3", FIGURES["S3"][0], f"{both['tokens_per_s']:.1f} tok/s, {sum(after.values())} loads",
                  f"{one['tokens_per_s']:.1f} tok/s", ratio, f">= {0.9 * bound:.2f} (0.9 x {bound:.2f})",
                  ratio >= 0.9 * bound, details={"one": one, "both": both, "loads": after})
        table.note(f"S3: {after} loads while 2 x {S3_TASKS} interleaved tasks ran; one model alone "
                   f"{one['elapsed']:.0f} s, alternating {both['elapsed']:.0f} s")
    finally:
        run.stack.stop(proc)
