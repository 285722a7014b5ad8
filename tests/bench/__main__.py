"""Run every figure once, side by side, and print one table (see ``tests/bench/__init__``)."""

import json
import os
import statistics
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path

from tests.bench import REPS, enabled
from tests.bench.util import (
    Freezer,
    cpu_seconds,
    descendants,
    essay_prompt,
    log,
    median,
    percentile,
    proc_name,
    vm_hwm_mib,
)
from tests.bench.util import user as essay_user

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
B5_EVENTS = 100_000
B6_QUEUED, B6_LOAD_TOKENS = 200, 128
KV_CACHE_GIB = 2
ENGINE_ARGS = {"dtype": "auto", "max_model_len": 2048, "max_num_seqs": 64, "enforce_eager": True}
# Production settings for every process (tests.harness.Stack sets short test leases).
PRODUCTION_ENV = {"LMSP_LEASE_SECONDS": "30", "LMSP_HEARTBEAT_SECONDS": "5", "LMSP_SWEEP_SECONDS": "10",
                  "LMSP_REQUEUE_AFTER_SECONDS": "60", "LMSP_TASK_DELTA_WINDOW_MS": "200"}
# The bench submits thousands of tasks from one principal: lift the per-principal limits.
LIMITS_ENV = {"LMSP_MAX_QUEUED_TASKS_PER_PRINCIPAL": "10000000", "LMSP_MAX_QUEUE_DEPTH": "10000000",
              "LMSP_MAX_STREAMS_PER_PRINCIPAL": "100000", "LMSP_MAX_FOLLOWERS_PER_PRINCIPAL": "100000",
              "LMSP_RATE_LIMIT_PER_SECOND": "1000000", "LMSP_RATE_LIMIT_BURST": "1000000"}


class Table:
    def __init__(self):
        self.rows: list[dict] = []

    def add(self, fid, name, service, baseline, value, goal, ok, unit="", details=None, na=None):
        self.rows.append({"id": fid, "figure": name, "service": service, "baseline": baseline,
                          "value": value, "unit": unit, "goal": goal,
                          "status": "n/a" if na else ("-" if ok is None else ("PASS" if ok else "FAIL")),
                          "na_reason": na, "details": details or {}})

    def na(self, fid, name, goal, reason):
        log(f"{fid}: n/a: {reason}")
        self.add(fid, name, "n/a", "n/a", None, goal, None, na=reason)

    def render(self) -> str:
        head = ["ID", "Figure", "Service", "Baseline", "Result", "Goal", "Status"]
        lines = []
        for r in self.rows:
            if r["na_reason"]:
                result = "n/a"
            elif isinstance(r["value"], float):
                result = f"{r['value']:.3g}{r['unit']}" if abs(r["value"]) < 1000 else f"{r['value']:.0f}{r['unit']}"
            else:
                result = f"{r['value']}{r['unit']}"
            lines.append([r["id"], r["figure"], str(r["service"]), str(r["baseline"]), result, r["goal"],
                          r["status"]])
        widths = [max(len(h), *(len(row[i]) for row in lines)) for i, h in enumerate(head)]
        fmt = " | ".join(f"{{:<{w}}}" for w in widths)
        out = [fmt.format(*head), "-+-".join("-" * w for w in widths)]
        out += [fmt.format(*row) for row in lines]
        notes = [f"  {r['id']}: n/a because {r['na_reason']}" for r in self.rows if r["na_reason"]]
        return "\n".join(out + notes)


def fmt_ms(x):
    return "n/a" if x is None else f"{1000 * x:.1f} ms"


def main() -> None:
    global STDOUT_FD
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
    log(f"reps={REPS}; logs in {tmp}")
    db_url = create_database("lmsp_bench")
    stack = None
    meta: dict = {"reps": REPS, "served_model": served, "parked_model": parked, "logs": str(tmp)}
    try:
        upgrade(db_url)
        entry = model_entry(served, engine=dict(ENGINE_ARGS), kv_cache_gib=KV_CACHE_GIB)
        resolved = resolve_engine(ModelSpec(**entry), detect_machine())  # what the worker will run
        meta["engine"] = resolved.resolved
        log(f"engine settings: {resolved.summary()}")
        stack = Stack(tmp, db_url, redis=True, models=[
            entry, model_entry(parked, engine=dict(ENGINE_ARGS), kv_cache_gib=KV_CACHE_GIB, queue_depth=10**7)])
        stack.env.update(PRODUCTION_ENV)
        stack.env.update(LIMITS_ENV)
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
        meta["boot_probe"] = probe = boot_probe(run)
        bad = sum(n for c, n in probe["statuses"].items() if c != "202")
        table.add("P0", "first 16 concurrent POST /tasks on a fresh api", f"{16 - bad}/16 accepted",
                  "; ".join(probe.get("api_log_errors", []))[:60] or "-", bad, "0 failed", bad == 0,
                  unit=" failed", details=probe)

        # ---- phase 1: no engine anywhere: the api alone -------------------------------------------------
        if enabled("B3"):
            guarded(table, "B3", "acceptance rate (POST /tasks ÷ GET /lmsp/v1)", ">= 0.5", lambda: b3(run, table))
        if enabled("B5"):
            guarded(table, "B5", "replay 100k events (endpoint ÷ SELECT)", ">= 0.5", lambda: b5(run, table))
        if enabled("D1"):
            guarded(table, "D1", "bare engine tok/s, resolved dtype ÷ bfloat16", ">= 3 without native bf16",
                    lambda: d1(table, entry["checkpoint"], resolved))

        # ---- phase 2: both engines loaded, only one ever running -----------------------------------------------
        # The engine-alone baseline (an EngineHost in this process) and the service's worker take turns:
        # the idle side is frozen with SIGSTOP, so it takes no CPU, and the reps of the two sides
        # alternate, so the noise of this shared machine falls on both alike.
        if any(enabled(f) for f in ("B0", "B1", "B2", "B4", "B6", "V1", "V2", "V3")):
            sides = Sides(run)
            try:
                if enabled("B0") or enabled("B1") or enabled("B2"):
                    from tests.bench.engine_side import EngineSide
                    log("engine-alone: loading EngineHost in the bench process")
                    try:
                        sides.engine = EngineSide(entry["checkpoint"], resolved)
                        sides.engine_freezer = Freezer("engine-alone", sides.engine.pids)
                        sides.engine_freezer.freeze()
                    except Exception as exc:  # noqa: BLE001
                        traceback.print_exc()
                        sides.engine_error = f"the engine-alone side did not load: {type(exc).__name__}: {exc}"
                log("service: starting the worker (loads its engine)")
                try:
                    t = time.monotonic()
                    run.worker_proc = stack.start_worker(served, f"bench-{tag}")
                    log(f"service: worker ready in {time.monotonic() - t:.0f}s")
                except Exception as exc:  # noqa: BLE001
                    reason = f"the worker did not start: {exc}"[:300]
                    for fid in ("B0", "B1", "B2", "B4", "B6"):
                        if enabled(fid):
                            table.na(fid, fid, "-", reason)
                if run.worker_proc is not None:
                    sides.worker_freezer = Freezer("worker", lambda: [run.worker_proc.pid]
                                                   + descendants(run.worker_proc.pid))
                    service_warmup(run)
                    if sides.engine is not None:
                        sides.use_engine()
                        engine_warmup(sides.engine)
                    if enabled("B1"):
                        guarded(table, "B1", "throughput efficiency (64 tasks x 128 tok)", ">= 0.95",
                                lambda: b1(run, table, sides))
                    if enabled("B0"):
                        guarded(table, "B0", "single-request tokens/s", "(info)", lambda: b0(run, table, sides))
                    if enabled("B2"):
                        guarded(table, "B2", "first-token overhead", "p50 <= 30 ms", lambda: b2(run, table, sides))
                    sides.drop_engine()
                    sides.use_service()
                    if any(enabled(f) for f in ("V1", "V2", "V3")):
                        guarded(table, "V", "side by side with vLLM's own OpenAI server", "-",
                                lambda: vllm_figures(run, table, sides, entry["checkpoint"], resolved))
                    if enabled("B4"):
                        guarded(table, "B4", f"fan-out {B4_CLIENTS} SSE followers, p99 lag", "<= 100 ms",
                                lambda: b4(run, table))
                    if enabled("B6"):
                        guarded(table, "B6", f"interactive TTFT, {B6_QUEUED} queued ÷ idle", "<= 2",
                                lambda: b6(run, table))
            finally:
                sides.drop_engine()
                if sides.worker_freezer is not None:
                    sides.worker_freezer.thaw()
        memory(run, table)
    except Exception as exc:  # noqa: BLE001 - still print what was measured
        traceback.print_exc()
        meta["error"] = f"{type(exc).__name__}: {exc}"
        table.na("--", "bench aborted", "-", meta["error"][:300])
    finally:
        if stack is not None:
            log("stopping processes")
            stack.close()
        cleanup_redis(REDIS_URL, [served, parked])
        drop_database(db_url)
    meta["runtime_s"] = round(time.monotonic() - started, 1)
    text = table.render() + f"\nruntime {meta['runtime_s']:.0f} s, reps {REPS}; {meta.get('api', '')}\n"
    os.write(STDOUT_FD, text.encode())
    OUT.write_text(json.dumps({"meta": meta, "figures": table.rows}, indent=1, default=str))
    log(f"wrote {OUT}")


class Sides:
    """Which side may use the CPU now: the engine alone, or the service's worker."""

    def __init__(self, run):
        self.run = run
        self.engine = None
        self.engine_error = "B1/B2 not enabled"
        self.engine_freezer = None
        self.worker_freezer = None

    def use_engine(self) -> None:
        self.worker_freezer.freeze()
        self.engine_freezer.thaw()

    def use_service(self) -> None:
        if self.engine_freezer is not None:
            self.engine_freezer.freeze()
        frozen_for = self.worker_freezer.thaw()
        if frozen_for > 20:  # its heartbeat may be past the lease: direct responses need a "ready" model
            wait_ready(self.run)

    def drop_engine(self) -> None:
        if self.engine is not None:
            self.engine_freezer.thaw()
            self.engine.shutdown()
            self.engine = None
            self.engine_error = "already shut down"
            log("engine-alone: shut down")


class CpuMeter:
    """CPU seconds (user + system) used by groups of processes between construction and read()."""

    def __init__(self, groups: dict):
        self.groups = groups
        self.start = {name: self._total(fn) for name, fn in groups.items()}

    @staticmethod
    def _total(fn) -> float:
        total = 0.0
        for pid in fn():
            try:
                total += cpu_seconds(pid)
            except OSError:
                pass
        return total

    def read(self) -> dict:
        return {name: round(self._total(fn) - self.start[name], 1) for name, fn in self.groups.items()}


def service_cpu(run) -> dict:
    """The service's process groups, for CpuMeter."""
    from tests.bench import service as svc
    worker = run.worker_proc.pid
    return {"worker main process": lambda: [worker], "engine processes": lambda: descendants(worker),
            "api workers": lambda: svc.api_workers(run)}


def wait_ready(run, timeout: float = 60) -> None:
    from tests.bench import service as svc
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = svc.session_for(run.token).get(f"{run.api}/lmsp/v1/models/{run.served}", timeout=30)
        if r.ok and r.json()["status"] == "ready":
            return
        time.sleep(0.5)
    raise TimeoutError(f"model {run.served} not ready after the worker resumed")


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


def start_api(stack, log_name: str, workers: int, threads: int) -> str:
    """Like tests.harness.Stack.start_api (same argv), with a wait that survives slow boots."""
    from tests.harness import api_argv, free_port
    port = free_port()
    stack.spawn(api_argv(port, workers, threads), log_name, LMSP_API_THREADS=str(threads))  # its stream slots
    base = f"http://127.0.0.1:{port}"
    wait_http(base + "/healthz", stack.tmp / log_name)
    return base


def guarded(table: Table, fid: str, name: str, goal: str, fn) -> None:
    log(f"{fid}: {name}")
    t = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - one broken figure must not hide the others
        traceback.print_exc()
        table.na(fid, name, goal, f"{type(exc).__name__}: {exc}"[:300])
    log(f"{fid}: done in {time.monotonic() - t:.0f}s")


# -- warm-ups ----------------------------------------------------------------------------------------------------------
def engine_warmup(engine) -> None:
    log("engine-alone: warm-up (64 short requests, 3 single)")
    engine.batch([engine.render(essay_prompt(i)) for i in range(B1_TASKS)], 4)
    prompt = engine.render(B2_PROMPT)
    for _ in range(3):
        engine.one(prompt, B2_TOKENS)


# -- phase 3 --------------------------------------------------------------------------------------------------------------
def service_warmup(run) -> None:
    from tests.bench import service as svc
    log("service: warm-up (64 short tasks, 3 streams)")
    svc.tasks_round(run, [essay_prompt(i) for i in range(B1_TASKS)], 4)
    for _ in range(3):
        svc.stream_ttft(run, B2_PROMPT, B2_TOKENS)


def b1(run, table: Table, sides: Sides) -> None:
    from tests.bench import service as svc
    name, goal = "throughput efficiency (64 tasks x 128 tok)", ">= 0.95"
    if sides.engine is None:
        table.na("B1", name, goal, f"no engine-alone baseline: {sides.engine_error}")
        return
    texts = [essay_prompt(i) for i in range(B1_TASKS)]
    prompts = [sides.engine.render(t) for t in texts]
    eng, rounds = [], []
    for rep in range(REPS):
        for side in (("engine", "service") if rep % 2 == 0 else ("service", "engine")):
            if side == "engine":
                sides.use_engine()
                cpu = CpuMeter({"bench process (client + AsyncLLM)": lambda: [os.getpid()],
                                "engine processes": sides.engine.pids})
                r = sides.engine.batch(prompts, B1_TOKENS)
                r["cpu_s"] = cpu.read()
                eng.append(r)
                log(f"B1 rep {rep + 1}/{REPS} engine-alone: {r['tokens']} tokens in {r['elapsed']:.1f}s "
                    f"= {r['tokens_per_s']:.1f} tok/s; CPU s {r['cpu_s']}")
            else:
                sides.use_service()
                cpu = CpuMeter(service_cpu(run))
                r = svc.tasks_round(run, texts, B1_TOKENS)
                r["cpu_s"] = cpu.read()
                rounds.append(r)
                log(f"B1 rep {rep + 1}/{REPS} service: {r['tokens']} tokens in {r['elapsed']:.1f}s = "
                    f"{r['tokens_per_s']:.1f} tok/s (accepted in {r['accepted_s']:.2f}s, "
                    f"last ended_at {r['db_makespan_s']:.1f}s); CPU s {r['cpu_s']}")
    s_rate, e_rate = median([r["tokens_per_s"] for r in rounds]), median([r["tokens_per_s"] for r in eng])
    same = sum(a == b for a, b in zip(rounds[0]["texts"], eng[0]["texts"], strict=True))
    ratio = s_rate / e_rate
    table.add("B1", name, f"{s_rate:.1f} tok/s", f"{e_rate:.1f} tok/s", ratio, goal, ratio >= 0.95, details={
        "service": [{k: v for k, v in r.items() if k not in ("texts", "timelines")} for r in rounds],
        "engine": [{k: v for k, v in r.items() if k != "texts"} for r in eng],
        "identical_outputs": f"{same}/{B1_TASKS}"})
    timeline_figure(table, [line for r in rounds for line in r["timelines"]])


def timeline_figure(table: Table, lines: list) -> None:
    """T1 (issue 24): the framework's share of a task's wall time, from B1's tasks' own timelines
    (x-lmsp-timeline: dispatch + prompt rendering + write lag, over created -> final event committed)."""
    name, goal = "framework share of a task's wall time (B1 tasks)", "<= 5%"
    lines = [line for line in lines if line and line.get("durations") and line["wall"] > 0]
    if not lines:
        table.na("T1", name, goal, "no task carried a timeline")
        return
    shares = sorted(line["durations"]["framework_overhead"] / line["wall"] for line in lines)
    p50, p99 = median(shares), shares[min(len(shares) - 1, int(0.99 * len(shares)))]
    phases = {p: median([line["durations"][p] for line in lines]) for p in lines[0]["durations"]}
    table.add("T1", name, f"p50 {100 * p50:.2f}%", "-", 100 * p99, goal, p99 <= 0.05, unit="% (p99)", details={
        "tasks": len(lines), "median_phase_seconds": phases, "median_wall_s": median([x["wall"] for x in lines])})


def b2(run, table: Table, sides: Sides) -> None:
    from tests.bench import service as svc
    name, goal = "first-token overhead", "p50 <= 30 ms"
    if sides.engine is None:
        table.na("B2", name, goal, f"no engine-alone baseline: {sides.engine_error}")
        return
    prompt = sides.engine.render(B2_PROMPT)
    samples, eng = [], []
    blocks = 3
    for block in range(blocks):
        n = B2_REQUESTS // blocks + (1 if block < B2_REQUESTS % blocks else 0)
        for side in (("engine", "service") if block % 2 == 0 else ("service", "engine")):
            if side == "engine":
                sides.use_engine()
                eng += [sides.engine.one(prompt, B2_TOKENS) for _ in range(n)]
            else:
                sides.use_service()
                samples += [svc.stream_ttft(run, B2_PROMPT, B2_TOKENS) for _ in range(n)]
    missing = [s for s in samples if s["ttft"] is None]
    if missing:
        raise RuntimeError(f"{len(missing)} streams had no text delta: {missing[0]}")
    s_t = [s["ttft"] for s in samples]
    e_t = [s["first_text"] for s in eng]
    e_tok = [s["first_token"] for s in eng]
    p50 = percentile(s_t, 50) - percentile(e_t, 50)
    p95 = percentile(s_t, 95) - percentile(e_t, 95)
    created = [s["created"] for s in samples]
    after = [s["ttft"] - s["created"] for s in samples if s["created"] is not None]
    log(f"B2: service: response.created (worker picked it up) p50 {fmt_ms(percentile(created, 50))}, then first "
        f"delta p50 {fmt_ms(percentile(after, 50))}")
    log(f"B2: service TTFT p50 {fmt_ms(percentile(s_t, 50))} p95 {fmt_ms(percentile(s_t, 95))}; engine first "
        f"text p50 {fmt_ms(percentile(e_t, 50))} p95 {fmt_ms(percentile(e_t, 95))} (first token p50 "
        f"{fmt_ms(percentile(e_tok, 50))})")
    details = {"service_ttft_ms": [round(1000 * x, 1) for x in s_t],
               "engine_first_text_ms": [round(1000 * x, 1) for x in e_t],
               "engine_first_token_ms": [round(1000 * x, 1) for x in e_tok],
               "service_created_ms": [None if x is None else round(1000 * x, 1) for x in created],
               "service_created_to_first_delta_ms": [round(1000 * x, 1) for x in after],
               "same_text": samples[0]["text"] == eng[0]["text"], "service_text": samples[0]["text"],
               "engine_text": eng[0]["text"]}
    table.add("B2", f"{name} p50", fmt_ms(percentile(s_t, 50)), fmt_ms(percentile(e_t, 50)),
              1000 * p50, goal, 1000 * p50 <= 30, unit=" ms", details=details)
    table.add("B2", f"{name} p95", fmt_ms(percentile(s_t, 95)), fmt_ms(percentile(e_t, 95)),
              1000 * p95, "(info)", None, unit=" ms")


def b0(run, table: Table, sides: Sides) -> None:
    """Issue 3's figure: one request's output tokens/s through the api ÷ the engine alone."""
    from tests.bench import service as svc
    name, goal = "single-request tokens/s (api ÷ engine)", "(info)"
    if sides.engine is None:
        table.na("B0", name, goal, f"no engine-alone baseline: {sides.engine_error}")
        return
    prompt = sides.engine.render(B0_PROMPT)
    eng, srv = [], []
    for rep in range(REPS):
        for side in (("engine", "service") if rep % 2 == 0 else ("service", "engine")):
            if side == "engine":
                sides.use_engine()
                start = time.perf_counter()
                one = sides.engine.one(prompt, B0_TOKENS)
                eng.append(one["tokens"] / (one["end"] - start))
            else:
                sides.use_service()
                one = svc.stream_ttft(run, B0_PROMPT, B0_TOKENS)
                srv.append(one["tokens"] / one["end"])
    s_rate, e_rate = statistics.median(srv), statistics.median(eng)
    table.add("B0", name, f"{s_rate:.1f} tok/s", f"{e_rate:.1f} tok/s", s_rate / e_rate, goal, None,
              details={"service": srv, "engine": eng})


def d1(table: Table, checkpoint: str, resolved) -> None:
    """The bare engine at bfloat16 and at the dtype resolved for this machine (tests/bench/dtype.py)."""
    import subprocess
    name, goal = "bare engine tok/s, resolved dtype ÷ bfloat16", ">= 3 without native bf16"
    dtype = resolved.args["dtype"]
    if dtype == "bfloat16":
        table.na("D1", name, goal, f"bfloat16 is native here ({resolved.resolved['dtype']})")
        return
    runs: dict[str, list[dict]] = {"bfloat16": [], dtype: []}
    for rep in range(REPS):
        for side in (("bfloat16", dtype) if rep % 2 == 0 else (dtype, "bfloat16")):
            out = subprocess.run([sys.executable, "-m", "tests.bench.dtype", checkpoint, side], cwd=ROOT,
                                 capture_output=True, text=True, env={**os.environ, **resolved.env})
            line = next((x for x in out.stdout.splitlines() if x.startswith("LMSP_DTYPE_RESULT ")), None)
            if line is None:
                raise RuntimeError(f"tests.bench.dtype {side} failed: {out.stderr[-1500:]}")
            runs[side].append(json.loads(line.split(" ", 1)[1]))
            log(f"D1 rep {rep + 1}/{REPS} {side}: {runs[side][-1]}")
    fast = median([r["tokens_per_s"] for r in runs[dtype]])
    slow = median([r["tokens_per_s"] for r in runs["bfloat16"]])
    ttft = {k: median([r["ttft_s"] for r in v]) for k, v in runs.items()}
    table.add("D1", f"{name} (32 req x 64 tok)", f"{dtype} {fast:.1f} tok/s, TTFT {fmt_ms(ttft[dtype])}",
              f"bfloat16 {slow:.1f} tok/s, TTFT {fmt_ms(ttft['bfloat16'])}", fast / slow, goal, fast / slow >= 3,
              details={"runs": runs, "resolved": resolved.resolved})


def vllm_figures(run, table: Table, sides: Sides, checkpoint: str, resolved) -> None:
    """V1-V3: the same workloads against vLLM's own OpenAI server, reps alternating with the service."""
    from tests.bench import service as svc
    from tests.bench.vllm_side import VllmServer
    from tests.harness import free_port
    server = VllmServer(run.stack, checkpoint, resolved, free_port())
    freezer = None
    try:
        t = time.monotonic()
        server.wait_ready()
        log(f"vllm-server: ready in {time.monotonic() - t:.0f}s")
        freezer = Freezer("vllm-server", server.pids)

        def use(side):
            if side == "vllm":
                sides.worker_freezer.freeze()
                freezer.thaw()
            else:
                freezer.freeze()
                sides.use_service()

        use("vllm")
        server.batch([essay_prompt(i) for i in range(B1_TASKS)], 4)
        for _ in range(3):
            server.stream_ttft(B2_PROMPT, B2_TOKENS)
        texts = [essay_prompt(i) for i in range(B1_TASKS)]
        got: dict[str, list] = {"tasks": [], "responses": [], "vllm": []}
        for rep in range(REPS if enabled("V1") or enabled("V2") else 0):
            for side in (("vllm", "service") if rep % 2 == 0 else ("service", "vllm")):
                use(side)
                if side == "vllm":
                    cpu = CpuMeter({"vLLM server processes": server.pids})
                    got["vllm"].append(server.batch(texts, B1_TOKENS))
                    got["vllm"][-1]["cpu_s"] = cpu.read()
                else:
                    for key, fn in (("tasks", svc.tasks_round), ("responses", svc.responses_round)):
                        cpu = CpuMeter(service_cpu(run))
                        got[key].append(fn(run, texts, B1_TOKENS))
                        got[key][-1]["cpu_s"] = cpu.read()
                log(f"V rep {rep + 1}/{REPS} {side}: " + ", ".join(
                    f"{k} {v[-1]['tokens_per_s']:.1f} tok/s (CPU s {v[-1]['cpu_s']})" for k, v in got.items() if v))
        if got["vllm"]:
            throughput_figures(table, got)
        ttft_figure(run, table, server, use)
    finally:
        if freezer is not None:
            freezer.thaw()
        run.stack.stop(server.proc)
        sides.use_service()
        log("vllm-server: stopped")


def throughput_figures(table: Table, got: dict) -> None:
    rate = {k: median([r["tokens_per_s"] for r in v]) for k, v in got.items()}
    same = {k: sum(a == b for a, b in zip(got[k][0]["texts"], got["vllm"][0]["texts"], strict=True))
            for k in ("tasks", "responses")}
    details = {k: [{x: y for x, y in r.items() if x != "texts"} for r in v] for k, v in got.items()}
    for fid, key, name, goal, floor in (
            ("V1", "tasks", f"{B1_TASKS} tasks x {B1_TOKENS} tok ÷ vLLM server", ">= 1.0", 1.0),
            ("V2", "responses", f"{B1_TASKS} concurrent POST /responses ÷ vLLM server", ">= 0.95", 0.95)):
        ratio = rate[key] / rate["vllm"]
        table.add(fid, name, f"{rate[key]:.1f} tok/s", f"{rate['vllm']:.1f} tok/s", ratio, goal, ratio >= floor,
                  details={**details, "identical_outputs": f"{same[key]}/{B1_TASKS}"})


def ttft_figure(run, table: Table, server, use) -> None:
    """30 sequential 8-token streams on each side, in alternating blocks."""
    from tests.bench import service as svc
    s_t, v_t = [], []
    blocks = 3
    for block in range(blocks):
        n = B2_REQUESTS // blocks + (1 if block < B2_REQUESTS % blocks else 0)
        for side in (("vllm", "service") if block % 2 == 0 else ("service", "vllm")):
            use(side)
            if side == "vllm":
                v_t += [server.stream_ttft(B2_PROMPT, B2_TOKENS)["ttft"] for _ in range(n)]
            else:
                s_t += [svc.stream_ttft(run, B2_PROMPT, B2_TOKENS)["ttft"] for _ in range(n)]
    if None in v_t or None in s_t:
        raise RuntimeError(f"streams without text: {v_t.count(None)} on vLLM's server, {s_t.count(None)} here")
    p50 = percentile(s_t, 50) - percentile(v_t, 50)
    table.add("V3", "TTFT over vLLM server p50", fmt_ms(percentile(s_t, 50)), fmt_ms(percentile(v_t, 50)),
              1000 * p50, "<= 10 ms", 1000 * p50 <= 10, unit=" ms",
              details={"service_ms": [1000 * x for x in s_t], "vllm_ms": [1000 * x for x in v_t]})
    table.add("V3", "TTFT over vLLM server p95", fmt_ms(percentile(s_t, 95)), fmt_ms(percentile(v_t, 95)),
              1000 * (percentile(s_t, 95) - percentile(v_t, 95)), "(info)", None, unit=" ms")


def b3(run, table: Table) -> None:
    from tests.bench import service as svc
    pids = svc.api_workers(run)
    body = {"type": "response", "input": {"model": run.parked, "input": svc.user("Write a haiku about rain."),
                                          "max_output_tokens": 16}}
    trivial = lambda s: svc.hammer(run.api, "GET", "/lmsp/v1", run.b3_token, None, s, B3_THREADS, 200, pids)  # noqa: E731
    accept = lambda s: svc.hammer(run.api, "POST", "/lmsp/v1/tasks", run.b3_token, body, s, B3_THREADS, 202,  # noqa: E731
                                  pids)
    # Warm-up (connections, pools, tokenizer): its errors are a finding too (the first requests after boot).
    warm = {"trivial": trivial(1.0), "accept": accept(1.0)}
    for k, w in warm.items():
        if w["errors"]:
            log(f"B3 warm-up {k}: {w['ok']} ok, errors {w['errors']}: {w['error_samples'][:1]}")
    t_rounds, a_rounds = [], []
    for rep in range(REPS):
        t_rounds.append(trivial(B3_SECONDS))
        a_rounds.append(accept(B3_SECONDS))
        log(f"B3 rep {rep + 1}/{REPS}: GET /lmsp/v1 {t_rounds[-1]['rate']:.0f}/s "
            f"({t_rounds[-1]['api_cpu_ms_per_req']:.1f} ms api CPU/req), POST /tasks {a_rounds[-1]['rate']:.0f}/s "
            f"({a_rounds[-1]['api_cpu_ms_per_req'] or 0:.1f} ms api CPU/req), errors {a_rounds[-1]['errors']}")
    errors = [r["errors"] for r in a_rounds + t_rounds if r["errors"]]
    a, t = median([r["rate"] for r in a_rounds]), median([r["rate"] for r in t_rounds])
    if not a:
        raise RuntimeError(f"no task was accepted: {a_rounds[0]['errors']} {a_rounds[0]['error_samples']}")
    ratio = a / t
    table.add("B3", "acceptance rate (POST /tasks ÷ GET /lmsp/v1)", f"{a:.0f} req/s", f"{t:.0f} req/s", ratio,
              ">= 0.5", ratio >= 0.5 and not errors, details={"accept": a_rounds, "trivial": t_rounds,
                                                              "errors": errors, "warm_up": warm})


def b5(run, table: Table) -> None:
    from tests.bench import service as svc
    log(f"B5: writing {B5_EVENTS} events")
    made = svc.make_long_log(run, B5_EVENTS)
    svc.select_once(run, made["response_id"])  # warm the cache for both sides
    svc.replay_once(run, made["task_id"])
    reps_r, reps_s = [], []
    n = max(REPS, 5)  # ~1 s each: sub-second timings on a noisy machine need a few more samples
    for rep in range(n):
        r = svc.replay_once(run, made["task_id"])
        s = svc.select_once(run, made["response_id"])
        if r["events"] != B5_EVENTS or s["rows"] != B5_EVENTS:
            raise RuntimeError(f"replayed {r['events']} events, selected {s['rows']} rows, expected {B5_EVENTS}")
        reps_r.append(r)
        reps_s.append(s)
        log(f"B5 rep {rep + 1}/{n}: endpoint {r['rate']:.0f} events/s ({r['elapsed']:.2f}s), "
            f"SELECT {s['rate']:.0f} rows/s ({s['elapsed']:.2f}s)")
    r, s = median([x["rate"] for x in reps_r]), median([x["rate"] for x in reps_s])
    ratio = r / s
    table.add("B5", "replay 100k events (endpoint ÷ SELECT)", f"{r:.0f} ev/s", f"{s:.0f} rows/s", ratio, ">= 0.5",
              ratio >= 0.5, details={"endpoint": reps_r, "select": reps_s})


def b4(run, table: Table) -> None:
    from tests.bench import service as svc
    # The production config first; then an api with a thread per follower, to tell the fan-out
    # path's own latency apart from waiting for a free gunicorn thread.
    threads = max(256, B4_CLIENTS // 2 + 32)  # a slot per follower, beside the reserved ones
    sized_base = start_api(run.stack, "api-sized.log", workers=2, threads=threads)
    for fid, base, label in (("B4", run.api, "production api, lmsp serve settings"),
                             ("B4b", sized_base, f"api 2x{threads} threads")):
        reps = []
        for rep in range(REPS):
            r = svc.fan_out(run, base, B4_CLIENTS, B4_TOKENS, essay_prompt(rep + 7))
            log(f"{fid} rep {rep + 1}/{REPS} ({label}): {r['events']} events, {r['complete']}/{r['clients']} "
                f"complete, {r['n_errors']} failed, stalled>1s {r['stalled_over_1s']}, all connected after "
                f"{r['all_connected_after_s'] or 0:.1f}s; lag p50 {r['p50_ms'] or 0:.1f} p99 {r['p99_ms'] or 0:.1f} "
                f"max {r['max_ms'] or 0:.1f} ms ({r['samples']} samples); once all connected: p99 "
                f"{r['steady_p99_ms'] or 0:.1f} ms ({r['steady_samples']} samples); to socket arrival p50 "
                f"{r['arrival_p50_ms'] or 0:.1f} p99 {r['arrival_p99_ms'] or 0:.1f} ms; {r['errors'][:1]}")
            reps.append(r)
        p99 = median([r["p99_ms"] for r in reps])
        steady = median([r["steady_p99_ms"] for r in reps])
        complete = min(r["complete"] for r in reps)
        failed = max(r["n_errors"] for r in reps)
        ok = p99 is not None and p99 <= 100 and complete == B4_CLIENTS
        steady_s = "n/a" if steady is None else f"{steady:.0f} ms"
        table.add(fid, f"fan-out {B4_CLIENTS} SSE followers, p99 lag ({label})",
                  f"p99 {p99:.0f} ms (once all connected {steady_s})",
                  f"{complete}/{B4_CLIENTS} got every event, {failed} refused, "
                  f"{max(r['stalled_over_1s'] for r in reps)} waited >1s",
                  # The goal is the issue's: stream caps raised for the bench (B4b); B4 shows lmsp serve's.
                  p99, "<= 100 ms" if fid == "B4b" else "(info)", ok if fid == "B4b" else None,
                  unit=" ms", details={"reps": reps})


def b6(run, table: Table) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from tests.bench import service as svc
    idle = [svc.stream_ttft(run, B2_PROMPT, B2_TOKENS)["ttft"] for _ in range(max(REPS, 5))]
    log(f"B6 idle TTFT: {[round(1000 * x) for x in idle]} ms")
    loaded, queued_at = [], []
    n = 0
    try:
        with ThreadPoolExecutor(16) as pool:
            def top_up():
                nonlocal n
                missing = B6_QUEUED - svc.count_status(run, run.served, ("queued",))
                if missing > 0:
                    texts = [essay_prompt(n + i) for i in range(missing)]
                    n += missing
                    list(pool.map(lambda t: svc.submit_task(run.api, run.token, run.served, t, B6_LOAD_TOKENS),
                                  texts))
            top_up()
            deadline = time.monotonic() + 60
            while svc.count_status(run, run.served, ("running",)) < 1 and time.monotonic() < deadline:
                time.sleep(0.2)
            for rep in range(REPS):
                top_up()
                queued = svc.count_status(run, run.served, ("queued",))
                running = svc.count_status(run, run.served, ("loading", "running"))
                r = svc.stream_ttft(run, B2_PROMPT, B2_TOKENS)
                loaded.append(r["ttft"])
                queued_at.append({"queued": queued, "running": running})
                log(f"B6 rep {rep + 1}/{REPS}: TTFT {fmt_ms(r['ttft'])} with {queued} queued, {running} running")
    finally:
        cancelled = svc.cancel_unfinished(run, run.served)
        log(f"B6: cancelled {cancelled} load tasks")
        svc.wait_idle(run, run.served, 120)
    i, ld = median(idle), median(loaded)
    ratio = ld / i
    table.add("B6", f"interactive TTFT, {B6_QUEUED} queued ÷ idle", fmt_ms(ld), fmt_ms(i), ratio, "<= 2",
              ratio <= 2, details={"idle_ms": [1000 * x for x in idle], "loaded_ms": [1000 * x for x in loaded],
                                   "queue": queued_at})


def memory(run, table: Table) -> None:
    api_pids = [p for p in descendants(run.api_proc.pid)]
    peaks = {p: vm_hwm_mib(p) for p in api_pids}
    peaks = {p: v for p, v in peaks.items() if v is not None}
    master = vm_hwm_mib(run.api_proc.pid)
    if peaks:
        table.add("M1", "api gunicorn workers peak RSS (VmHWM, each)",
                  ", ".join(f"{v:.0f}" for v in peaks.values()) + " MiB", f"master {master:.0f} MiB",
                  max(peaks.values()), "<= 200 MiB", max(peaks.values()) <= 200, unit=" MiB",
                  details={"pids": peaks})
    if run.worker_proc is not None and run.worker_proc.poll() is None:
        main = vm_hwm_mib(run.worker_proc.pid)
        kids = {p: (proc_name(p), vm_hwm_mib(p)) for p in descendants(run.worker_proc.pid)}
        engine = ", ".join(f"{Path(n.split()[0]).name} {v:.0f} MiB" for n, v in kids.values() if v is not None)
        table.add("M2", "worker main process peak RSS (without engine children)", f"{main:.0f} MiB",
                  engine or "-", main, "(info)", None, unit=" MiB", details={"children": kids})
    else:
        table.add("M2", "worker main process peak RSS", "n/a", "n/a", None, "(info)", None,
                  na="the worker was not running")


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
        main()
    except KeyboardInterrupt:
        sys.exit(130)
