"""Spec chapter 7 on the real stack: create, poll, cancel, follow (SSE + WebSocket), retention, idempotency."""

import json
import threading
import time

import pytest
import redis
import websocket
from sqlalchemy import func, select, update

from common.bus import FOLLOWED
from common.db import make_engine, session_factory
from common.tables import Task
from tests.harness import user

FINALS = {"response.completed", "response.incomplete", "response.failed", "response.cancelled"}


@pytest.fixture(scope="module")
def sessions(pg_url):
    engine = make_engine(pg_url)
    yield session_factory(engine)
    engine.dispose()


def submit(client, model_id, text="Write a haiku about rain.", headers=None, **fields):
    body = {"type": "response", "input": {"model": model_id, "input": user(text), "temperature": 0, **fields}}
    return client.post("/lmsp/v1/tasks", body, headers=headers or {})


def wait_status(client, task_id, statuses, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        task = client.get(f"/lmsp/v1/tasks/{task_id}").json()
        if task["status"] in statuses:
            return task
        time.sleep(0.1)
    raise TimeoutError(task)


def check_sequence(events, start=1):
    ids = [e[0] for e in events]
    assert ids == list(range(start, start + len(events))), ids
    finals = [e for e in events if e[1] in FINALS]
    assert len(finals) == 1 and events[-1][1] in FINALS


def test_create_and_poll(alice, model_id):
    resp = submit(alice, model_id, max_output_tokens=12)
    assert resp.status_code == 202, resp.text
    task = resp.json()
    assert task["id"].startswith("task_") and task["object"] == "task" and task["type"] == "response"
    assert task["status"] == "queued" and task["response_id"].startswith("resp_")
    assert task["events_url"] == f"/lmsp/v1/tasks/{task['id']}/events"
    assert task["on_restart"] == "fail" and task["response"] is None and task["error"] is None
    done = wait_status(alice, task["id"], {"succeeded"})
    assert done["response"]["id"] == task["response_id"]
    assert done["response"]["status"] == "incomplete"  # the token limit: incomplete response, succeeded task
    assert done["response"]["usage"]["output_tokens"] == 12
    assert alice.get("/lmsp/v1/tasks/task_nope").json()["code"] == "task_not_found"


PHASES = ("queue", "retries", "dispatch", "load", "prefill", "decode", "write_lag")


def test_timeline_phases_sum_to_the_wall_time(alice, model_id):
    """Issue 24 part 2: where a task's time went, recorded by the worker, split into phases that sum to
    its wall time (created -> final event committed)."""
    task = submit(alice, model_id, max_output_tokens=16).json()
    done = wait_status(alice, task["id"], {"succeeded"})
    line = done["extensions"]["x-lmsp-timeline"]
    durations = line["durations"]
    assert all(durations[p] >= 0 for p in PHASES)
    assert sum(durations[p] for p in PHASES) == pytest.approx(line["wall"], abs=1e-6)
    assert line["wall"] == pytest.approx(line["ended_at"] - line["queued_at"])
    assert (int(line["queued_at"]), int(line["ended_at"])) == (done["created_at"], done["updated_at"])
    [attempt] = line["attempts"]
    assert attempt["attempt"] == 1 and attempt["worker_id"] == f"test-{model_id}"
    points = [attempt[p] for p in ("delivered_at", "claimed_at", "submitted_at", "admitted_at", "first_token_at",
                                   "last_token_at", "finished_at")] + [line["ended_at"]]
    assert points == sorted(points)  # one worker's clock, in the order things happen
    assert durations["prefill"] > 0 and durations["decode"] > 0 and durations["retries"] == 0
    assert 0 < durations["framework_overhead"] < line["wall"]
    assert attempt["commit_lag"]["batches"] >= 1 and attempt["commit_lag"]["max"] >= attempt["commit_lag"]["mean"]


def test_events_replay_and_resume(alice, model_id):
    task = submit(alice, model_id, max_output_tokens=30).json()
    events = alice.sse(task["events_url"])
    check_sequence(events)
    assert events[0][1] == "response.created"
    # A late joiner gets what it missed; after / Last-Event-ID resume; after wins over the header.
    assert alice.sse(task["events_url"] + "?after=5") == events[5:]
    assert alice.sse(task["events_url"], headers={"Last-Event-ID": "7"}) == events[7:]
    assert alice.sse(task["events_url"] + "?after=3", headers={"Last-Event-ID": "9"}) == events[3:]
    bad = alice.get(task["events_url"] + "?after=x")
    assert bad.status_code == 400 and bad.json()["param"] == "after"


def test_live_follow_from_queued(alice, model_id):
    task = submit(alice, model_id, max_output_tokens=40).json()
    events = alice.sse(task["events_url"])  # connects while queued or running: replay, then live
    check_sequence(events)
    deltas = "".join(e[2]["delta"] for e in events if e[1] == "response.output_text.delta")
    final = wait_status(alice, task["id"], {"succeeded"})
    assert deltas == final["response"]["output"][0]["content"][0]["text"]


def test_a_task_nobody_follows_is_logged_in_quiet_windows_and_a_followed_one_in_short_ones(alice, model_id,
                                                                                            redis_url):
    """Unfollowed, a task's text is merged over the quiet window (LMSP_TASK_QUIET_WINDOW_MS, its token cap
    grown as much; worker/gate.py ``Deltas``); followed live from the start (its batches reach a
    subscriber), over the task window (LMSP_TASK_DELTA_WINDOW_MS, or 16 tokens). The same greedy text. A follower's connect tells the worker
    (bus.FOLLOWED), so one that joins a quiet stream does not wait for its window."""
    hints = redis.Redis.from_url(redis_url).pubsub()
    hints.subscribe(FOLLOWED)
    assert hints.get_message(timeout=5)["type"] == "subscribe"
    text = "Write a long story about a lighthouse keeper and the sea."
    followed = submit(alice, model_id, text, max_output_tokens=128).json()
    live = alice.sse(followed["events_url"])  # connected while queued or at its start: every batch reaches it
    # The channel is the Redis server's: tests running beside this one publish their own follows on it.
    deadline, heard = time.monotonic() + 5, []
    while followed["response_id"] not in heard and time.monotonic() < deadline:
        hint = hints.get_message(timeout=max(0.01, deadline - time.monotonic()))
        if hint is not None and hint["type"] == "message":
            heard.append(hint["data"].decode())
    assert followed["response_id"] in heard, heard
    alone = submit(alice, model_id, text, max_output_tokens=128).json()
    wait_status(alice, alone["id"], {"succeeded"})
    quiet = alice.sse(alone["events_url"])  # its log, read once it ended: nobody followed it live
    hints.close()

    def deltas(events):
        return [e[2]["delta"] for e in events if e[1] == "response.output_text.delta"]
    assert "".join(deltas(quiet)) == "".join(deltas(live))
    assert 2 * len(deltas(quiet)) <= len(deltas(live)), (len(deltas(quiet)), len(deltas(live)))


def test_websocket_carries_the_same_events(alice, model_id, api):
    task = submit(alice, model_id, max_output_tokens=20).json()
    sse = alice.sse(task["events_url"])
    url = api.replace("http", "ws") + f"/lmsp/v1/tasks/{task['id']}/ws?after=2"
    ws = websocket.create_connection(url, header=[f"Authorization: {alice.http.headers['Authorization']}"])
    frames = []
    try:
        while True:
            frame = ws.recv()
            if not frame:
                break
            frames.append(json.loads(frame))
    except websocket.WebSocketConnectionClosedException:
        pass
    assert [(f["id"], f["event"], f["data"]) for f in frames] == sse[2:]
    # Access is checked before the handshake: a refusal is a real HTTP status, not a broken socket.
    with pytest.raises(websocket.WebSocketBadStatusException) as refused:
        websocket.create_connection(api.replace("http", "ws") + "/lmsp/v1/tasks/task_nope/ws",
                                    header=[f"Authorization: {alice.http.headers['Authorization']}"])
    assert refused.value.status_code == 404


def test_heartbeat_keeps_idle_stream_open(alice, stack):
    task = submit(alice, stack.fault_model).json()  # no worker serves it: the stream stays idle
    with alice.http.get(alice.url(task["events_url"]), stream=True, timeout=30) as resp:
        lines = resp.iter_lines(decode_unicode=True)
        seen = [next(lines) for _ in range(6)]
    assert any(line.startswith(":") for line in seen)  # comments while nothing happens
    assert alice.post(f"/lmsp/v1/tasks/{task['id']}/cancel").json()["status"] == "cancelled"


def test_cancel_queued_running_and_idempotent(alice, model_id, stack):
    queued = submit(alice, stack.fault_model).json()
    cancelled = alice.post(f"/lmsp/v1/tasks/{queued['id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert alice.post(f"/lmsp/v1/tasks/{queued['id']}/cancel").json()["status"] == "cancelled"
    events = alice.sse(queued["events_url"])
    assert [e[1] for e in events] == ["response.created", "response.cancelled"]

    running = submit(alice, model_id, "Write a long essay about bridges.", max_output_tokens=1000).json()
    wait_status(alice, running["id"], {"running"})
    first = alice.post(f"/lmsp/v1/tasks/{running['id']}/cancel").json()
    assert first["status"] in ("cancelling", "cancelled")
    again = alice.post(f"/lmsp/v1/tasks/{running['id']}/cancel")
    assert again.status_code == 200 and again.json()["status"] in ("cancelling", "cancelled")
    events = alice.sse(running["events_url"])
    check_sequence(events)
    assert events[-1][1] == "response.cancelled"
    final = wait_status(alice, running["id"], {"cancelled"}, timeout=10)
    assert final["response"] is None

    done = submit(alice, model_id, max_output_tokens=4).json()
    wait_status(alice, done["id"], {"succeeded"})
    refused = alice.post(f"/lmsp/v1/tasks/{done['id']}/cancel")
    assert refused.status_code == 409 and refused.json()["code"] == "task_not_cancelable"


def test_cancel_races_completion(alice, model_id):
    """Cancel fired around the moment of completion: never both, never stuck in cancelling."""
    outcomes = {}
    tasks = [submit(alice, model_id, f"Count to {n}.", max_output_tokens=6 + n % 5).json() for n in range(12)]
    for i, task in enumerate(tasks):
        wait_status(alice, task["id"], {"running", "succeeded"})
        time.sleep(0.05 * (i % 4))
        alice.post(f"/lmsp/v1/tasks/{task['id']}/cancel")
    for task in tasks:
        final = wait_status(alice, task["id"], {"succeeded", "cancelled", "failed"}, timeout=60)
        events = alice.sse(task["events_url"])
        check_sequence(events)
        expected = {"succeeded": {"response.completed", "response.incomplete"},
                    "cancelled": {"response.cancelled"}}[final["status"]]
        assert events[-1][1] in expected
        outcomes[final["status"]] = outcomes.get(final["status"], 0) + 1
    assert set(outcomes) <= {"succeeded", "cancelled"}


def test_retention_expires_events_but_keeps_the_task(alice, model_id, sessions):
    task = submit(alice, model_id, max_output_tokens=5).json()
    wait_status(alice, task["id"], {"succeeded"})
    with sessions() as session:
        session.execute(update(Task).where(Task.id == task["id"]).values(ended_at=time.time() - 3 * 86400))
        session.commit()
    # Past its retention the history is gone for clients at once, whether or not its rows are yet: on
    # Postgres they go with their whole partition (test_scale.py drops one), never row by row.
    gone = alice.get(task["events_url"])
    assert gone.status_code == 410 and gone.json()["code"] == "event_history_expired"
    resumed = alice.get(task["events_url"], headers={"Last-Event-ID": "1"})
    assert resumed.status_code == 410
    final = alice.get(f"/lmsp/v1/tasks/{task['id']}").json()
    assert final["status"] == "succeeded" and final["response"]["output"]


def test_idempotent_task_creation(alice, bob, model_id, sessions):
    headers = {"Idempotency-Key": "report-1"}
    first = submit(alice, model_id, "Write a limerick.", headers=headers, max_output_tokens=8)
    again = submit(alice, model_id, "Write a limerick.", headers=headers, max_output_tokens=8)
    assert first.status_code == again.status_code == 202
    assert first.json()["id"] == again.json()["id"]
    reused = submit(alice, model_id, "Something else.", headers=headers, max_output_tokens=8)
    assert reused.status_code == 422 and reused.json()["code"] == "idempotency_key_reused"
    other = submit(bob, model_id, "Write a limerick.", headers=headers, max_output_tokens=8)
    assert other.status_code == 202 and other.json()["id"] != first.json()["id"]  # keys are per principal
    with sessions() as session:
        count = session.execute(select(func.count()).select_from(Task).where(
            Task.principal_id == "alice", Task.id == first.json()["id"])).scalar()
    assert count == 1
    done = wait_status(alice, first.json()["id"], {"succeeded"})
    replay = submit(alice, model_id, "Write a limerick.", headers=headers, max_output_tokens=8)
    assert replay.json() == done  # the same task, in its current state


def test_concurrent_duplicates_create_one_task(alice, model_id, sessions):
    results = []

    def post():
        results.append(submit(alice, model_id, "Name a fruit.", headers={"Idempotency-Key": "dup-race"},
                              max_output_tokens=4))

    threads = [threading.Thread(target=post) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {r.status_code for r in results} == {202}
    assert len({r.json()["id"] for r in results}) == 1


def test_idempotent_response_in_flight_and_replay(alice, model_id):
    body = {"model": model_id, "input": user("Write a long poem about the moon."), "temperature": 0,
            "max_output_tokens": 120}
    headers = {"Idempotency-Key": "resp-key-1"}
    first = {}
    thread = threading.Thread(target=lambda: first.update(r=alice.post("/lmsp/v1/responses", body,
                                                                       headers=headers)))
    thread.start()
    time.sleep(1.5)
    busy = alice.post("/lmsp/v1/responses", body, headers=headers)
    assert busy.status_code == 409 and busy.json()["code"] == "idempotency_key_in_use"
    thread.join()
    assert first["r"].status_code == 200
    replay = alice.post("/lmsp/v1/responses", body, headers=headers)
    assert replay.status_code == 200 and replay.json() == first["r"].json()  # nothing ran twice
    changed = alice.post("/lmsp/v1/responses", {**body, "max_output_tokens": 5}, headers=headers)
    assert changed.status_code == 422


def test_resume_needs_resume_snapshots(alice):
    resp = alice.post("/lmsp/v1/tasks", {"type": "response", "on_restart": "resume",
                                         "input": {"model": "tiny:no-tools", "input": user("hi")}})
    assert resp.status_code == 400 and resp.json()["code"] == "unsupported_capability"


def test_other_principal_sees_nothing(alice, bob, model_id):
    task = submit(alice, model_id, max_output_tokens=4).json()
    for path in (f"/lmsp/v1/tasks/{task['id']}", f"/lmsp/v1/tasks/{task['id']}/events"):
        theirs, none = bob.get(path), bob.get(path.replace(task["id"], "task_01ZZZZZZZZZZZZZZZZZZZZZZZZ"))
        assert theirs.status_code == none.status_code == 404
        assert theirs.json()["detail"].replace(task["id"], "X") == none.json()["detail"].replace(
            "task_01ZZZZZZZZZZZZZZZZZZZZZZZZ", "X")
    assert bob.post(f"/lmsp/v1/tasks/{task['id']}/cancel").status_code == 404
