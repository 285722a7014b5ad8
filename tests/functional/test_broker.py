"""queue_length on kombu's Redis transport (real Redis, no engine): every priority list of a queue counts."""

import uuid

import pytest
import redis

from common.broker import BACKGROUND, INTERACTIVE, dispatch, make_celery, queue_length
from common.settings import Settings
from tests.harness import REDIS_URL


@pytest.fixture
def celery(tmp_path):
    return make_celery(Settings(home=tmp_path, broker_url=REDIS_URL))


def test_queue_length_counts_every_priority(celery):
    queue = f"lmsp.test.{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(REDIS_URL)
    try:
        assert queue_length(celery, queue) == 0  # no list at all: kombu says not found, which is empty
        for priority in (INTERACTIVE, 3, BACKGROUND, BACKGROUND, 9):
            dispatch(celery, queue, {"task_id": "t"}, priority)
        assert len(client.keys(queue + "*")) == 4  # one list per priority step used
        assert queue_length(celery, queue) == 5
        assert queue_length(celery, queue + ".interactive") == 0
    finally:
        client.delete(*client.keys(queue + "*") or [queue])
    assert queue_length(celery, queue) == 0


def test_an_interactive_message_survives_a_flushed_binding_table(celery):
    """A Redis flushed under live connections loses kombu's binding tables while kombu still believes
    them declared: a message routed through one vanishes. What FLUSHALL does to this queue, done to its
    keys alone (the shared Redis stays as it is)."""
    from common import interactive_wire
    name = f"lmsp.test.{uuid.uuid4().hex[:8]}.interactive"
    client = redis.Redis.from_url(REDIS_URL)
    got = []
    try:
        interactive_wire.send(celery, name, "resp_before")
        client.delete(*client.keys(f"_kombu.binding*{name}") or ["-"])
        interactive_wire.send(celery, name, "resp_after")
        with celery.connection_for_read() as conn, conn.Consumer(
                interactive_wire.queue(name), accept=["json"],
                callbacks=[lambda body, message: (got.append(interactive_wire.decode(body)), message.ack())]):
            for _ in range(4):
                try:
                    conn.drain_events(timeout=1)
                except TimeoutError:
                    break
    finally:
        client.delete(*client.keys(f"*{name}*") or ["-"])
    assert got == ["resp_before", "resp_after"]


def test_an_interactive_send_to_a_broker_gone_away_fails_at_once_and_goes_once_it_is_back(tmp_path):
    """kombu's publish with retry and no policy retried for as long as the broker was away: the api's
    request thread hung in it, and a synchronous request never answered (its DirectWatch never began).
    One retry revives a connection a restart broke; an absent broker is an error at once."""
    import threading
    import time
    from urllib.parse import urlsplit

    from common import interactive_wire
    from tests.functional.test_edges import RedisProxy

    target = urlsplit(REDIS_URL)
    proxy = RedisProxy((target.hostname, target.port))
    celery = make_celery(Settings(home=tmp_path, broker_url=f"redis://127.0.0.1:{proxy.port}{target.path or '/0'}"))
    name = f"lmsp.test.{uuid.uuid4().hex[:8]}.interactive"
    client = redis.Redis.from_url(REDIS_URL)
    try:
        interactive_wire.send(celery, name, "resp_1")  # the pooled connection is up
        proxy.cut()
        outcome = []

        def send():
            try:
                interactive_wire.send(celery, name, "resp_2")
                outcome.append("sent")
            except Exception as exc:  # noqa: BLE001 - what the caller (api/services/work.py) catches
                outcome.append(type(exc).__name__)
        started = time.monotonic()
        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        sender.join(20)
        assert outcome and outcome[0] != "sent" and time.monotonic() - started < 10
        proxy.mode = "pass"  # the broker is back: the broken pooled connection is replaced at once
        interactive_wire.send(celery, name, "resp_3")
        assert client.llen(name) == 2
    finally:
        client.delete(name)
