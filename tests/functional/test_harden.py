"""Issue 21's worker-side defects on real Postgres, driving the real runner and lifecycle with a scripted
engine (the defects live in the worker's logic and the database, not in vLLM's numbers): no engine
load, no vLLM import."""

import time

import pytest

from common import events, lifecycle
from common.db import make_engine, session_factory
from common.registry import ModelSpec
from common.settings import Settings
from common.states import R
from common.tables import Response
from tests import factories
from tests.harness import model_entry
from worker import runner
from worker.context import WorkerContext
from worker.gate import Delta
from worker.residency import Residency, Slot
from worker.writer import EventWriter

MODEL = "smollm2:harden"


class ScriptedEngine:
    """Answers every request with ``text`` in one delta, as the engine's consumer sees it."""

    dead = False
    dead_errors: tuple = ()

    def __init__(self, text: str):
        self.text = text

    def tokenizer(self):
        from common.prompt import load_tokenizer
        return load_tokenizer(model_entry(MODEL)["checkpoint"])

    def generate(self, request_id, prompt, params, window=0.0, max_tokens=None, on_delta=None, quiet=None,
                 opened=None):
        yield Delta(text=self.text, token_ids=3, finish_reason="stop", prompt_tokens=5)

    def abort(self, request_id):
        pass

    def running(self):
        return 0

    def shutdown(self):
        pass


class Recorder:
    """A live publisher (so direct events are not logged, as with Redis) that keeps what it publishes."""

    live = True

    def __init__(self):
        self.published: dict[str, list] = {}

    def publish(self, response_id, batch):
        return self.publish_many({response_id: batch}) is not None

    def publish_many(self, batches):
        for rid, batch in batches.items():
            self.published.setdefault(rid, []).extend(batch)
        return {rid: 0 for rid in batches}

    def abort(self, response_id):
        pass


@pytest.fixture(scope="module")
def sessions(pg_url):
    return session_factory(make_engine(pg_url))


def worker_ctx(sessions, pg_url, engine, publisher=None) -> WorkerContext:
    publisher = publisher or Recorder()
    hosts = Residency([Slot(ModelSpec(**model_entry(MODEL)), 0.0, lambda: engine)], budget_gib=0, keep_alive=-1)
    ctx = WorkerContext(settings=Settings(database_url=pg_url), worker_id=f"w-{time.monotonic_ns()}",
                        sessions=sessions, celery=None, publisher=publisher, writer=None, hosts=hosts)
    ctx.writer = EventWriter(sessions, publisher, ctx.lose, ctx.stopping)
    hosts.load(MODEL, ctx.stopping)
    ctx.engine_ok.set()
    return ctx


def direct_response(sessions, **request) -> str:
    body = {"model": MODEL, "input": [{"type": "message", "role": "user", "content": "hi"}], **request}
    with sessions() as session:
        who = factories.principal(session, "harden")
        row = lifecycle.new_response(principal=who, model=MODEL, request=body, input_tokens=5, max_tokens=64,
                                     status=R.QUEUED, stored=False, previous_response_id=None)
        lifecycle.create_direct(session, row)
        session.commit()
    return row.id


WEATHER = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]


@pytest.mark.parametrize("call", [
    '{"name": "get\\u0000weather", "arguments": {}}',        # Postgres JSONB refuses U+0000
    '{"name": "get_weather", "arguments": {"city": "\\ud800"}}',  # ... and a lone surrogate
], ids=["nul-in-name", "lone-surrogate-in-arguments"])
def test_a_direct_response_whose_output_the_database_refuses_ends_failed(sessions, pg_url, call):
    """Defect 1: the output's JSONB write fails; the response must still end (failed, generation_failed,
    with its final event published), not stay in_progress under a live worker forever."""
    ctx = worker_ctx(sessions, pg_url, ScriptedEngine(f"<tool_call>{call}</tool_call>"))
    rid = direct_response(sessions, tools=WEATHER)
    try:
        runner.run_direct(ctx, MODEL, rid)
    finally:
        ctx.stopping.set()
        ctx.writer.stop()
    with sessions() as session:
        row = session.get(Response, rid)
        assert row.status == R.FAILED and row.error["code"] == "generation_failed", (row.status, row.error)
    final = ctx.publisher.published[rid][-1]
    assert final[1] == events.FAILED, ctx.publisher.published[rid]


def test_the_interactive_lane_claims_nothing_while_the_worker_is_not_ready(sessions, pg_url, tmp_path):
    """Defect 3: a draining worker (or one whose engine is dead or reloading) leaves direct requests in
    the queue for ready workers instead of claiming them (and failing them server_restarted, or making
    its drain wait); once ready again it serves them."""
    from common import interactive_wire
    from common.broker import make_celery
    from worker import interactive

    ctx = worker_ctx(sessions, pg_url, ScriptedEngine("Hello"))
    ctx.celery = make_celery(Settings(home=tmp_path, database_url=pg_url))  # the filesystem broker
    ctx.draining.set()
    rid = direct_response(sessions)
    interactive_wire.send(ctx.celery, ctx.spec(MODEL).interactive_queue, rid)
    try:
        interactive.start(ctx)
        time.sleep(2)
        with sessions() as session:
            assert session.get(Response, rid).status == R.QUEUED
        ctx.draining.clear()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with sessions() as session:
                if session.get(Response, rid).status == R.COMPLETED:
                    break
            time.sleep(0.1)
        else:
            raise AssertionError("not served once ready")
    finally:
        ctx.stopping.set()
        ctx.writer.stop()


class EngineDied(Exception):
    """What vLLM's EngineDeadError is to its host."""


class CrashingEngine(ScriptedEngine):
    """Dies under every request, during its prefill (``prefilling``) or while it waited for a slot."""

    dead_errors = (EngineDied,)

    def __init__(self, prefilling: bool):
        super().__init__("")
        self.prefilling = prefilling

    def generate(self, request_id, prompt, params, window=0.0, max_tokens=None, on_delta=None, quiet=None,
                 opened=None):
        raise EngineDied()
        yield  # a generator, as the engine's

    def failed_prefilling(self, request_id):
        return self.prefilling


def new_task(sessions, on_restart="fail") -> str:
    with sessions() as session:
        who = factories.principal(session, "harden")
        response = lifecycle.new_response(principal=who, model=MODEL, request={
            "model": MODEL, "input": [{"type": "message", "role": "user", "content": "hi"}]}, input_tokens=5,
            max_tokens=64, status=R.IN_PROGRESS, stored=False, previous_response_id=None)
        task = lifecycle.new_task(response, on_restart)
        lifecycle.create_task(session, response, task, commit=True)
    return task.id


@pytest.mark.parametrize("prefilling", [True, False], ids=["killed-in-its-prefill", "waiting-for-a-slot"])
def test_a_request_that_kills_the_engine_in_its_prefill_fails_after_max_attempts(sessions, pg_url, tmp_path,
                                                                                  prefilling):
    """Defect 5: a poison request is run again at most LMSP_MAX_ATTEMPTS (3) times, then fails
    generation_failed saying why; a crash is counted only against the request being prefilled."""
    from common.broker import make_celery
    from common.tables import Task

    ctx = worker_ctx(sessions, pg_url, CrashingEngine(prefilling))
    ctx.celery = make_celery(Settings(home=tmp_path, database_url=pg_url))
    task_id = new_task(sessions)
    try:
        for run in range(1, 6):
            runner.run_task(ctx, task_id)
            with sessions() as session:
                task = session.get(Task, task_id)
            if prefilling and run >= 3:
                assert task.status == "failed" and task.error["code"] == "generation_failed", task.error
                assert "LMSP_MAX_ATTEMPTS" in task.error["detail"]
                break
            assert task.status == "loading" and task.worker_id is None, (run, task.status)  # queued again
    finally:
        ctx.stopping.set()
        ctx.writer.stop()


def test_a_direct_finish_racing_an_abort_ends_with_one_consistent_outcome(sessions):
    """Defect 9: _finish_direct read the status without a lock, so an abort committing meanwhile left a
    cancelled row whose published final event said completed. With the row locked, the finish waits and
    finishes the cancellation."""
    import threading

    rid = direct_response(sessions)
    with sessions() as session:
        attempt, _ = lifecycle.claim_direct(session, rid, "w-race")
        session.commit()
    aborting = sessions()
    lifecycle.abort_direct(aborting, rid)  # holds the row until it commits
    outcome = {}

    def finish():
        with sessions() as session:
            outcome["publish"] = lifecycle.finish(session, attempt, R.COMPLETED, seq=events.Sequence(1), emitted=[],
                                                  output=[], usage={"input_tokens": 1, "output_tokens": 1,
                                                                    "total_tokens": 2}, logged=False)
            session.commit()

    thread = threading.Thread(target=finish)
    thread.start()
    time.sleep(1)
    aborting.commit()
    aborting.close()
    thread.join(30)
    with sessions() as session:
        status = session.get(Response, rid).status
    assert (status, outcome["publish"][rid][-1][1]) == (R.CANCELLED, events.CANCELLED)


def test_the_engine_watch_reloads_after_a_pass_that_failed_half_way(sessions, pg_url):
    """Defect 2: the engine dies while Postgres is unreachable; the watch's first pass fails (its
    heartbeat cannot be written). The next pass must still load a new engine, not return early for good
    (no engine, never exiting, /healthz 200)."""
    from sqlalchemy.exc import SQLAlchemyError

    from worker import engine_watch

    dead = ScriptedEngine("")
    dead.dead = True
    loaded = []
    ctx = worker_ctx(sessions, pg_url, dead)
    ctx.hosts.primary.load = lambda: loaded.append(ScriptedEngine("")) or loaded[-1]
    ctx.sessions = session_factory(make_engine("postgresql://postgres@127.0.0.1:1/down"))  # refused
    try:
        try:
            engine_watch.watch_engine(ctx)
        except SQLAlchemyError:
            pass  # the loop around it logs this and calls it again
        ctx.sessions = sessions  # Postgres is back
        engine_watch.watch_engine(ctx)
        assert loaded and ctx.hosts.primary.engine is loaded[-1] and ctx.engine_ok.is_set()
    finally:
        ctx.stopping.set()
        ctx.writer.stop()


def test_the_engine_watch_loads_again_when_a_new_engine_fails_to_start(sessions, pg_url, monkeypatch):
    """Issue 21's chaos run (seed 7177): the new engine's core was killed while it started; the worker
    exited (71) at once, although another load would have worked. It exits only after
    ENGINE_RELOAD_SECONDS without an engine."""
    from worker import engine_watch

    def exit_(code):
        raise AssertionError(f"the worker exited ({code})")

    monkeypatch.setattr(engine_watch.os, "_exit", exit_)
    dead = ScriptedEngine("")
    dead.dead = True
    dead.shutdown = lambda: None
    tries = []

    def new_engine():
        tries.append(1)
        if len(tries) == 1:
            raise RuntimeError("Engine core initialization failed. See root cause above.")
        return ScriptedEngine("")

    ctx = worker_ctx(sessions, pg_url, dead)
    ctx.hosts.primary.load = new_engine
    try:
        engine_watch.watch_engine(ctx)
        assert not ctx.engine_ok.is_set() and ctx.hosts.primary.engine is None  # not claiming yet
        engine_watch.watch_engine(ctx)
        engine = ctx.hosts.primary.engine
        assert len(tries) == 2 and engine is not None and engine is not dead and ctx.engine_ok.is_set()
    finally:
        ctx.stopping.set()
        ctx.writer.stop()


def test_attempt_n_held_by_two_workers_logs_only_the_current_ones_events(sessions):
    """Defect 9 on Postgres' group commit: a claim lost by a database crash let another worker claim the
    same attempt number; only the worker that holds the task now may log."""
    from sqlalchemy import update

    from common.tables import Task

    task_id = new_task(sessions)
    with sessions() as session:
        first = lifecycle.claim(session, task_id, "w-lost")[0].attempt
        session.commit()
        session.execute(update(Task).where(Task.id == task_id).values(status="queued", worker_id=None,
                                                                       attempt=Task.attempt - 1))
        session.commit()
        second = lifecycle.claim(session, task_id, "w-now")[0].attempt
        session.commit()
        assert first.number == second.number
        refused = lifecycle.append(session, {first: [(2, events.TEXT_DELTA, "{}")],
                                             second: [(3, events.TEXT_DELTA, "{}")]})
        session.commit()
    assert refused == {first}


def test_after_a_refused_batch_no_later_event_of_its_attempt_is_logged(sessions):
    """A batch the log refuses (a row already at one of its numbers) fails its attempt, which is being
    stopped: the batches it handed over meanwhile must not be logged after the gap, nor anyone else's
    be held up (seen as a log 1..24, 29 in the foreign-row fault test once commits carried more)."""
    import threading

    from common import eventlog
    with sessions() as session, session.begin():
        victim, other = (factories.task(session, "running") for _ in range(2))
        eventlog.append(session, victim.response_id, [(1, "x.foreign", "{}")])
    victim, other = (lifecycle.Attempt(t.response_id, t.id, 1, "factory-worker") for t in (victim, other))
    lost = []
    writer = EventWriter(sessions, Recorder(), lambda attempt, error: lost.append((attempt, error)),
                         threading.Event())
    try:
        delta = (events.TEXT_DELTA, '{"delta": "x"}')
        writer.submit(victim, [(1, *delta), (2, *delta)])
        writer.submit(other, [(1, *delta)])
        writer.flush()
        writer.submit(victim, [(3, *delta)])
        writer.submit(other, [(2, *delta)])
        writer.flush()
    finally:
        writer.stop()
    assert [(a, e["code"]) for a, e in lost] == [(victim, "generation_failed")]
    with sessions() as session:
        assert [e[:2] for e in eventlog.read(session, victim.response_id, 0)] == [(1, "x.foreign")]
        assert [e[0] for e in eventlog.read(session, other.response_id, 0)] == [1, 2]
