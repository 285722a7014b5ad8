"""Run the figures side by side and print one table (see ``tests/bench/__init__``); exit 1 on any FAIL."""

import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

from tests.bench import ONLY, REPS, enabled, fairness, select, slowlink
from tests.bench import models as models_bench
from tests.bench.util import (
    Freezer,
    ThreadMeter,
    affinity,
    descendants,
    engine_compute_cpus,
    essay_prompt,
    log,
    median,
    percentile,
    pin_off_engine,
    proc_name,
    tree,
    vm_hwm_mib,
)
from tests.bench.util import user as essay_user
from tests.bench.verdict import MIN_REPS, Table, guarded, output_mismatch, spread

ROOT = Path(__file__).resolve().parents[2]
STDOUT_FD = 1  # set in main(): the table is the only thing written to stdout
OUT = Path(os.environ.get("LMSP_BENCH_OUT", ROOT / "bench-results.json"))

# Workload constants (the figures' definitions).
B1_TASKS, B1_TOKENS = 64, 128
B2_REQUESTS, B2_TOKENS = 30, 8
B2_PROMPT = "Say hello in one sentence."
B0_PROMPT, B0_TOKENS = "Write a long story about a dragon who learns to read.", 128
B3_THREADS, B3_SECONDS = 32, float(os.environ.get("LMSP_BENCH_B3_SECONDS", "4"))
B4_CLIENTS, B4_TOKENS = int(os.environ.get("LMSP_BENCH_B4_CLIENTS", "1000")), 128
B4_REPS = int(os.environ.get("LMSP_BENCH_B4_REPS", "3"))  # a p99, not a ratio: 3 tasks of 1000 followers
B4_MIN_SAMPLES = 1000  # (event, follower) lags per rep, below which a p99 says nothing
B5_EVENTS = 100_000
B6_QUEUED, B6_LOAD_TOKENS, B6_SAMPLES, B6_WINDOW_SECONDS = 200, 128, 10, 5.0
KV_CACHE_GIB = 1  # 23k tokens at float32: a full batch of 64 x (40 + 128) needs 11k; two engines load at once
DTYPE = os.environ.get("LMSP_BENCH_DTYPE", "float32")
# Pinned on every side: vLLM's defaults differ between its server and AsyncLLM on large GPUs
# (max_num_batched_tokens 8192 vs 2048), and two engines loaded together must not each ask for
# 0.9 of a card. On CPU the KV cache is VLLM_CPU_KVCACHE_SPACE (KV_CACHE_GIB) on every side.
ENGINE_ARGS = {"dtype": DTYPE, "max_model_len": 2048, "max_num_seqs": 64, "enforce_eager": True,
               "max_num_batched_tokens": 2048, "gpu_memory_utilization": 0.4}
# An engine lever's arguments over these, on every side, for A/B runs of the same bench code
# (LMSP_BENCH_ENGINE_ARGS='{"max_num_batched_tokens": 128}').
ENGINE_ARGS.update(json.loads(os.environ.get("LMSP_BENCH_ENGINE_ARGS") or "{}"))
# Production settings for every process (tests.harness.Stack sets short test leases).
PRODUCTION_ENV = {"LMSP_LEASE_SECONDS": "30", "LMSP_HEARTBEAT_SECONDS": "5", "LMSP_SWEEP_SECONDS": "10",
                  "LMSP_REQUEUE_AFTER_SECONDS": "60", "LMSP_TASK_DELTA_WINDOW_MS": "200"}
# The bench submits thousands of tasks from one principal: lift the per-principal limits.
LIMITS_ENV = {"LMSP_MAX_QUEUED_TASKS_PER_PRINCIPAL": "10000000", "LMSP_MAX_QUEUE_DEPTH": "10000000",
              "LMSP_MAX_STREAMS_PER_PRINCIPAL": "100000", "LMSP_MAX_FOLLOWERS_PER_PRINCIPAL": "100000",
              "LMSP_RATE_LIMIT_PER_SECOND": "1000000", "LMSP_RATE_LIMIT_BURST": "1000000"}

# id -> (name, goal): every enabled one ends in the table, measured or FAIL with its reason.
FIGURES = {
    "P0": ("first 16 concurrent POST /tasks on a fresh api", "0 failed"),
    "B3": ("acceptance rate (POST /tasks, counted once its message is sent ÷ GET /lmsp/v1)", ">= 0.5"),
    "B5": ("replay 100k events (endpoint ÷ SELECT)", ">= 0.5"),
    "D1": ("bare engine tok/s, resolved dtype ÷ bfloat16 (32 req x 64 tok)", ">= 3 without native bf16"),
    "B1": (f"{B1_TASKS} tasks x {B1_TOKENS} tok ÷ bare AsyncLLM", ">= 0.95"),
    "T1": ("framework share of a task's wall time (B1 tasks)", "<= 5%"),
    "B2": ("first-token overhead over bare AsyncLLM, p50", "<= 30 ms"),
    "V1": (f"{B1_TASKS} tasks x {B1_TOKENS} tok ÷ vLLM server", ">= 1.0"),
    "V2": (f"{B1_TASKS} concurrent POST /responses ÷ vLLM server", ">= 0.95"),
    "V1c": ("CPU-s per output token of every process, V1's tasks ÷ vLLM server", "<= 1.03"),
    "V3": ("TTFT over vLLM server, p50", "<= 10 ms"),
    "B4": (f"fan-out {B4_CLIENTS} SSE followers, p99 lag engine token -> follower (lmsp serve settings)",
           "<= 100 ms, all served"),
    "B4b": (f"fan-out {B4_CLIENTS} SSE followers, p99 lag engine token -> follower (a slot per follower)",
            "<= 100 ms, all served"),
    "B6": (f"interactive TTFT, {B6_QUEUED} queued + full batch ÷ idle", "<= 2"),
    "B6t": (f"B6's background tokens/s, {B6_WINDOW_SECONDS:g} s from a person's request on ÷ without", ">= 0.8"),
    "M1": ("api gunicorn workers peak RSS (VmHWM, each; lmsp serve's and B4b's)", "<= 200 MiB"),
    **fairness.FIGURES,
    **models_bench.FIGURES,
    **slowlink.FIGURES,
}


def figs(*ids: str) -> list[tuple[str, str, str]]:
    return [(f, *FIGURES[f]) for f in ids if enabled(PART_OF.get(f, f))]


PART_OF = {"B4b": "B4", "T1": "B1", "V1c": "V1", "B6t": "B6"}  # measured by another figure's run
FAIRNESS = tuple(fairness.FIGURES)


def main() -> int:
    global STDOUT_FD
    select(sys.argv[1:])
    # vLLM logs to stdout (here and in its engine processes): send everything but the table to stderr.
    sys.stdout.flush()
    STDOUT_FD = os.dup(1)
    os.dup2(2, 1)
    from api.serve import gunicorn_argv
    from common.db import make_engine, session_factory, upgrade
    from common.registry import ModelSpec, detect_machine, resolve_engine
    from common.settings import Settings
    from tests.bench import service as svc
    from tests.harness import REDIS_URL, Stack, create_database, drop_database, free_port, model_entry

    started = time.monotonic()
    table = Table()
    tag = uuid.uuid4().hex[:6]
    served, parked = f"smollm2:bench{tag}", f"smollm2:park{tag}"
    tmp = Path(tempfile.mkdtemp(prefix="lmsp-bench-"))
    log(f"reps={REPS}; figures {sorted(ONLY) or 'all'}; redis {REDIS_URL}; logs in {tmp}")
    db_url = create_database("lmsp_bench")
    stack, pair = None, []
    meta: dict = {"reps": REPS, "served_model": served, "parked_model": parked, "logs": str(tmp)}
    try:
        upgrade(db_url)
        entry = model_entry(served, engine=dict(ENGINE_ARGS), kv_cache_gib=KV_CACHE_GIB)
        machine = detect_machine()
        resolved = resolve_engine(ModelSpec(**entry), machine)  # what the worker will run
        meta["engine"] = {**resolved.resolved, "args": resolved.args}
        log(f"engine settings: {resolved.summary()}; args {resolved.args}")
        pair = models_bench.entries(model_entry, tag, ENGINE_ARGS, KV_CACHE_GIB)  # S1-S3: one worker, two models
        stack = Stack(tmp, db_url, redis=True, models=[
            entry, model_entry(parked, engine=dict(ENGINE_ARGS), kv_cache_gib=KV_CACHE_GIB, queue_depth=10**7),
            *pair])
        stack.env.update(PRODUCTION_ENV)
        stack.env.update(LIMITS_ENV)
        stack.env["LMSP_TRACE_TOKEN_TIMES"] = str(tmp / "token-times.log")  # B4: each delta's engine token time
        db = make_engine(db_url, pool_size=4, max_overflow=8)
        sessions = session_factory(db)
        token = stack.token("bench")
        b3_token = stack.token("bench-b3")

        # The api exactly as `lmsp serve` runs it (gthread, LMSP_API_WORKERS x LMSP_API_THREADS).
        prod = Settings(host="127.0.0.1", port=free_port())
        meta["api"] = f"gunicorn gthread {prod.api_workers} workers x {prod.api_threads} threads"
        api_proc = stack.spawn(gunicorn_argv(prod), "api-prod.log")
        base = f"http://127.0.0.1:{prod.port}"
        wait_http(base + "/healthz", tmp / "api-prod.log")
        log(f"api up at {base} ({meta['api']})")
        run = svc.Run(stack=stack, db_url=db_url, sessions=sessions, api=base, api_proc=api_proc, token=token,
                      principal="bench", served=served, parked=parked, b3_token=b3_token, b3_principal="bench-b3")
        run.redis_url = REDIS_URL
        meta["boot_probe"] = probe = boot_probe(run)
        bad = sum(n for c, n in probe["statuses"].items() if c != "202")
        table.add("P0", FIGURES["P0"][0], f"{16 - bad}/16 accepted",
                  "; ".join(probe.get("api_log_errors", []))[:60] or "-", bad, "0 failed", bad == 0,
                  unit=" failed", details=probe)

        # ---- phase 1: no engine anywhere: the api alone -------------------------------------------------
        if enabled("B3"):
            guarded(table, figs("B3"), lambda: b3(run, table), log)
        if enabled("B5"):
            guarded(table, figs("B5"), lambda: b5(run, table), log)
        if enabled("D1"):
            guarded(table, figs("D1"), lambda: d1(table, entry, machine), log)
        if figs(*FAIRNESS):  # simulated GPUs: no engine takes the CPU
            guarded(table, figs(*FAIRNESS), lambda: fairness.figures(table, db_url, tmp / "fairness"), log)
        if enabled("B7"):  # a simulated GPU: the link is what is measured
            guarded(table, figs("B7"), lambda: slowlink.figures(table, db_url, tmp / "slowlink"), log)

        # ---- phase 2: engines, only one ever running -----------------------------------------------------
        # The idle side is frozen with SIGSTOP, so it takes no CPU, and the reps of the sides
        # alternate, so the noise of this shared machine falls on all alike.
        phase2 = figs("B1", "B2", "V1", "V1c", "V2", "V3", "B4", "B4b", "B6", "B6t")
        if phase2 or enabled("B0"):
            sides = Sides(run, meta)
            try:
                guarded(table, phase2, lambda: engine_phase(run, table, sides, entry, resolved), log)
            finally:
                sides.close()
        memory(run, table)

        # ---- phase 3: a worker of two models, alone (phase 2's engines have stopped) -----------------------
        if any(enabled(f) for f in ("S1", "S2", "S3")):
            if run.worker_proc is not None:
                stack.stop(run.worker_proc)
            guarded(table, figs("S1", "S2", "S3"),
                    lambda: models_bench.model_switch(run, table, *(m["id"] for m in pair)), log)
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - still print what was measured, and fail
        import traceback
        traceback.print_exc()
        meta["error"] = "interrupted (SIGINT/SIGTERM)" if isinstance(exc, KeyboardInterrupt) else \
            f"{type(exc).__name__}: {exc}"
        table.fail("--", "bench aborted", "-", meta["error"][:300])
    finally:
        if stack is not None:
            log("stopping processes")
            stack.close()
        cleanup_redis(REDIS_URL, [served, parked, *(m["id"] for m in pair)])
        drop_database(db_url)
    for fid, name, goal in figs(*FIGURES):  # whatever aborted, nothing enabled is silently missing
        if not table.has(fid):
            table.fail(fid, name, goal, meta.get("error", "not measured"))
    meta["runtime_s"] = round(time.monotonic() - started, 1)
    head = f"pinning: {meta.get('pinning', 'no engine ran')}\nengine: {meta.get('engine', {}).get('args')}\n"
    text = (head + table.render() + f"\nruntime {meta['runtime_s']:.0f} s, reps {REPS}; {meta.get('api', '')}; "
            f"{len(table.failures())} FAIL\n")
    os.write(STDOUT_FD, text.encode())
    OUT.write_text(json.dumps({"meta": meta, "figures": table.rows, "info": table.info}, indent=1, default=str))
    log(f"wrote {OUT}")
    return table.exit_code()


class Sides:
    """Which engine may use the CPU now: the engine alone, the service's worker or vLLM's server."""

    def __init__(self, run, meta: dict):
        self.run = run
        self.meta = meta
        self.engine = None
        self.freezers: dict[str, Freezer] = {}
        self.pinning: dict[str, dict] = {}

    def add(self, name: str, pids_fn, main_pid: int, pinned: list[int] | None) -> None:
        self.freezers[name] = Freezer(name, pids_fn)
        self.pinning[name] = {"non-compute threads": pinned, "engine compute": engine_compute_cpus(main_pid)}
        self.meta["pinning"] = self.describe()

    def describe(self) -> str:
        return "; ".join(f"{n}: non-compute threads on CPUs {p['non-compute threads'] or 'unpinned'}, engine "
                         f"compute on {p['engine compute']}" for n, p in self.pinning.items()) + \
            " (api, Postgres, Redis and the bench's clients unpinned on every side)"

    def unequal(self) -> str | None:
        """Why the sides are not on equal CPU terms, or None."""
        seen = {json.dumps(p, sort_keys=True) for p in self.pinning.values()}
        return None if len(seen) <= 1 else f"CPU pinning differs between sides: {self.describe()}"

    def use(self, name: str) -> None:
        for other, f in self.freezers.items():
            if other != name:
                f.freeze()
        frozen_for = self.freezers[name].thaw()
        if name == "service" and frozen_for > 20:  # its heartbeat may be past the lease: "ready" again
            wait_ready(self.run)

    def drop(self, name: str, stop) -> None:
        f = self.freezers.pop(name, None)
        if f is not None:
            f.thaw()
        stop()

    def close(self) -> None:
        for f in self.freezers.values():
            f.thaw()
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def cpu_meter(groups: dict):
    """CPU seconds (user + system, from /proc) of groups of processes from now to its stop(): fleet's
    Meter (imported here, where it is used: tests.bench.fleet imports this module)."""
    from tests.bench.fleet import Meter
    return Meter(groups).start()


def cpu_used(meter) -> dict:
    return {name: round(cpu, 2) for name, cpu in meter.stop().items() if name != "seconds"}


def service_cpu(run) -> dict:
    """Every process of the service, for cpu_meter: the api (gunicorn master and workers), the worker,
    its engine's processes, the Postgres server it writes to (the postmaster and every process it
    started: background writers and each connection's backend) and the Redis server it publishes on.
    The servers are counted whole: an upper bound if anything else used them meanwhile."""
    from tests.bench import service as svc
    postmaster, redis_pid = svc.server_pids(run)
    return {"api": lambda: tree(run.api_proc), "worker main process": lambda: tree(run.worker_proc)[:1],
            "engine processes": lambda: tree(run.worker_proc)[1:],
            "postgres": lambda: [postmaster, *descendants(postmaster)], "redis": lambda: [redis_pid]}


def wait_ready(run, timeout: float = 60) -> None:
    from tests.bench import service as svc
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = svc.session_for(run.token).get(f"{run.api}/lmsp/v1/models/{run.served}", timeout=30)
        if r.ok and r.json()["status"] == "ready":
            return
        time.sleep(0.5)
    raise TimeoutError(f"model {run.served} not ready after the worker resumed")


def engine_phase(run, table: Table, sides: Sides, entry: dict, resolved) -> None:
    """The worker and, for B1/B2, the engine alone; then vLLM's server (V); then B4 and B6."""
    from tests.bench.engine_side import EngineSide
    if enabled("B1") or enabled("B2") or enabled("B0"):
        log("engine-alone: loading AsyncLLM (EngineHost, pinned as the worker) in its own process")
        sides.engine = EngineSide(run.stack, entry["checkpoint"], resolved)
        sides.add("engine", sides.engine.pids, sides.engine.proc.pid, sides.engine.pinned)
        sides.use("engine")
        engine_warmup(sides.engine, prompt_ids(entry["checkpoint"]))
        sides.freezers["engine"].freeze()
    log("service: starting the worker (loads its engine)")
    t = time.monotonic()
    run.worker_proc = run.stack.start_worker(run.served, f"bench-{run.served.rsplit('bench', 1)[1]}")
    log(f"service: worker ready in {time.monotonic() - t:.0f}s")
    sides.add("service", lambda: tree(run.worker_proc), run.worker_proc.pid, affinity(run.worker_proc.pid)
              if engine_compute_cpus(run.worker_proc.pid) and affinity(run.worker_proc.pid) != affinity(0) else None)
    sides.use("service")
    service_warmup(run)
    if sides.engine is not None:
        encode = prompt_ids(entry["checkpoint"])
        if enabled("B1"):
            guarded(table, figs("B1", "T1"), lambda: b1(run, table, sides, encode), log)
        if enabled("B2"):
            guarded(table, figs("B2"), lambda: b2(run, table, sides, encode), log)
        if enabled("B0"):
            guarded(table, [], lambda: b0(run, table, sides, encode), log)
        sides.drop("engine", sides.engine.shutdown)
        sides.engine = None
        log("engine-alone: shut down")
    sides.use("service")
    # The cheaper figures first: a run cut short (SIGTERM) still has them.
    if enabled("B6"):
        guarded(table, figs("B6", "B6t"), lambda: b6(run, table), log)
    if any(enabled(f) for f in ("V1", "V2", "V3")):
        guarded(table, figs("V1", "V1c", "V2", "V3"), lambda: vllm_figures(run, table, sides, entry["checkpoint"],
                                                                    resolved), log)
    if enabled("B4"):
        guarded(table, figs("B4", "B4b"), lambda: b4(run, table), log)


def prompt_ids(checkpoint: str):
    """text -> the token ids the worker generates from (common.prompt.render, the checkpoint's tokenizer)."""
    from common.prompt import load_tokenizer, render
    from common.protocol import ResponseRequest
    tok = load_tokenizer(checkpoint)
    return lambda text: tok.encode(render(tok, ResponseRequest.model_validate({"model": "m",
                                                                                "input": essay_user(text)})))


# -- warm-ups ----------------------------------------------------------------------------------------------------------
def engine_warmup(engine, encode) -> None:
    log("engine-alone: warm-up (64 short requests, 3 single)")
    engine.batch([encode(essay_prompt(i)) for i in range(B1_TASKS)], 4)
    for _ in range(3):
        engine.one(encode(B2_PROMPT), B2_TOKENS)


def service_warmup(run) -> None:
    from tests.bench import service as svc
    log("service: warm-up (64 short tasks, 3 streams)")
    svc.tasks_round(run, [essay_prompt(i) for i in range(B1_TASKS)], 4)
    for _ in range(3):
        svc.stream_ttft(run, B2_PROMPT, B2_TOKENS)


def rotated(sides: list[str], rep: int) -> list[str]:
    """Rep ``rep``'s order: each side goes first in turn, so drift in the machine's load hits all alike."""
    k = rep % len(sides)
    return sides[k:] + sides[:k]


def checked(got: dict[str, list[dict]], baseline: str) -> list[str]:
    """Every rep of every side against the baseline's first rep: the same texts and token totals."""
    ref = got[baseline][0] if got[baseline] else None
    if ref is None:
        return [f"no {baseline} rep"]
    return [output_mismatch(f"{side} rep {i + 1}", ref, r) for side, reps in got.items()
            for i, r in enumerate(reps)]


def lean(reps: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("texts", "timelines")} for r in reps]


def b1(run, table: Table, sides: Sides, encode) -> None:
    from tests.bench import service as svc
    texts = [essay_prompt(i) for i in range(B1_TASKS)]
    prompts = [encode(t) for t in texts]
    got: dict[str, list] = {"engine": [], "service": [], "host": []}
    for rep in range(REPS):
        for side in rotated(["engine", "host", "service"] if enabled("B1H") else ["engine", "service"], rep):
            if side == "service":
                sides.use("service")
                cpu = cpu_meter(service_cpu(run))
                r = svc.tasks_round(run, texts, B1_TOKENS)
            else:
                sides.use("engine")
                cpu = cpu_meter({"engine-alone processes": sides.engine.pids})
                r = sides.engine.batch(prompts, B1_TOKENS, mode="bare" if side == "engine" else "host")
            r["cpu_s"] = cpu_used(cpu)
            got[side].append(r)
            log(f"B1 rep {rep + 1}/{REPS} {side}: {r['tokens']} tokens in {r['elapsed']:.1f}s = "
                f"{r['tokens_per_s']:.1f} tok/s; CPU s {r['cpu_s']}")
    rate = {k: [r["tokens_per_s"] for r in v] for k, v in got.items()}
    ratios = [s / e for s, e in zip(rate["service"], rate["engine"], strict=True)]
    table.add_reps("B1", FIGURES["B1"][0], FIGURES["B1"][1], lambda m: m >= 0.95, ratios,
                   service=f"{median(rate['service']):.1f} tok/s", baseline=f"{median(rate['engine']):.1f} tok/s",
                   problems=checked(got, "engine") + [sides.unequal()],
                   details={k: lean(v) for k, v in got.items()})
    timeline_figure(table, [line for r in got["service"] for line in r["timelines"]])
    if rate["host"]:
        host = spread([h / e for h, e in zip(rate["host"], rate["engine"], strict=True)])
        table.note(f"B1h EngineHost (the worker's wrapper: admission gate, thread hand-offs) ÷ bare AsyncLLM, same "
                   f"engine: {host[0]:.3f} ({host[1]:.3f}-{host[2]:.3f}); {median(rate['host']):.1f} tok/s")


def timeline_figure(table: Table, lines: list) -> None:
    """T1 (issue 24): the framework's share of a task's wall time, from B1's tasks' own timelines
    (x-lmsp-timeline: dispatch + prompt rendering + write lag, over created -> final event committed)."""
    name, goal = FIGURES["T1"]
    lines = [line for line in lines if line and line.get("durations") and line["wall"] > 0]
    if not lines:
        table.fail("T1", name, goal, "no task carried a timeline")
        return
    shares = sorted(line["durations"]["framework_overhead"] / line["wall"] for line in lines)
    p50, p99 = median(shares), shares[min(len(shares) - 1, int(0.99 * len(shares)))]
    phases = {p: median([line["durations"][p] for line in lines]) for p in lines[0]["durations"]}
    table.add("T1", name, f"p50 {100 * p50:.2f}%", "-", 100 * p99, goal, p99 <= 0.05, unit="% (p99)", details={
        "tasks": len(lines), "median_phase_seconds": phases, "median_wall_s": median([x["wall"] for x in lines])})


def blocks_of(n_total: int) -> list[int]:
    """Sizes of interleaved blocks: at least MIN_REPS of them, every sample in one."""
    blocks = max(REPS, MIN_REPS)
    return [n_total // blocks + (1 if b < n_total % blocks else 0) for b in range(blocks)]


def b2(run, table: Table, sides: Sides, encode) -> None:
    from tests.bench import service as svc
    prompt = encode(B2_PROMPT)
    diffs, s_all, e_all, problems = [], [], [], []
    ref = None
    for block, n in enumerate(blocks_of(B2_REQUESTS)):
        s_t, e_t = [], []
        for side in rotated(["engine", "service"], block):
            sides.use(side)
            for _ in range(n):
                if side == "engine":
                    r = sides.engine.one(prompt, B2_TOKENS)
                    e_t.append(r["first_text"])
                else:
                    r = svc.stream_ttft(run, B2_PROMPT, B2_TOKENS)
                    s_t.append(r["ttft"])
                ref = ref or {"texts": [r["text"]], "tokens": r["tokens"]}
                problems.append(output_mismatch(f"{side} block {block + 1}", ref,
                                                {"texts": [r["text"]], "tokens": r["tokens"]}))
        if None in s_t or None in e_t:
            problems.append(f"block {block + 1}: a request without text ({s_t}, {e_t})")
            continue
        diffs.append(1000 * (percentile(s_t, 50) - percentile(e_t, 50)))
        s_all += s_t
        e_all += e_t
        log(f"B2 block {block + 1}: service p50 {fmt_ms(percentile(s_t, 50))}, engine first text p50 "
            f"{fmt_ms(percentile(e_t, 50))}")
    table.add_reps("B2", FIGURES["B2"][0], FIGURES["B2"][1], lambda m: m <= 30, diffs, unit=" ms",
                   service=fmt_ms(percentile(s_all, 50)), baseline=fmt_ms(percentile(e_all, 50)),
                   problems=problems + [sides.unequal()],
                   details={"service_ms": [1000 * x for x in s_all], "engine_ms": [1000 * x for x in e_all]})
    if s_all and e_all:
        table.note(f"B2 p95: service {fmt_ms(percentile(s_all, 95))}, bare engine {fmt_ms(percentile(e_all, 95))}")


def b0(run, table: Table, sides: Sides, encode) -> None:
    """Issue 3's figure (a note): one request's output tokens/s through the api ÷ the engine alone."""
    from tests.bench import service as svc
    ratios = []
    for rep in range(REPS):
        rates = {}
        for side in rotated(["engine", "service"], rep):
            sides.use(side)
            if side == "engine":
                one = sides.engine.one(encode(B0_PROMPT), B0_TOKENS)
                rates[side] = one["tokens"] / one["elapsed"]
            else:
                one = svc.stream_ttft(run, B0_PROMPT, B0_TOKENS)
                rates[side] = one["tokens"] / one["end"]
        ratios.append(rates["service"] / rates["engine"])
    s = spread(ratios)
    table.note(f"B0 single-request tokens/s, streaming POST /responses ÷ bare engine: {s[0]:.3f} ({s[1]:.3f}-{s[2]:.3f})")


def vllm_figures(run, table: Table, sides: Sides, checkpoint: str, resolved) -> None:
    """V1-V3: the same workloads against vLLM's own OpenAI server, reps alternating with the service."""
    from tests.bench import service as svc
    from tests.bench.vllm_side import VllmServer
    from tests.harness import free_port
    server = VllmServer(run.stack, checkpoint, resolved, free_port())
    try:
        t = time.monotonic()
        server.wait_ready()
        log(f"vllm-server: ready in {time.monotonic() - t:.0f}s")
        sides.add("vllm", server.pids, server.proc.pid, pin_off_engine(server.proc.pid))
        sides.use("vllm")
        server.batch([essay_prompt(i) for i in range(B1_TASKS)], 4)
        for _ in range(3):
            server.stream_ttft(B2_PROMPT, B2_TOKENS)
        if enabled("V3"):
            ttft_figure(run, table, server, sides)
        texts = [essay_prompt(i) for i in range(B1_TASKS)]
        got: dict[str, list] = {"vllm": [], "tasks": [], "responses": []}
        if enabled("V1") or enabled("V2"):
            for rep in range(REPS):
                for side in rotated(["vllm", "tasks", "responses"], rep):
                    sides.use("vllm" if side == "vllm" else "service")
                    if side == "vllm":
                        cpu = cpu_meter({"vLLM api server": lambda: server.pids()[:1],
                                         "vLLM engine processes": lambda: server.pids()[1:]})
                        got[side].append(server.batch(texts, B1_TOKENS))
                    else:
                        cpu = cpu_meter(service_cpu(run))
                        threads = ThreadMeter(run.worker_proc.pid).start()
                        fn = svc.tasks_round if side == "tasks" else svc.responses_round
                        got[side].append(fn(run, texts, B1_TOKENS))
                        got[side][-1]["worker_threads_s"] = threads.stop()
                    got[side][-1]["cpu_s"] = cpu_used(cpu)
                    log(f"V rep {rep + 1}/{REPS} {side}: {got[side][-1]['tokens_per_s']:.1f} tok/s "
                        f"(CPU s {got[side][-1]['cpu_s']})")
            throughput_figures(table, got, sides.unequal())
            cpu_figure(table, got)
    finally:
        sides.drop("vllm", lambda: run.stack.stop(server.proc))
        sides.use("service")
        log("vllm-server: stopped")


def throughput_figures(table: Table, got: dict, unequal: str | None) -> None:
    rate = {k: [r["tokens_per_s"] for r in v] for k, v in got.items()}
    details = {k: lean(v) for k, v in got.items()}
    problems = checked(got, "vllm") + [unequal]
    for fid, key, floor in (("V1", "tasks", 1.0), ("V2", "responses", 0.95)):
        ratios = [s / v for s, v in zip(rate[key], rate["vllm"], strict=True)]
        mine = [p for p in problems if p and not p.startswith(("tasks", "responses")) or p and p.startswith(key)]
        table.add_reps(fid, FIGURES[fid][0], FIGURES[fid][1], lambda m, f=floor: m >= f, ratios,
                       service=f"{median(rate[key]):.1f} tok/s", baseline=f"{median(rate['vllm']):.1f} tok/s",
                       problems=mine, details=details)


def cpu_figure(table: Table, got: dict) -> None:
    """V1c: CPU seconds per output token of every process of each side in V1's reps (the bench's own
    clients on neither), the service's tasks ÷ vLLM's server, rep by rep; V2's direct requests a note."""
    per_token = {k: [sum(r["cpu_s"].values()) / r["tokens"] for r in v] for k, v in got.items()}
    name, goal = FIGURES["V1c"]
    ratios = {k: [s / v for s, v in zip(per_token[k], per_token["vllm"], strict=True)] for k in ("tasks", "responses")}
    table.add_reps("V1c", name, goal, lambda m: m <= 1.03, ratios["tasks"],
                   service=f"{1000 * median(per_token['tasks']):.2f} CPU-ms/tok",
                   baseline=f"{1000 * median(per_token['vllm']):.2f} CPU-ms/tok",
                   details={"cpu_s": {k: [r["cpu_s"] for r in v] for k, v in got.items()}})
    if ratios["responses"]:
        s = spread(ratios["responses"])
        table.note(f"V2c CPU per output token, {B1_TASKS} concurrent POST /responses ÷ vLLM server: "
                   f"{s[0]:.3f} ({s[1]:.3f}-{s[2]:.3f})")
    for side, reps in got.items():
        ms = {g: 1000 * median([r["cpu_s"][g] / r["tokens"] for r in reps]) for g in reps[0]["cpu_s"]} if reps else {}
        table.note(f"V1c {side} CPU-ms per output token by process: " + ", ".join(f"{g} {v:.3f}" for g, v in ms.items()))
        if reps and "worker_threads_s" in reps[0]:  # where the worker's own share goes
            names = {n for r in reps for n in r["worker_threads_s"]}
            by = {n: 1000 * median([r["worker_threads_s"].get(n, 0.0) / r["tokens"] for r in reps]) for n in names}
            table.note(f"V1c {side} worker main process by thread, CPU-ms per output token: " + ", ".join(
                f"{n} {v:.3f}" for n, v in sorted(by.items(), key=lambda kv: -kv[1]) if v >= 0.001))


def ttft_figure(run, table: Table, server, sides: Sides) -> None:
    """30 sequential 8-token streams on each side, in interleaved blocks; per block p50 minus p50."""
    from tests.bench import service as svc
    diffs, s_all, v_all, problems, ref = [], [], [], [], None
    for block, n in enumerate(blocks_of(B2_REQUESTS)):
        s_t, v_t = [], []
        for side in rotated(["vllm", "service"], block):
            sides.use(side)
            for _ in range(n):
                r = server.stream_ttft(B2_PROMPT, B2_TOKENS) if side == "vllm" else \
                    svc.stream_ttft(run, B2_PROMPT, B2_TOKENS)
                (v_t if side == "vllm" else s_t).append(r["ttft"])
                ref = ref or {"texts": [r["text"]], "tokens": r["tokens"]}
                problems.append(output_mismatch(f"{side} block {block + 1}", ref,
                                                {"texts": [r["text"]], "tokens": r["tokens"]}))
        if None in s_t or None in v_t:
            problems.append(f"block {block + 1}: a stream without text")
            continue
        diffs.append(1000 * (percentile(s_t, 50) - percentile(v_t, 50)))
        s_all += s_t
        v_all += v_t
    table.add_reps("V3", FIGURES["V3"][0], FIGURES["V3"][1], lambda m: m <= 10, diffs, unit=" ms",
                   service=fmt_ms(percentile(s_all, 50)), baseline=fmt_ms(percentile(v_all, 50)),
                   problems=problems + [sides.unequal()],
                   details={"service_ms": [1000 * x for x in s_all], "vllm_ms": [1000 * x for x in v_all]})
    if s_all and v_all:
        table.note(f"V3 p95: service {fmt_ms(percentile(s_all, 95))}, vLLM server {fmt_ms(percentile(v_all, 95))}")


def b3(run, table: Table) -> None:
    from tests.bench import service as svc
    pids = svc.api_workers(run)
    queue = svc.queue_of(run.parked)
    body = {"type": "response", "input": {"model": run.parked, "input": svc.user("Write a haiku about rain."),
                                          "max_output_tokens": 16}}
    trivial = lambda s: svc.hammer(run.api, "GET", "/lmsp/v1", run.b3_token, None, s, B3_THREADS, 200, pids)  # noqa: E731

    def accept(seconds):
        # POST /tasks answers 202 before its broker message is sent (a background thread sends it):
        # a task counts only once its message is in the broker, so the window ends when the last is.
        svc.clear_broker(run.redis_url, queue)
        r = svc.hammer(run.api, "POST", "/lmsp/v1/tasks", run.b3_token, body, seconds, B3_THREADS, 202, pids)
        sent_after = svc.wait_broker(run.redis_url, queue, r["ok"], r["start"])
        r["sent_lag_s"] = sent_after - r["elapsed"]
        r["elapsed"] = max(r["elapsed"], sent_after)
        r["rate"] = r["ok"] / r["elapsed"]
        return r

    warm = {"trivial": trivial(1.0), "accept": accept(1.0)}
    for k, w in warm.items():
        if w["errors"]:
            log(f"B3 warm-up {k}: {w['ok']} ok, errors {w['errors']}: {w['error_samples'][:1]}")
    t_rounds, a_rounds = [], []
    for rep in range(REPS):
        for side in rotated(["trivial", "accept"], rep):  # alternate which goes first
            (t_rounds if side == "trivial" else a_rounds).append((trivial if side == "trivial" else accept)(B3_SECONDS))
        log(f"B3 rep {rep + 1}/{REPS}: GET /lmsp/v1 {t_rounds[-1]['rate']:.0f}/s "
            f"({t_rounds[-1]['api_cpu_ms_per_req']:.1f} ms api CPU/req), POST /tasks {a_rounds[-1]['rate']:.0f}/s "
            f"({a_rounds[-1]['api_cpu_ms_per_req'] or 0:.1f} ms api CPU/req, last message sent "
            f"{a_rounds[-1]['sent_lag_s']:.3f}s after the last 202), errors {a_rounds[-1]['errors']}")
    errors = [f"{r['errors']} {r['error_samples'][:1]}" for r in a_rounds + t_rounds if r["errors"]]
    ratios = [a["rate"] / t["rate"] for a, t in zip(a_rounds, t_rounds, strict=True)]
    table.add_reps("B3", FIGURES["B3"][0], FIGURES["B3"][1], lambda m: m >= 0.5, ratios,
                   service=f"{median([r['rate'] for r in a_rounds]):.0f} req/s",
                   baseline=f"{median([r['rate'] for r in t_rounds]):.0f} req/s",
                   problems=[f"errors: {e}" for e in errors[:2]],
                   details={"accept": a_rounds, "trivial": t_rounds, "warm_up": warm})


def b5(run, table: Table) -> None:
    from tests.bench import service as svc
    log(f"B5: writing {B5_EVENTS} events")
    made = svc.make_long_log(run, B5_EVENTS)
    svc.select_once(run, made["response_id"])  # warm the cache for both sides
    svc.replay_once(run, made["task_id"])
    reps_r, reps_s, problems = [], [], []
    for rep in range(max(REPS, MIN_REPS)):
        for side in rotated(["endpoint", "select"], rep):
            if side == "endpoint":
                reps_r.append(svc.replay_once(run, made["task_id"]))
            else:
                reps_s.append(svc.select_once(run, made["response_id"]))
        r, s = reps_r[-1], reps_s[-1]
        if r["events"] != B5_EVENTS or s["rows"] != B5_EVENTS:
            problems.append(f"rep {rep + 1}: replayed {r['events']} events, selected {s['rows']} rows, "
                            f"expected {B5_EVENTS}")
        log(f"B5 rep {rep + 1}: endpoint {r['rate']:.0f} events/s ({r['elapsed']:.2f}s), "
            f"SELECT {s['rate']:.0f} rows/s ({s['elapsed']:.2f}s)")
    ratios = [r["rate"] / s["rate"] for r, s in zip(reps_r, reps_s, strict=True)]
    table.add_reps("B5", FIGURES["B5"][0], FIGURES["B5"][1], lambda m: m >= 0.5, ratios,
                   service=f"{median([x['rate'] for x in reps_r]):.0f} ev/s",
                   baseline=f"{median([x['rate'] for x in reps_s]):.0f} rows/s", problems=problems,
                   details={"endpoint": reps_r, "select": reps_s})


def b4(run, table: Table) -> None:
    from tests.bench import service as svc
    # The goal on the production configuration (lmsp serve's settings); then an api with a stream slot
    # per follower, to tell the fan-out path's own latency apart from refusals.
    threads = max(256, B4_CLIENTS // 2 + 32)
    sized_base, sized_proc = start_api(run.stack, "api-sized.log", workers=2, threads=threads)
    run.notes.append(sized_proc)  # its workers count for M1
    for fid, base, label in (("B4", run.api, "production api"), ("B4b", sized_base, f"api 2x{threads} threads")):
        reps, problems = [], []
        for rep in range(B4_REPS):
            r = svc.fan_out(run, base, B4_CLIENTS, B4_TOKENS, essay_prompt(rep + 7))
            log(f"{fid} rep {rep + 1}/{B4_REPS} ({label}): {r['events']} events, {r['complete']}/{r['clients']} "
                f"complete, {r['n_errors']} failed, all connected after {r['all_connected_after_s'] or 0:.1f}s; "
                f"lag from the engine's token p50 {r['p50_ms'] or 0:.1f} p99 {r['p99_ms'] or 0:.1f} ms "
                f"({r['samples']} samples); from INSERT p99 {r['insert_p99_ms'] or 0:.1f} ms; {r['errors'][:1]}")
            reps.append(r)
            if r["samples"] < B4_MIN_SAMPLES:
                problems.append(f"rep {rep + 1}: {r['samples']} lag samples, at least {B4_MIN_SAMPLES} needed")
            if r["complete"] != B4_CLIENTS:
                problems.append(f"rep {rep + 1}: {r['complete']}/{B4_CLIENTS} followers got every event "
                                f"({r['n_errors']} failed, e.g. {r['errors'][:1]})")
        table.add_reps(fid, FIGURES[fid][0], FIGURES[fid][1], lambda m: m <= 100, [r["p99_ms"] for r in reps],
                       unit=" ms", min_reps=B4_REPS, problems=problems[:3],
                       service=f"p50 {median([r['p50_ms'] for r in reps]) or 0:.0f} ms",
                       baseline=f"{min(r['complete'] for r in reps)}/{B4_CLIENTS} served",
                       details={"reps": reps})


def b6(run, table: Table) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from tests.bench import service as svc
    idle = [svc.stream_ttft(run, B2_PROMPT, B2_TOKENS)["ttft"] for _ in range(max(REPS, MIN_REPS))]
    log(f"B6 idle TTFT: {[round(1000 * x) for x in idle]} ms")
    loaded, kept, states, problems = [], [], [], []
    try:
        with ThreadPoolExecutor(16) as pool:
            load = Background(run, pool)
            # Each sample is two windows of B6_WINDOW_SECONDS at a verified full batch, one with a
            # person's request sent at its start and one without, in alternating order: the
            # background's tokens in the one ÷ in the other is what that person cost it.
            for sample in range(B6_SAMPLES):
                tokens = {}
                for side in rotated(["person", "quiet"], sample):
                    state = load.full()
                    if state is None:
                        problems.append(f"sample {sample + 1}: no full batch with {B6_QUEUED} queued within "
                                        f"120 s (last seen {load.state})")
                        break
                    t0, own = time.time(), 0
                    if side == "person":
                        r = svc.stream_ttft(run, B2_PROMPT, B2_TOKENS)
                        loaded.append(r["ttft"])
                        states.append(state)
                        own = r["tokens"] or 0
                    time.sleep(max(0.0, t0 + B6_WINDOW_SECONDS - time.time()))
                    tokens[side] = svc.traced_tokens(run, t0, t0 + B6_WINDOW_SECONDS) - own
                if len(tokens) == 2:
                    kept.append(tokens["person"] / tokens["quiet"])
                    log(f"B6 sample {sample + 1}/{B6_SAMPLES}: TTFT {fmt_ms(loaded[-1])} at {states[-1]}; "
                        f"background {tokens['person']} tokens with the person, {tokens['quiet']} without")
    finally:
        cancelled = svc.cancel_unfinished(run, run.served)
        log(f"B6: cancelled {cancelled} load tasks")
        svc.wait_idle(run, run.served, 120)
    base = median(idle)
    table.add_reps("B6", FIGURES["B6"][0], FIGURES["B6"][1], lambda m: m <= 2,
                   [x / base for x in loaded if x is not None], min_reps=B6_SAMPLES, problems=problems[:3],
                   service=fmt_ms(median(loaded)), baseline=fmt_ms(base),
                   details={"idle_ms": [1000 * x for x in idle], "loaded_ms": [1000 * x for x in loaded],
                            "states": states})
    table.add_reps("B6t", FIGURES["B6t"][0], FIGURES["B6t"][1], lambda m: m >= 0.8, kept, min_reps=B6_SAMPLES,
                   problems=problems[:3], details={"kept": kept})


class Background:
    """B6's load: tasks submitted to keep B6_QUEUED queued behind a full batch."""

    def __init__(self, run, pool):
        self.run, self.pool, self.n, self.state = run, pool, 0, None

    def top_up(self) -> None:
        from tests.bench import service as svc
        missing = B6_QUEUED - svc.count_status(self.run, self.run.served, ("queued",))
        if missing > 0:
            texts = [essay_prompt(self.n + i) for i in range(missing)]
            self.n += missing
            list(self.pool.map(lambda t: svc.submit_task(self.run.api, self.run.token, self.run.served, t,
                                                          B6_LOAD_TOKENS), texts))

    def full(self, timeout: float = 120) -> dict | None:
        """The batch's state once every slot is running (past its first token) with B6_QUEUED queued
        behind it; None if that is not seen within ``timeout``."""
        from tests.bench import service as svc
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.top_up()
            self.state = svc.batch_state(self.run, self.run.served)
            if svc.loaded(self.state, ENGINE_ARGS["max_num_seqs"], B6_QUEUED):
                return self.state
            time.sleep(0.05)
        return None


def memory(run, table: Table) -> None:
    # Every api the bench started (lmsp serve's, and B4b's with a stream slot per follower).
    apis = [run.api_proc, *run.notes]
    peaks = {p: vm_hwm_mib(p) for proc in apis for p in tree(proc)[1:]}
    peaks = {p: v for p, v in peaks.items() if v is not None}
    if not peaks:
        table.fail("M1", *FIGURES["M1"], "no api worker process was left to read")
    else:
        table.add("M1", FIGURES["M1"][0], ", ".join(f"{v:.0f}" for v in peaks.values()) + " MiB",
                  "masters " + ", ".join(f"{vm_hwm_mib(p.pid) or 0:.0f}" for p in apis) + " MiB",
                  max(peaks.values()), FIGURES["M1"][1], max(peaks.values()) <= 200, unit=" MiB",
                  details={"pids": peaks})
    if run.worker_proc is not None and run.worker_proc.poll() is None:
        main = vm_hwm_mib(run.worker_proc.pid)
        kids = {p: (proc_name(p), vm_hwm_mib(p)) for p in descendants(run.worker_proc.pid)}
        engine = ", ".join(f"{Path(n.split()[0]).name} {v:.0f} MiB" for n, v in kids.values() if v is not None)
        table.note(f"M2 worker main process peak RSS (without engine children): {main:.0f} MiB; engine: {engine}")


def fmt_ms(x):
    return "n/a" if x is None else f"{1000 * x:.1f} ms"


def boot_probe(run) -> dict:
    """The first requests a fresh api gets, 16 at once (a deploy behind a busy load balancer)."""
    from concurrent.futures import ThreadPoolExecutor

    import requests
    body = {"type": "response", "input": {"model": run.parked, "input": essay_user("boot probe"),
                                          "max_output_tokens": 4}}

    def one(_):
        r = requests.post(run.api + "/lmsp/v1/tasks", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {run.b3_token}"})
        return r.status_code

    with ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(one, range(16)))
    # Then one at a time (new connections, so both gunicorn workers get some): these cannot race,
    # and they leave every worker warm for the figures.
    after = [one(0) for _ in range(20)]
    out = {"statuses": {str(c): codes.count(c) for c in sorted(set(codes))},
           "then_sequential": {str(c): after.count(c) for c in sorted(set(after))}}
    if any(c != 202 for c in codes):
        logfile = run.stack.tmp / "api-prod.log"
        errors = [line for line in logfile.read_text(errors="replace").splitlines() if "Error" in line]
        out["api_log_errors"] = sorted(set(errors))[:3]
        log(f"boot probe: 16 concurrent POST /tasks on a fresh api -> {out['statuses']}, then 20 sequential -> "
            f"{out['then_sequential']}; {out['api_log_errors']}")
    return out


def wait_http(url: str, logfile: Path, timeout: float = 60) -> None:
    import requests
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if requests.get(url, timeout=1).ok:
                return
        except requests.RequestException:  # refused, or accepted while the workers still boot
            time.sleep(0.2)
    raise TimeoutError(logfile.read_text()[-3000:])


def start_api(stack, log_name: str, workers: int, threads: int):
    """Like tests.harness.Stack.start_api (same argv), with a wait that survives slow boots: (url, process)."""
    from tests.harness import api_argv, free_port
    port = free_port()
    proc = stack.spawn(api_argv(port, workers, threads), log_name, LMSP_API_THREADS=str(threads))  # its stream slots
    base = f"http://127.0.0.1:{port}"
    wait_http(base + "/healthz", stack.tmp / log_name)
    return base, proc


def d1(table: Table, entry: dict, machine) -> None:
    """The bare engine at bfloat16 and at the dtype ``auto`` resolves to here (tests/bench/dtype.py)."""
    import subprocess

    from common.registry import ModelSpec, resolve_engine
    resolved = resolve_engine(ModelSpec(**{**entry, "engine": {**entry["engine"], "dtype": "auto"}}), machine)
    name, goal = FIGURES["D1"]
    dtype = resolved.args["dtype"]
    if dtype == "bfloat16":  # the figure is about machines without native bf16: this one is not one
        table.na("D1", name, goal, f"bfloat16 is native here ({resolved.resolved['dtype']})", lacking=True)
        return
    runs: dict[str, list[dict]] = {"bfloat16": [], dtype: []}
    for rep in range(REPS):
        for side in rotated(["bfloat16", dtype], rep):
            out = subprocess.run([sys.executable, "-m", "tests.bench.dtype", entry["checkpoint"], side], cwd=ROOT,
                                 capture_output=True, text=True, env={**os.environ, **resolved.env})
            line = next((x for x in out.stdout.splitlines() if x.startswith("LMSP_DTYPE_RESULT ")), None)
            if line is None:
                raise RuntimeError(f"tests.bench.dtype {side} failed: {out.stderr[-1500:]}")
            runs[side].append(json.loads(line.split(" ", 1)[1]))
            log(f"D1 rep {rep + 1}/{REPS} {side}: {runs[side][-1]}")
    ratios = [f["tokens_per_s"] / b["tokens_per_s"] for f, b in zip(runs[dtype], runs["bfloat16"], strict=True)]
    table.add_reps("D1", name, goal, lambda m: m >= 3, ratios,
                   service=f"{dtype} {median([r['tokens_per_s'] for r in runs[dtype]]):.1f} tok/s",
                   baseline=f"bfloat16 {median([r['tokens_per_s'] for r in runs['bfloat16']]):.1f} tok/s",
                   details={"runs": runs, "resolved": resolved.resolved})


def cleanup_redis(url: str, models: list[str]) -> None:
    import redis

    from common.registry import queue_name
    try:
        client = redis.Redis.from_url(url)
        for model in models:
            q = queue_name(model)
            client.delete(q, *(f"{q}:{i}" for i in range(1, 10)), f"_kombu.binding.{q}")
    except redis.RedisError as exc:
        log(f"could not clean Redis: {exc}")


def _interrupt(*_):
    raise KeyboardInterrupt  # unwinds through the finally blocks: thaw, stop processes, drop the database


if __name__ == "__main__":
    import signal
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
