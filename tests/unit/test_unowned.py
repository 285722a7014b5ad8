"""Issue 21 defect 10: states nobody would ever move on, and queues two models would share; the real
lifecycle core and api on the unit layer's SQLite."""

import time

import pytest
from sqlalchemy import update

from common import lifecycle
from common.registry import ModelSpec, Registry
from common.settings import ConfigError
from common.states import R
from common.tables import Response, Task, Worker
from tests import factories
from tests.harness import model_entry
from tests.unit.conftest import MODEL


def test_cancelling_a_task_whose_worker_is_gone_finishes_at_once(unit, alice):
    """With no worker alive at all, no sweeper would ever finish the cancellation."""
    with unit.sessions() as session:
        # Of another model: a live worker of the shared app's model would make others' requests wait for it.
        session.merge(Worker(id="gone", model="elsewhere", heartbeat_at=time.time() - 3600, started_at=0, running=1))
        session.commit()
    running = alice.task("running", worker_id="gone")
    resp = alice.post(f"/lmsp/v1/tasks/{running.id}/cancel")
    assert resp.status_code == 200 and resp.get_json()["status"] == "cancelled", resp.get_json()
    # ... and one already cancelling when its worker died, at the next cancel (idempotent, 7.3).
    stuck = alice.task("cancelling", worker_id="gone")
    resp = alice.post(f"/lmsp/v1/tasks/{stuck.id}/cancel")
    assert resp.status_code == 200 and resp.get_json()["status"] == "cancelled", resp.get_json()
    with unit.sessions() as session:
        session.merge(Worker(id="alive", model="elsewhere", heartbeat_at=time.time(), started_at=0, running=1))
        session.commit()
    owned = alice.task("running", worker_id="alive")
    assert alice.post(f"/lmsp/v1/tasks/{owned.id}/cancel").get_json()["status"] == "cancelling"


def test_a_queued_direct_response_nobody_watches_is_failed(unit):
    """Its api died and its message was lost: no worker would ever take it, no api would ever end it."""
    with unit.sessions() as session:
        factories.principal(session, "p")
        rows = [lifecycle.new_response(principal="p", model=MODEL, request={"input": []}, input_tokens=1,
                                       max_tokens=4, status=R.QUEUED, stored=False, previous_response_id=None)
                for _ in range(2)]
        session.add_all(rows)
        session.commit()
        session.execute(update(Response).where(Response.id == rows[0].id).values(updated_at=time.time() - 600))
        lifecycle.watched_direct(session, rows[1].id)
        assert lifecycle.fail_abandoned_direct(session, 60) == [rows[0].id]
        session.commit()
        abandoned = session.get(Response, rows[0].id, populate_existing=True)
        assert abandoned.status == R.FAILED and abandoned.error["code"] == "server_restarted"


def test_models_whose_queue_names_collide_are_refused():
    specs = [ModelSpec(**model_entry(i)) for i in ("a:b", "a/b")]
    assert specs[0].queue == specs[1].queue
    with pytest.raises(ConfigError, match="share the queue"):
        Registry(specs)
    Registry([ModelSpec(**model_entry(i)) for i in ("a:b", "a.b")])


def test_a_claim_checks_the_model(unit):
    with unit.sessions() as session:
        task = factories.task(session, "queued", model="a:b")
        session.commit()
        assert lifecycle.claim(session, task.id, "w", model="a_b")[0] is None
        assert session.get(Task, task.id).status == "queued"
        assert lifecycle.claim(session, task.id, "w", model="a:b")[0] is not None
        direct = lifecycle.new_response(principal="factory", model="a:b", request={"input": []}, input_tokens=1,
                                        max_tokens=4, status=R.QUEUED, stored=False, previous_response_id=None)
        session.add(direct)
        session.commit()
        assert lifecycle.claim_direct(session, direct.id, "w", "a_b") is None
        assert lifecycle.claim_direct(session, direct.id, "w", "a:b") is not None
