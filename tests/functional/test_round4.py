"""Issue 36's worker-side defects on real Postgres, with the real runner, writer and lifecycle and a
scripted engine (tests/functional/test_harden.py's harness): no engine load, no vLLM import. ~5 s."""

import time

from common import lifecycle
from common.tables import Task
from tests.functional.test_harden import EngineDied, ScriptedEngine, new_task, sessions, worker_ctx  # noqa: F401
from worker import runner
from worker.gate import Delta


class DiesInDecode(ScriptedEngine):
    """Generates a few tokens, then dies (not in the request's prefill)."""

    dead_errors = (EngineDied,)

    def __init__(self, before=None):
        super().__init__("")
        self.before = before  # called before it dies (a test fences the task there)

    def generate(self, request_id, prompt, params, window=0.0, max_tokens=None, on_delta=None, quiet=None,
                 opened=None):
        for i in range(4):
            yield Delta(text="a", token_ids=1, finish_reason=None, prompt_tokens=5)
            time.sleep(0.25)  # past a task's delta window: each token is a batch of its own
            if i == 1 and self.before:
                self.before()
        raise EngineDied()

    def failed_prefilling(self, request_id):
        return False


def _writer_keeps(ctx) -> int:
    ctx.writer.flush()
    with ctx.writer._cond:
        return len(ctx.writer._lags) + len(ctx.writer._refused) + len(getattr(ctx.writer, "_ended", ()))


def test_the_writers_maps_forget_attempts_that_end_without_finishing(sessions, pg_url, tmp_path):  # noqa: F811
    """Defect 5: an attempt lost with its engine, and one fenced (taken over) while it generated, leave
    nothing in the writer's maps (they kept one entry each for the life of the worker)."""
    from common.broker import make_celery
    from common.settings import Settings

    engine = DiesInDecode()
    ctx = worker_ctx(sessions, pg_url, engine)
    ctx.celery = make_celery(Settings(home=tmp_path, database_url=pg_url))
    try:
        lost = new_task(sessions, on_restart="fail")
        runner.run_task(ctx, lost)
        with sessions() as session:
            assert session.get(Task, lost).status == "failed"
        assert _writer_keeps(ctx) == 0

        fenced = new_task(sessions, on_restart="retry")

        def take_over():
            with sessions() as session:
                task = session.get(Task, fenced)
                lifecycle.hand_on(session, fenced, error={}, attempt=task.attempt)
                session.commit()
        engine.before = take_over  # its next batches are refused by the fence
        runner.run_task(ctx, fenced)
        assert _writer_keeps(ctx) == 0
    finally:
        ctx.stopping.set()
        ctx.writer.stop()


def test_a_task_of_a_model_whose_load_always_fails_ends_failed_naming_the_cause(sessions, pg_url):  # noqa: F811
    """Defect 2: the task stayed queued for ever (its message re-sent, each one retrying the load); now,
    after the bound (3 failures), it fails model_unavailable with the load's error in its detail."""
    import uuid

    from common.registry import ModelSpec
    from common.settings import Settings
    from tests import factories
    from tests.functional.test_harden import MODEL, Recorder
    from tests.harness import model_entry
    from worker.context import WorkerContext
    from worker.residency import Residency, Slot
    from worker.writer import EventWriter

    broken = f"smollm2:broken{uuid.uuid4().hex[:6]}"

    def load_broken():
        raise RuntimeError("CUDA out of memory (simulated)")
    hosts = Residency([Slot(ModelSpec(**model_entry(MODEL)), 1.0, lambda: ScriptedEngine("hi")),
                       Slot(ModelSpec(**model_entry(broken)), 1.0, load_broken)],
                      budget_gib=2.0, keep_alive=-1, retry_after=0.01)
    ctx = WorkerContext(settings=Settings(database_url=pg_url), worker_id=f"w-{time.monotonic_ns()}",
                        sessions=sessions, celery=None, publisher=Recorder(), writer=None, hosts=hosts)
    ctx.writer = EventWriter(sessions, ctx.publisher, ctx.lose, ctx.stopping)
    hosts.load(MODEL, ctx.stopping)
    ctx.engine_ok.set()
    with sessions() as session:
        who = factories.principal(session, "round4")
        response = lifecycle.new_response(principal=who, model=broken, request={
            "model": broken, "input": [{"type": "message", "role": "user", "content": "hi"}]}, input_tokens=5,
            max_tokens=64, status=lifecycle.R.IN_PROGRESS, stored=False, previous_response_id=None)
        task = lifecycle.new_task(response, "retry")
        lifecycle.create_task(session, response, task, commit=True)
    try:
        runner.run_task(ctx, task.id, broken)
        with sessions() as session:
            row = session.get(Task, task.id)
        assert row.status == "failed" and row.error["code"] == "model_unavailable", (row.status, row.error)
        assert "failed 3 times" in row.error["detail"] and "CUDA out of memory" in row.error["detail"]
        assert hosts.servable() == [MODEL] and hosts.loaded() == [MODEL]
    finally:
        ctx.stopping.set()
        ctx.writer.stop()


class PoisonEngine(ScriptedEngine):
    """Runs requests side by side, 12 tokens each; a prompt that says POISON kills the engine at its third
    decode step, and every request in it fails with it. Counts who was in the engine beside a poison."""

    dead_errors = (EngineDied,)

    def __init__(self):
        super().__init__("")
        import threading
        self.lock, self.inside, self.deaths, self.beside_poison, self.gather = threading.Lock(), set(), 0, [], 0

    def generate(self, request_id, prompt, params, window=0.0, max_tokens=None, on_delta=None, quiet=None,
                 opened=None):
        poison = "POISON" in prompt
        with self.lock:
            self.inside.add(request_id)
            deaths = self.deaths
        try:
            deadline = time.monotonic() + 3
            while len(self.inside) < self.gather and time.monotonic() < deadline:
                time.sleep(0.01)  # the first round: all in one batch
            for i in range(12):
                time.sleep(0.05)
                with self.lock:
                    if self.deaths != deaths:
                        raise EngineDied()
                    if poison and i == 2:
                        self.beside_poison.append(len(self.inside) - 1)
                        self.deaths += 1
                        raise EngineDied()
                yield Delta(text="a", token_ids=1, finish_reason="length" if i == 11 else None, prompt_tokens=5)
        finally:
            with self.lock:
                self.inside.discard(request_id)

    def failed_prefilling(self, request_id):
        return False


def _task(factory, text: str, on_restart: str) -> str:
    from common import lifecycle as lc
    from tests import factories
    from tests.functional.test_harden import MODEL
    with factory() as session:
        who = factories.principal(session, "round4")
        response = lc.new_response(principal=who, model=MODEL, request={
            "model": MODEL, "input": [{"type": "message", "role": "user", "content": text}]}, input_tokens=5,
            max_tokens=64, status=lc.R.IN_PROGRESS, stored=False, previous_response_id=None)
        task = lc.new_task(response, on_restart)
        lc.create_task(session, response, task, commit=True)
    return task.id


def test_a_request_that_kills_the_engine_in_decode_is_run_apart_and_capped(sessions, pg_url, tmp_path):  # noqa: F811
    """Defect 4: a crash in decode is counted against every request that was in the engine; those run
    alone next time, so the innocent one finishes and the poison kills only itself until the cap
    (3 crashes) fails it. Before, a decode-time crash counted against nobody: the poison was re-run with
    the others, killing them again, for ever."""
    import threading

    from common.broker import make_celery
    from common.settings import Settings

    engine = PoisonEngine()
    ctx = worker_ctx(sessions, pg_url, engine)
    ctx.celery = make_celery(Settings(home=tmp_path, database_url=pg_url))

    def run(*task_ids):
        threads = [threading.Thread(target=runner.run_task, args=(ctx, t)) for t in task_ids]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)

    def row(task_id):
        with sessions() as session:
            return session.get(Task, task_id)
    poison, innocent, bystander = (_task(sessions, "POISON", "retry"), _task(sessions, "hi", "retry"),
                                   _task(sessions, "hi", "fail"))
    try:
        engine.gather = 3
        run(poison, innocent, bystander)
        engine.gather = 0
        assert engine.beside_poison == [2]
        assert (row(poison).crashes, row(innocent).crashes) == (1, 1)
        assert row(bystander).status == "failed"  # its policy: it was running when the engine died
        for _ in range(4):
            if row(poison).status == "failed":
                break
            run(poison, innocent)
        assert engine.beside_poison[1:] == [0, 0], engine.beside_poison  # apart after the first crash
        assert row(innocent).status == "succeeded" and row(innocent).crashes == 1
        failed = row(poison)
        assert failed.status == "failed" and failed.crashes == 3 and "LMSP_MAX_ATTEMPTS" in failed.error["detail"]
    finally:
        ctx.stopping.set()
        ctx.writer.stop()
