"""Fair share is settled on every end of a task, exactly once (issue 36, defect 7): the principal's clock
ends at its charges minus what its tasks did not use, whichever way each task ended. The real lifecycle
core on the unit layer's SQLite. Each task is charged 200 (input 100 + max output 100), weight 1."""

import uuid

import pytest
from sqlalchemy import select

from common import events, fairshare, lifecycle
from common.errors import problem
from common.states import R
from common.tables import Task, VirtualTime
from tests.unit.test_fairshare import _create

ERROR = problem("generation_failed", "x")


@pytest.fixture
def fair(unit):
    model = f"fair:{uuid.uuid4().hex[:6]}"
    who = f"user-{model}"
    with unit.sessions() as session:
        def clock() -> float:
            return session.execute(select(VirtualTime.finish).where(
                VirtualTime.model == model, VirtualTime.principal_id == who)).scalar()

        def running(policy: str = "fail") -> lifecycle.Claim:
            task = _create(session, who, model)
            session.execute(Task.__table__.update().where(Task.id == task.id).values(on_restart=policy))
            got, _ = lifecycle.claim(session, task.id, "w", model=model)
            assert lifecycle.start(session, got.attempt)
            session.commit()
            return got

        yield session, clock, running


def test_a_fail_task_handed_on_gives_back_what_it_did_not_use(fair):
    session, clock, running = fair
    got = running("fail")
    lifecycle.hand_on(session, got.task.id, error=ERROR, attempt=got.attempt.number, used=130)
    session.commit()
    assert session.get(Task, got.task.id).status == "failed"
    assert clock() == 130.0  # charged 200, used 130


def test_the_crash_cap_settles(fair):
    session, clock, running = fair
    got = running("retry")
    lifecycle.hand_on(session, got.task.id, error=ERROR, attempt=got.attempt.number, crashed_after=1)
    session.commit()
    assert session.get(Task, got.task.id).status == "failed"
    assert clock() == 100.0  # its worker did not say: the prompt, which it had prefilled


def test_fail_write_settles(fair):
    session, clock, running = fair
    got = running()
    lifecycle.fail_write(session, got.attempt, ERROR, used=150)
    session.commit()
    assert clock() == 150.0


def test_cancelling_a_handed_on_task_settles(fair):
    session, clock, running = fair
    got = running("resume")
    lifecycle.hand_on(session, got.task.id, error=ERROR, attempt=got.attempt.number, used=120)
    session.commit()
    task = session.get(Task, got.task.id, populate_existing=True)
    assert task.worker_id is None and clock() == 200.0  # resumed later: nothing settled yet
    assert lifecycle.cancel(session, task)[0] is False
    session.commit()
    assert session.get(Task, got.task.id, populate_existing=True).status == "cancelled"
    assert clock() == 100.0  # ended: charged 200, its prompt used


def test_a_retry_tasks_thrown_away_attempt_is_counted(fair):
    session, clock, running = fair
    got = running("retry")
    lifecycle.hand_on(session, got.task.id, error=ERROR, attempt=got.attempt.number, used=150)
    session.commit()
    assert clock() == 350.0  # 200 charged + the 150 the first attempt used, which the next repeats
    again, _ = lifecycle.claim(session, got.task.id, "w2", model=got.task.model)
    assert lifecycle.start(session, again.attempt)
    lifecycle.finish(session, again.attempt, R.COMPLETED, seq=events.Sequence(1), emitted=[], output=[],
                     usage={"input_tokens": 100, "output_tokens": 20, "total_tokens": 120})
    session.commit()
    assert clock() == 270.0  # 150 + 120: both attempts, nothing more


def test_settling_twice_gives_back_once(fair):
    session, clock, running = fair
    got = running()
    lifecycle.finish(session, got.attempt, R.COMPLETED, seq=events.Sequence(1), emitted=[], output=[],
                     usage={"input_tokens": 100, "output_tokens": 20, "total_tokens": 120})
    session.commit()
    assert clock() == 120.0
    assert fairshare.settle(session, got.task.id, 120) and fairshare.settle(session, got.task.id, 0)
    session.commit()
    assert clock() == 120.0
