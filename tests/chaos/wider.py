"""The chaos run's faults of issue 36 ("Chaos, wider") that need more than a signal: a third worker of two
models, one simulated (its poison request kills the engine in decode: worker/sim.py CRASH_MARK) and one
whose checkpoint cannot load; slow followers through a throttled link to the api; and the fair-share
ledger the checker reads (triggers on the clocks and the tasks' tags, the checker's own instrument).

Worker c serves both models with room for one (LMSP_WORKER_MEMORY_BUDGET_GIB), so a load of the broken
model would need the simulated one unloaded: the first try may (it has not failed yet: worker/residency.py),
no later one may."""

import json
import random
import re
import threading
import time
from pathlib import Path

import psycopg
import requests

from tests.chaos.load import TOPICS, History, Load
from tests.harness import CHECKPOINT, model_entry, user
from worker.sim import CRASH_MARK

SIM_MODEL, BROKEN_MODEL = "chaos-sim", "chaos-broken"
WORKER_C_MODELS = f"{SIM_MODEL},{BROKEN_MODEL}"
WORKER_C_ENV = {"LMSP_WORKER_MEMORY_BUDGET_GIB": "1.5"}  # one of the two 1 GiB models at a time
BROKEN_WAIT = 240  # seconds for a model_broken fault's tasks to fail: the failures are bounded
SIM_ENGINE = {"kind": "sim", "max_num_seqs": 8, "ttft_ms": 100, "tokens_per_s": 10, "tick_ms": 100}


def models(root: Path) -> list[dict]:
    """The entries of worker c's models. The broken checkpoint is the default one with a config naming an
    architecture no engine has: the api reads its tokenizer (so tasks are accepted), the engine fails."""
    broken = root / "broken-checkpoint"
    broken.mkdir()
    for f in CHECKPOINT.iterdir():
        if f.name != "config.json":
            (broken / f.name).symlink_to(f)
    config = json.loads((CHECKPOINT / "config.json").read_text())
    config["architectures"] = ["ChaosBrokenForCausalLM"]
    (broken / "config.json").write_text(json.dumps(config))
    return [model_entry(SIM_MODEL, engine=SIM_ENGINE, memory_gib=1.0),
            model_entry(BROKEN_MODEL, checkpoint=str(broken), memory_gib=1.0)]


# -- the fair-share ledger -------------------------------------------------------------------------------
LEDGER = """
CREATE TABLE chaos_fair_log (n bigserial PRIMARY KEY, tx bigint NOT NULL DEFAULT txid_current(), kind text,
    model text, principal_id text, task_id text, status text, old_start float8, old_finish float8,
    new_start float8, new_finish float8);
CREATE FUNCTION chaos_clock() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
    INSERT INTO chaos_fair_log (kind, model, principal_id, old_finish, new_finish)
    VALUES ('clock', NEW.model, NEW.principal_id, CASE WHEN TG_OP = 'UPDATE' THEN OLD.finish END, NEW.finish);
    RETURN NULL; END $$;
CREATE TRIGGER chaos_clock AFTER INSERT OR UPDATE OF finish ON virtual_times FOR EACH ROW
    WHEN (NEW.principal_id <> '') EXECUTE FUNCTION chaos_clock();
CREATE FUNCTION chaos_tags() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
    IF TG_OP = 'UPDATE' AND OLD.virtual_start = NEW.virtual_start AND OLD.virtual_finish = NEW.virtual_finish
    THEN RETURN NULL; END IF;
    INSERT INTO chaos_fair_log (kind, model, principal_id, task_id, status, old_start, old_finish, new_start,
                                new_finish)
    VALUES (CASE WHEN TG_OP = 'INSERT' THEN 'charge' ELSE 'settle' END, NEW.model, NEW.principal_id, NEW.id,
            NEW.status, CASE WHEN TG_OP = 'UPDATE' THEN OLD.virtual_start END,
            CASE WHEN TG_OP = 'UPDATE' THEN OLD.virtual_finish END, NEW.virtual_start, NEW.virtual_finish);
    RETURN NULL; END $$;
CREATE TRIGGER chaos_tags AFTER INSERT OR UPDATE OF virtual_start, virtual_finish ON tasks FOR EACH ROW
    EXECUTE FUNCTION chaos_tags();
"""


def install_ledger(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(LEDGER)


def fair_state(url: str) -> dict:
    """What the checker's fair-share check reads: the ledger, every task's tags and the clocks."""
    with psycopg.connect(url, autocommit=True) as conn:
        cols = ("n", "tx", "kind", "model", "principal_id", "task_id", "status", "old_start", "old_finish",
                "new_start", "new_finish")
        log = [dict(zip(cols, r, strict=True)) for r in conn.execute(
            f"SELECT {', '.join(cols)} FROM chaos_fair_log ORDER BY n").fetchall()]
        tasks = {r[0]: {"model": r[1], "principal_id": r[2], "status": r[3], "start": r[4], "finish": r[5],
                        "cost": r[6]} for r in conn.execute(
            "SELECT id, model, principal_id, status, virtual_start, virtual_finish, cost FROM tasks").fetchall()}
        clocks = [{"model": m, "principal_id": p, "finish": f} for m, p, f in conn.execute(
            "SELECT model, principal_id, finish FROM virtual_times WHERE principal_id <> ''").fetchall()]
    return {"log": log, "tasks": tasks, "clocks": clocks}


# -- the faults ------------------------------------------------------------------------------------------
class Wider:
    """The faults of this module, mixed into tests/chaos/__main__.Cluster (which sets ``load``, ``slow``,
    ``h``, ``base``, ``extra``)."""

    load: Load
    slow: Load          # the same clients through the throttled link to the api
    h: History
    base: str
    extra: list[threading.Thread]
    model_checks: list[dict]

    def _submit_tasks(self, model: str, specs: list[tuple[str, str, str]], max_tokens: int) -> list[dict]:
        """Submit tasks of (policy, role, prompt) and record them with their role for the checker."""
        http, out = self.load.session(), []
        for policy, role, prompt in specs:
            body = {"type": "response", "on_restart": policy, "input": {
                "model": model, "input": user(prompt), "temperature": 0, "max_output_tokens": max_tokens}}
            key = f"chaos-{role}-{random.getrandbits(64):016x}"
            task = self.load._submit(http, body, key, first=True)
            if task is None:
                continue
            with self.h.lock:
                self.h.tasks[task["id"]] = {"policy": policy, "cancel": None, "key": key, "role": role}
            out.append(task)
        return out

    def _follow_all(self, tasks: list[dict], via: Load, every: tuple[int, int] = (2, 8)) -> None:
        for task in tasks:
            t = threading.Thread(target=via._follow, args=(task, random.choice(["sse", "ws"]), random.Random(),
                                                           every), daemon=True, name=f"follow-{task['id']}")
            t.start()
            self.extra.append(t)

    def _poison_request(self, _target, _hold):
        """One request that kills the simulated engine in decode, submitted with three innocent ones so
        they share its batch: only the poison may fail (the crash cap), the others finish."""
        topic = random.choice(TOPICS)
        specs = [("retry", "poison", f"{CRASH_MARK} Write a short story about {topic}."),
                 *[(policy, "innocent", f"Write a short story about {topic}, take {n}.")
                   for n, policy in enumerate(("retry", "resume", "retry"))]]
        tasks = self._submit_tasks(SIM_MODEL, specs, 24)
        self._follow_all(tasks, self.load)
        return f"{len(tasks)} tasks: {', '.join(t['id'] for t in tasks)}"

    def _model_broken(self, _target, _hold):
        """Tasks for the model whose checkpoint fails to load; a watcher waits for their ends (a first load
        in a process imports vLLM: a minute or more under load), then asks GET /models, for the checker."""
        tasks = self._submit_tasks(BROKEN_MODEL, [(p, "broken", f"Describe {random.choice(TOPICS)}.")
                                                  for p in ("fail", "retry", "resume")], 16)
        self._follow_all(tasks, self.load)
        watcher = threading.Thread(target=self._watch_broken, args=(tasks, self.h.now()), daemon=True)
        watcher.start()
        self.extra.append(watcher)
        return f"{len(tasks)} tasks: {', '.join(t['id'] for t in tasks)}"

    def _watch_broken(self, tasks: list[dict], since: float) -> None:
        http = self.load.session()
        deadline, ended = time.monotonic() + BROKEN_WAIT, {}
        while time.monotonic() < deadline and len(ended) < len(tasks):
            for task in tasks:
                try:
                    resp = http.get(f"{self.base}/lmsp/v1/tasks/{task['id']}", timeout=10)
                except requests.RequestException:
                    continue
                if resp.ok and resp.json()["status"] in ("succeeded", "failed", "cancelled"):
                    ended[task["id"]] = resp.json()["status"]
            time.sleep(2)
        try:
            model = http.get(f"{self.base}/lmsp/v1/models/{BROKEN_MODEL}", timeout=10).json()
        except (requests.RequestException, ValueError) as exc:
            model = {"status": f"unread: {exc}"[:100]}
        self.model_checks.append({"t": round(since, 1), "waited": round(self.h.now() - since, 1),
                                  "tasks": [t["id"] for t in tasks], "ended": ended,
                                  "model_status": model.get("status")})

    def _slow_followers(self, _target, hold):
        """Tasks of the default model followed only through the throttled link (tests/proxy.WAN's shape,
        slower): one connection each, resumed only when it breaks; each must see its whole log once."""
        specs = [(random.choice(["fail", "retry", "resume"]), "slow", f"Write a story about {random.choice(TOPICS)}.")
                 for _ in range(3)]
        tasks = self._submit_tasks(self.load.model, specs, 96)
        self._follow_all(tasks, self.slow, every=(10_000, 10_000))
        time.sleep(hold)
        return f"{len(tasks)} tasks followed through the slow link"


def join_extra(threads: list[threading.Thread], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))


UNLOAD = re.compile(r"unloading (\S+) \(to make room for (\S+)\)")
FAILED = re.compile(r"loading (\S+) failed \d+ times in a row")
LOADED = re.compile(r"lmsp\.residency: loaded (\S+) in [\d.]+ s")


def residency_events(text: str) -> list[list[str]]:
    """The lines of one worker process's log that say what it loaded, unloaded and failed to load, as
    [kind, model, why]: ("unload", X, M: to make room for M), ("failed", M, ""), ("loaded", M, "")."""
    out = []
    for line in text.splitlines():
        if m := UNLOAD.search(line):
            out.append(["unload", m[1], m[2]])
        elif m := FAILED.search(line):
            out.append(["failed", m[1], ""])
        elif m := LOADED.search(line):
            out.append(["loaded", m[1], ""])
    return out
