"""Claims, sweeps, the writer and retention at scale, on Postgres (docs/architecture.md, invariants 11-13):

* with 10,000 queued tasks, 10,000 finished ones and 100 workers, no query a claim, a start, the
  writer's group commit, a follower's read or any sweep makes reads a whole table of tasks, responses
  or events (EXPLAIN of every statement the real code sends, captured as it runs);
* one worker per sweep interval runs a cluster-wide sweep, however many tick;
* retention drops a whole partition once every task made in its period is past its event retention:
  the events endpoint's check answers 410 while the task itself is still there, and a partition
  with one task still inside its retention is kept, its expired tasks flagged.

Cost (measured with the machine at load ~30 on 2 cores): the crowded database ~19 s (its own, 30,000 rows
written by INSERT ... SELECT); the retention test ~1 s beyond the shared api fixture; the SQLite one ~3 s.
"""

import json
import time
from types import SimpleNamespace

import pytest
from sqlalchemy import event, select, text, update

from common import db, eventlog, events, lifecycle, liveness, partitions
from common.db import make_engine, session_factory, transaction, upgrade
from common.ids import id_floor
from common.settings import Settings
from common.tables import Task
from tests import factories
from tests.harness import create_database, drop_database
from worker import recovery, retention, sweeper

QUEUED, DONE, WORKERS = 10_000, 10_000, 100


@pytest.fixture(scope="module")
def crowded():
    url = create_database("lmsp_scale")
    upgrade(url)
    engine = make_engine(url)
    now = time.time()
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO principals VALUES ('crowd', 0)"))
        # Ids of new_id's shape and time; request and output kept small.
        prefix = id_floor("response", now)[5:15]
        for kind, count, status, ended in (("Q", QUEUED, "queued", "NULL"), ("D", DONE, "succeeded", ":now")):
            conn.execute(text(f"""
                INSERT INTO responses (id, principal_id, model, request, status, stored, created_at, updated_at)
                SELECT 'resp_' || :prefix || '{kind}' || lpad(i::text, 15, '0'), 'crowd', 'm', '{{}}',
                       CASE WHEN '{status}' = 'queued' THEN 'queued' ELSE 'completed' END, true, :now, :now
                FROM generate_series(1, :n) i"""), {"prefix": prefix, "now": now, "n": count})
            conn.execute(text(f"""
                INSERT INTO tasks (id, principal_id, response_id, type, model, status, on_restart, attempt,
                                   created_at, updated_at, dispatched_at, dispatches, ended_at, events_expired)
                SELECT 'task_' || :prefix || '{kind}' || lpad(i::text, 15, '0'), 'crowd',
                       'resp_' || :prefix || '{kind}' || lpad(i::text, 15, '0'),
                       'response', 'm', '{status}', 'retry', 0, :now, :now, :now, 1, {ended}, false
                FROM generate_series(1, :n) i"""), {"prefix": prefix, "now": now, "n": count})
        conn.execute(text("INSERT INTO workers (id, model, heartbeat_at, started_at, running, ready) "
                          "SELECT 'w' || i, 'm', :now - (i % 2) * 3600, 0, 0, true FROM generate_series(1, :n) i"),
                     {"now": now, "n": WORKERS})
        # Fair share's clocks: a model's system time and a principal's, among many principals' and models'.
        conn.execute(text("INSERT INTO virtual_times (model, principal_id, finish) VALUES ('m', '', 0), "
                          "('m', 'crowd', 0)"))
        conn.execute(text("INSERT INTO virtual_times (model, principal_id, finish) "
                          "SELECT 'm' || (i % 100), 'p' || i, i FROM generate_series(1, :n) i"), {"n": QUEUED})
        conn.execute(text("INSERT INTO idempotency_records (principal_id, method, path, key, request_hash, created_at) "
                          "SELECT 'crowd', 'POST', '/lmsp/v1/tasks', i::text, 'h', :now FROM generate_series(1, :n) i"),
                     {"now": now, "n": QUEUED})
        conn.execute(text("ANALYZE"))
    engine.queued = [f"task_{prefix}Q{i:015d}" for i in (1, 2, 3)]
    yield engine
    engine.dispose()
    drop_database(url)


def _seq_scans(plan) -> list[str]:
    found = [plan.get("Relation Name")] if plan["Node Type"] == "Seq Scan" else []
    for child in plan.get("Plans", []):
        found += _seq_scans(child)
    # A row per worker, or per sweep: small tables read whole by design.
    return [name for name in found if name and name not in ("workers", "sweeps")]


def test_no_query_of_a_claim_a_sweep_or_the_writer_scans_a_table(crowded, monkeypatch):
    sessions = session_factory(crowded)
    statements = []

    @event.listens_for(crowded, "before_cursor_execute")
    def capture(_conn, _cursor, statement, parameters, _context, _many):
        if not statement.lstrip().upper().startswith(("SELECT PG_", "BEGIN", "COMMIT")):
            statements.append((statement, parameters))

    send = db._send  # compiled statements (the claim, create_task) go by the driver's cursor: seen here

    def capture_send(conn, steps, *args):
        statements.extend(step.bind(conn.dialect, values) for step, values in steps)
        return send(conn, steps, *args)
    monkeypatch.setattr(db, "_send", capture_send)

    settings = Settings(database_url=str(crowded.url))
    ctx = SimpleNamespace(settings=settings, sessions=sessions, worker_id="w2", orphans=set(),
                          running_ids=lambda: set())
    try:
        with transaction(sessions) as session:
            claimed, _ = lifecycle.claim(session, crowded.queued[0], "w2")
            lifecycle.start(session, claimed.attempt)
            lifecycle.append(session, {claimed.attempt: [(2, "response.output_text.delta", "{}")]})
            lifecycle.finish(session, claimed.attempt, lifecycle.R.COMPLETED, seq=events.Sequence(2), emitted=[], output=[],
                             usage={})
            eventlog.read(session, claimed.attempt.response_id, 0)
            with db.autocommit(crowded).connect() as conn:
                lifecycle.followed_task(conn, "crowd", crowded.queued[1])
            dead = liveness.expired_workers(session, 30, "w2")
            lifecycle.fail_direct(session, dead, {})
            lifecycle.hand_on(session, crowded.queued[2], error={}, attempt=0, owner_expired_after=30)
            lifecycle.due_dispatches(session, "m", 60)
            liveness.live_workers(session, 30)
            session.rollback()
        recovery.hand_on_orphans(ctx)
        sweeper.my_turn(ctx, "takeover")
        retention.enforce_retention(ctx)
    finally:
        event.remove(crowded, "before_cursor_execute", capture)
    assert len(statements) > 15
    with crowded.connect() as conn:
        for statement, parameters in statements:
            if not statement.lstrip().upper().startswith(("SELECT", "UPDATE", "INSERT", "DELETE", "WITH")):
                continue
            plan = conn.exec_driver_sql("EXPLAIN (FORMAT JSON) " + statement, parameters).scalar()
            plan = plan if isinstance(plan, list) else json.loads(plan)
            assert _seq_scans(plan[0]["Plan"]) == [], f"a full scan per call:\n{statement}\n{parameters}"
        conn.rollback()


def test_one_worker_per_interval_runs_a_cluster_wide_sweep(crowded):
    sessions = session_factory(crowded)
    ctxs = [SimpleNamespace(settings=Settings(sweep_seconds=30), sessions=sessions) for _ in range(20)]
    assert [sweeper.my_turn(c, "test-sweep") for c in ctxs].count(True) == 1
    with transaction(sessions) as session:
        session.execute(text("UPDATE sweeps SET swept_at = swept_at - 30 WHERE name = 'test-sweep'"))
    assert [sweeper.my_turn(c, "test-sweep") for c in ctxs].count(True) == 1


def test_retention_drops_a_whole_partition_and_the_events_endpoint_answers_410(pg_url, bob):
    """Two tasks made in one past period: while one is inside its event retention the period's partition
    is kept (and the other is flagged expired); once both are past it, the partition is dropped whole,
    and the events endpoint answers 410 while GET /tasks/{id} still has the task."""
    engine = make_engine(pg_url)
    sessions = session_factory(engine)
    retention, now = 600, time.time()
    past = now - 10 * 3600  # before the migration made its first period: the rows go to events_p0
    with transaction(sessions) as session:
        factories.principal(session, "bob")
    ids = []
    for ended in (past + 60, now - 60):  # one long past its event retention, one inside it
        response, task = _rows_at(past + 1)
        with transaction(sessions) as session:
            lifecycle.create_task(session, response, task)
            session.execute(update(Task).where(Task.id == task.id).values(status="succeeded", ended_at=ended))
        ids.append((task.id, response.id))
    with partitions._admin(engine) as conn:
        assert partitions.parts(conn)[0].name == "events_p0"
    # Counted by name: the run's own later periods may be past the retention too, and go.
    partitions.drop_expired(engine, retention)
    with partitions._admin(engine) as conn:
        assert "events_p0" in {p.name for p in partitions.parts(conn)}  # the second task keeps it
    with sessions() as session:
        flags = dict(session.execute(select(Task.id, Task.events_expired).where(
            Task.id.in_([t for t, _ in ids]))).all())
        assert flags == {ids[0][0]: True, ids[1][0]: False}
        assert [e[0] for e in eventlog.read(session, ids[1][1], 0)] == [1]  # kept, whole
    assert bob.get(f"/lmsp/v1/tasks/{ids[0][0]}/events").status_code == 410
    with transaction(sessions) as session:
        session.execute(update(Task).where(Task.id == ids[1][0]).values(ended_at=past + 120))
    assert partitions.drop_expired(engine, retention) >= 1
    with partitions._admin(engine) as conn:
        assert "events_p0" not in {p.name for p in partitions.parts(conn)}
    with sessions() as session:
        assert eventlog.read(session, ids[1][1], 0) == []
    gone = bob.get(f"/lmsp/v1/tasks/{ids[1][0]}/events")
    assert gone.status_code == 410 and gone.json()["code"] == "event_history_expired"
    task = bob.get(f"/lmsp/v1/tasks/{ids[1][0]}")
    assert task.status_code == 200 and task.json()["status"] == "succeeded"
    engine.dispose()


def _rows_at(at: float):
    """A task and its response as the api makes them, with an id of time ``at``."""
    import os

    from common import ids
    from common.states import R
    response = lifecycle.new_response(principal="bob", model="m-old", request={"input": []}, input_tokens=1,
                                      max_tokens=1, status=R.QUEUED, stored=True, previous_response_id=None)
    response.id = ids.id_floor("response", at) + ids._encode(int.from_bytes(os.urandom(10), "big"))[-16:]
    response.created_at = response.updated_at = at
    task = lifecycle.new_task(response, "fail")
    task.created_at = task.updated_at = at
    return response, task


def test_retention_purges_the_events_of_direct_responses_on_sqlite(tmp_path):
    """Issue 21 item 7: a direct response's events were never deleted. SQLite deletes them by rows once
    the response is past the event retention (Postgres drops their partition with the tasks'). <1 s."""
    url = f"sqlite:///{tmp_path / 'direct.db'}"
    upgrade(url)
    engine = make_engine(url)
    sessions = session_factory(engine)
    settings = Settings(database_url=url, event_retention_seconds=600)
    with transaction(sessions) as session:
        factories.principal(session, "p")
        for stored, age in ((True, 3600), (False, 3600), (True, 60)):
            response = lifecycle.new_response(principal="p", model="m", request={"input": []}, input_tokens=1,
                                              max_tokens=1, status=lifecycle.R.COMPLETED, stored=stored,
                                              previous_response_id=None)
            response.updated_at = time.time() - age
            session.add(response)
            session.flush()
            eventlog.append(session, response.id, [(1, "response.created", "{}"), (2, "response.completed", "{}")])
    retention.enforce_retention(SimpleNamespace(settings=settings, sessions=sessions))
    with sessions() as session:
        kept = session.execute(text("SELECT r.stored, count(e.seq) FROM responses r LEFT JOIN events e "
                                    "ON e.response_id = r.id GROUP BY r.id ORDER BY r.updated_at")).all()
    # The stored one past its event retention keeps its record, not its events; the unstored one is gone
    # with its events; the recent one keeps both.
    assert [tuple(k) for k in kept] == [(True, 0), (True, 2)]
    with sessions() as session:
        assert session.execute(text("SELECT count(*) FROM events")).scalar() == 2  # no orphan rows
    engine.dispose()
