"""The broker as the api uses it, on the filesystem transport: a committed task's message in its queue."""

import time

from common.broker import queue_length
from tests.unit.conftest import MODEL, NARROW, task_body


def test_a_created_task_is_announced_in_its_models_queue(unit, alice, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # kombu's exchange tables must not land in the current directory
    svc = unit.app.extensions["lmsp"]
    queue, other = svc.registry.get(MODEL).queue, svc.registry.get(NARROW).queue
    before, before_other = queue_length(svc.celery, queue), queue_length(svc.celery, other)
    assert alice.post("/lmsp/v1/tasks", task_body()).status_code == 202
    deadline = time.monotonic() + 10
    while queue_length(svc.celery, queue) == before:  # sent after the commit, off the request thread
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert queue_length(svc.celery, queue) == before + 1
    assert queue_length(svc.celery, other) == before_other
    assert queue_length(svc.celery, "lmsp.never-used") == 0
    assert list(tmp_path.iterdir()) == []
    # The api declares nothing: a message named by its queue goes straight onto it (common/broker.py).
    control = unit.settings.broker_folder / "control"
    assert not control.exists() or list(control.iterdir()) == []


def _produce(settings, count):
    from common.broker import make_celery
    with make_celery(settings).connection_for_write() as conn:
        for i in range(count):
            conn.default_channel._put("lmsp.model.race", {"i": i, "pad": "x" * 20000})
            time.sleep(0.0005)


def test_a_consumer_polling_while_messages_are_written_never_reads_one_half_written(tmp_path):
    """kombu's own filesystem channel creates a message file before writing it: a consumer polling in
    between read an empty message (about a third of these, measured) and `lmsp dev`'s worker stopped."""
    import multiprocessing
    from queue import Empty

    from common.broker import make_celery
    from tests.unit.conftest import unit_settings

    settings, count = unit_settings(tmp_path), 1000  # the filesystem broker, whatever LMSP_* the shell has
    producer = multiprocessing.get_context("spawn").Process(target=_produce, args=(settings, count))
    producer.start()
    got, deadline = [], time.monotonic() + 60
    with make_celery(settings).connection_for_write() as conn:
        while len(got) < count and time.monotonic() < deadline:
            try:
                got.append(conn.default_channel._get("lmsp.model.race")["i"])  # raises on a half-written one
            except Empty:
                pass
    producer.join(30)
    assert producer.exitcode == 0 and sorted(got) == list(range(count))
