"""GET /lmsp/v1/tasks/{id}: ETag / If-None-Match and the ?wait=N long poll, on the real stack."""

import threading
import time

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
    # Woken by the response's event, well before the 5 s re-check timer or the 30 s wait.
    assert got["resp"].status_code == 200 and got["resp"].json()["status"] == "cancelled"
    assert got["after"] < 3, got["after"]
    assert got["resp"].headers["ETag"] != tag
    # A finished task never changes: a wait returns at once.
    start = time.monotonic()
    assert bob.get(path + "?wait=30", headers={"If-None-Match": got["resp"].headers["ETag"]}).status_code == 304
    assert time.monotonic() - start < 2


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
