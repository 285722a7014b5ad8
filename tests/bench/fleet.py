"""``make fleet`` (``python -m tests.bench.fleet``): the parts every worker shares — Postgres, Redis,
the api processes — under a fleet of simulated GPUs on this machine, stepping N = 4, 8, 16, 32, ...
workers until the machine saturates. A benchmark, not a test: it prints figures and goals.

Per step, two phases of equal load (tasks at a steady rate sized to keep 75% of the fleet's batch
slots busy, each task's end awaited by a long poll or not at all, a streaming ``POST /responses``
every second):

* A, no followers: what a delivered event costs the worker, Postgres, Redis and the api;
* B, the same plus followers: SSE and WebSocket clients on a quarter of the tasks, a fan-out of
  ``LMSP_FLEET_FANOUT`` clients on one long task that all drop and reconnect at once halfway (a
  reconnect storm), and one worker SIGKILLed mid-phase and restarted with its id (a supervisor).
  The api's extra CPU over phase A, per event delivered to a follower, is its cost per follower.

Every followed stream is checked against the log: lost, duplicated or out-of-order events must be 0.
Before the steps, ``LMSP_FLEET_BACKLOG`` tasks (10,000 by default) are queued for a model no worker
serves, so every claim runs beside them; two probes measure one api process holding followers
(up to ``LMSP_FLEET_HOLD``) and 1,000 followers connecting at once.

Knobs: ``LMSP_FLEET_SECONDS`` (900) bounds the whole run; ``LMSP_FLEET_OUT`` (fleet-results.json);
``LMSP_FLEET_APIS`` (2) api processes of ``LMSP_FLEET_API_THREADS`` (1024) threads each;
``LMSP_FLEET_STEPS`` (4,8,16,32,64,128); ``LMSP_FLEET_PG_CONNECTIONS``: what the fleet's processes may
hold of Postgres' connections, by default what the server has free when the run starts (its
max_connections less the superuser's reserve and the connections open then). A step of N workers
needs 2 N + 20 (2 a worker, 8 an api process, 4 the bench's own): 84 for F5's 32 workers, within
the 100 of a stock server; a step that does not fit ends the steps, and so does a saturated one. F5 is
the claim's own latency, from the attempts' timeline (claimed_at to submitted_at). ``LMSP_FLEET_ONLY`` (e.g. F5):
only what those figures need (F5: the steps' phase A; no probes, followers or reports). CPU is read
from /proc for this machine's processes: the whole Postgres and Redis servers (their background
processes too; shared: an upper bound).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path

import psycopg

from tests.bench.__main__ import LIMITS_ENV, PRODUCTION_ENV, cleanup_redis
from tests.bench.fleet_load import (
    OPEN,
    SIM_ENGINE,
    Fleet,
    Followed,
    Loop,
    check,
    direct_stream,
    dsn,
    follow,
    long_poll,
    pool_env,
    post_task,
    read_log,
    rss_kib,
    task_body,
)
from tests.bench.util import cpu_seconds, descendants, log, percentile

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(os.environ.get("LMSP_FLEET_OUT", ROOT / "fleet-results.json"))
SECONDS = float(os.environ.get("LMSP_FLEET_SECONDS", "900"))
APIS = int(os.environ.get("LMSP_FLEET_APIS", "2"))
API_THREADS = int(os.environ.get("LMSP_FLEET_API_THREADS", "1024"))
STEPS = [int(n) for n in os.environ.get("LMSP_FLEET_STEPS", "4,8,16,32,64,128").split(",")]
BACKLOG = int(os.environ.get("LMSP_FLEET_BACKLOG", str(min(10_000, int(SECONDS * 12)))))
HOLD = int(os.environ.get("LMSP_FLEET_HOLD", "10000"))
STORM = 1000
FANOUT = int(os.environ.get("LMSP_FLEET_FANOUT", "200"))
ONLY = {f for f in os.environ.get("LMSP_FLEET_ONLY", "").split(",") if f}
# Postgres connections the whole fleet may hold (None: what the server has free at the start). Each worker
# gets 2 (LMSP_FLEET_WORKER_CONNECTIONS), each api process 8: followers read the log through the api's
# pool, and an exhausted pool answers POST /tasks 503 after 30 s.
PG_CONNECTIONS = int(os.environ["LMSP_FLEET_PG_CONNECTIONS"]) if "LMSP_FLEET_PG_CONNECTIONS" in os.environ else None
WORKER_CONNECTIONS = int(os.environ.get("LMSP_FLEET_WORKER_CONNECTIONS", "2"))
API_CONNECTIONS, BENCH_CONNECTIONS = 8, 4

SLOTS, RATE, TTFT = SIM_ENGINE["max_num_seqs"], SIM_ENGINE["tokens_per_s"], SIM_ENGINE["ttft_ms"] / 1000
TASK_TOKENS = 200                     # 5 s of generation at 40 tokens/s: many claims, followers that come and go
TASK_SECONDS = TTFT + TASK_TOKENS / RATE
# The service's own work: reports. A task's costs (its POST, claim, start and finish, ~15-25 ms of CPU in
# all) are spread over its events, so what an event costs a fleet of reports is measured on reports.
REPORT_TOKENS = int(os.environ.get("LMSP_FLEET_REPORT_TOKENS", "2000"))  # 50 s at 40 tokens/s
REPORT_MEASURE = 30.0                 # seconds measured once the fleet is full of reports
LOAD = 0.75                           # offered concurrency, as a share of the fleet's batch slots
FOLLOWED_EVERY, LONGPOLL_EVERY = 4, 4  # a quarter of the tasks followed (one SSE, one WebSocket), a quarter long-polled
GPU_TOKENS_PER_S = 64 * 40            # the GPU: 64 streams at 40 tokens/s
F5_WORKERS = 32
FOLLOWERS_PER_TASK = 1                # the sizing table's assumption: one person or script tails each task
CORE_PER_API_PROCESS = 0.8            # a Python process uses at most one core; keep a fifth for bursts


# -- measuring -------------------------------------------------------------------------------------------
class Meter:
    """CPU seconds of groups of processes between start() and stop(); pids come and go (a killed worker's
    last seconds are lost, a new one counts from zero)."""

    def __init__(self, groups: dict):
        self.groups = groups

    def _read(self) -> dict:
        out = {}
        for name, fn in self.groups.items():
            for pid in fn():
                try:
                    out[(name, pid)] = cpu_seconds(pid)
                except OSError:
                    pass
        return out

    def start(self):
        self.t0, self.before = time.monotonic(), self._read()
        return self

    def stop(self) -> dict:
        after, elapsed = self._read(), time.monotonic() - self.t0
        used = {name: 0.0 for name in self.groups}
        for (name, pid), cpu in after.items():
            used[name] += cpu - self.before.get((name, pid), 0.0)
        return {"seconds": elapsed, **used}


def server(comm: str):
    """Every process of a local server by its name: its background processes (the WAL writer, the
    checkpointer, autovacuum) and connections that came and went are part of what an event costs.
    Shared with whatever else uses the server: an upper bound."""
    def pids() -> list[int]:
        out = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if (entry / "comm").read_text().strip() == comm:
                        out.append(int(entry.name))
                except OSError:
                    pass
        return out
    return pids


def wanted(*figures: str) -> bool:
    return not ONLY or not ONLY.isdisjoint(figures)


def free_connections(db_url: str) -> int:
    """The connections the server can still open for a client that is not a superuser."""
    with psycopg.connect(dsn(db_url)) as conn:
        return conn.execute(
            "SELECT current_setting('max_connections')::int - current_setting('superuser_reserved_connections')::int"
            " - (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')").fetchone()[0]


def wal_lsn(db_url: str) -> int:
    with psycopg.connect(dsn(db_url)) as conn:
        return conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint").fetchone()[0]


def db_counts(db_url: str, model: str, a: float, b: float) -> dict:
    """Event rows written in [a, b), and the output tokens of the tasks that ended then: a fleet that falls
    behind ends fewer tasks than it is given."""
    with psycopg.connect(dsn(db_url)) as conn:
        rows = conn.execute("SELECT count(*) FROM events WHERE created_at >= %s AND created_at < %s",
                            (a, b)).fetchone()[0]
        tokens = conn.execute(
            "SELECT coalesce(sum((r.usage->>'output_tokens')::bigint), 0) FROM tasks t "
            "JOIN responses r ON r.id = t.response_id WHERE t.model = %s AND t.ended_at >= %s AND t.ended_at < %s",
            (model, a, b)).fetchone()[0]
        queued = conn.execute("SELECT count(*) FROM tasks WHERE model = %s AND status = 'queued'",
                              (model,)).fetchone()[0]
    return {"rows": rows, "tokens": int(tokens), "queued_at_end": queued}


def claim_latencies(db_url: str, task_ids: list[str]) -> list[float]:
    """The claim, from the attempts' timeline (worker clock): its transaction began (``claimed_at``) to the
    claimed task's prompt handed to the engine (``submitted_at``): the claim's statement and commit, and
    the job's set-up. A wait for a free batch slot, the broker's delivery and the TTFT are not in it."""
    with psycopg.connect(dsn(db_url)) as conn:
        rows = conn.execute("SELECT submitted_at - claimed_at FROM task_attempts WHERE task_id = ANY(%s) "
                            "AND attempt = 1 AND submitted_at IS NOT NULL", (task_ids,)).fetchall()
    return [max(0.0, took) for (took,) in rows]


def start_latencies(db_url: str, task_ids: list[str]) -> list[float]:
    """Accepted -> first token, less the simulated TTFT, seen from the log (response.created is logged at
    the POST, the first delta at the first token): the broker, a free batch slot, the claim, the writer."""
    with psycopg.connect(dsn(db_url)) as conn:
        rows = conn.execute(
            "SELECT max(e.created_at) FILTER (WHERE e.seq = 1), min(e.created_at) FILTER (WHERE e.seq = 2) "
            "FROM tasks t JOIN events e ON e.response_id = t.response_id AND e.seq <= 2 "
            "WHERE t.id = ANY(%s) AND t.attempt = 1 GROUP BY t.id", (task_ids,)).fetchall()
    return [max(0.0, second - first - TTFT) for first, second in rows if first is not None and second is not None]


def events_partitioned(db_url: str) -> bool:
    with psycopg.connect(dsn(db_url)) as conn:
        return conn.execute("SELECT count(*) FROM pg_partitioned_table p JOIN pg_class c ON c.oid = p.partrelid "
                            "WHERE c.relname = 'events'").fetchone()[0] > 0


# -- one phase of load ---------------------------------------------------------------------------------------
class Phase:
    def __init__(self, run: Run, workers: int, seconds: float, followers: bool, tokens: int = TASK_TOKENS,
                 tail_each: bool = False):
        self.run, self.workers, self.seconds, self.followers, self.tokens = run, workers, seconds, followers, tokens
        self.tail_each = tail_each  # every task tailed by one follower to its end (the sizing's reports)
        self.task_seconds = TTFT + tokens / RATE
        self.rate = LOAD * workers * SLOTS / self.task_seconds  # tasks per second
        self.tasks: list[str] = []
        self.post_seconds: list[float] = []
        self.followed = []
        self.fanout = []
        self.directs: list[str | None] = []
        self.polls: list[str] = []
        self.killed: str | None = None
        self.rss: dict = {}

    async def drive(self) -> None:
        run = self.run
        clients: list[asyncio.Task] = []
        start, wall0 = time.monotonic(), time.time()
        end = start + self.seconds
        if self.followers:
            clients.append(asyncio.ensure_future(self._fanout(start)))
        clients.append(asyncio.ensure_future(self._directs(end)))
        i = 0
        while time.monotonic() < end:
            due = start + i / self.rate
            if due > time.monotonic():
                await asyncio.sleep(due - time.monotonic())
            clients.append(asyncio.ensure_future(self._task(i)))
            i += 1
            if self.followers and self.killed is None and time.monotonic() > start + self.seconds / 2:
                self.rss = {"api_kib": rss_kib(run.fleet.api_pids()), "open": OPEN["followers"]}
                await loop_kill(run)
                self.killed = run.last_killed
        self.offered = i / self.seconds
        self.window = (wall0, time.time())
        self.tail = asyncio.gather(*clients, return_exceptions=True)

    async def _task(self, i: int) -> None:
        run = self.run
        base = run.bases[i % len(run.bases)]
        doc, took = await post_task(run.loop.http, base, run.token, task_body(run.fleet.model, f"fleet {i}", self.tokens))
        self.tasks.append(doc["id"])
        self.post_seconds.append(took)
        if self.tail_each:
            self.followed.append(await follow(run.loop.http, base, run.token, doc["id"], ("sse", "ws")[i % 2],
                                              deadline=self.task_seconds + 300))
        elif self.followers and i % FOLLOWED_EVERY == 0:
            recs = await asyncio.gather(*[follow(run.loop.http, run.bases[(i + k) % len(run.bases)], run.token,
                                                 doc["id"], mode, deadline=300) for k, mode in enumerate(("sse", "ws"))])
            self.followed += recs
        elif i % LONGPOLL_EVERY == 1:
            self.polls.append(await long_poll(run.loop.http, base, run.token, doc["id"]))

    async def _fanout(self, start: float) -> None:
        """FANOUT followers of one task that runs the whole phase; all drop at once halfway and resume."""
        run = self.run
        tokens = int((self.seconds + 5) * RATE)
        doc, _ = await post_task(run.loop.http, run.bases[0], run.token, task_body(run.fleet.model, "fan-out", tokens))
        storm_at = start + self.seconds / 2
        recs = await asyncio.gather(*[
            follow(run.loop.http, run.bases[k % len(run.bases)], run.token, doc["id"], ("sse", "ws")[k % 2],
                   drop_after=max(1.0, storm_at - time.monotonic()), deadline=self.seconds + 300)
            for k in range(FANOUT)])
        self.fanout += recs

    async def _directs(self, end: float) -> None:
        run, pending = self.run, []
        while time.monotonic() < end:
            pending.append(asyncio.ensure_future(direct_stream(run.loop.http, run.bases[len(pending) % len(run.bases)],
                                                               run.token, run.fleet.model, 20)))
            await asyncio.sleep(1.0)
        self.directs = await asyncio.gather(*pending, return_exceptions=True)


async def loop_kill(run: Run) -> None:
    await asyncio.get_running_loop().run_in_executor(None, kill_and_restart, run)


def kill_and_restart(run: Run) -> None:
    """SIGKILL a worker that is generating, and start it again with its id, as a supervisor would."""
    with psycopg.connect(dsn(run.db_url)) as conn:
        row = conn.execute("SELECT worker_id FROM tasks WHERE model = %s AND status = 'running' "
                           "AND worker_id IS NOT NULL LIMIT 1", (run.fleet.model,)).fetchone()
    victim = row[0] if row else random.choice(list(run.fleet.workers))
    run.fleet.kill_worker(victim)
    run.fleet.spawn_workers([victim])
    run.last_killed = victim
    log(f"SIGKILLed worker {victim}; restarted with its id")


class Run:
    def __init__(self, fleet: Fleet, db_url: str, loop: Loop, bases: list[str], token: str):
        self.fleet, self.db_url, self.loop, self.bases, self.token = fleet, db_url, loop, bases, token
        self.last_killed = None
        self.meter = Meter({"worker": fleet.worker_pids, "api": fleet.api_pids,
                            "postgres": server("postgres"), "redis": server("redis-server"),
                            "client": lambda: [os.getpid()]})


def run_phase(run: Run, workers: int, seconds: float, followers: bool) -> dict:
    phase = Phase(run, workers, seconds, followers)
    wal0, meter = wal_lsn(run.db_url), run.meter.start()
    run.loop.run(phase.drive())
    cpu, wal1 = meter.stop(), wal_lsn(run.db_url)
    a, b = phase.window
    log(f"  phase {'B' if followers else 'A'}: offered {phase.offered:.1f} tasks/s; waiting for its clients")
    run.loop.run(_wait(phase.tail), timeout=600)
    # Rates from the steady state (the first task's length is the fleet filling up); costs per event over the
    # whole phase, as the CPU was measured.
    counts = db_counts(run.db_url, run.fleet.model, a + TASK_SECONDS, b)
    claims = claim_latencies(run.db_url, phase.tasks)
    counts["steady_seconds"] = b - a - TASK_SECONDS
    counts["rows_all"] = db_counts(run.db_url, run.fleet.model, a, b)["rows"]
    out = {"followers": followers, "seconds": seconds, "tasks_per_s_target": phase.rate,
           "tasks_per_s_offered": phase.offered, "cpu": cpu, "wal_bytes": wal1 - wal0, **counts,
           "post_p99_ms": _ms(percentile(phase.post_seconds, 99)),
           "claim_ms": [_ms(percentile(claims, q)) for q in (50, 99)], "claims_per_s": round(len(claims) / seconds, 1),
           "start_ms": [_ms(percentile(start_latencies(run.db_url, phase.tasks), q)) for q in (50, 99)],
           "directs_ok": sum(1 for d in phase.directs if d in ("response.completed", "response.incomplete")),
           "directs": len(phase.directs), "long_polls_ok": phase.polls.count("succeeded"), "long_polls": len(phase.polls)}
    if followers:
        everyone = phase.followed + phase.fanout
        logged = read_log(run.db_url, sorted({f.task_id for f in everyone}))
        c = check(everyone, logged, since=a)
        delivered = sum(1 for f in everyone for _, _, t in f.events if a <= t < b)
        out.update({"followers_n": len(everyone), "follower_events": c.events, "delivered_in_window": delivered,
                    "lost": c.lost, "duplicated": c.duplicated, "out_of_order": c.out_of_order,
                    "finals_wrong": c.finals_wrong, "unfinished": c.unfinished, "stream_errors": c.stream_errors,
                    "refused": sum(f.refused for f in everyone),
                    "lag_ms": [_ms(percentile(c.lags, q)) for q in (50, 99)], "rss": phase.rss,
                    "killed": phase.killed})
    return out


def reports_phase(run: Run, workers: int, tailed: bool = False) -> dict:
    """Reports of REPORT_TOKENS at the steps' offered concurrency, no followers (or, ``tailed``, each with
    one follower to its end: it logs at the followed pace); measured for REPORT_MEASURE seconds once the
    first reports end (the fleet is full), not while it fills."""
    phase = Phase(run, workers, TTFT + REPORT_TOKENS / RATE + REPORT_MEASURE, False, tokens=REPORT_TOKENS,
                  tail_each=tailed)
    driving = run.loop.spawn(phase.drive())
    time.sleep(phase.task_seconds)
    a, wal0, meter = time.time(), wal_lsn(run.db_url), run.meter.start()
    driving.result()
    cpu, wal1, b = meter.stop(), wal_lsn(run.db_url), time.time()
    log(f"  reports of {REPORT_TOKENS} tokens: offered {phase.offered:.2f} tasks/s; waiting for them to end")
    run.loop.run(_wait(phase.tail), timeout=600)
    ended = sum(1 for f in phase.followed if f.ended)
    rows = db_counts(run.db_url, run.fleet.model, a, b)["rows"]
    # Tokens the fleet generated meanwhile: the offered streams at the engine's rate (the step kept up).
    tokens = LOAD * workers * SLOTS * RATE * cpu["seconds"]
    return {"workers": workers, "tokens": REPORT_TOKENS, "tailed": f"{ended}/{len(phase.followed)}" if tailed else None,
            "seconds": round(cpu["seconds"], 1), "rows": rows,
            "rows_per_token": round(rows / tokens, 4), "cpu": cpu,
            "cpu_s_per_1k_events": {k: round(1000 * cpu[k] / rows, 4) if rows else None
                                    for k in ("worker", "postgres", "redis", "api", "client")},
            "wal_bytes_per_event": round((wal1 - wal0) / rows) if rows else None}


async def _wait(fut):
    return await fut


def _ms(x):
    return None if x is None else round(1000 * x, 1)


# -- one step: N workers, phase A then B ----------------------------------------------------------------------
def step(run: Run, n: int, seconds: float) -> dict:
    have = len(run.fleet.workers)
    if n > have:
        t = time.monotonic()
        run.fleet.start_workers([f"fleet-{i}" for i in range(have, n)], timeout=600)
        log(f"step N={n}: {n - have} workers started in {time.monotonic() - t:.0f}s")
    a = run_phase(run, n, seconds / 2, followers=False)
    if not wanted("F1", "F3", "F4", "F7", "F8"):
        return figures_of(n, a, None)
    base_rss, base_open = rss_kib(run.fleet.api_pids()), OPEN["followers"]
    b = run_phase(run, n, seconds / 2, followers=True)
    if b["rss"]:
        b["rss"]["per_follower_kib"] = round((b["rss"]["api_kib"] - base_rss) / max(1, b["rss"]["open"] - base_open), 1)
    return figures_of(n, a, b)


def figures_of(n: int, a: dict, b: dict | None) -> dict:
    """A step's figures from its phase A and its phase B (None: not run, its figures None)."""
    def per_k(cpu: float, events: int):
        return None if not events else round(1000 * cpu / events, 4)

    if b is None:
        b = {"rows_all": 0, "rows": 0, "steady_seconds": 1, "delivered_in_window": 0, "lag_ms": [None, None],
             "post_p99_ms": None, "cpu": {"api": 0.0, "seconds": 1}, "followers_n": 0, "killed": None,
             "directs_ok": 0, "directs": 0, "long_polls_ok": 0, "long_polls": 0,
             **dict.fromkeys(("lost", "duplicated", "out_of_order", "finals_wrong", "unfinished", "refused"), 0)}
    rows_a = a["rows_all"]
    # The api's work without followers is its tasks' (POSTs, long polls, directs), the same offered load
    # in both phases: what phase B used beyond phase A's rate, per event delivered to a follower. Not by
    # events: followed tasks log more of them (short windows; an unfollowed one's are quiet, gate.Deltas).
    # Not positive: not measurable.
    api_follow = b["cpu"]["api"] - a["cpu"]["api"] * b["cpu"]["seconds"] / a["cpu"]["seconds"]
    s = {
        "workers": n,
        "tokens_per_s": round(a["tokens"] / a["steady_seconds"], 1),
        "rows_per_s": round(a["rows"] / a["steady_seconds"], 1),
        "rows_per_s_b": round(b["rows"] / b["steady_seconds"], 1),
        "follower_events_per_s": round(b["delivered_in_window"] / b["cpu"]["seconds"], 1),
        "lag_ms": b["lag_ms"],
        "claim_ms": a["claim_ms"], "start_ms": a["start_ms"], "claims_per_s": a["claims_per_s"],
        "post_p99_ms": max((x for x in (a["post_p99_ms"], b["post_p99_ms"]) if x is not None), default=None),
        "cpu_s_per_1k_events": {
            "worker": per_k(a["cpu"]["worker"], rows_a), "postgres": per_k(a["cpu"]["postgres"], rows_a),
            "redis": per_k(a["cpu"]["redis"], rows_a), "api": per_k(a["cpu"]["api"], rows_a),
            "api_per_follower": per_k(api_follow, b["delivered_in_window"]) if api_follow > 0 else None,
            "client": per_k(a["cpu"]["client"], rows_a)},
        "wal_bytes_per_event": round(a["wal_bytes"] / rows_a) if rows_a else None,
        "rss_per_follower_kib": (b.get("rss") or {}).get("per_follower_kib"),
        "lost": b["lost"], "duplicated": b["duplicated"], "out_of_order": b["out_of_order"],
        "finals_wrong": b["finals_wrong"], "unfinished": b["unfinished"], "refused": b["refused"],
        "stream_errors": b.get("stream_errors"),
        "followers": b["followers_n"], "killed": b["killed"],
        "directs_ok": f"{a['directs_ok'] + b['directs_ok']}/{a['directs'] + b['directs']}",
        "long_polls_ok": f"{a['long_polls_ok'] + b['long_polls_ok']}/{a['long_polls'] + b['long_polls']}",
        "phases": {"A": a, "B": b},
    }
    reasons = []
    if a["tasks_per_s_offered"] < 0.9 * a["tasks_per_s_target"]:
        reasons.append(f"the client offered {a['tasks_per_s_offered']:.0f} of {a['tasks_per_s_target']:.0f} tasks/s")
    if a["queued_at_end"] > 0.05 * a["tasks_per_s_target"] * a["seconds"]:
        reasons.append(f"{a['queued_at_end']} tasks still queued")
    if s["tokens_per_s"] < 0.85 * LOAD * n * SLOTS * RATE:
        reasons.append(f"{s['tokens_per_s']:.0f} of {LOAD * n * SLOTS * RATE:.0f} tokens/s offered")
    # Latencies are figures, not the end of the steps: on a shared machine p99s of seconds come from other
    # people's load (and from the connection budget) as much as from the fleet. Throughput is the test.
    s["saturated"] = "; ".join(reasons) or None
    return s


def print_step(s: dict) -> None:
    c = s["cpu_s_per_1k_events"]
    lines = [
        f"N={s['workers']} workers: {s['tokens_per_s']:.0f} tokens/s, {s['rows_per_s']:.0f} event rows/s "
        f"({s['rows_per_s_b']:.0f} with followers), {s['follower_events_per_s']:.0f} events/s to {s['followers']} followers",
        f"  lag p50/p99 {s['lag_ms'][0]}/{s['lag_ms'][1]} ms; claim p50/p99 {s['claim_ms'][0]}/{s['claim_ms'][1]} ms "
        f"(accepted to first token less TTFT {s['start_ms'][0]}/{s['start_ms'][1]} ms); "
        f"POST /tasks p99 {s['post_p99_ms']} ms; directs {s['directs_ok']}, long polls {s['long_polls_ok']}",
        f"  CPU-s per 1000 events: worker {c['worker']}, postgres {c['postgres']}, redis {c['redis']}, "
        f"api {c['api']}, api per follower-event {c['api_per_follower']} (client {c['client']}); "
        f"WAL {s['wal_bytes_per_event']} B/event; RSS/follower {s['rss_per_follower_kib']} KiB",
        f"  lost {s['lost']}, duplicated {s['duplicated']}, out of order {s['out_of_order']}, wrong finals "
        f"{s['finals_wrong']}, unfinished {s['unfinished']} (SIGKILL: {s['killed']}); 429s {s['refused']}, "
        f"streams ended by an error event and resumed {s['stream_errors']}"
        + (f"; SATURATED: {s['saturated']}" if s["saturated"] else ""),
    ]
    os.write(STDOUT_FD, ("\n".join(lines) + "\n").encode())


def print_reports(r: dict) -> None:
    c = r["cpu_s_per_1k_events"]
    os.write(STDOUT_FD, (
        f"reports of {r['tokens']} tokens{', each tailed' if r['tailed'] else ''}, N={r['workers']}: {r['rows']} event rows in {r['seconds']} s "
        f"({r['rows_per_token']} a token)\n  CPU-s per 1000 events: worker {c['worker']}, postgres {c['postgres']}, "
        f"redis {c['redis']}, api {c['api']} (client {c['client']}); WAL {r['wal_bytes_per_event']} B/event\n").encode())


# -- probes: one api process holding followers, and a connect storm ------------------------------------------------
def hold_probe(run: Run, seconds: float) -> dict:
    """How many followers one api process holds (up to HOLD), connected in waves of 500 to ten long tasks
    until a wave adds next to nothing (refused by the stream caps, or not served); their RSS each."""
    base, proc = run.fleet.apis[0]
    pids = descendants(proc.pid)
    rss0, open0 = rss_kib(pids), OPEN["followers"]
    tokens = int((seconds + 30) * RATE)

    async def go():
        docs = [(await post_task(run.loop.http, base, run.token, task_body(run.fleet.model, f"hold {k}", tokens)))[0]
                for k in range(10)]
        futs, held = [], 0
        deadline = time.monotonic() + seconds
        while len(futs) < HOLD and time.monotonic() < deadline:
            for k in range(min(500, HOLD - len(futs))):
                futs.append(asyncio.ensure_future(follow(run.loop.http, base, run.token, docs[k % 10]["id"],
                                                         ("sse", "ws")[k % 2], deadline=seconds + 60)))
            await asyncio.sleep(2.0)
            now_open = OPEN["followers"] - open0
            if now_open <= held + 50:
                held = max(held, now_open)
                break
            held = now_open
        rss = rss_kib(pids)
        for f in futs:
            f.cancel()
        await asyncio.gather(*futs, return_exceptions=True)
        return held, rss

    held, rss = run.loop.run(go())
    return {"held": held, "rss_per_follower_kib": round((rss - rss0) / max(1, held), 1), "api_processes": 1}


def storm_probe(run: Run) -> dict:
    """STORM followers connect at once (spread over the api processes) to one running task. The CPU each
    side spends until every follower has its first event (at most 5 s) is the connect's cost, profiled."""
    async def go():
        doc, _ = await post_task(run.loop.http, run.bases[0], run.token, task_body(run.fleet.model, "storm", 400))
        await asyncio.sleep(1.0)
        recs = [Followed(doc["id"], ("sse", "ws")[k % 2]) for k in range(STORM)]
        t0, meter = time.time(), run.meter.start()
        tasks = [asyncio.ensure_future(follow(run.loop.http, run.bases[k % len(run.bases)], run.token, doc["id"],
                                              rec.mode, rec=rec, deadline=120)) for k, rec in enumerate(recs)]
        while any(r.first_at is None for r in recs) and time.time() - t0 < 5:
            await asyncio.sleep(0.05)
        cpu = meter.stop()
        await asyncio.gather(*tasks)
        return t0, recs, doc["id"], cpu

    t0, recs, task_id, cpu = run.loop.run(go())
    firsts = [r.first_at - t0 if r.first_at else None for r in recs]
    c = check(recs, read_log(run.db_url, [task_id]))
    got = [f for f in firsts if f is not None]
    return {"within_2s": sum(1 for f in got if f <= 2.0), "max_s": round(max(got), 2) if got else None,
            "p99_s": round(percentile(got, 99), 2) if got else None, "refused": sum(r.refused for r in recs),
            "bad": c.bad, "metered_s": round(cpu["seconds"], 2),
            "cpu_ms_per_connect": {k: round(v * 1000 / STORM, 2) for k, v in cpu.items() if k != "seconds"}}


# -- the goals and the sizing table ---------------------------------------------------------------------------------
def basis(best: dict, reports: dict | None, tailed: dict | None = None) -> dict:
    """The costs the sizing scales: a fleet of reports each tailed by one follower (when measured: the
    sizing's own assumption, measured whole, the follower's api work and its followed pace of rows
    included), else unfollowed reports', else the step's short tasks'; for those two, a follower's from
    the step (followers of short tasks: their connects counted in, an upper bound)."""
    if tailed is not None:
        return {"of": f"N={tailed['workers']}, reports of {tailed['tokens']} tokens, each tailed by one follower",
                "cpu": {**tailed["cpu_s_per_1k_events"], "api_per_follower": 0},  # in its api's CPU already
                "rows_per_token": tailed["rows_per_token"], "wal_bytes_per_event": tailed["wal_bytes_per_event"]}
    if reports is None:
        return {"of": f"N={best['workers']}, tasks of {TASK_TOKENS} tokens", "cpu": best["cpu_s_per_1k_events"],
                "rows_per_token": best["rows_per_s"] / best["tokens_per_s"] if best["tokens_per_s"] else None,
                "wal_bytes_per_event": best["wal_bytes_per_event"]}
    return {"of": f"N={reports['workers']}, reports of {reports['tokens']} tokens",
            "cpu": {**reports["cpu_s_per_1k_events"], "api_per_follower": best["cpu_s_per_1k_events"]["api_per_follower"]},
            "rows_per_token": reports["rows_per_token"], "wal_bytes_per_event": reports["wal_bytes_per_event"]}


def sizing(s: dict) -> dict:
    """What 100 and 1000 GPUs need, from per-event costs (``basis``)."""
    c = s["cpu"]
    rows_per_token = s["rows_per_token"]
    out = {}
    for gpus in (100, 1000):
        rows = gpus * GPU_TOKENS_PER_S * rows_per_token
        api_core = rows * (c["api"] + FOLLOWERS_PER_TASK * (c["api_per_follower"] or 0)) / 1000
        out[gpus] = {
            "event_rows_per_s": round(rows),
            "postgres_cores": round(rows * c["postgres"] / 1000, 1),
            "wal_gib_per_day": round(rows * (s["wal_bytes_per_event"] or 0) * 86400 / 2**30),
            "redis_cores": round(rows * c["redis"] / 1000, 2),
            "api_processes": max(1, round(api_core / CORE_PER_API_PROCESS + 0.5)),
            "worker_cpu_per_gpu_cores": round(GPU_TOKENS_PER_S * rows_per_token * c["worker"] / 1000, 2),
        }
        # As measured: the workers' and api processes' pools; above a few hundred, a pooler.
        out[gpus]["postgres_connections"] = gpus * WORKER_CONNECTIONS + out[gpus]["api_processes"] * API_CONNECTIONS
        walls = {"Postgres (16 cores)": out[gpus]["postgres_cores"] / 16,
                 "Redis (one core: single-threaded)": out[gpus]["redis_cores"] / 1,
                 "api (4 processes)": out[gpus]["api_processes"] / 4}
        out[gpus]["first_wall"] = max(walls, key=walls.get)
    return out


class Table:
    def __init__(self):
        self.rows = []

    def add(self, fid: str, figure: str, value, goal: str, ok: bool | None, note: str = ""):
        self.rows.append({"id": fid, "figure": figure, "value": value, "goal": goal,
                          "status": "n/a" if ok is None else ("PASS" if ok else "FAIL"), "note": note})

    def render(self) -> str:
        head = ["ID", "Figure", "Value", "Goal", "Status"]
        lines = [[r["id"], r["figure"], str(r["value"]), r["goal"], r["status"]] for r in self.rows]
        widths = [max(len(h), *(len(x[i]) for x in lines)) for i, h in enumerate(head)]
        fmt = " | ".join(f"{{:<{w}}}" for w in widths)
        out = [fmt.format(*head), "-+-".join("-" * w for w in widths), *(fmt.format(*x) for x in lines)]
        return "\n".join(out + [f"  {r['id']}: {r['note']}" for r in self.rows if r["note"]])


def goals(table: Table, steps: list[dict], hold: dict | None, storm: dict | None, partitioned: bool,
          reports: dict | None, tailed: dict | None) -> None:
    ok_steps = [s for s in steps if not s["saturated"]] or steps
    best = ok_steps[-1] if ok_steps else None
    if hold:
        lag = best["lag_ms"][1] if best else None
        table.add("F1", "followers held by one api process (RSS each; p99 lag once connected)",
                  f"{hold['held']} ({hold['rss_per_follower_kib']} KiB; {lag} ms)",
                  ">= 10,000, <= 64 KiB, <= 100 ms",
                  hold["held"] >= 10_000 and hold["rss_per_follower_kib"] <= 64 and lag is not None and lag <= 100,
                  "lag from the largest unsaturated step's followers")
    else:
        table.add("F1", "followers held by one api process", "not measured", ">= 10,000", None, "no time left")
    if storm:
        table.add("F2", "1,000 followers connecting at once: first event within 2 s",
                  f"{storm['within_2s']}/1000 (max {storm['max_s']} s, 429s {storm['refused']})", "1000/1000",
                  storm["within_2s"] == STORM and storm["bad"] == 0)
    if best:
        def total(c):
            return round(1000 * (c["worker"] + c["postgres"] + c["redis"] + c["api"]), 1)
        c = best["cpu_s_per_1k_events"]
        short = f"tasks of {TASK_TOKENS} tokens: {total(c)} µs (N={best['workers']})"
        if reports is not None:
            us = total(reports["cpu_s_per_1k_events"])
            # Per token too: an unfollowed task's quiet windows carry several times the tokens an event.
            per_token = round(us * reports["rows_per_token"], 2)
            table.add("F3", f"CPU per delivered event: worker + Postgres + Redis + api (no followers; reports of "
                      f"{reports['tokens']} tokens)", f"{us} µs (N={reports['workers']})", "<= 60 µs", us <= 60,
                      f"{per_token} µs a token ({reports['rows_per_token']} events a token); {short}; Postgres "
                      "and Redis are the whole servers: an upper bound")
        else:
            us = total(c)
            table.add("F3", "CPU per delivered event: worker + Postgres + Redis + api (no followers)", short,
                      "<= 60 µs", us <= 60, "no reports measured; Postgres and Redis are the whole servers")
        fus = None if c["api_per_follower"] is None else round(1000 * c["api_per_follower"], 1)
        table.add("F4", "api CPU per follower per event", f"{fus} µs", "<= 10 µs", fus is not None and fus <= 10)
    at32 = next((s for s in steps if s["workers"] == F5_WORKERS), None)
    # Below 32 workers: the claim's p99 at each unsaturated step (a saturated machine starves the claim).
    below = "; ".join(f"N={s['workers']}: p50/p99 {s['claim_ms'][0]}/{s['claim_ms'][1]} ms at {s['claims_per_s']} claims/s"
                      for s in ok_steps if s is not at32)
    table.add("F5", f"claim latency p99 with {BACKLOG} queued tasks and {F5_WORKERS} workers",
              f"{at32['claim_ms'][1]} ms" if at32 else f"{F5_WORKERS} workers not reached", "<= 50 ms (10,000 queued)",
              at32 is not None and at32["claim_ms"][1] is not None and at32["claim_ms"][1] <= 50 and BACKLOG >= 10_000,
              "claimed_at to submitted_at (task_attempts: the claim's statement, its commit, the job's set-up)"
              + (f"; {below}" if below else ""))
    table.add("F6", "retention while 10k rows/s are written", "events partitioned" if partitioned
              else "row-by-row DELETE (events not partitioned)", "whole partitions dropped", partitioned,
              "checked from the schema; the cost of a drop is not timed here")
    bad = sum(s["lost"] + s["duplicated"] + s["out_of_order"] + s["finals_wrong"] + s["unfinished"] for s in steps)
    table.add("F7", "lost / duplicated / out-of-order events, every step, SIGKILL included",
              f"{bad} over {sum(s['followers'] for s in steps)} followers", "0", bool(steps) and bad == 0,
              f"streams ended by an error event and resumed: {sum(s.get('stream_errors') or 0 for s in steps)}")
    if best:
        costs = basis(best, reports, tailed)
        size = sizing(costs)[100]
        table.add("F8", "sizing: 100 GPUs x 64 streams x 40 tok/s",
                  f"Postgres {size['postgres_cores']} cores, {size['api_processes']} api processes",
                  "<= 16-core Postgres, <= 4 api", size["postgres_cores"] <= 16 and size["api_processes"] <= 4,
                  f"first wall: {size['first_wall']}; from {costs['of']}"
                  + (f" ({tailed['tailed']} followers to the end)" if tailed else ""))


def render_sizing(costs: dict) -> str:
    size = sizing(costs)
    keys = [("event_rows_per_s", "event rows/s"), ("postgres_cores", "Postgres cores"),
            ("wal_gib_per_day", "WAL GiB/day"), ("redis_cores", "Redis cores"), ("api_processes", "api processes"),
            ("worker_cpu_per_gpu_cores", "worker host CPU per GPU (cores)"),
            ("postgres_connections", "Postgres connections"), ("first_wall", "first wall")]
    lines = [f"sizing from {costs['of']} (one follower a task):", "| | 100 GPUs | 1000 GPUs |", "|---|---|---|"]
    lines += [f"| {label} | {size[100][k]} | {size[1000][k]} |" for k, label in keys]
    return "\n".join(lines)


# -- main ---------------------------------------------------------------------------------------------------------
STDOUT_FD = 1


def main() -> None:
    global STDOUT_FD
    sys.stdout.flush()
    STDOUT_FD = os.dup(1)
    os.dup2(2, 1)  # everything but the figures goes to stderr
    from common.db import upgrade
    from tests.harness import REDIS_URL, create_database, drop_database, model_entry

    started = time.monotonic()
    deadline = started + SECONDS
    tag = uuid.uuid4().hex[:6]
    model, parked = f"sim:fleet{tag}", f"sim:park{tag}"
    tmp = Path(tempfile.mkdtemp(prefix="lmsp-fleet-"))
    db_url = create_database("lmsp_fleet")
    table, steps, meta = Table(), [], {"logs": str(tmp), "seconds": SECONDS, "apis": APIS, "api_threads": API_THREADS,
                                       "sim_engine": SIM_ENGINE, "backlog": BACKLOG, "pg_connections": PG_CONNECTIONS}
    fleet = loop = None
    hold = storm = reports = tailed = None
    partitioned = False
    log(f"fleet: budget {SECONDS:.0f}s, {APIS} api processes x {API_THREADS} threads; logs in {tmp}")
    try:
        upgrade(db_url)
        partitioned = events_partitioned(db_url)
        budget = PG_CONNECTIONS if PG_CONNECTIONS is not None else free_connections(db_url)
        meta["pg_connections"] = budget
        fleet = Fleet(tmp, db_url, model, env={**PRODUCTION_ENV, **LIMITS_ENV},
                      extra_models=[model_entry(parked, engine=SIM_ENGINE, queue_depth=10**7)])
        fleet.worker_env = pool_env(WORKER_CONNECTIONS)
        fleet.spawn_workers([f"fleet-{i}" for i in range(STEPS[0])])
        bases = fleet.start_apis(APIS, API_THREADS, **pool_env(API_CONNECTIONS))
        token = fleet.stack.token("fleet")
        fleet.wait_workers(list(fleet.workers), 600)
        loop = Loop()
        run = Run(fleet, db_url, loop, bases, token)
        t = time.monotonic()
        backlog(run, parked)
        meta["backlog_seconds"] = round(time.monotonic() - t, 1)
        log(f"backlog: {BACKLOG} tasks queued for {parked} in {meta['backlog_seconds']}s")
        left = deadline - time.monotonic()
        # Reports: filling, measured, ending.
        one_report = 2 * (TTFT + REPORT_TOKENS / RATE) + REPORT_MEASURE + 10
        report_need = one_report * (wanted("F3", "F8") + wanted("F8"))
        step_seconds = max(20.0, min(120.0, (left - 120 - report_need) / 5))
        meta["step_seconds"] = step_seconds
        if left > 200 and wanted("F2"):
            storm = storm_probe(run)
            log(f"storm: {storm}")
        for n in STEPS if wanted("F1", "F3", "F4", "F5", "F7", "F8") else []:
            conns = n * WORKER_CONNECTIONS + APIS * API_CONNECTIONS + BENCH_CONNECTIONS
            if conns > budget:
                meta["stopped"] = f"Postgres connections: N={n} needs {conns}, {budget} free"
                log(meta["stopped"])
                break
            need = step_seconds + 60 + 3 * max(0, n - len(fleet.workers))  # the phases, their tails, boots
            if time.monotonic() + need > deadline:
                log(f"step N={n}: skipped, {deadline - time.monotonic():.0f}s left")
                meta["stopped"] = f"time: N={n} would not fit in LMSP_FLEET_SECONDS"
                break
            log(f"step N={n}: {step_seconds:.0f}s")
            s = step(run, n, step_seconds)
            steps.append(s)
            print_step(s)
            if reports is None and not s["saturated"] and time.monotonic() + report_need + 60 < deadline \
                    and wanted("F3", "F8"):
                log(f"reports of {REPORT_TOKENS} tokens, N={n}")
                reports = reports_phase(run, n)
                print_reports(reports)
                if wanted("F8") and time.monotonic() + one_report + 60 < deadline:
                    log(f"reports of {REPORT_TOKENS} tokens, each tailed by one follower, N={n}")
                    tailed = reports_phase(run, n, tailed=True)
                    print_reports(tailed)
            if s["saturated"]:
                meta["stopped"] = f"saturated at N={n}: {s['saturated']}"
                break
        if deadline - time.monotonic() > 90 and wanted("F1"):
            hold = hold_probe(run, min(90.0, deadline - time.monotonic() - 30))
            log(f"hold: {hold}")
    except Exception as exc:  # noqa: BLE001 - still print what was measured
        traceback.print_exc()
        meta["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if loop is not None:
            loop.close()
        if fleet is not None:
            fleet.close()
        cleanup_redis(REDIS_URL, [model, parked])
        drop_database(db_url)
    goals(table, steps, hold, storm, partitioned, reports, tailed)
    table.rows = [row for row in table.rows if wanted(row["id"])]
    meta["runtime_s"] = round(time.monotonic() - started, 1)
    ok = [s for s in steps if not s["saturated"]] or steps
    costs = basis(ok[-1], reports, tailed) if ok else None
    text = table.render() + "\n"
    if costs:
        text += render_sizing(costs) + "\n"
    text += f"runtime {meta['runtime_s']:.0f} s; {meta.get('stopped', '')}{meta.get('error', '')}\n"
    os.write(STDOUT_FD, text.encode())
    OUT.write_text(json.dumps({"meta": meta, "figures": table.rows, "steps": steps,
                               "reports": reports, "tailed_reports": tailed, "sizing": sizing(costs) if costs else None, "basis": costs,
                               "hold": hold, "storm": storm},
                              indent=1, default=str))
    log(f"wrote {OUT}")


def backlog(run: Run, parked: str) -> None:
    """BACKLOG queued tasks of a model no worker serves: every claim and sweep of the steps runs beside them."""
    async def go():
        sem = asyncio.Semaphore(32)

        async def one(i):
            async with sem:
                await post_task(run.loop.http, run.bases[i % len(run.bases)], run.token,
                                task_body(parked, f"backlog {i}", 16))
        await asyncio.gather(*[one(i) for i in range(BACKLOG)])
    run.loop.run(go())


if __name__ == "__main__":
    import signal

    from tests.bench.__main__ import _interrupt
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
