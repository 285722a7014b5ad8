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

    def generate(self, request_id, prompt, params):
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
