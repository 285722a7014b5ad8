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
    assert (unit.settings.broker_folder / "control").is_dir()
