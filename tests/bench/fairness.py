"""Fair share between principals, measured on simulated GPUs (issue 24, part 1; common/fairshare.py).

Two loads, each on its own sim model (its own queue) served by ``WORKERS`` workers:

* late: tenant A floods ``FLOOD`` tasks, then tenant B submits ``LATE`` (equal weights). B's queue
  wait (created -> claimed) p99 against what its share entitles it to (F1), and the load's
  throughput against the same tasks submitted by one principal, which the claim then serves in
  arrival order: FIFO on the same code path (F2).
* weighted: tenants of weight 1 and 2 flood together, the weight-2 one with shorter tasks (shares are
  of tokens, not of tasks); the tokens each is charged for the tasks claimed while both are
  backlogged (F3), and the largest gap between their weight-normalised services over any interval
  of that time, against the bound common/fairshare.py states (F4).

Everything is read afterwards from Postgres (tasks, their first attempt's claim time, their usage);
the pure functions below are what the figures and tests/functional/test_fairshare.py judge.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg

from common.db import make_engine, session_factory
from common.tokens import DEFAULT_SCOPES, create_token
from tests.bench.fleet_load import Fleet, Loop, dsn, pool_env, post_task, task_body
from tests.bench.util import log, percentile

FLOOD, LATE = 500, 10
WEIGHTED = 300  # tasks of each weighted tenant
WORKERS = 2
# Simulated GPUs: a task of 64 tokens takes ~0.7 s, 16 slots in all: ~23 tasks/s, slower than the
# submissions, so the backlogs form.
ENGINE = {"kind": "sim", "max_num_seqs": 8, "ttft_ms": 20, "tokens_per_s": 100, "tick_ms": 25}
TOKENS = 64
REPS = max(1, int(os.environ.get("LMSP_BENCH_FAIR_REPS", "3")))
LIMITS = {"LMSP_MAX_QUEUED_TASKS_PER_PRINCIPAL": "10000000", "LMSP_RATE_LIMIT_PER_SECOND": "1000000",
          "LMSP_RATE_LIMIT_BURST": "1000000",
          # Workers are held still while a backlog is submitted (Bench.paused): no lease runs out meanwhile,
          # and no re-sent message doubles the queue's.
          "LMSP_LEASE_SECONDS": "300", "LMSP_REQUEUE_AFTER_SECONDS": "300"}
FIGURES = {
    "F1": (f"late tenant's queue wait p99 ÷ its share's ({LATE} tasks after {FLOOD})", "<= 1.2"),
    "F2": ("throughput with fair share ÷ FIFO, same load", ">= 0.98"),
    "F3": ("tokens of a weight-2 tenant ÷ weight-1 while both wait", "2 ± 0.2"),
    "F4": ("largest weighted service gap ÷ the bound kept (common/fairshare.py)", "<= 1"),
}


@dataclass
class Row:
    principal: str
    created: float
    claimed: float
    ended: float
    cost: int       # tokens charged (input + max output)
    used: int       # tokens used (input + output)


# -- the judgement (pure) ------------------------------------------------------------------------------
def entitled_waits(late: list[Row], rate: float, share: float, largest: int) -> list[float]:
    """What each late task's wait should be at most if its tenant got ``share`` of ``rate`` tokens/s
    from its arrival: its own tasks before it at that share, plus one largest task at the full rate
    (the slot that frees first: SFQ's delay term)."""
    out, ahead = [], 0
    for row in sorted(late, key=lambda r: r.created):
        out.append((ahead / share + largest) / rate)
        ahead += row.cost
    return out


def claim_rate(rows: list[Row], since: float, until: float) -> float:
    """Tokens charged per second to the tasks claimed in [since, until]."""
    return sum(r.cost for r in rows if since <= r.claimed <= until) / max(until - since, 1e-9)


def late_wait_ratio(rows: list[Row], late: str, share: float) -> tuple[float, dict]:
    """F1: p99 of the late tenant's waits ÷ the p99 of what its share entitles them to; the service's
    rate is measured over the late tenant's time in the queue, while the flood is backlogged."""
    mine = [r for r in rows if r.principal == late]
    since, until = min(r.created for r in mine), max(r.claimed for r in mine)
    rate = claim_rate(rows, since, until)
    waits = [r.claimed - r.created for r in sorted(mine, key=lambda r: r.created)]
    entitled = entitled_waits(mine, rate, share, max(r.cost for r in rows))
    p99, due = percentile(waits, 99), percentile(entitled, 99)
    return p99 / due, {"p99_s": p99, "entitled_p99_s": due, "rate_tokens_s": rate,
                       "flood_left": sum(1 for r in rows if r.principal != late and r.claimed > until)}


def throughput(rows: list[Row]) -> float:
    """Tokens used per second from the first claim to the last end."""
    return sum(r.used for r in rows) / (max(r.ended for r in rows) - min(r.claimed for r in rows))


def backlogged(rows: list[Row], principals: tuple[str, str]) -> tuple[float, float]:
    """From the last submission (or the first claim, if later) to the first time one of ``principals``
    has nothing left to claim."""
    since = max(max(r.created for r in rows), min(r.claimed for r in rows))
    return since, min(max(r.claimed for r in rows if r.principal == p) for p in principals)


def weighted_service(rows: list[Row], weights: dict[str, float], slots: int) -> tuple[float, float, dict]:
    """F3 and F4 over the time both tenants are backlogged: the ratio of tokens charged to the claims of
    the heavier and the lighter, and the largest gap |W_f/w_f - W_g/w_g| over any interval in it
    (max minus min of the running difference, claims in claim-time order) ÷ the bound over time that
    common/fairshare.py states for ``slots`` claiming at once."""
    (f, wf), (g, wg) = sorted(weights.items(), key=lambda kv: kv[1])
    since, until = backlogged(rows, (f, g))
    inside = sorted((r for r in rows if since <= r.claimed <= until), key=lambda r: r.claimed)
    served = {f: 0, g: 0}
    gaps = [0.0]
    for r in inside:
        served[r.principal] += r.cost
        gaps.append(served[f] / wf - served[g] / wg)
    spans = (max(r.cost for r in rows if r.principal == f) / wf, max(r.cost for r in rows if r.principal == g) / wg)
    sequence = sum(spans)  # SFQ's, for the sequence of claims
    bound = sequence + (slots - 1) * max(spans)
    gap = max(gaps) - min(gaps)
    return served[g] / served[f], gap / bound, {"tokens": served, "seconds": until - since, "gap": gap,
                                                "bound": bound, "sequence_bound": sequence, "claims": len(inside)}


# -- the runs ------------------------------------------------------------------------------------------
def read_rows(database_url: str, task_ids: list[str]) -> list[Row]:
    with psycopg.connect(dsn(database_url)) as conn:
        found = conn.execute(
            "SELECT t.principal_id, t.created_at, a.claimed_at, t.ended_at, t.cost, "
            "(r.usage->>'total_tokens')::int FROM tasks t JOIN task_attempts a ON a.task_id = t.id AND a.attempt = 1 "
            "JOIN responses r ON r.id = t.response_id WHERE t.id = ANY(%s)", (task_ids,)).fetchall()
    return [Row(*row) for row in found]


def submit(loop: Loop, base: str, model: str, batches: list[tuple[str, int, int]]) -> list[str]:
    """POST ``(token, count, max_tokens)`` batches, one after the other; the tasks' ids."""
    async def one_batch(token: str, count: int, tokens: int) -> list[str]:
        pending, ids = asyncio.Semaphore(16), []

        async def post(i: int) -> None:
            async with pending:
                doc, _ = await post_task(loop.http, base, token, task_body(model, f"report {i}", tokens))
                ids.append(doc["id"])
        await asyncio.gather(*(post(i) for i in range(count)))
        return ids

    ids: list[str] = []
    for token, count, tokens in batches:
        ids += loop.run(one_batch(token, count, tokens))
    return ids


def wait_done(database_url: str, task_ids: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with psycopg.connect(dsn(database_url), autocommit=True) as conn:
        while time.monotonic() < deadline:
            left = conn.execute("SELECT count(*) FROM tasks WHERE id = ANY(%s) AND ended_at IS NULL",
                                (task_ids,)).fetchone()[0]
            if not left:
                return
            time.sleep(0.5)
    raise TimeoutError(f"{left} of {len(task_ids)} tasks unfinished after {timeout:.0f} s")


class Bench:
    """A sim model with its workers and one api, and the tenants' tokens."""

    def __init__(self, tmp: Path, database_url: str, *, workers: int = WORKERS, engine: dict | None = None,
                 env: dict | None = None):
        self.db = database_url
        self.fleet = Fleet(tmp, database_url, f"sim:fair{uuid.uuid4().hex[:8]}", engine=engine or ENGINE,
                           env={**LIMITS, **(env or {})})
        self.fleet.worker_env = pool_env(4)
        ids = [f"fair-{uuid.uuid4().hex[:6]}-{i}" for i in range(workers)]
        self.fleet.spawn_workers(ids)
        self.base = self.fleet.start_apis(1, threads=32, **pool_env(8))[0]
        self.fleet.wait_workers(ids)
        self.loop = Loop()
        self.sessions = session_factory(make_engine(database_url, pool_size=1, max_overflow=0))

    def tenant(self, name: str, weight: float = 1.0) -> tuple[str, str]:
        """(principal, token) of a new tenant of that weight (as `lmsp tokens create --weight` makes it)."""
        principal = f"{name}-{uuid.uuid4().hex[:6]}"
        with self.sessions() as session:
            _, secret = create_token(session, principal, DEFAULT_SCOPES, weight=weight)
            session.commit()
        return principal, secret

    @contextmanager
    def paused(self):
        """Workers stopped (SIGSTOP): what is submitted meanwhile is a backlog from the start, however
        slow the api is on a busy machine next to the simulated GPUs."""
        for proc in self.fleet.workers.values():
            os.killpg(proc.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            for proc in self.fleet.workers.values():
                os.killpg(proc.pid, signal.SIGCONT)

    def finish(self, ids: list[str], timeout: float = 600) -> list[Row]:
        wait_done(self.db, ids, timeout)
        return read_rows(self.db, ids)

    def close(self) -> None:
        self.loop.close()
        self.fleet.close(graceful=False)


def late_load(bench: Bench, flood: int, late: int, tokens: int, fifo: bool) -> tuple[list[Row], str]:
    """A floods, then B submits; ``fifo``: one principal submits both (arrival order). The rows, and
    the principal whose tasks came last."""
    a, a_token = bench.tenant("flood")
    b, b_token = (a, a_token) if fifo else bench.tenant("late")
    with bench.paused():
        ids = submit(bench.loop, bench.base, bench.fleet.model, [(a_token, flood, tokens)])
    time.sleep(1.0)  # the workers are busy with the flood when the late tenant comes
    rows = bench.finish(ids + submit(bench.loop, bench.base, bench.fleet.model, [(b_token, late, tokens)]))
    if fifo:  # the last ``late`` submitted are B's for the figure
        for row in sorted(rows, key=lambda r: r.created)[-late:]:
            row.principal = b = "late-fifo"
    return rows, b


def weighted_load(bench: Bench, count: int, tokens: tuple[int, int]) -> tuple[list[Row], dict[str, float]]:
    """A tenant of weight 1 and one of weight 2 (shorter tasks) flood at once."""
    (one, one_token), (two, two_token) = bench.tenant("w1", 1), bench.tenant("w2", 2)
    with bench.paused():
        ids = submit(bench.loop, bench.base, bench.fleet.model, [(one_token, count, tokens[0]),
                                                                 (two_token, count, tokens[1])])
    return bench.finish(ids), {one: 1.0, two: 2.0}


def figures(table, database_url: str, tmp: Path) -> None:
    """F1-F4 into the bench's table (tests/bench/__main__.py)."""
    tmp.mkdir(parents=True, exist_ok=True)
    bench = Bench(tmp, database_url)
    try:
        ratios, throughputs, details = [], [], []
        for rep in range(REPS):  # fair and FIFO alternate, so the machine's noise falls on both
            rows, late = late_load(bench, FLOOD, LATE, TOKENS, fifo=False)
            fifo_rows, _ = late_load(bench, FLOOD, LATE, TOKENS, fifo=True)
            ratio, info = late_wait_ratio(rows, late, share=0.5)
            ratios.append(ratio)
            throughputs.append(throughput(rows) / throughput(fifo_rows))
            fifo_ratio, fifo_info = late_wait_ratio(fifo_rows, "late-fifo", share=0.5)
            details.append({"fair": info, "fifo": fifo_info, "fifo_ratio": fifo_ratio})
            log(f"F1/F2 rep {rep + 1}/{REPS}: late p99 {info['p99_s']:.2f} s (entitled {info['entitled_p99_s']:.2f} s, "
                f"FIFO {fifo_info['p99_s']:.2f} s); throughput ÷ FIFO {throughputs[-1]:.3f}")
        table.add_reps("F1", *FIGURES["F1"], lambda m: m <= 1.2, ratios, service="fair share", baseline="its share",
                       details={"reps": details}, min_reps=REPS)
        table.add_reps("F2", *FIGURES["F2"], lambda m: m >= 0.98, throughputs, service="fair share",
                       baseline="FIFO", min_reps=REPS)
        table.note("F1 under FIFO (the same load from one principal): late p99 "
                   + ", ".join(f"{d['fifo']['p99_s']:.1f} s" for d in details))
        rows, weights = weighted_load(bench, WEIGHTED, (TOKENS, TOKENS // 2))
        share, gap, info = weighted_service(rows, weights, WORKERS * ENGINE["max_num_seqs"])
        log(f"F3/F4: {info}")
        table.add("F3", *FIGURES["F3"][:1], "weight 2", "weight 1", share, FIGURES["F3"][1], abs(share - 2) <= 0.2,
                  details=info)
        table.add("F4", FIGURES["F4"][0], f"{info['gap']:.0f} tokens/weight", f"bound {info['bound']:.0f}", gap,
                  FIGURES["F4"][1], gap <= 1, details=info)
        table.note(f"F4: the gap is {info['gap'] / info['sequence_bound']:.2f} x SFQ's bound for the sequence of "
                   f"claims alone ({info['sequence_bound']:.0f}; the rest of the bound is claims in flight)")
    finally:
        bench.close()
