"""The lifecycle core on both databases: claims, fencing, hand-over by policy, takeovers by the
database's clock, cancellation of handed-on work, and broker re-sends spaced per task."""

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import delete, func, select, text, update

from common import eventlog, events, lifecycle, liveness
from common.db import db_now, make_engine, session_factory, transaction, upgrade
from common.lifecycle import Fenced
from common.states import R
from common.tables import Event, IdempotencyRecord, Response, Task, Worker
from tests import factories


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def sessions(request, tmp_path_factory):
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('lifecycle') / 'db.sqlite'}"
        upgrade(url)
    else:
        url = request.getfixturevalue("pg_url")
    engine = make_engine(url)
    yield session_factory(engine)
    engine.dispose()


def new_rows(principal="p", model="m", on_restart="fail"):
    response = lifecycle.new_response(principal=principal, model=model, request={"input": []}, input_tokens=3,
                                      max_tokens=10, status=R.IN_PROGRESS, stored=True, previous_response_id=None)
    return response, lifecycle.new_task(response, on_restart)


def new_task(sessions, on_restart="fail", model="m"):
    with transaction(sessions) as session:
        factories.principal(session, "p")
        response, task = new_rows(model=model, on_restart=on_restart)
        assert lifecycle.create_task(session, response, task)
    return task.id, response.id


def claim(sessions, task_id, worker):
    with transaction(sessions) as session:
        claimed, _ = lifecycle.claim(session, task_id, worker)
    return claimed


def log_of(sessions, rid):
    with sessions() as session:
        return eventlog.read(session, rid, 0, limit=1000)


def status(sessions, task_id):
    with sessions() as session:
        return session.execute(select(Task.status, Task.attempt, Task.worker_id).where(Task.id == task_id)).one()


def test_a_stale_attempt_can_no_longer_write(sessions):
    task_id, rid = new_task(sessions, "retry")
    first = claim(sessions, task_id, "w1").attempt
    with transaction(sessions) as session:
        assert lifecycle.start(session, first)
        assert lifecycle.append(session, {first: [(2, events.TEXT_DELTA, "{}")]}) == set()
    # w1's lease is gone: the task is handed on and claimed by w2 with a new attempt number.
    with transaction(sessions) as session:
        send, _ = lifecycle.hand_on(session, task_id, error={}, attempt=first.number)
    assert send and status(sessions, task_id) == ("running", 2, None)
    assert claim(sessions, task_id, "w2") is not None
    assert claim(sessions, task_id, "w3") is None  # owned: a second claim wins nothing
    with transaction(sessions) as session:
        assert lifecycle.append(session, {first: [(3, events.TEXT_DELTA, "{}")]}) == {first}
        with pytest.raises(Fenced):
            lifecycle.finish(session, first, R.COMPLETED, seq=events.Sequence(2), emitted=[], output=[], usage={})
    assert [e[0] for e in log_of(sessions, rid)] == [1, 2]


def test_an_append_holds_off_a_takeover_until_it_commits(sessions):
    """The group commit's fence is a row lock: a takeover that comes while a batch is being logged waits
    for its commit (so the batch is in the log before the task is handed on), and the stale attempt's
    next batch is refused."""
    task_id, rid = new_task(sessions, "retry")
    first = claim(sessions, task_id, "w1").attempt
    with transaction(sessions) as session:
        assert lifecycle.start(session, first)
    handed = threading.Event()

    def takeover():
        with transaction(sessions) as session:
            assert lifecycle.hand_on(session, task_id, error={}, attempt=first.number)[0]
        handed.set()

    with sessions() as session:
        assert lifecycle.append(session, {first: [(2, events.TEXT_DELTA, "{}")]}) == set()
        thread = threading.Thread(target=takeover)
        thread.start()
        # SQLite's writers wait for the database lock, Postgres' takeover for the row the append locked.
        assert not handed.wait(1.0), "the takeover committed while the batch was being logged"
        session.commit()
    thread.join(30)
    assert handed.is_set() and status(sessions, task_id) == ("running", 2, None)
    with transaction(sessions) as session:
        assert lifecycle.append(session, {first: [(3, events.TEXT_DELTA, "{}")]}) == {first}
    assert [e[0] for e in log_of(sessions, rid)] == [1, 2]


def test_hand_on_applies_each_policy(sessions):
    outcomes = {}
    for policy in ("fail", "retry", "resume"):
        task_id, rid = new_task(sessions, policy)
        attempt = claim(sessions, task_id, "w1").attempt
        with transaction(sessions) as session:
            send, publish = lifecycle.hand_on(session, task_id, error=lifecycle.restarted_error("gone"),
                                              attempt=attempt.number)
        outcomes[policy] = (send, status(sessions, task_id)[0], [e[1] for e in log_of(sessions, rid)])
    assert outcomes["fail"] == (False, "failed", [events.CREATED, events.FAILED])
    assert outcomes["retry"] == (True, "loading", [events.CREATED])
    assert outcomes["resume"] == (True, "loading", [events.CREATED])
    # A cancelling task is cancelled whatever its policy.
    task_id, rid = new_task(sessions, "resume")
    claim(sessions, task_id, "w1")
    with transaction(sessions) as session:
        assert lifecycle.cancel(session, session.get(Task, task_id))[0]  # the owner must be told
        lifecycle.hand_on(session, task_id, error={})
    assert status(sessions, task_id)[0] == "cancelled"
    assert log_of(sessions, rid)[-1][1] == events.CANCELLED


def test_takeover_needs_the_lease_expired_by_the_database_clock(sessions):
    task_id, _ = new_task(sessions, "fail")
    attempt = claim(sessions, task_id, "w-live").attempt
    with transaction(sessions) as session:
        liveness.heartbeat(session, "w-live", ["m"], 1.0, running=1, ready=True, loaded=["m"], boot=True)
    with transaction(sessions) as session:  # a sweeper with a stale view of the lease
        assert lifecycle.hand_on(session, task_id, error={}, attempt=attempt.number,
                                 owner_expired_after=30) == (False, {})
    assert status(sessions, task_id)[0] == "loading"
    with transaction(sessions) as session:
        session.execute(update(Worker).where(Worker.id == "w-live").values(heartbeat_at=db_now() - 31))
        assert "w-live" in liveness.expired_workers(session, 30, "me")
        send, publish = lifecycle.hand_on(session, task_id, error=lifecycle.restarted_error("gone"),
                                          attempt=attempt.number, owner_expired_after=30)
    assert status(sessions, task_id)[0] == "failed"
    [(_, name, data)] = next(iter(publish.values()))
    assert name == events.FAILED and json.loads(data)["error"]["code"] == "server_restarted"


def test_cancel_of_a_handed_on_task_completes_at_once(sessions):
    task_id, rid = new_task(sessions, "retry")
    attempt = claim(sessions, task_id, "w1").attempt
    with transaction(sessions) as session:
        lifecycle.start(session, attempt)
        lifecycle.hand_on(session, task_id, error={}, attempt=attempt.number)
    with transaction(sessions) as session:
        notify, publish = lifecycle.cancel(session, session.get(Task, task_id))
    assert not notify and status(sessions, task_id)[0] == "cancelled"
    assert [e[1] for e in log_of(sessions, rid)] == [events.CREATED, events.CANCELLED]
    assert claim(sessions, task_id, "w2") is None


def test_finish_continues_the_log_and_a_cancel_that_came_first_wins(sessions):
    task_id, rid = new_task(sessions)
    attempt = claim(sessions, task_id, "w1").attempt
    with transaction(sessions) as session:
        lifecycle.start(session, attempt)
        lifecycle.cancel(session, session.get(Task, task_id))
    with transaction(sessions) as session:
        lifecycle.finish(session, attempt, R.COMPLETED, seq=events.Sequence(1), emitted=[], output=[], usage={})
    assert status(sessions, task_id)[0] == "cancelled"
    with sessions() as session:
        assert session.get(Response, rid).status == "cancelled"
    assert [e[:2] for e in log_of(sessions, rid)] == [(1, events.CREATED), (2, events.CANCELLED)]


def test_a_write_that_cannot_succeed_fails_only_its_task(sessions):
    task_id, rid = new_task(sessions)
    attempt = claim(sessions, task_id, "w1").attempt
    with transaction(sessions) as session:
        lifecycle.start(session, attempt)
        eventlog.append(session, rid, [(2, "x.foreign", "{}")])  # someone else's row at our next seq
    with transaction(sessions) as session:
        assert not lifecycle.already_logged(session, rid, [(2, events.TEXT_DELTA, "{}")])
        lifecycle.fail_write(session, attempt, {"code": "generation_failed", "detail": "collides"})
    assert status(sessions, task_id)[0] == "failed"
    assert [e[0] for e in log_of(sessions, rid)] == [1, 2, 3]  # the final event after the log's max


def test_due_dispatches_spaces_copies_per_task(sessions):
    ids = [new_task(sessions, model="mq")[0] for _ in range(3)]
    with transaction(sessions) as session:
        session.execute(update(Task).where(Task.id.in_(ids)).values(dispatched_at=db_now() - 100))
        session.execute(update(Task).where(Task.id == ids[2]).values(dispatches=5))  # sent 5 times
    with transaction(sessions) as session:
        due = lifecycle.due_dispatches(session, "mq", 60)
    assert set(due) == set(ids[:2])  # the fifth copy waits 16 x 60 s, not 60 s
    with transaction(sessions) as session:
        assert lifecycle.due_dispatches(session, "mq", 60) == []  # just sent
        # The broker restarted empty: every copy is due at once, except the ones sent a moment ago.
        assert set(lifecycle.due_dispatches(session, "mq", 60, force=True)) == {ids[2]}
        session.execute(update(Task).where(Task.id.in_(ids)).values(dispatched_at=db_now() - 2))
        assert set(lifecycle.due_dispatches(session, "mq", 60, force=True)) == set(ids)


def test_a_task_whose_engine_died_before_its_first_token_runs_again_whatever_its_policy(sessions):
    task_id, _ = new_task(sessions, "fail")
    attempt = claim(sessions, task_id, "w1").attempt  # loading: not one token yet
    with transaction(sessions) as session:
        send, _ = lifecycle.hand_on(session, task_id, error={}, attempt=attempt.number, unstarted_again=True)
    assert send and status(sessions, task_id)[:1] == ("loading",)
    attempt = claim(sessions, task_id, "w2").attempt
    with transaction(sessions) as session:
        lifecycle.start(session, attempt)  # it generated: now its policy applies
        send, _ = lifecycle.hand_on(session, task_id, error={}, attempt=attempt.number, unstarted_again=True)
    assert not send and status(sessions, task_id)[0] == "failed"


def test_concurrent_creations_never_overshoot_a_queue_limit(sessions):
    """Eight at once for three places (the principal's) and then for the model's last two: each place
    is taken once, however the creations interleave (spec 10: exact queue-depth limits)."""
    with transaction(sessions) as session:
        for name in ("crowd", "crowd2"):
            factories.principal(session, name)

    def race(principal, room):
        go = threading.Barrier(8)

        def create(_):
            response, task = new_rows(principal, model="m-crowd")
            with sessions() as session:
                go.wait()
                return lifecycle.create_task(session, response, task, room, commit=True)

        with ThreadPoolExecutor(8) as pool:
            return list(pool.map(create, range(8))).count(True)

    assert race("crowd", lifecycle.Room(mine=3, total=100)) == 3
    assert race("crowd2", lifecycle.Room(mine=100, total=5)) == 2
    with sessions() as session:
        assert lifecycle.queued(session, "crowd", "m-crowd") == (3, 5)
        tasks = session.execute(select(Task.response_id).where(Task.model == "m-crowd")).scalars().all()
        firsts = session.execute(select(Event.response_id).where(Event.response_id.in_(tasks), Event.seq == 1))
        assert len(set(firsts.scalars())) == len(tasks) == 5  # every task has its response.created, no other


def test_a_refused_task_writes_nothing(sessions):
    with transaction(sessions) as session:
        factories.principal(session, "full")
    response, task = new_rows("full", model="m-full")
    record = IdempotencyRecord(principal_id="full", method="POST", path="/x", key="k", request_hash="h",
                               status_code=202, task_id=task.id, created_at=0)
    with sessions() as session:
        assert not lifecycle.create_task(session, response, task, lifecycle.Room(mine=0, total=10), also=(record,),
                                         commit=True)
        for table in (Task, Response, IdempotencyRecord):
            assert session.execute(select(func.count()).select_from(table).where(
                table.principal_id == "full")).scalar() == 0
        assert session.execute(select(func.count()).where(Event.response_id == response.id)).scalar() == 0
        assert lifecycle.create_task(session, response, task, lifecycle.Room(mine=1, total=10), also=(record,),
                                     commit=True)
        assert session.get(IdempotencyRecord, ("full", "POST", "/x", "k")).task_id == task.id


def test_queue_counts_follow_every_change_of_a_queued_task(sessions):
    """The counts the queue limits read (kept by triggers on tasks) stay the queued tasks through
    creations, a claim, a cancel, a deletion and a write that bypasses lifecycle."""
    with transaction(sessions) as session:
        factories.principal(session, "qc")
    ids = []
    for _ in range(4):
        with transaction(sessions) as session:
            response, task = new_rows("qc", model="m-qc")
            assert lifecycle.create_task(session, response, task)
            ids.append(task.id)
    with transaction(sessions) as session:
        factories.task(session, "queued", owner="qc", model="m-other")
    assert claim(sessions, ids[0], "w-qc") is not None
    with transaction(sessions) as session:
        lifecycle.cancel(session, session.get(Task, ids[1]))
        session.execute(delete(Task).where(Task.id == ids[2]))
    with sessions() as session:
        assert lifecycle.queued(session, "qc", "m-qc") == (2, 1)
        assert lifecycle.queued(session, "qc", "m-other") == (2, 1)
        assert lifecycle.queued(session, "nobody", "m-none") == (0, 0)


def test_a_claim_whose_statement_began_before_a_task_was_committed_still_claims_it(pg_url):
    """Each message claims the first queued task of its model, its own or another's. A claim's statement
    sees the tasks committed before it began: when another message's claim holds this message's task, and
    that message's own task was committed after this statement began, the claim must still take it, not
    leave it queued for the sweeper (a minute; seen in make bench's V1, one task of 64). The statement's
    old snapshot is made here with REPEATABLE READ, where the race needs a burst of claims."""
    import time

    engine = make_engine(pg_url)
    sessions = session_factory(engine)
    model = "late-commit"
    try:
        with transaction(sessions) as session:
            factories.principal(session, "p")
        own = new_task(sessions, model=model)[0]  # this message's task
        # The claim in a transaction block, as the worker's (worker/runner.py).
        with sessions() as claiming, claiming.begin(), sessions() as other:
            claiming.connection(execution_options={"isolation_level": "REPEATABLE READ"})
            claiming.execute(text("SELECT 1"))  # its snapshot: before the next task's commit
            other.execute(select(Task.id).where(Task.id == own).with_for_update())  # another claim holds it
            later = new_task(sessions, model=model)[0]  # that claim's own task, committed now
            claimed, _ = lifecycle.claim(claiming, own, "w1", model=model, commit=True,
                                         points={"delivered_at": time.time()})
            other.execute(update(Task).where(Task.id == own).values(status="loading", worker_id="w2",
                                                                    attempt=Task.attempt + 1))
            other.commit()
        assert claimed is not None and claimed.task.id == later
        assert status(sessions, later)[0] == "loading"
    finally:
        engine.dispose()
