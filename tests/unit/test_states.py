"""The state machine of spec 7.2 on SQLite: every (from, to) pair through the one conditional UPDATE, and
what the api lets a client do in each state. Races on one row run on Postgres (tests/functional/test_states.py)."""

import json

import pytest
from sqlalchemy import select

from common import events, states
from common.tables import Task
from tests import factories
from tests.unit.conftest import problem

EXPECTED = {
    ("queued", "loading"), ("queued", "cancelled"), ("queued", "failed"),
    ("loading", "running"), ("loading", "cancelling"), ("loading", "failed"),
    ("running", "succeeded"), ("running", "failed"), ("running", "cancelling"),
    ("cancelling", "cancelled"),
}


def test_table_matches_spec():
    table = {(s, t) for s, targets in states.TRANSITIONS.items() for t in targets}
    assert table == EXPECTED
    assert states.TERMINAL == {"succeeded", "failed", "cancelled"}


@pytest.mark.parametrize("source", states.STATES)
@pytest.mark.parametrize("target", states.STATES)
def test_every_pair(unit, source, target):
    with unit.sessions() as session:
        row = factories.task(session, source)
        session.commit()
        won = states.transition(session, row.id, target)
        session.commit()
        status = session.execute(select(Task.status).where(Task.id == row.id)).scalar_one()
    assert won == ((source, target) in EXPECTED)
    assert status == (target if won else source)


def test_only_from_narrows_the_sources(unit):
    with unit.sessions() as session:
        row = factories.task(session, "loading")
        session.commit()
        assert not states.transition(session, row.id, "succeeded", only_from=["running"])
        assert not states.transition(session, row.id, "failed", only_from=["running"])
        assert states.transition(session, row.id, "failed", only_from=["loading", "running"], error={"x": 1})
        session.commit()
        session.expire_all()
        row = session.get(Task, row.id)
        assert (row.status, row.error) == ("failed", {"x": 1}) and row.ended_at is not None


@pytest.mark.parametrize("status,after", [("queued", "cancelled"), ("loading", "cancelling"),
                                          ("running", "cancelling"), ("cancelling", "cancelling"),
                                          ("cancelled", "cancelled")])
def test_cancel_is_idempotent(alice, status, after):
    task = alice.task(status)
    for _ in range(2):
        resp = alice.post(f"/lmsp/v1/tasks/{task.id}/cancel")
        assert resp.status_code == 200 and resp.get_json()["status"] == after


@pytest.mark.parametrize("status", ["succeeded", "failed"])
def test_finished_tasks_cannot_be_cancelled(alice, status):
    task = alice.task(status)
    problem(alice.post(f"/lmsp/v1/tasks/{task.id}/cancel"), 409, "task_not_cancelable")
    assert alice.get(f"/lmsp/v1/tasks/{task.id}").get_json()["status"] == status


def test_cancelling_a_queued_task_logs_the_final_event(alice):
    task = alice.task("queued")
    alice.log(task, [events.ResponseCreated(response_id=task.response_id)])
    alice.post(f"/lmsp/v1/tasks/{task.id}/cancel")
    text = alice.get(f"/lmsp/v1/tasks/{task.id}/events").get_data(as_text=True)
    # The data also carries the event's type and sequence number (the OpenAI SDK reads them there).
    name, data = text.rstrip().split("\n")[-2:]
    assert name == "event: response.cancelled" and data.startswith(
        'data: {"type":"response.cancelled",'
        f'"sequence_number":2,"response_id":"{task.response_id}","status":"cancelled",')
    # ... and the response as GET would return it (the OpenAI SDK reads the final response there)
    obj = json.loads(data.removeprefix("data: "))["response"]
    assert obj["id"] == task.response_id and obj["status"] == "cancelled" and obj["output"] == []
