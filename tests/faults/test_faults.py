"""Crashes with real processes: SIGKILLed workers, Redis restarted empty, Postgres restarted, lost leases,
duplicate deliveries. Every follower must see every sequence number exactly once, ending with one final event."""

import json
import os
import signal
import threading
import time

import jsonschema
import psutil
import pytest
import redis
import requests
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError

from common import eventlog
from common.broker import BACKGROUND, dispatch, make_celery
from common.db import make_engine, session_factory
from common.registry import queue_name
from common.settings import Settings
from common.tables import Response, Task, Worker
from tests.harness import engine_pids, iter_sse, user, wait_for

FINALS = {"response.completed", "response.incomplete", "response.failed", "response.cancelled"}
ESSAY = "Write a very long, detailed essay about the history of {}."


@pytest.fixture(scope="module")
def sessions(pg_url):
    engine = make_engine(pg_url)
    yield session_factory(engine)
    engine.dispose()


# Two workers of one model (the stack's pair_model) serve every fault test (this lane loads no other engine):
# a SIGKILL, Redis restarted empty, Postgres down, pauses, a dead engine, Redis restarts, a rolling restart,
# a dead peer, an api's SIGTERM.
@pytest.fixture(scope="module")
def pair(stack):
    env = {"LMSP_DRAIN_SECONDS": "60"}  # a Kubernetes-like grace: a SIGTERMed worker's fail tasks finish in it
    workers = {name: stack.start_worker(stack.pair_model, name, **env) for name in ("pair-a", "pair-b")}
    workers["env"] = env
    yield workers
    for name in ("pair-a", "pair-b"):
        stack.stop(workers[name])


class Follower(threading.Thread):
    """Follows a task's events, dropping the connection every few events (and on any error) and
    reconnecting with Last-Event-ID, the way a laptop on a flaky network would."""

    def __init__(self, client, task, every=15):
        super().__init__(daemon=True)
        self.client, self.task, self.every = client, task, every
        self.events: list[tuple[int, str, dict]] = []
        self.errors: list[tuple[int, str, dict]] = []  # error events: not the response's, they end a connection
        self.reconnects = 0

    def run(self):
        last = 0
        while True:
            try:
                with self.client.http.get(self.client.url(self.task["events_url"]), stream=True,
                                          headers={"Last-Event-ID": str(last)}, timeout=(5, 30)) as resp:
                    if resp.status_code != 200:
                        raise requests.RequestException(resp.status_code)
                    for n, event in enumerate(iter_sse(resp.iter_lines(decode_unicode=True)), 1):
                        if event[1] == "error":  # the server cannot go on (6.3): resume from its id
                            self.errors.append(event)
                            break
                        self.events.append(event)
                        last = event[0]
                        if event[1] in FINALS:
                            return
                        if n >= self.every:
                            break
            except requests.RequestException:
                time.sleep(0.3)
            self.reconnects += 1

    def text(self) -> str:
        return "".join(e[2]["delta"] for e in self.events if e[1] == "response.output_text.delta")

    def deltas(self) -> int:
        return sum(1 for e in self.events if e[1] == "response.output_text.delta")


def check_exactly_once(events):
    ids = [e[0] for e in events]
    assert ids == list(range(1, len(ids) + 1)), ids
    assert sum(1 for e in events if e[1] in FINALS) == 1 and events[-1][1] in FINALS


SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "animals", "schema": {
    # Bounded, so a small model that repeats itself still closes the document within the token budget.
    "type": "object", "properties": {"animals": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                                 "minItems": 40, "maxItems": 40}},
    "required": ["animals"], "additionalProperties": False}}}


def text_after_last_attempt(events) -> str:
    """What a client that honours response.attempt.started reassembles from the deltas."""
    marks = [i for i, e in enumerate(events) if e[1] == "response.attempt.started"]
    tail = events[marks[-1] + 1:] if marks else events
    return "".join(e[2]["delta"] for e in tail if e[1] == "response.output_text.delta")


def submit(client, model, text, on_restart="fail", max_tokens=300, **fields):
    body = {"type": "response", "on_restart": on_restart,
            "input": {"model": model, "input": user(text), "temperature": 0, "max_output_tokens": max_tokens,
                      **fields}}
    resp = client.post("/lmsp/v1/tasks", body)
    assert resp.status_code == 202, resp.text
    return resp.json()


def final_task(client, task_id, timeout=600):
    wait_for(lambda: client.get(f"/lmsp/v1/tasks/{task_id}").json()["status"] in ("succeeded", "failed",
                                                                                  "cancelled"),
             timeout, f"task {task_id} never finished")
    return client.get(f"/lmsp/v1/tasks/{task_id}").json()


def _cut_from_redis(redis_url: str, pid: int) -> None:
    """Drop a frozen process's Redis connections: its pending BRPOP would still take the next message
    (it reconnects when it is let go, as after a Redis restart)."""
    client = redis.Redis.from_url(redis_url)
    port = client.connection_pool.connection_kwargs["port"]
    for conn in psutil.Process(pid).net_connections(kind="tcp"):
        if conn.raddr and conn.raddr.port == port:
            client.client_kill(f"{conn.laddr.ip}:{conn.laddr.port}")
    client.close()


def test_sigkill_mid_generation_then_restart(stack, alice, pair, sessions, redis_url):
    model, worker_id = stack.pair_model, "pair-a"
    proc = pair["pair-a"]
    os.kill(pair["pair-b"].pid, signal.SIGSTOP)  # all on pair-a; nobody takes over: its own boot applies on_restart
    _cut_from_redis(redis_url, pair["pair-b"].pid)
    try:
        _sigkill_then_restart(stack, alice, pair, sessions, model, worker_id, proc)
    finally:
        os.kill(pair["pair-b"].pid, signal.SIGCONT)


def _sigkill_then_restart(stack, alice, pair, sessions, model, worker_id, proc):
    direct: list = []  # an interactive stream on the same worker: its client must not hang forever

    def stream_direct():
        body = {"model": model, "input": user(ESSAY.format("Chile")), "stream": True, "max_output_tokens": 900}
        with alice.stream_post("/lmsp/v1/responses", body) as resp:
            for event in iter_sse(resp.iter_lines(decode_unicode=True)):
                direct.append(event)

    sync: list = []  # a synchronous request on it: its answer must be a problem document, not a hang

    def sync_direct():
        body = {"model": model, "input": user(ESSAY.format("Mali")), "max_output_tokens": 900}
        sync.append(alice.post("/lmsp/v1/responses", body))

    # The api's first structured-output request starts its grammar spawner (an import of torch and vLLM:
    # 12 CPU-s, up to a minute on a loaded host, while the tasks below ran to their end). Made here, on a
    # model nobody serves; the constrained task's schema is then checked already.
    warm = submit(alice, stack.fault_model, "Warm up.", response_format=SCHEMA_FORMAT)
    assert alice.post(f"/lmsp/v1/tasks/{warm['id']}/cancel").json()["status"] == "cancelled"
    # The direct requests start first: the tasks then need only a few seconds to be running, so short
    # tasks are still mid-generation when the crash comes (waiting on the direct requests after the
    # tasks once let 300-token tasks end before it).
    direct_thread = threading.Thread(target=stream_direct, daemon=True)
    direct_thread.start()
    sync_thread = threading.Thread(target=sync_direct, daemon=True)
    sync_thread.start()
    wait_for(lambda: _direct_responses(sessions, model, "in_progress") == 2, 120, "the direct requests did not start")
    tasks = {policy: submit(alice, model, ESSAY.format(topic), policy)
             for policy, topic in [("fail", "Rome"), ("retry", "Egypt"), ("resume", "China")]}
    cancelling = submit(alice, model, ESSAY.format("Peru"), "resume")
    constrained = submit(alice, model, "List one hundred animals as JSON.", "resume", max_tokens=700,
                         response_format=SCHEMA_FORMAT)
    followers = {p: Follower(alice, t) for p, t in {**tasks, "json": constrained}.items()}
    for f in followers.values():
        f.start()
    wait_for(lambda: all(f.deltas() >= 12 for f in followers.values()), 300, "generation did not start")
    wait_for(lambda: alice.get(f"/lmsp/v1/tasks/{cancelling['id']}").json()["status"] == "running", 60, "run")
    assert len(direct) > 1 and not sync, "the direct requests ended before the crash"
    os.kill(proc.pid, signal.SIGSTOP)  # freeze it so the cancel below cannot complete before the crash
    assert alice.post(f"/lmsp/v1/tasks/{cancelling['id']}/cancel").json()["status"] == "cancelling"
    before = {p: f.text() for p, f in followers.items()}
    os.kill(proc.pid, signal.SIGKILL)  # the worker only: its engine is left behind, as in a real crash
    proc.wait(30)
    stale = engine_pids(worker_id)
    assert stale, "expected the killed worker's engine to outlive it"

    booted: list = []  # same identity: applies on_restart at boot
    restarter = threading.Thread(target=lambda: booted.append(stack.start_worker(model, worker_id, **pair["env"])),
                                 daemon=True)
    restarter.start()
    # Its own tasks are handed on at boot, before its engine loads (a minute or more on a busy host).
    failed = final_task(alice, tasks["fail"]["id"], timeout=300)
    assert _worker_state(sessions, worker_id) == "loading", "on_restart waited for the engine to load"
    restarter.join(600)
    pair["pair-a"] = booted[0]
    assert not set(stale) & set(engine_pids(worker_id)), "the stale engine must be gone"
    for f in followers.values():
        f.join(600)
        assert not f.is_alive()
        check_exactly_once(f.events)

    assert failed["status"] == "failed" and failed["error"]["code"] == "server_restarted"
    assert followers["fail"].events[-1][1] == "response.failed"
    assert followers["fail"].events[-1][2]["error"]["code"] == "server_restarted"

    retried = final_task(alice, tasks["retry"]["id"])
    assert retried["status"] == "succeeded"
    starts = [e for e in followers["retry"].events if e[1] == "response.output_item.added"]
    assert len(starts) == 2 and starts[0][2]["item"]["id"] != starts[1][2]["item"]["id"]  # ran again, new items
    assert retried["response"]["output"][0]["id"] == starts[1][2]["item"]["id"]
    # The second attempt is announced before its items; what follows the marker is the whole output.
    marks = [i for i, e in enumerate(followers["retry"].events) if e[1] == "response.attempt.started"]
    assert len(marks) == 1 and followers["retry"].events[marks[0]][2]["attempt"] == 2
    assert followers["retry"].events.index(starts[1]) > marks[0] > followers["retry"].events.index(starts[0])
    assert text_after_last_attempt(followers["retry"].events) == \
        retried["response"]["output"][0]["content"][0]["text"]

    # Structured output cannot continue a partial JSON: resume falls back to a fresh, marked attempt.
    structured = final_task(alice, constrained["id"])
    assert structured["status"] == "succeeded"
    assert any(e[1] == "response.attempt.started" for e in followers["json"].events)
    document = json.loads(structured["response"]["output"][0]["content"][0]["text"])
    jsonschema.validate(document, SCHEMA_FORMAT["json_schema"]["schema"])
    assert text_after_last_attempt(followers["json"].events) == structured["response"]["output"][0]["content"][0]["text"]

    resumed = final_task(alice, tasks["resume"]["id"])
    assert resumed["status"] == "succeeded"
    text = resumed["response"]["output"][0]["content"][0]["text"]
    assert before["resume"] and text.startswith(before["resume"])  # continues where it stopped
    assert followers["resume"].text() == text
    assert len([e for e in followers["resume"].events if e[1] == "response.output_item.added"]) == 1

    cancelled = final_task(alice, cancelling["id"])  # cancelling at restart -> cancelled, whatever the policy
    assert cancelled["status"] == "cancelled"
    events = alice.sse(cancelling["events_url"])
    check_exactly_once(events)
    assert events[-1][1] == "response.cancelled"

    direct_thread.join(120)
    assert direct and direct[-1][1] == "response.failed" and direct[-1][2]["error"]["code"] == "server_restarted"
    sync_thread.join(120)
    assert sync and sync[0].status_code == 500, sync and sync[0].text
    assert sync[0].headers["Content-Type"] == "application/problem+json"
    assert sync[0].json()["code"] == "server_restarted"
    assert sum(1 for e in direct if e[1] in FINALS) == 1


def _worker_state(sessions, worker_id) -> str:
    with sessions() as session:
        return session.execute(select(Worker.state).where(Worker.id == worker_id)).scalar()


def _direct_responses(sessions, model, status) -> int:
    """Direct responses (no task behind them) of the model in the status."""
    with sessions() as session:
        return session.execute(select(func.count()).select_from(Response).where(
            Response.model == model, Response.status == status,
            Response.id.not_in(select(Task.response_id)))).scalar()


@pytest.fixture
def restart_redis(private_servers):
    """Restart the run's Redis empty (it saves nothing), as a crashed or redeployed broker comes back."""
    server = private_servers[1]

    def restart():
        server.stop()
        server.start()
    return restart


def test_redis_restarted_empty_loses_no_queued_task(stack, alice, pair, restart_redis):
    model = stack.pair_model
    frozen = [pair[name].pid for name in ("pair-a", "pair-b")]
    for pid in frozen:  # nobody takes the tasks before the broker forgets them
        os.kill(pid, signal.SIGSTOP)
    try:
        tasks = [submit(alice, model, f"Name a color, number {i}.", max_tokens=6) for i in range(20)]
        restart_redis()
        assert redis.Redis.from_url(stack.redis_url).llen(queue_name(model)) == 0  # the broker forgot them
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    for task in tasks:
        assert final_task(alice, task["id"], timeout=300)["status"] == "succeeded"
        check_exactly_once(alice.sse(task["events_url"]))


def test_a_long_poll_held_while_redis_is_down_still_sees_its_task_change(stack, alice, private_servers):
    """A change made while Redis is away publishes no notice: a poll that was waiting when Redis went
    reads its task often from then on (as one begun without Redis does), not only at its long re-check."""
    redis_server = private_servers[1]
    resp = alice.post("/lmsp/v1/tasks", {"type": "response", "input": {  # a model no worker serves: queued
        "model": "tiny:no-tools", "input": user("Say no."), "max_output_tokens": 4}})
    assert resp.status_code == 202, resp.text
    path = f"/lmsp/v1/tasks/{resp.json()['id']}"
    got = {}

    def waiter():
        got["resp"] = alice.get(path + "?wait=30", headers={"If-None-Match": alice.get(path).headers["ETag"]})
        got["at"] = time.monotonic()

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(1.0)  # held, subscribed
    redis_server.stop()
    try:
        time.sleep(2.0)  # the api's listener has seen its connection go
        assert alice.post(path + "/cancel").json()["status"] == "cancelled"
        cancelled_at = time.monotonic()
        thread.join(timeout=40)
    finally:
        redis_server.start()
    assert got["resp"].status_code == 200 and got["resp"].json()["status"] == "cancelled", got["resp"].status_code
    assert got["at"] - cancelled_at < 5, got["at"] - cancelled_at


def test_postgres_down_longer_than_the_lease_while_tasks_run(stack, alice, pair, private_servers):
    """Every worker's heartbeat looks expired when Postgres comes back: nobody may take over a live
    worker's tasks for that (fail-policy tasks would fail because Postgres blinked)."""
    tasks = [submit(alice, stack.pair_model, ESSAY.format(t), "fail", max_tokens=250)
             for t in ("salt", "glass", "iron")]
    followers = [Follower(alice, t, every=1000) for t in tasks]
    for f in followers:
        f.start()
    wait_for(lambda: all(f.deltas() >= 5 for f in followers), 300, "generation did not start")
    postgres = private_servers[0]
    postgres.stop()
    time.sleep(int(stack.env["LMSP_LEASE_SECONDS"]) + 4)
    postgres.start()
    for f in followers:
        f.join(600)
        assert not f.is_alive()
        check_exactly_once(f.events)
    for task, f in zip(tasks, followers, strict=True):
        final = final_task(alice, task["id"])
        assert final["status"] == "succeeded", final
        replay = alice.sse(task["events_url"])
        assert [(e[0], e[1]) for e in replay] == [(e[0], e[1]) for e in f.events]
        assert f.text() == final["response"]["output"][0]["content"][0]["text"]


def test_a_foreign_event_row_fails_only_its_task(stack, alice, pair, sessions):
    tasks = [submit(alice, stack.pair_model, ESSAY.format(t), "fail", max_tokens=200) for t in ("moss", "fern", "reed")]
    followers = [Follower(alice, t, every=1000) for t in tasks]
    for f in followers:
        f.start()
    wait_for(lambda: all(f.deltas() >= 3 for f in followers), 300, "generation did not start")
    victim = tasks[0]["response_id"]
    while True:  # a row at the victim's next sequence number, as a buggy or replayed writer would leave
        try:
            with sessions() as session, session.begin():
                seq = eventlog.max_seq(session, victim) + 1
                eventlog.append(session, victim, [(seq, "x.foreign", "{}")])
            break
        except IntegrityError:
            continue
    for f in followers:
        f.join(600)
    failed = final_task(alice, tasks[0]["id"])
    assert failed["status"] == "failed" and failed["error"]["code"] == "generation_failed"
    victim_events = alice.sse(tasks[0]["events_url"])
    check_exactly_once(victim_events)
    assert victim_events[-1][1] == "response.failed"
    for task, f in zip(tasks[1:], followers[1:], strict=True):
        assert final_task(alice, task["id"])["status"] == "succeeded"
        check_exactly_once(f.events)
    later = submit(alice, stack.pair_model, "Say hello.", max_tokens=8)  # the worker goes on taking work
    assert final_task(alice, later["id"], timeout=120)["status"] == "succeeded"


def owners(sessions, task_ids) -> dict[str, str | None]:
    with sessions() as session:
        return dict(session.execute(select(Task.id, Task.worker_id).where(Task.id.in_(task_ids))).all())


def worker_log(stack, name) -> str:
    return (stack.tmp / f"worker-{name}.log").read_text(errors="replace")


def check_outcome(task, follower):
    """Exactly once: one contiguous sequence, one final event, matching the task; the text a client
    reassembles equals the output; a failed task claims no output."""
    check_exactly_once(follower.events)
    final = follower.events[-1]
    if task["status"] == "succeeded":
        assert final[1] in ("response.completed", "response.incomplete")
        assert text_after_last_attempt(follower.events) == task["response"]["output"][0]["content"][0]["text"]
    else:
        assert task["status"] == "failed" and final[1] == "response.failed", (task, final)
        assert not any(e[1] in ("response.completed", "response.incomplete") for e in follower.events)


def test_a_paused_worker_is_fenced_and_every_task_finishes_once(stack, alice, pair, sessions):
    model = stack.pair_model
    os.kill(pair["pair-b"].pid, signal.SIGSTOP)  # everything lands on pair-a first
    try:
        tasks = [submit(alice, model, ESSAY.format(t), policy, max_tokens=400)
                 for t, policy in [("maps", "fail"), ("bells", "retry"), ("ink", "resume"), ("kites", "resume")]]
        followers = [Follower(alice, t, every=1000) for t in tasks]
        for f in followers:
            f.start()
        wait_for(lambda: all(f.deltas() >= 8 for f in followers), 300, "generation did not start")
        assert set(owners(sessions, [t["id"] for t in tasks]).values()) == {"pair-a"}
    finally:
        os.kill(pair["pair-b"].pid, signal.SIGCONT)
    time.sleep(3)  # pair-b heartbeats again
    os.kill(pair["pair-a"].pid, signal.SIGSTOP)  # past its lease (6 s): pair-b takes its tasks over
    try:
        wait_for(lambda: set(owners(sessions, [t["id"] for t in tasks]).values()) != {"pair-a"}, 60,
                 "the paused worker's tasks were not taken over")
        time.sleep(2)
    finally:
        os.kill(pair["pair-a"].pid, signal.SIGCONT)  # it wakes up still generating: it must not write
    for task, f in zip(tasks, followers, strict=True):
        f.join(600)
        assert not f.is_alive()
        check_outcome(final_task(alice, task["id"]), f)
    assert final_task(alice, tasks[0]["id"])["error"]["code"] == "server_restarted"
    for task in tasks[1:]:
        assert final_task(alice, task["id"])["status"] == "succeeded"
    assert "was taken over" in worker_log(stack, "pair-a")  # it noticed, and stopped generating
    assert pair["pair-a"].poll() is None and pair["pair-b"].poll() is None


def test_a_dead_engine_fails_no_task_and_comes_back(stack, alice, pair, sessions):
    model = stack.pair_model
    os.kill(pair["pair-b"].pid, signal.SIGSTOP)  # keep the work on pair-a
    try:
        running = [submit(alice, model, ESSAY.format(t), policy, max_tokens=300)
                   for t, policy in [("oak", "retry"), ("elm", "resume")]]
        followers = [Follower(alice, t, every=1000) for t in running]
        for f in followers:
            f.start()
        wait_for(lambda: all(f.deltas() >= 5 for f in followers), 300, "generation did not start")
        core = [pid for pid in engine_pids("pair-a") if b"EngineCore" in open(f"/proc/{pid}/cmdline", "rb").read()]
        assert core
        os.kill(core[0], signal.SIGKILL)
        queued = [submit(alice, model, f"Name a fruit, number {i}.", max_tokens=8) for i in range(5)]
        wait_for(lambda: _model(alice, model)["workers"] == 0, 60, "the worker still looks ready")
    finally:
        os.kill(pair["pair-b"].pid, signal.SIGCONT)
    for task, f in zip(running, followers, strict=True):
        f.join(600)
        done = final_task(alice, task["id"])
        assert done["status"] == "succeeded", done
        check_outcome(done, f)
    for task in queued:
        assert final_task(alice, task["id"], timeout=300)["status"] == "succeeded"
    wait_for(lambda: _model(alice, model)["workers"] == 2, 300, "the engine did not come back")
    assert pair["pair-a"].poll() is None  # the same process, with a new engine
    assert "a new engine is loaded" in worker_log(stack, "pair-a")


def _model(client, model):
    return client.get(f"/lmsp/v1/models/{requests.utils.quote(model, safe='')}").json()


def test_redis_restarts_do_not_stop_workers(stack, alice, pair, restart_redis):
    model = stack.pair_model
    pids = {name: pair[name].pid for name in ("pair-a", "pair-b")}
    loads = {name: worker_log(stack, name).count("Loading weights took") for name in pids}
    running = [submit(alice, model, ESSAY.format(t), "fail", max_tokens=250) for t in ("wax", "tin")]
    followers = [Follower(alice, t) for t in running]
    for f in followers:
        f.start()
    wait_for(lambda: all(f.deltas() >= 5 for f in followers), 300, "generation did not start")
    steady: list = []
    stop = threading.Event()

    def submitter():  # a steady stream of submissions across the restart
        while not stop.is_set():
            try:
                resp = alice.post("/lmsp/v1/tasks", {"type": "response", "input": {
                    "model": model, "input": user("Say yes."), "max_output_tokens": 4}})
                if resp.status_code == 202:
                    steady.append(resp.json())
            except requests.RequestException:
                pass
            time.sleep(0.3)

    thread = threading.Thread(target=submitter, daemon=True)
    thread.start()
    restart_redis()  # while tasks stream
    time.sleep(3)
    stop.set()
    thread.join()
    for task, f in zip(running, followers, strict=True):
        f.join(600)
        check_outcome(final_task(alice, task["id"]), f)
        assert final_task(alice, task["id"])["status"] == "succeeded"
    assert steady
    for task in steady:
        assert final_task(alice, task["id"], timeout=120)["status"] == "succeeded"
    restart_redis()  # and while idle
    after = [submit(alice, model, f"Say {w}.", max_tokens=4) for w in ("up", "down")]
    started = time.time()
    for task in after:
        assert final_task(alice, task["id"], timeout=60)["status"] == "succeeded"
    assert time.time() - started < 60
    for name, pid in pids.items():
        assert pair[name].poll() is None and pair[name].pid == pid, worker_log(stack, name)[-3000:]
        assert worker_log(stack, name).count("Loading weights took") == loads[name]  # engine kept


def test_rolling_restart_hands_tasks_over_without_a_lease_wait(stack, alice, pair, sessions):
    """SIGTERM to one worker under load (a rolling update, a scale-down): its retry/resume tasks move at
    once, its `fail` tasks shorter than the grace finish where they run; none fails, nobody waits for a
    lease, and its engine is gone before it exits."""
    model, grace = stack.pair_model, float(pair["env"]["LMSP_DRAIN_SECONDS"])
    # pair-b is paused while the work is handed out: each worker takes up to 32 tasks, and pair-b alone had
    # taken all 28 (pair-a then had nothing to hand over). It goes on once pair-a is generating.
    os.kill(pair["pair-b"].pid, signal.SIGSTOP)
    tasks = [submit(alice, model, ESSAY.format(f"city number {i}"), ("resume", "retry")[i % 2], max_tokens=200)
             for i in range(20)]
    # Long enough to be still running once pair-a's long tasks stream on a loaded host, well within the grace.
    short = [submit(alice, model, f"Write three sentences about the river number {i}.", "fail", max_tokens=96)
             for i in range(8)]
    followers = [Follower(alice, t) for t in tasks]
    for f in followers:
        f.start()

    def owned_by_a(policies):
        with sessions() as session:
            return set(session.execute(select(Task.id).where(
                Task.id.in_([t["id"] for t in tasks + short]), Task.worker_id == "pair-a",
                Task.on_restart.in_(policies), Task.status.in_(("loading", "running")))).scalars())

    def mid_generation_on_a():  # a fail task running on pair-a, and a resume/retry one streaming there
        moving = owned_by_a(["resume", "retry"])
        return owned_by_a(["fail"]) and any(f.deltas() >= 3 for t, f in zip(tasks, followers, strict=True)
                                            if t["id"] in moving)

    try:
        wait_for(mid_generation_on_a, 300, "pair-a is not generating both kinds of task")
    finally:
        os.kill(pair["pair-b"].pid, signal.SIGCONT)
    fail_on_a = owned_by_a(["fail"])
    before = worker_log(stack, "pair-b").count("took over")
    pair["pair-a"].send_signal(signal.SIGTERM)  # to the worker alone, as Kubernetes does
    signalled = time.monotonic()
    wait_for(lambda: not owned_by_a(["resume", "retry"]), 15, "pair-a kept its retry/resume tasks")
    pair["pair-a"].wait(grace + 30)
    assert time.monotonic() - signalled < grace, "pair-a drained until its grace ran out"
    assert engine_pids("pair-a") == []  # its engine is gone before it exits
    pair["pair-a"] = stack.start_worker(model, "pair-a", **pair["env"])  # rolling: it comes back
    for task, f in zip(tasks, followers, strict=True):
        f.join(600)
        done = final_task(alice, task["id"])
        assert done["status"] == "succeeded", done
        check_outcome(done, f)
    for task in short:
        assert final_task(alice, task["id"])["status"] == "succeeded", task["id"] in fail_on_a
    with sessions() as session:
        attempts = dict(session.execute(select(Task.id, Task.attempt).where(Task.id.in_(fail_on_a))).all())
    assert set(attempts.values()) == {1}  # finished where they ran, never moved
    assert "handed on at once" in worker_log(stack, "pair-a")
    assert worker_log(stack, "pair-b").count("took over") == before  # nobody waited for a lease
    assert engine_pids("pair-a") != [] and pair["pair-a"].poll() is None


def test_two_workers_share_a_queue_drop_duplicates_and_take_over(stack, alice, pair, sessions):
    model_id = stack.pair_model
    settings = Settings(broker_url=stack.redis_url, home=stack.tmp / "home")
    celery = make_celery(settings)
    tasks = [submit(alice, model_id, f"Write two sentences about the number {i}.", max_tokens=40)
             for i in range(12)]
    wait_for(lambda: all(alice.get(f"/lmsp/v1/tasks/{t['id']}").json()["status"] != "queued" for t in tasks),
             300, "not claimed")
    for task in tasks:  # a broker redelivery of every message while the tasks run
        dispatch(celery, queue_name(model_id), {"task_id": task["id"]}, BACKGROUND)
    for task in tasks:
        assert final_task(alice, task["id"])["status"] == "succeeded"
        check_exactly_once(alice.sse(task["events_url"]))
    with sessions() as session:
        rows = session.execute(select(Task.worker_id, Task.attempt).where(
            Task.id.in_([t["id"] for t in tasks]))).all()
    assert {attempt for _, attempt in rows} == {1}  # nothing ran twice
    owners = {w for w, _ in rows}
    assert owners == {"pair-a", "pair-b"}  # both workers took a share

    # Lease expiry: pair-b dies for good (the last test of the pair); pair-a takes over its tasks.
    long = [submit(alice, model_id, ESSAY.format(t), "resume", max_tokens=400) for t in ("tea", "silk", "jade",
                                                                                          "wool")]
    followers = {t["id"]: Follower(alice, t) for t in long}
    for f in followers.values():
        f.start()

    def second_is_generating():
        with sessions() as session:
            mine = session.execute(select(Task.id).where(
                Task.id.in_(list(followers)), Task.worker_id == "pair-b", Task.status == "running")).scalars()
            return [tid for tid in mine if followers[tid].deltas() >= 5]

    wait_for(second_is_generating, 300, "the second worker did not take a task")
    stack.stop(pair["pair-b"], sig=signal.SIGKILL)
    with sessions() as session:
        orphaned = set(session.execute(select(Task.id).where(
            Task.id.in_(list(followers)), Task.worker_id == "pair-b", Task.status == "running")).scalars())
    assert orphaned
    for task in long:
        f = followers[task["id"]]
        f.join(600)
        check_exactly_once(f.events)
        assert final_task(alice, task["id"])["status"] == "succeeded"
    with sessions() as session:
        owners = set(session.execute(select(Task.worker_id).where(Task.id.in_(orphaned))).scalars())
    assert owners == {"pair-a"}  # taken over after the lease expired


def test_api_sigterm_ends_task_streams_so_clients_resume_elsewhere(stack, alice, pair):
    base = stack.start_api()  # a second api process on the same database, to be rolled
    proc = stack.procs[-1]
    task = submit(alice, stack.pair_model, ESSAY.format("clay"), max_tokens=200)
    seen, raw, stopped = [], [], None
    with alice.http.get(base + task["events_url"], stream=True, timeout=(5, 30)) as resp:
        def lines():
            for line in resp.iter_lines(decode_unicode=True):
                raw.append(line)
                yield line

        events = iter_sse(lines())
        for event in events:
            seen.append(event)
            if sum(1 for e in seen if e[1] == "response.output_text.delta") == 5:
                stopped = time.monotonic()
                os.kill(proc.pid, signal.SIGTERM)  # gunicorn's master: a rolling update of the api
                break
        seen.extend(events)  # what it still sends before it closes the stream
    assert stopped is not None and time.monotonic() - stopped < 5, "the stream outlived the api's SIGTERM"
    assert any(line.startswith(":") and "shutting down" in line for line in raw)
    assert not any(e[1] in FINALS for e in seen)  # it ended early, mid-generation
    rest = alice.sse(task["events_url"], headers={"Last-Event-ID": str(seen[-1][0])})  # on another api
    check_exactly_once(seen + rest)
    proc.wait(30)
