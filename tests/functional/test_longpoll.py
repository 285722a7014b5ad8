"""GET /lmsp/v1/tasks/{id}: ETag / If-None-Match and the ?wait=N long poll, on the real stack."""

import threading
import time

import redis

from common import lifecycle
from common.bus import CHANGED, TEXT_ONLY, Publisher, channel, decode, notices
from common.db import make_engine, session_factory
from common.events import FINAL, ITEM_ADDED, TEXT_DELTA
from tests.harness import user

PARKED = "tiny:no-tools"  # registered in the stack, served by no worker: its tasks stay queued


def submit(client, model, tokens=8):
    body = {"type": "response", "input": {"model": model, "input": user("Hi"), "max_output_tokens": tokens,
                                          "temperature": 0}}
    resp = client.post("/lmsp/v1/tasks", body)
    assert resp.status_code == 202, resp.text
    return resp.json()


def test_etag_304_wait_timeout_and_wake_on_change(bob):
    task = submit(bob, PARKED)
    path = f"/lmsp/v1/tasks/{task['id']}"
    first = bob.get(path)
    tag = first.headers["ETag"]
    assert first.status_code == 200 and first.json()["status"] == "queued" and tag.startswith('"')
    assert bob.get(path, headers={"If-None-Match": tag}).status_code == 304
    assert bob.get(path, headers={"If-None-Match": '"other"'}).status_code == 200
    bad = bob.get(path + "?wait=soon")
    assert bad.status_code == 400 and bad.json()["param"] == "wait"

    start = time.monotonic()
    held = bob.get(path + "?wait=1.5", headers={"If-None-Match": tag})
    assert held.status_code == 304 and 1.4 <= time.monotonic() - start < 5
    start = time.monotonic()
    held = bob.get(path + "?wait=1")  # no ETag: "until it changes from now", then the task as it is
    assert held.status_code == 200 and held.headers["ETag"] == tag and time.monotonic() - start >= 0.9

    got = {}

    def waiter():
        t = time.monotonic()
        got["resp"] = bob.get(path + "?wait=30", headers={"If-None-Match": tag})
        got["after"] = time.monotonic() - t

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.5)
    assert bob.post(path + "/cancel").json()["status"] == "cancelled"
    thread.join(timeout=35)
    # Woken by the response's event, well before the re-check timer or the 30 s wait.
    assert got["resp"].status_code == 200 and got["resp"].json()["status"] == "cancelled"
    assert got["after"] < 3, got["after"]
    assert got["resp"].headers["ETag"] != tag
    # A finished task never changes: a wait returns at once.
    start = time.monotonic()
    assert bob.get(path + "?wait=30", headers={"If-None-Match": got["resp"].headers["ETag"]}).status_code == 304
    assert time.monotonic() - start < 10  # not the 30 s asked for


def test_waiting_client_follows_a_task_to_the_end_in_few_requests(alice, model_id):
    task = submit(alice, model_id, tokens=8)
    path, tag, seen = f"/lmsp/v1/tasks/{task['id']}", None, []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        resp = alice.get(path + "?wait=30", headers={"If-None-Match": tag} if tag else {})
        if resp.status_code == 200:
            tag = resp.headers["ETag"]
            seen.append(resp.json()["status"])
            if seen[-1] in ("succeeded", "failed", "cancelled"):
                break
    assert seen[-1] == "succeeded", seen
    # queued -> (loading ->) running -> succeeded: one answer per change, not a poll every few ms.
    assert len(seen) <= 5, seen


def test_a_long_poll_is_told_of_each_batch_that_can_change_the_task_not_of_each_token(alice, model_id, redis_url):
    """The notices a long poll watches (common/bus.py ``notices``), heard on Redis itself beside the events
    channel: one for each batch holding an event that is not text (its seq and name), none for a batch of
    text alone (the first text's batch, as its item opens, and the final event are among them), and one
    for the claim, before its first token (queued -> loading logs no event)."""
    sub = redis.Redis.from_url(redis_url).pubsub()
    sub.psubscribe(channel("*"))  # before the task exists: nothing of it is missed
    while sub.get_message(timeout=1) is None:
        pass  # the subscription's confirmation
    rid = submit(alice, model_id, tokens=48)["response_id"]
    batches, heard = [], []

    def hear(timeout: float) -> bool:
        message = sub.get_message(timeout=timeout)
        if message is not None and message["channel"].decode() in (channel(rid), channel(notices(rid))):
            (heard if message["channel"].decode() == channel(notices(rid)) else batches).append(
                decode(message["data"]))
        return message is not None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (batches and batches[-1][-1][1] in FINAL):
        hear(1)
    deadline = time.monotonic() + 2  # the final batch's notice comes after it, in the same pipeline
    while time.monotonic() < deadline:
        hear(0.5)
    sub.close()
    assert batches and batches[-1][-1][1] in FINAL, "the task's events were not all heard"
    expected = [[(e[0], e[1], "{}")] for b in batches for e in [next((e for e in reversed(b) if e[1] not in TEXT_ONLY), None)]
                if e is not None]
    texts_alone = [b for b in batches if all(e[1] in TEXT_ONLY for e in b)]
    claimed = [(0, CHANGED, "{}")]
    assert heard.count(claimed) == 1, heard
    assert [h for h in heard if h != claimed] == expected and texts_alone, (heard, len(batches))
    assert heard[0] == claimed  # the claim is heard before its first token's batch
    assert heard[-1][0][1] in FINAL
    first_text = next(b for b in batches if any(e[1] == TEXT_DELTA for e in b))
    assert any(e[1] == ITEM_ADDED for e in first_text)  # the first token's batch is a notice


def test_a_long_poll_hears_a_claim_and_a_cancel_that_log_no_event(bob, pg_url, redis_url):
    """queued -> loading (a worker's claim) and -> cancelling (the api's cancel of a task its owner still
    runs) log no event: each publishes a notice after its commit, so a waiting poll answers at once, not
    at its re-check or at the end of its wait."""
    task = submit(bob, PARKED)
    path = f"/lmsp/v1/tasks/{task['id']}"
    got: list = []

    def waiting(tag: str) -> threading.Thread:
        def wait():
            t = time.monotonic()
            got.append((bob.get(path + "?wait=30", headers={"If-None-Match": tag}), time.monotonic() - t))
        thread = threading.Thread(target=wait)
        thread.start()
        time.sleep(1.0)  # the poll is held (subscribed) before the change
        return thread

    engine = make_engine(pg_url)
    publisher = Publisher(redis_url)
    try:
        thread = waiting(bob.get(path).headers["ETag"])
        # The claim as a worker makes it (worker/runner.py): committed, then its publish; the queue's first
        # task of the model may be another test's leftover: taken and handed on until it is ours.
        for _ in range(1000):
            with session_factory(engine)() as session:
                claimed, publish = lifecycle.claim(session, task["id"], "w-longpoll", model=PARKED, commit=True)
                if claimed is not None and claimed.task.id != task["id"]:
                    lifecycle.hand_on(session, claimed.task.id, error={}, unstarted_again=True)
                    session.commit()
                    continue
            break
        assert claimed is not None and claimed.task.id == task["id"]
        assert publish == {task["response_id"]: []}
        publisher.publish_many(publish)
        thread.join(timeout=35)
        resp, after = got.pop()
        assert resp.status_code == 200 and resp.json()["status"] == "loading" and after < 3, (resp.status_code, after)

        thread = waiting(resp.headers["ETag"])
        # Its owner (this test) holds it: the cancel leaves it cancelling until the owner stops.
        assert bob.post(path + "/cancel").json()["status"] == "cancelling"
        thread.join(timeout=35)
        resp, after = got.pop()
        assert resp.status_code == 200 and resp.json()["status"] == "cancelling" and after < 3, (resp.status_code, after)
    finally:
        with session_factory(engine)() as session:  # the owner stops: the cancellation completes
            lifecycle.hand_on(session, task["id"], error={})
            session.commit()
        engine.dispose()
