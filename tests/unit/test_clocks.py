"""Issue 21 defect 10: what replicas judge by time uses the database's clock, never their own, so a
replica whose clock is off neither takes a live Idempotency-Key over nor expires fresh events."""

import time

import pytest

from api.services import idempotency
from common.errors import LMSPError

AHEAD = 25 * 3600  # a replica whose clock runs a day ahead


@pytest.fixture
def own(tmp_path):
    """An app of its own: the skew must not reach the caches of the session's shared one."""
    from tests.unit.conftest import make_unit
    return make_unit(tmp_path)


@pytest.fixture
def skewed(monkeypatch):
    """From here on this process is the skewed replica."""
    real = time.time
    return lambda: monkeypatch.setattr(time, "time", lambda: real() + AHEAD)


def test_a_skewed_replica_does_not_take_a_live_idempotency_key_over(own, skewed):
    key = idempotency.key_from("live-key", "skew", "POST", "/lmsp/v1/responses", {"a": 1})
    from tests import factories
    with own.sessions() as session:
        factories.principal(session, "skew")
        session.commit()
    assert idempotency.Claims(own.sessions, beat=10).begin(key) is None  # in flight on one replica
    skewed()
    with pytest.raises(LMSPError) as err:
        idempotency.Claims(own.sessions, beat=10).begin(key)  # a retry reaches another replica
    assert err.value.code == "idempotency_key_in_use"


def test_a_skewed_replica_does_not_expire_fresh_events(own, skewed):
    alice = own.as_("alice")
    task = alice.task("succeeded", ended_at=time.time())
    skewed()
    assert alice.get(f"/lmsp/v1/tasks/{task.id}/events").status_code == 200


def test_a_task_that_ends_before_it_was_created_by_another_clock_has_no_negative_time(alice):
    """created_at is the accepting api's clock, ended_at the database's: GET /tasks/{id} must not fail
    (a 500: the timeline's wall time below 0) when they disagree."""
    task = alice.task("succeeded", ended_at=time.time() - 3 * 86400)
    resp = alice.get(f"/lmsp/v1/tasks/{task.id}")
    assert resp.status_code == 200, resp.get_data(as_text=True)[:300]
    timeline = resp.get_json()["extensions"]["x-lmsp-timeline"]
    assert timeline["wall"] == 0 and all(v >= 0 for v in timeline["durations"].values())
