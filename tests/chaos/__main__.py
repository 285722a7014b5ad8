"""`make chaos`: the production shape (two workers of the default model, Postgres, Redis, one api) under
mixed load and a seeded random schedule of faults, then a history check. See tests/chaos/__init__.py."""

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections import Counter
from pathlib import Path

import psycopg

from common import partitions
from common.db import upgrade
from common.ids import id_time
from tests.chaos import checker, faults, wider
from tests.chaos.load import History, Load
from tests.chaos.pair import Pair
from tests.chaos.servers import EventDisk
from tests.harness import Stack, engine_pids, free_port, model_entry
from tests.proxy import Link, Proxy
from tests.servers import PgCluster, RedisServer

SECONDS = float(os.environ.get("LMSP_CHAOS_SECONDS") or 1200)
SEED = int(os.environ.get("LMSP_CHAOS_SEED") or random.SystemRandom().randrange(1 << 31))
KINDS = [k for k in (os.environ.get("LMSP_CHAOS_FAULTS") or "").split(",") if k] or None
# Postgres as a primary and a synchronous standby, with postgres_failover drawn (tests/chaos/pair.py).
PAIR = os.environ.get("LMSP_CHAOS_PAIR") == "1" or "postgres_failover" in (KINDS or ())
SETTLE = float(os.environ.get("LMSP_CHAOS_SETTLE_SECONDS") or 420)  # after the faults, for every task to end
# Shorter than production's 30 s so a run has room for many faults; heartbeats and sweeps keep its ratios.
LEASE, HEARTBEAT, SWEEP, REQUEUE = 10, 2, 2, 5
PARTITION, AHEAD = 30, 120
# The migration below (this process's settings) makes the first periods: as short as the workers' own.
os.environ["LMSP_EVENT_PARTITION_SECONDS"], os.environ["LMSP_EVENT_PARTITIONS_AHEAD_SECONDS"] = \
    str(PARTITION), str(AHEAD)
MODEL = "smollm2-135m"
PRINCIPAL = "chaos"
# The slow followers' link to the api: a tenth of tests/proxy.WAN's bandwidth, its latency twice over.
SLOW_LINK = Link(bits_per_s=100_000, latency=0.2)
T0 = time.monotonic()


def log(message: str) -> None:
    print(f"[chaos {time.monotonic() - T0:7.1f}s] {message}", file=sys.stderr, flush=True)


class Cluster(wider.Wider):
    """The servers, the proxy in front of them, the api and the workers (two of the default model, one of
    wider.py's two); the faults act on these."""

    def __init__(self, root: Path, history: History):
        self.root, self.h = root, history
        self.pg = PgCluster(root / "pg")
        self.redis = RedisServer(root)
        self.api_port = free_port()
        with self.pg.connect() as conn:
            conn.execute("CREATE DATABASE lmsp")
        # On a pair (tests/chaos/pair.py) each server has a link of the proxy; the service's URL names both.
        self.pair = Pair(root, self.pg) if PAIR else None
        upstreams = {"postgres": self.pg.port, "redis": self.redis.port, "api": self.api_port}
        if self.pair is not None:
            upstreams["postgres2"] = self.pair.standby.port
        self.proxy = Proxy(upstreams, links={"api": SLOW_LINK})
        url = self.pg.url(self.proxy.ports["postgres"], "lmsp") if self.pair is None else \
            self.pair.url("lmsp", (self.proxy.ports["postgres"], self.proxy.ports["postgres2"]))
        upgrade(url)
        wider.install_ledger(self.db_direct)
        self.disk = EventDisk(root)
        self.disk_problem = self.disk.arrange(self.pg, "lmsp") if self.pair is None else \
            "not on a pair (tests/chaos/pair.py)"
        redis_url = f"redis://127.0.0.1:{self.proxy.ports['redis']}/0"
        self.stack = Stack(root, url, redis=False, models=[model_entry(MODEL), *wider.models(root)])
        self.stack.env.update({
            "LMSP_BROKER_URL": redis_url, "LMSP_REDIS_URL": redis_url,
            "LMSP_LEASE_SECONDS": str(LEASE), "LMSP_HEARTBEAT_SECONDS": str(HEARTBEAT),
            "LMSP_SWEEP_SECONDS": str(SWEEP), "LMSP_REQUEUE_AFTER_SECONDS": str(REQUEUE),
            "LMSP_TASK_DELTA_WINDOW_MS": "200", "LMSP_DRAIN_SECONDS": "5", "LMSP_WORKER_METRICS_PORT": "0",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            # Partition maintenance often (periods of 30 s, made 2 minutes ahead: a pass extends them about
            # once a minute), so maintenance_kill finds one to kill and the checker's promise covers many.
            "LMSP_EVENT_PARTITION_SECONDS": str(PARTITION), "LMSP_EVENT_PARTITIONS_AHEAD_SECONDS": str(AHEAD)})
        self.marker = f"LMSP_DATABASE_URL={url}".encode()  # every process of this run carries it
        run = uuid.uuid4().hex[:6]
        self.worker_ids = {"a": f"chaos-{run}-a", "b": f"chaos-{run}-b", "c": f"chaos-{run}-c"}
        self.worker_models = {"a": MODEL, "b": MODEL, "c": wider.WORKER_C_MODELS}
        self.worker_env = {"c": wider.WORKER_C_ENV}
        self.starts: dict[str, list[int]] = {n: [] for n in self.worker_ids}  # where each process's log begins
        self.extra: list[threading.Thread] = []  # followers the faults started
        self.model_checks: list[dict] = []
        self.workers: dict[str, subprocess.Popen] = {}
        self.ready_from: dict[str, int] = {}  # where the current process's part of its log starts
        self.api: subprocess.Popen | None = None
        self.base = f"http://127.0.0.1:{self.api_port}"
        self.held: set[str] = set()  # what a fault keeps down on purpose: the keeper leaves it alone
        self.exits: list[dict] = []
        self.orphans: list[dict] = []           # processes a killed worker left that its successor did not end
        self.orphan_seen: dict[int, float] = {}
        self.restarts: Counter = Counter()
        self.done = threading.Event()

    @property
    def db_direct(self) -> str:
        """The checker's own view of the database, past the proxy (on a pair: whichever is primary)."""
        return self.pg.url(db="lmsp") if self.pair is None else self.pair.url("lmsp")

    # -- processes -----------------------------------------------------------------------------------
    def start(self) -> str:
        self.start_api()
        token = self.stack.token(PRINCIPAL)
        threads = [threading.Thread(target=self.start_worker, args=(n, True)) for n in self.worker_ids]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return token

    def worker_log(self, name: str) -> Path:
        return self.root / f"worker-{self.worker_ids[name]}.log"

    def start_worker(self, name: str, wait: bool = False) -> None:
        log_file = self.worker_log(name)
        self.ready_from[name] = log_file.stat().st_size if log_file.exists() else 0
        self.starts[name].append(self.ready_from[name])
        model, env = self.worker_models[name], self.worker_env.get(name, {})
        if wait:
            self.workers[name] = self.stack.start_worker(model, self.worker_ids[name], **env)
        else:
            self.workers[name] = self.stack.spawn([sys.executable, "-m", "worker", "--model", model],
                                                  log_file.name, LMSP_WORKER_ID=self.worker_ids[name], **env)

    def start_api(self) -> None:
        self.stack.start_api(workers=1, threads=64, port=self.api_port)
        self.api = self.stack.procs[-1]

    def tail(self, path: Path, start: int = 0) -> str:
        return path.read_bytes()[start:].decode(errors="replace")[-2500:] if path.exists() else ""

    def keeper(self) -> None:
        """A supervisor's job (compose, Kubernetes): start again what ended by itself. A worker that was
        ready and ended on its own (not the exit 72 of a replaced id) is a violation; one that failed
        at boot (its database unreachable, say) is only started again."""
        while not self.done.wait(2):
            for name, proc in list(self.workers.items()):
                if name in self.held or proc.poll() is None:
                    continue
                text = self.tail(self.worker_log(name), self.ready_from[name])
                was_ready = self.is_ready(name)
                log(f"worker {name} exited by itself (rc {proc.returncode}, {'after' if was_ready else 'before'} "
                    "ready); starting it again")
                if was_ready and proc.returncode != 72:
                    self.exits.append({"name": f"worker {name}", "rc": proc.returncode, "t": round(self.h.now(), 1),
                                       "why": "a ready worker ended by itself", "tail": text[-1500:]})
                self.restarts[f"worker {name} (exited)"] += 1
                self.start_worker(name)
            self.watch_orphans()
            if "api" not in self.held and self.api is not None and self.api.poll() is not None:
                self.exits.append({"name": "api", "rc": self.api.returncode, "t": round(self.h.now(), 1),
                                   "why": "the api ended by itself",
                                   "tail": self.tail(self.root / f"api-{self.api_port}.log")[-1500:]})
                self.restarts["api (exited)"] += 1
                self._restart_api()

    def is_ready(self, name: str) -> bool:
        """Whether the worker's current process said it is ready."""
        return " ready." in self.worker_log(name).read_bytes()[self.ready_from[name]:].decode(errors="replace")

    def watch_orphans(self) -> None:
        """What a killed worker left (its engine, started or still starting, and their helpers) must be
        gone once the next process of its id is ready: its boot ends them (DESIGN, "A killed worker leaves
        vLLM's engine process behind"). One still there 10 s after that is left behind."""
        now = self.h.now()
        for p in self.survivors():
            name = next((n for n, w in self.worker_ids.items() if w == p["worker_id"]), None)
            proc = self.workers.get(name)
            if proc is None or proc.poll() is not None or not self.is_ready(name) or _descends(p["pid"], proc.pid):
                continue
            first = self.orphan_seen.setdefault(p["pid"], now)
            if now - first > 10 and p["pid"] not in {o["pid"] for o in self.orphans}:
                log(f"left behind by worker {name}: {p}")
                self.orphans.append({**p, "t": round(now, 1), "why": f"still alive 10 s after worker {name} "
                                     "was ready again"})

    def _restart_api(self) -> None:
        for _ in range(10):
            try:
                self.start_api()
                return
            except (TimeoutError, OSError) as exc:
                log(f"api did not start: {str(exc)[-300:]}")
                time.sleep(2)

    def engine_core(self, name: str) -> list[int]:
        out = []
        for pid in engine_pids(self.worker_ids[name]):
            try:
                if b"EngineCore" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    out.append(pid)
            except OSError:
                continue
        return out

    # -- faults --------------------------------------------------------------------------------------
    def inject(self, fault: dict) -> dict:
        rec = {"kind": fault["kind"], "target": fault["target"], "planned": fault["at"],
               "start": round(self.h.now(), 1), "end": None, "note": ""}
        try:
            rec["note"] = getattr(self, "_" + fault["kind"])(fault["target"], fault["hold"]) or ""
        except Exception as exc:  # noqa: BLE001 - the driver's own failure: shown, and the run goes on
            rec["note"] = f"injection failed: {type(exc).__name__}: {exc}"[:300]
            log(traceback.format_exc())
        rec["end"] = round(self.h.now(), 1)
        return rec

    def _worker_kill(self, name, hold):
        self.held.add(name)
        try:
            proc = self.workers[name]
            proc.kill()  # the worker alone: its engine is left behind, as after a real crash
            proc.wait(30)
            left = self.engine_core(name)
            time.sleep(hold)
            self.start_worker(name)
            return f"engine left behind: {left}"
        finally:
            self.held.discard(name)

    def _worker_stop(self, name, hold):
        pid = self.workers[name].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(hold)
        finally:
            os.kill(pid, signal.SIGCONT)

    def _engine_kill(self, name, _hold):
        cores = self.engine_core(name)
        for pid in cores:
            os.kill(pid, signal.SIGKILL)
        return f"killed {cores}" if cores else "no engine up (loading): nothing killed"

    def _redis_restart(self, _target, hold):
        self.redis.stop()
        time.sleep(hold)
        self.redis.start()

    def _redis_flush(self, _target, _hold):
        self.redis.client().flushall()

    def _postgres_restart(self, mode, hold):
        self.pg.stop(mode)
        time.sleep(hold)
        self.pg.start()

    def _postgres_failover(self, _target, _hold):
        dead, new, down = self.pair.fail_over()
        self.pg = self.pair.primary
        link = next(name for name, port in self.proxy.upstreams.items() if port == dead)
        self.proxy.upstreams[link] = new  # the dead server's link leads to the new standby from now on
        return f"no primary for {down:.1f} s; the new standby is behind link {link}"

    def _api_kill(self, _target, hold):
        self.held.add("api")
        try:
            os.killpg(self.api.pid, signal.SIGKILL)
            self.api.wait(30)
            time.sleep(hold)
            self._restart_api()
        finally:
            self.held.discard("api")

    def _proxy_cut(self, link, hold):
        self.proxy.set_cut(link, True)
        try:
            time.sleep(hold)
        finally:
            self.proxy.set_cut(link, False)

    def _proxy_stall(self, link, hold):
        self.proxy.set_stall(link, True)
        try:
            time.sleep(hold)
        finally:
            self.proxy.set_stall(link, False)

    def _maintenance_kill(self, name, hold):
        """kill -9 of whichever worker makes or drops partitions, as soon as one is seen in such a step
        (a pass extends the periods about once a PARTITION), within 150 s; else of ``name``. Started
        again after ``hold``."""
        deadline, victim = time.monotonic() + 150, None
        with psycopg.connect(self.db_direct, autocommit=True) as conn:
            while victim is None and time.monotonic() < deadline:
                rows = conn.execute("SELECT application_name FROM pg_stat_activity WHERE state IN ('active', "
                                    "'idle in transaction') AND (query LIKE 'ALTER TABLE events %%' OR query LIKE "
                                    "'CREATE TABLE IF NOT EXISTS \"events_p%%')").fetchall()
                # A worker's connections are named "lmsp-worker <its id>" (pg_stat_activity.application_name).
                victim = next((n for n, wid in self.worker_ids.items() if any(wid in app for (app,) in rows)), None)
                time.sleep(0.002)
        name = victim or name
        self._worker_kill(name, hold)
        return f"{'in maintenance' if victim else 'none seen in maintenance: killed anyway'}: {name}"

    def _grammar_kill(self, _target, _hold):
        import psutil
        gone = []
        for proc in psutil.process_iter(["cmdline"]):
            cmd = " ".join(proc.info["cmdline"] or [])
            if "api.grammar_pool" in cmd and _descends(proc.pid, self.api.pid):
                proc.kill()
                gone.append(proc.pid)
        return f"killed {gone}" if gone else "no grammar helper up: nothing killed"

    def _disk_full(self, _target, hold):
        if self.disk_problem:
            return f"skipped: {self.disk_problem}"
        self.disk.fill()
        try:
            time.sleep(hold)
        finally:
            self.disk.free()

    # -- observation ---------------------------------------------------------------------------------
    OWNERLESS = """
        WITH now AS (SELECT EXTRACT(EPOCH FROM clock_timestamp()) AS t)
        SELECT t.id, t.status, t.attempt, t.worker_id, (SELECT now.t FROM now) - w.heartbeat_at, w.stopped_at
        FROM tasks t LEFT JOIN workers w ON w.id = t.worker_id
        WHERE t.status IN ('loading', 'running', 'cancelling') AND t.worker_id IS NOT NULL
          AND (w.id IS NULL OR w.stopped_at IS NOT NULL OR w.heartbeat_at < (SELECT now.t FROM now) - %(lease)s)
        UNION ALL
        SELECT r.id, r.status, 0, r.worker_id, (SELECT now.t FROM now) - w.heartbeat_at, w.stopped_at
        FROM responses r LEFT JOIN workers w ON w.id = r.worker_id
        WHERE r.status IN ('queued', 'in_progress') AND r.worker_id IS NOT NULL
          AND NOT EXISTS (SELECT 1 FROM tasks x WHERE x.response_id = r.id)
          AND (w.id IS NULL OR w.stopped_at IS NOT NULL OR w.heartbeat_at < (SELECT now.t FROM now) - %(lease)s)"""

    def sampler(self, samples: list) -> None:
        """Every 2 s: the live states whose owner's lease has expired (the checker judges how long)."""
        while not self.done.wait(2):
            try:
                with psycopg.connect(self.db_direct, autocommit=True, connect_timeout=2) as conn:
                    rows = conn.execute(self.OWNERLESS, {"lease": LEASE}).fetchall()
            except psycopg.Error:
                continue  # Postgres is down: that fault's window excuses it
            t = round(self.h.now(), 1)
            samples += [{"t": t, "id": r[0], "status": r[1], "attempt": r[2],
                         "why": f"owner {r[3]}: " + ("gone" if r[4] is None else
                                                     "stopped" if r[5] else f"heartbeat {r[4]:.0f}s old")}
                        for r in rows]

    def partitions(self) -> dict:
        """The event log's partitions at the end, as the checker reads the look-ahead's promise."""
        with psycopg.connect(self.db_direct, autocommit=True) as conn:
            now = conn.execute(partitions._NOW).fetchone()[0]
            found = partitions.parts(conn)
            detached = partitions._detached(conn)
        # A pass keeps half the look-ahead; between passes (one a sweep interval, by any live worker) it
        # wears down by up to an interval: a few intervals of slack.
        return {"now": now, "promised": AHEAD / 2 - 5 * SWEEP, "detached": detached,
                "parts": [{"name": p.name, "low": p.low and id_time(p.low), "high": p.high and id_time(p.high),
                           "pending": p.pending} for p in found]}

    def residency(self) -> list[dict]:
        """What each process of worker c loaded, unloaded and failed to load (wider.residency_events)."""
        path = self.worker_log("c")
        data = path.read_bytes() if path.exists() else b""
        bounds = [*self.starts["c"], len(data)]
        return [{"process": n, "events": wider.residency_events(data[a:b].decode(errors="replace"))}
                for n, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))]

    def unfinished(self) -> int:
        with psycopg.connect(self.db_direct, autocommit=True, connect_timeout=5) as conn:
            return conn.execute("SELECT count(*) FROM tasks WHERE status NOT IN ('succeeded', 'failed', "
                                "'cancelled')").fetchone()[0]

    def collect(self, load: Load) -> dict:
        """Every task the database holds for the run's principal (also one whose 202 was lost), its
        state as the api answers it, and its log as Postgres has it."""
        http = load.session()
        out = {}
        with psycopg.connect(self.db_direct, autocommit=True) as conn:
            rows = conn.execute("SELECT id, response_id, on_restart FROM tasks WHERE principal_id = %s",
                                (PRINCIPAL,)).fetchall()
            for task_id, response_id, policy in rows:
                rec = dict(self.h.tasks.get(task_id) or {"policy": policy, "cancel": None, "key": None})
                rec["policy"] = policy
                rec["log"] = [[seq, name, json.loads(data)] for seq, name, data in conn.execute(
                    "SELECT seq, name, data FROM events WHERE response_id = %s ORDER BY seq", (response_id,))]
                resp = self._read_task(http, task_id)
                if resp.ok:
                    task = resp.json()
                    text = "".join(p.get("text", "") for item in ((task.get("response") or {}).get("output") or [])
                                   if item.get("type") == "message" for p in item.get("content") or [])
                    rec["final"] = {"status": task["status"], "error_code": (task.get("error") or {}).get("code"),
                                    "error": task.get("error"), "text": text}
                else:
                    rec["final"], rec["final_http"] = None, resp.status_code
                out[task_id] = rec
        return out

    def _read_task(self, http, task_id: str):
        """GET the task as its owner would, waiting out the principal's rate limit: reading hundreds of
        tasks in a row is over it (seed 4099 read 448 and got no state for 43 whose logs had ended)."""
        for _ in range(30):
            resp = http.get(f"{self.base}/lmsp/v1/tasks/{task_id}", timeout=30)
            if resp.status_code != 429:
                return resp
            time.sleep(float(resp.headers.get("Retry-After") or 1))
        return resp

    def stop_all(self) -> list[dict]:
        """Each process as its operator stops it (SIGTERM to the worker alone, as Kubernetes does; to
        gunicorn's master); then whatever of this run is still alive is left behind: noted, then killed."""
        self.done.set()
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        if self.api is not None and self.api.poll() is None:
            self.api.send_signal(signal.SIGTERM)
        for name, proc in [*self.workers.items(), ("api", self.api)]:
            if proc is None:  # the api never started: the run failed before it
                continue
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                self.exits.append({"name": name if name == "api" else f"worker {name}", "rc": None,
                                   "t": round(self.h.now(), 1), "why": "did not exit within 90 s of SIGTERM",
                                   "tail": ""})
                os.killpg(proc.pid, signal.SIGKILL)
        # What has not ended 15 s after its parents did is left behind (under load an exiting helper,
        # such as multiprocessing's resource tracker cleaning up, may take a few seconds).
        deadline = time.monotonic() + 15
        while (left := self.survivors()) and time.monotonic() < deadline:
            time.sleep(1)
        for p in left:
            try:
                os.kill(p["pid"], signal.SIGKILL)
            except OSError:
                pass
        self.stack.close()
        return left

    def survivors(self) -> list[dict]:
        """The live processes that carry this run's marker, with what says where they come from."""
        left = []
        for p in Path("/proc").iterdir():
            if not p.name.isdigit() or int(p.name) == os.getpid():
                continue
            try:
                env = (p / "environ").read_bytes().split(b"\0")
                stat = (p / "stat").read_text().rsplit(")", 1)[1].split()
                if self.marker not in env or stat[0] == "Z":
                    continue
                worker = next((v.split(b"=", 1)[1].decode() for v in env if v.startswith(b"LMSP_WORKER_ID=")), "")
                left.append({"pid": int(p.name), "ppid": int(stat[1]), "worker_id": worker,
                             "cmdline": (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200],
                             "age_seconds": round(time.clock_gettime(time.CLOCK_BOOTTIME)
                                                  - int(stat[19]) / os.sysconf("SC_CLK_TCK"))})
            except OSError:
                continue
        return left

    def close(self) -> None:
        self.proxy.close()
        self.redis.close()
        if self.pair is not None:
            self.pair.close()
        else:
            self.pg.close()
        self.disk.close()


def _descends(pid: int, ancestor: int) -> bool:
    try:
        while pid > 1:
            if pid == ancestor:
                return True
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError):
        pass
    return False


def figures(history: dict, cluster: Cluster, h: History) -> list[str]:
    tasks = history["tasks"]
    by = Counter((r["policy"], (r.get("final") or {}).get("status"), (r.get("final") or {}).get("error_code"))
                 for r in tasks.values())
    logs = {n: cluster.worker_log(n).read_text(errors="replace") if cluster.worker_log(n).exists() else ""
            for n in cluster.worker_ids}
    marks = sum(1 for r in tasks.values() for e in r["log"] if e[1] == checker.MARK)
    lines = [f"tasks: {len(tasks)} in the database, {h.counts.get('tasks accepted', 0)} accepted by a 202, "
             f"{h.counts.get('idempotent replays', 0)} idempotent replays",
             "outcomes (policy, status, error): " + ", ".join(f"{k}={v}" for k, v in sorted(by.items(), key=str)),
             f"events in the log: {sum(len(r['log']) for r in tasks.values())}; attempt markers: {marks}",
             f"followers: {len(history['followers'])} "
             f"({Counter(f['transport'] for f in history['followers'])}), "
             f"{sum(f['reconnects'] for f in history['followers'])} reconnects",
             f"direct streams: {Counter(d['outcome'] for d in history['directs'])}; failed ones by detail: "
             f"{Counter(((d['events'][-1][2].get('error') or {}).get('detail') or '')[:60] for d in history['directs'] if d['events'] and d['events'][-1][1] == 'response.failed')}",
             "takeovers: " + ", ".join(f"{n}={t.count('took over')}" for n, t in logs.items()) +
             "; engines reloaded: " + ", ".join(f"{n}={t.count('a new engine is loaded')}" for n, t in logs.items()),
             f"restarts by the keeper: {dict(cluster.restarts)}",
             "client counts: " + ", ".join(f"{k}={v}" for k, v in sorted(h.counts.items()))]
    roles = Counter((r.get("role"), (r.get("final") or {}).get("status")) for r in tasks.values() if r.get("role"))
    unloads = Counter(e[2] for p in history.get("residency", []) for e in p["events"] if e[0] == "unload")
    fair = history.get("fairshare") or {"log": []}
    lines += [f"fault tasks (role, status): {dict(sorted(roles.items(), key=str))}",
              f"model_broken: GET /models said {[c['model_status'] for c in history.get('broken_model', [])]}; "
              f"worker c unloaded to make room for: {dict(unloads)}; worker c processes: "
              f"{len(history.get('residency', []))}",
              f"fair-share ledger: {Counter(e['kind'] for e in fair['log'])}"]
    return lines


def main() -> int:
    rng = random.Random(SEED)
    plan = faults.schedule(SEED, SECONDS, LEASE, KINDS or faults.default_kinds(PAIR))
    root = Path(tempfile.mkdtemp(prefix=f"lmsp-chaos-{SEED}-"))
    os.chmod(root, 0o755)
    print(f"chaos: seed {SEED}, {SECONDS:.0f} s, {'on a Postgres pair, ' if PAIR else ''}run folder {root}",
          flush=True)
    print("schedule:", flush=True)
    for f in plan:
        print(f"  t={f['at']:7.1f}s {f['kind']:<17} {f['target']:<9} hold {f['hold']:.1f}s", flush=True)
    h = History(time.monotonic())
    cluster = Cluster(root, h)
    done_faults: list[dict] = []
    samples: list[dict] = []
    history: dict = {}
    try:
        log(f"starting the api and two workers (disk fault: {cluster.disk_problem or 'arranged'})")
        token = cluster.start()
        h.t0 = time.monotonic()  # the schedule's clock starts with the load
        load = Load(cluster.base, token, MODEL, h, rng)
        cluster.load = load
        cluster.slow = Load(f"http://127.0.0.1:{cluster.proxy.ports['api']}", token, MODEL, h, rng,
                            task_clients=0, direct_clients=0, label=" slow")
        load.start()
        for target in (cluster.keeper, lambda: cluster.sampler(samples)):
            threading.Thread(target=target, daemon=True).start()
        for f in plan:
            wait = f["at"] - h.now()
            if wait > 0:
                time.sleep(wait)
            log(f"fault {f['kind']} {f['target']} for {f['hold']:.1f}s")
            done_faults.append(cluster.inject(f))
        time.sleep(max(0.0, SECONDS - h.now()))
        log("the faults are over: no new work; waiting for every task to end")
        load.stop.set()
        deadline = time.monotonic() + SETTLE
        load.join(SETTLE)
        while time.monotonic() < deadline and cluster.unfinished():
            time.sleep(2)
        load.give_up.set()
        cluster.slow.give_up.set()
        load.join(30)
        wider.join_extra(cluster.extra, wider.BROKEN_WAIT)  # followers end on give_up, watchers by their wait
        log("collecting the history")
        history = {"seed": SEED, "seconds": SECONDS, "lease_seconds": LEASE, "sweep_seconds": SWEEP,
                   "faults": done_faults, "tasks": cluster.collect(load), "followers": h.followers,
                   "directs": h.directs, "http": h.http, "ownerless": samples,
                   "idempotency": [{"key": k, "task_ids": sorted(v)} for k, v in h.keys.items()],
                   "broken_model": cluster.model_checks, "fairshare": wider.fair_state(cluster.db_direct)}
        log("stopping every process")
        history["partitions"] = cluster.partitions()
        history["residency"] = cluster.residency()
        history["leftovers"] = cluster.orphans + cluster.stop_all()
        history["exits"] = cluster.exits
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        try:
            if "leftovers" not in history:  # the run broke off: end its processes all the same
                cluster.stop_all()
        finally:
            cluster.close()
    (root / "history.json").write_text(json.dumps(history, default=str))
    violations = checker.check(history)
    print("faults:", flush=True)
    for f in done_faults:
        print(f"  {f['start']:7.1f}-{f['end']:7.1f}s {f['kind']:<17} {f['target']:<9} {f['note']}", flush=True)
    print("faults drawn: " + ", ".join(f"{k}={v}" for k, v in sorted(Counter(f["kind"] for f in plan).items())),
          flush=True)
    print("figures:", flush=True)
    for line in figures(history, cluster, h):
        print("  " + line, flush=True)
    by_check = Counter(v["check"] for v in violations)
    print(f"violations: {dict(by_check) or 'none'}", flush=True)
    for v in violations:
        print("  " + str(v), flush=True)
    print(f"history: {root / 'history.json'}; logs: {root}", flush=True)
    print(f"chaos: {len(violations)} violations", flush=True)
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
