"""What the event log and the claim path cost on Postgres, measured from inside (not a test):

    python -m tests.bench.log_costs [append|claim|retention|all]

* append: the writer's group commit (``lifecycle.append``, as worker/writer.py calls it) for batch shapes
  of (attempts x events each): CPU per event in this process (µs, thread time) and in its Postgres backend
  (µs, /proc of the backend: Postgres must be local), and WAL bytes per event (pg_walinspect: only the
  records of this database's transactions, so other users of a shared server do not count).
* claim: 10,000 queued tasks of one model, 32 threads claiming them (``lifecycle.claim``, one transaction
  each, as a worker does) while a sweeper runs every sweep query in a loop: claim latency p50/p99.
* retention: one thread writes ~10,000 event rows/s in batches; the commit latency p50/p99/max and rows/s
  with nothing else running, then while partitions are added and expired ones detached and dropped.

Each figure is printed as one line; the database is created and dropped here.
"""

import os
import sys
import threading
import time

import psycopg
from sqlalchemy import text

from common import events, lifecycle, liveness, partitions
from common.db import make_engine, session_factory, transaction, upgrade
from common.ids import id_floor
from common.states import R
from tests import factories
from tests.harness import create_database, drop_database


def _backend_cpu(pid: int) -> float:
    """utime + stime of a local Postgres backend, in seconds."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _p(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _tasks(sessions, n: int, model: str = "m", principal: str = "bench", claim_by: str | None = None):
    """``n`` tasks created as the api does; claimed by ``claim_by`` (started) if given."""
    attempts, made = [], []
    with transaction(sessions) as session:
        factories.principal(session, principal)
    for start in range(0, n, 500):
        with transaction(sessions) as session:
            for _ in range(min(500, n - start)):
                response = lifecycle.new_response(principal=principal, model=model, request={"input": []},
                                                  input_tokens=3, max_tokens=10, status=R.QUEUED, stored=True,
                                                  previous_response_id=None)
                task = lifecycle.new_task(response, "retry")
                lifecycle.create_task(session, response, task)
                made.append(task.id)
    if claim_by:
        for task_id in made:
            with transaction(sessions) as session:
                claimed, _ = lifecycle.claim(session, task_id, claim_by)
                lifecycle.start(session, claimed.attempt)
                attempts.append(claimed.attempt)
    return made, attempts


class _Wal:
    """WAL bytes written by this database's transactions between two marks."""

    def __init__(self, url: str):
        self.conn = psycopg.connect(url.replace("postgresql+psycopg", "postgresql"), autocommit=True)
        self.conn.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        self.db = self.conn.execute("SELECT oid FROM pg_database WHERE datname = current_database()").fetchone()[0]

    def mark(self):
        return self.conn.execute("SELECT pg_current_wal_insert_lsn()").fetchone()[0]

    def since(self, start) -> int:
        # Read at once: a checkpoint (any CREATE DATABASE on a shared server) recycles old segments.
        return self.conn.execute(
            "WITH r AS (SELECT xid, record_length, block_ref FROM pg_get_wal_records_info(%s, pg_current_wal_flush_lsn())),"
            " mine AS (SELECT DISTINCT xid FROM r WHERE xid <> '0' AND block_ref LIKE %s)"
            " SELECT coalesce(sum(record_length), 0) FROM r WHERE xid IN (SELECT xid FROM mine)",
            (start, f"%/{self.db}/%")).fetchone()[0]


_DELTA = events.dumps({"type": "response.output_text.delta", "item_id": "msg_01J8M8R5X3V7B2N4Q9T1W6Y0ZC",
                       "output_index": 0, "content_index": 0, "delta": " a few tokens of text"})


def sweep_queries(sessions, model: str, me: str) -> None:
    """What each worker's sweeper and cancel watch ask the database every tick (worker/sweeper.py, worker/cancels.py)."""
    from sqlalchemy import select

    from common.states import CANCELLING, LIVE
    from common.tables import Response, Task
    with transaction(sessions) as session:
        dead = liveness.expired_workers(session, 30, me)
        lifecycle.fail_direct(session, dead + ["gone-worker"], {})
        session.execute(select(Task.id, Task.attempt).where(Task.worker_id.in_(dead + ["gone-worker"]),
                                                            Task.status.in_(LIVE))).all()
        session.execute(select(Task.id).where(Task.status.in_(LIVE), Task.worker_id == me).union_all(
            select(Task.id).where(Task.status == CANCELLING, Task.worker_id.is_(None)))).all()
        lifecycle.due_dispatches(session, model, 60)
        session.execute(select(Response.id).where(Response.id.in_(["resp_x"]), Response.status == "cancelled")).all()
        liveness.live_workers(session, 30)


def measure_append(url: str, sessions) -> None:
    wal = _Wal(url)
    for attempts_n, per, rounds in ((8, 2, 600), (64, 4, 150), (64, 16, 60)):
        _, attempts = _tasks(sessions, attempts_n, model=f"append{attempts_n}x{per}", claim_by="bench-w")
        seqs = {a: 2 for a in attempts}

        def batches(attempts=attempts, seqs=seqs, per=per):
            grouped = {}
            for a in attempts:
                grouped[a] = [(seqs[a] + i, events.TEXT_DELTA, _DELTA) for i in range(per)]
                seqs[a] += per
            return grouped

        with sessions() as session:  # the writer's one connection: its backend is measured
            pid = session.execute(text("SELECT pg_backend_pid()")).scalar()
            session.commit()
            for _ in range(5):  # warm up (plans, caches)
                lifecycle.append(session, batches())
                session.commit()
            wal_bytes, pg0, me0, t0 = 0, _backend_cpu(pid), time.thread_time(), time.perf_counter()
            for r in range(rounds):
                if r % 10 == 0:
                    start = wal.mark()
                refused = lifecycle.append(session, batches())
                session.commit()
                assert not refused
                if r % 10 == 9:
                    wal_bytes += wal.since(start)
            wall, me, pg = time.perf_counter() - t0, time.thread_time() - me0, _backend_cpu(pid) - pg0
        n = attempts_n * per * rounds
        print(f"append {attempts_n} attempts x {per} events per commit: worker {me / n * 1e6:.1f} µs/event, "
              f"postgres {pg / n * 1e6:.1f} µs/event, WAL {wal_bytes / n:.0f} bytes/event, "
              f"{n / wall:,.0f} events/s on one connection", flush=True)


def measure_claim(url: str, sessions, queued: int = 10_000, workers: int = 32, rate: float = 100.0,
                  claims: int = 2000) -> None:
    """``workers`` threads claim ``rate`` tasks a second between them (a cluster of 100 GPUs x 64 streams
    with one-minute tasks claims ~100/s), while one more thread runs every sweep query back to back."""
    task_ids, _ = _tasks(sessions, queued, model="claimq")
    # CPU per claim, one at a time (what a loaded machine's wall clock hides): here and in Postgres.
    with sessions() as session:
        pid = session.execute(text("SELECT pg_backend_pid()")).scalar()
        session.commit()
        serial = task_ids[claims:claims + 300]
        pg0, me0 = _backend_cpu(pid), time.thread_time()
        for task_id in serial:
            assert lifecycle.claim(session, task_id, "serial-w")[0] is not None
            session.commit()
        me, pg = time.thread_time() - me0, _backend_cpu(pid) - pg0
    print(f"claim with {queued:,} queued, one at a time: {me / len(serial) * 1e3:.2f} ms CPU here, "
          f"{pg / len(serial) * 1e3:.2f} ms in Postgres per claim", flush=True)
    todo = task_ids[:claims]
    lock, latencies, stop = threading.Lock(), [], threading.Event()
    start = time.perf_counter() + 0.5

    def claimer(i):
        n = 0
        while True:
            due = start + (n * workers + i) / rate
            n += 1
            time.sleep(max(0.0, due - time.perf_counter()))
            with lock:
                if not todo:
                    return
                task_id = todo.pop()
            t0 = time.perf_counter()
            with transaction(sessions) as session:
                claimed, _ = lifecycle.claim(session, task_id, f"claim-w{i}")
            took = time.perf_counter() - t0
            assert claimed is not None
            with lock:
                latencies.append(took)

    sweeps = []

    def sweeper():
        while not stop.is_set():
            t0 = time.perf_counter()
            sweep_queries(sessions, "claimq", "claim-w0")
            sweeps.append(time.perf_counter() - t0)

    sweeping = threading.Thread(target=sweeper)
    sweeping.start()
    threads = [threading.Thread(target=claimer, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    stop.set()
    sweeping.join()
    print(f"claim with {queued:,} queued, {workers} threads offering {rate:.0f}/s: p50 {_p(latencies, .5) * 1e3:.1f} ms, "
          f"p99 {_p(latencies, .99) * 1e3:.1f} ms, {len(latencies) / wall:,.0f} claims/s; every sweep query "
          f"back to back meanwhile: p50 {_p(sweeps, .5) * 1e3:.1f} ms a round, {len(sweeps)} rounds", flush=True)


def measure_retention(url: str, sessions, rate: int = 10_000, seconds: float = 8.0) -> None:
    _, attempts = _tasks(sessions, 50, model="retention", claim_by="bench-w")
    seq = {a: 2 for a in attempts}
    payload = events.dumps({"delta": "x" * 40})
    per_commit = rate // 100  # a commit every 10 ms

    def write(window: float, during=None):
        lat, rows, done = [], 0, threading.Event()
        side = threading.Thread(target=lambda: (during(), done.set())) if during else None
        with sessions() as session:
            if side:
                side.start()
            t0 = time.perf_counter()
            tick = t0
            while time.perf_counter() - t0 < window:
                grouped = {}
                for i in range(per_commit):
                    a = attempts[i % len(attempts)]
                    grouped.setdefault(a, []).append((seq[a], events.TEXT_DELTA, payload))
                    seq[a] += 1
                c0 = time.perf_counter()
                lifecycle.append(session, grouped)
                session.commit()
                lat.append(time.perf_counter() - c0)
                rows += per_commit
                tick += 0.01
                time.sleep(max(0.0, tick - time.perf_counter()))
            wall = time.perf_counter() - t0
        if side:
            side.join()
        return lat, rows / wall

    # An old period to drop: 50 tasks made 10 hours ago (so in events_p0), ended, 200,000 events.
    engine = sessions.kw["bind"]
    with transaction(sessions) as session:
        session.execute(text("""
            INSERT INTO responses (id, principal_id, model, request, status, stored, created_at, updated_at)
            SELECT 'resp_' || :prefix || lpad(i::text, 16, '0'), 'bench', 'old', '{}', 'completed', true, :at, :at
            FROM generate_series(1, 50) i"""), {"prefix": id_floor("response", time.time() - 36000)[5:], "at":
                                                time.time() - 36000})
        session.execute(text("""
            INSERT INTO events (response_id, seq, name, data, created_at)
            SELECT 'resp_' || :prefix || lpad((i % 50 + 1)::text, 16, '0'), i, 'x', repeat('x', 100), 0
            FROM generate_series(1, 200000) i"""), {"prefix": id_floor("response", time.time() - 36000)[5:]})

    def maintain():
        time.sleep(1)
        t0 = time.perf_counter()
        made = partitions.ensure_ahead(engine, time.time() + 3 * 86400, 3600)
        t1 = time.perf_counter()
        dropped = partitions.drop_expired(engine, 1)  # events_p0 holds only the old period here
        print(f"  ({made} partitions made in {(t1 - t0) * 1e3:.0f} ms, {dropped} dropped (200,000 rows) in "
              f"{(time.perf_counter() - t1) * 1e3:.0f} ms, while writing)", flush=True)

    for label, during in (("alone", None), ("with partitions added and dropped", maintain)):
        lat, speed = write(seconds, during)
        print(f"retention: {speed:,.0f} rows/s written {label}: commit p50 {_p(lat, .5) * 1e3:.2f} ms, "
              f"p99 {_p(lat, .99) * 1e3:.2f} ms, max {max(lat) * 1e3:.1f} ms", flush=True)


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    url = create_database("lmsp_logcost")
    try:
        upgrade(url)
        engine = make_engine(url, pool_size=40, max_overflow=10)
        sessions = session_factory(engine)
        if what in ("append", "all"):
            measure_append(url, sessions)
        if what in ("claim", "all"):
            measure_claim(url, sessions)
        if what in ("retention", "all"):
            measure_retention(url, sessions)
        engine.dispose()
    finally:
        drop_database(url)


if __name__ == "__main__":
    main()
