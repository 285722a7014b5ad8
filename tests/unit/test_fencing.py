"""Issue 21 defect 9: fencing edge cases, driving the real lifecycle core on the unit layer's SQLite."""

import pytest
from sqlalchemy import update

from common import events, lifecycle
from common.settings import Settings
from common.states import R
from common.tables import Response, Task
from tests import factories

USAGE = {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2}


@pytest.fixture
def sessions(unit):
    return unit.sessions


def queued(sessions) -> Task:
    with sessions() as session:
        task = factories.task(session, "queued")
        session.commit()
    return task


def claim(sessions, task_id, worker_id, **kw):
    with sessions() as session:
        claimed, _ = lifecycle.claim(session, task_id, worker_id, **kw)
        session.commit()
    return claimed


def lose_the_claim(sessions, task_id) -> None:
    """What a database crash does to a lazily committed claim: the task is queued again, as before it."""
    with sessions() as session:
        session.execute(update(Task).where(Task.id == task_id).values(status="queued", worker_id=None,
                                                                       attempt=Task.attempt - 1))
        session.commit()


def test_a_claim_replayed_after_its_reply_was_lost_takes_the_task_again(sessions):
    task = queued(sessions)
    assert claim(sessions, task.id, "w1") is not None  # committed; the worker never heard back
    again = claim(sessions, task.id, "w1", retried=True)
    assert again is not None and again.attempt.number == 2 and again.fresh
    # ... but not while a thread of this worker runs it, nor for another worker, nor as a first try.
    assert claim(sessions, task.id, "w1", retried=True, busy=frozenset({task.response_id})) is None
    assert claim(sessions, task.id, "w2", retried=True) is None
    assert claim(sessions, task.id, "w1") is None


def test_a_lost_start_does_not_turn_a_finished_generation_into_cancelled(sessions):
    task = queued(sessions)
    attempt = claim(sessions, task.id, "w1").attempt  # its start (loading -> running) was lost: still loading
    with sessions() as session:
        publish = lifecycle.finish(session, attempt, R.COMPLETED, seq=events.Sequence(1), emitted=[], output=[],
                                   usage=USAGE)
        session.commit()
        assert session.get(Task, task.id).status == "succeeded"
    assert publish[task.response_id][-1][1] == events.COMPLETED


def test_attempt_n_claimed_twice_fences_the_worker_whose_claim_was_lost(sessions):
    task = queued(sessions)
    first = claim(sessions, task.id, "w1").attempt
    lose_the_claim(sessions, task.id)
    second = claim(sessions, task.id, "w2").attempt
    assert first.number == second.number  # the number alone cannot tell them apart
    batch = [(2, events.TEXT_DELTA, "{}")]
    with sessions() as session:
        refused = lifecycle.append(session, {first: batch, second: [(2, events.TEXT_DELTA, "{}")]})
        session.commit()
    assert refused == {first}
    with sessions() as session, pytest.raises(lifecycle.Fenced):
        lifecycle.start(session, first)


def test_an_older_attempts_loss_does_not_stop_a_newer_attempt_here():
    from worker.context import WorkerContext

    ctx = WorkerContext(settings=Settings(), worker_id="w1", sessions=None, celery=None,
                        publisher=None, writer=None, hosts=None)
    older = lifecycle.Attempt("resp_1", "task_1", 1, "w1")
    newer = lifecycle.Attempt("resp_1", "task_1", 3, "w1")
    entry = ctx.register(newer)
    ctx.lose(older)
    ctx.lose(older, {"detail": "refused"})
    assert not entry.fenced and entry.write_error is None
    ctx.lose(newer)
    assert entry.fenced


def test_a_finished_direct_response_is_final_once(sessions):
    """The status a direct response's finish reads is the one it writes over (SQLite serialises writers;
    the row lock on Postgres is in tests/functional/test_harden.py)."""
    with sessions() as session:
        factories.principal(session, "p")
        row = lifecycle.new_response(principal="p", model="m", request={"input": []}, input_tokens=1,
                                     max_tokens=4, status=R.QUEUED, stored=False, previous_response_id=None)
        session.add(row)
        session.commit()
        attempt, _ = lifecycle.claim_direct(session, row.id, "w1")
        session.commit()
        lifecycle.abort_direct(session, row.id)
        session.commit()
        publish = lifecycle.finish(session, attempt, R.COMPLETED, seq=events.Sequence(1), emitted=[], output=[],
                                   usage=USAGE, logged=False)
        session.commit()
        assert session.get(Response, row.id).status == R.CANCELLED
    assert publish[row.id][-1][1] == events.CANCELLED
