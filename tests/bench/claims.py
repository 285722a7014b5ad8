"""What a claim costs, A/B between two checkouts (issue 38, item 3), on the real Postgres:
``python tests/bench/claims.py OLD_TREE NEW_TREE [REPS]``.

One database, migrated by NEW_TREE, with ``BACKLOG`` tasks queued for a model nobody claims (as in
``make fleet``'s F5). A long-lived process per checkout imports that checkout's code; the driver
alternates them (which goes first alternates too), and before each run queues ``CLAIMS`` tasks of the
claimed model. A run claims them all through what the worker calls (``worker.runner._claim`` in the
transaction ``ctx.write`` makes), on ``THREADS`` threads of one process, as a worker's Celery threads
do, then once more on one thread. Printed per side: the median (min-max over reps) of the claim's wall
time p50 and p99, and of the claiming process's CPU per claim.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

BACKLOG = int(os.environ.get("LMSP_CLAIMS_BACKLOG", "10000"))
CLAIMS = int(os.environ.get("LMSP_CLAIMS_N", "400"))
THREADS = int(os.environ.get("LMSP_CLAIMS_THREADS", "8"))
MODEL, PARKED = "sim:claimed", "sim:parked"


# -- a side: one checkout's code, claiming when told -----------------------------------------------------------
class _Ctx:
    """What ``_claim`` asks of a worker's context."""
    worker_id = "bench-worker"

    @staticmethod
    def running_ids() -> set[str]:
        return set()


def side(db_url: str) -> None:
    from common.db import make_engine, session_factory

    sessions = session_factory(make_engine(db_url, pool_size=THREADS, max_overflow=0))
    for line in sys.stdin:
        ids, threads = json.loads(line)
        print(json.dumps(run(sessions, ids, threads)), flush=True)


def run(sessions, ids: list[str], threads: int) -> dict:
    from common.db import transaction
    from worker import runner

    took: list[float] = []

    def claim_all(mine: list[str]) -> None:
        for task_id in mine:
            t = time.perf_counter()
            with transaction(sessions) as session:
                claimed, _ = runner._claim(session, _Ctx, task_id, MODEL, {"delivered_at": time.time()})
            took.append(time.perf_counter() - t)
            if claimed is None:
                raise RuntimeError("a claim took nothing")

    cpu, wall = time.process_time(), time.perf_counter()
    workers = [threading.Thread(target=claim_all, args=(ids[k::threads],)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    took.sort()
    return {"n": len(took), "p50_ms": 1000 * took[len(took) // 2], "p99_ms": 1000 * took[int(len(took) * 0.99)],
            "cpu_us": 1e6 * cpu / len(took), "per_s": len(took) / wall}


# -- the driver -----------------------------------------------------------------------------------------------
def queue(sessions, model: str, n: int) -> list[str]:
    from common import lifecycle
    from common.db import transaction
    from common.states import R

    ids = []
    for i in range(n):
        with transaction(sessions) as session:
            response = lifecycle.new_response(principal="bench", model=model, request={"input": f"claim {i}"},
                                              input_tokens=10, max_tokens=100, status=R.IN_PROGRESS, stored=True,
                                              previous_response_id=None)
            task = lifecycle.new_task(response, "fail")
            lifecycle.create_task(session, response, task)
            ids.append(task.id)
    return ids


def summary(runs: list[dict], key: str) -> str:
    values = [r[key] for r in runs]
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main(old: Path, new: Path, reps: int) -> None:
    sys.path.insert(0, str(new))
    from common.db import make_engine, session_factory, transaction, upgrade
    from common.tables import Principal
    from tests.harness import create_database, drop_database

    db_url = create_database("lmsp_claims")
    procs = {}
    try:
        upgrade(db_url)
        sessions = session_factory(make_engine(db_url))
        with transaction(sessions) as session:
            session.add(Principal(id="bench", created_at=time.time()))
        t = time.monotonic()
        queue(sessions, PARKED, BACKLOG)
        print(f"backlog: {BACKLOG} tasks queued for {PARKED} in {time.monotonic() - t:.0f}s", file=sys.stderr)
        for name, tree in (("old", old), ("new", new)):
            procs[name] = subprocess.Popen([sys.executable, __file__, "side", db_url], cwd=tree, text=True,
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                           env={**os.environ, "PYTHONPATH": str(tree)})
        results = {(name, threads): [] for name in procs for threads in (THREADS, 1)}
        for rep in range(reps):
            for name in (("old", "new") if rep % 2 == 0 else ("new", "old")):
                for threads in (THREADS, 1):
                    ids = queue(sessions, MODEL, CLAIMS)
                    procs[name].stdin.write(json.dumps([ids, threads]) + "\n")
                    procs[name].stdin.flush()
                    got = json.loads(procs[name].stdout.readline())
                    results[(name, threads)].append(got)
                    print(f"rep {rep + 1} {name} x{threads}: {got}", file=sys.stderr)
        for (name, threads), runs in results.items():
            print(f"{name} {threads} thread(s): claim p50 {summary(runs, 'p50_ms')} ms, p99 {summary(runs, 'p99_ms')} "
                  f"ms, CPU {summary(runs, 'cpu_us')} us/claim, {summary(runs, 'per_s')} claims/s")
    finally:
        for proc in procs.values():
            proc.stdin.close()
            proc.wait(30)
        drop_database(db_url)


if __name__ == "__main__":
    if sys.argv[1] == "side":
        sys.path.insert(0, os.getcwd())
        side(sys.argv[2])
    else:
        main(Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve(), int(sys.argv[3]) if len(sys.argv) > 3 else 5)
