"""A task's timeline (common/timeline.py): the phases partition its wall time, whatever was recorded;
the task object carries it as an extension the OpenAPI document describes; the worker's histograms."""

from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY

from common import timeline
from common.tables import TaskAttempt
from tests.unit.conftest import task_body
from tests.unit.test_openapi import check, doc  # noqa: F401 - the document fixture

PARTITION = timeline.PHASES


def attempt(n=1, **points):
    base = dict(delivered_at=10.0, claimed_at=10.1, submitted_at=10.15, admitted_at=10.3, first_token_at=10.8,
                last_token_at=14.0, finished_at=14.05)
    return SimpleNamespace(attempt=n, **{**base, **points})


@pytest.mark.parametrize("attempts,expected", [
    ([attempt()], {"queue": 1.0, "dispatch": 0.1, "load": 0.2, "prefill": 0.5, "decode": 3.2, "write_lag": 0.1,
                   "framework_overhead": 0.1 + 0.05 + 0.1}),
    # cancelled while prefilling: no first or last token, the time after admission is prefill
    ([attempt(first_token_at=None, last_token_at=None)], {"prefill": 3.8, "decode": 0.0, "write_lag": 0.0}),
    # an earlier attempt whose worker died: its time is retries
    ([attempt(1, finished_at=None, delivered_at=9.5), attempt(3, delivered_at=10.0)],
     {"queue": 0.5, "retries": 0.5, "decode": 3.2}),
    # no attempt finished (failed by a takeover): all after the first delivery is retries
    ([attempt(finished_at=None)], {"queue": 1.0, "retries": 4.1, "decode": 0.0}),
    # cancelled while queued
    ([], {"queue": 5.1, "framework_overhead": 0.0}),
    # the api's clock ahead of the worker's: never a negative phase
    ([attempt(delivered_at=8.0, claimed_at=8.1)], {"queue": 0.0, "dispatch": 0.0}),
])
def test_phases_partition_the_wall_time(attempts, expected):
    durations = timeline.durations(9.0, 14.1, attempts)
    assert all(durations[p] >= 0 for p in PARTITION)
    assert sum(durations[p] for p in PARTITION) == pytest.approx(14.1 - 9.0, abs=1e-9)
    for name, value in expected.items():
        assert durations[name] == pytest.approx(value, abs=1e-9), name


def test_task_object_carries_the_timeline(unit, alice, doc):  # noqa: F811
    queued = check(doc, alice, "POST", "/lmsp/v1/tasks", "/lmsp/v1/tasks", 202,
                   json=task_body(input="Hi"))
    assert "extensions" not in queued  # nobody has claimed it: nothing to say yet
    task = alice.task("succeeded", ended_at=None)
    with unit.sessions() as session:
        row = session.get(type(task), task.id)
        row.ended_at = row.created_at + 5.1
        session.add(TaskAttempt(task_id=task.id, attempt=1, worker_id="w1", **{
            k: row.created_at + v - 9.0 for k, v in vars(attempt()).items() if k != "attempt"},
            commit_batches=4, commit_lag_sum=0.2, commit_lag_max=0.09))
        session.commit()
    body = check(doc, alice, "GET", "/lmsp/v1/tasks/{task_id}", f"/lmsp/v1/tasks/{task.id}", 200)
    line = body["extensions"][timeline.KEY]
    assert line["wall"] == pytest.approx(5.1) and line["durations"]["decode"] == pytest.approx(3.2)
    assert line["attempts"][0]["worker_id"] == "w1" and line["attempts"][0]["commit_lag"] == {
        "batches": 4, "mean": pytest.approx(0.05), "max": 0.09}
    listed = alice.get("/lmsp/v1/tasks?limit=100").get_json()["data"]
    assert next(t for t in listed if t["id"] == task.id)["extensions"] == body["extensions"]


def test_worker_observes_each_phase():
    from worker import metrics
    metrics.observe_timeline("m-timeline", timeline.durations(9.0, 14.1, [attempt()]))
    for phase in ("queue", "dispatch", "load", "prefill", "decode", "write_lag", "framework_overhead"):
        assert REGISTRY.get_sample_value("lmsp_task_phase_seconds_count",
                                         {"model": "m-timeline", "phase": phase}) == 1
