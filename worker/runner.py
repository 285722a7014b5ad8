"""Running one response on the engine: claim, stream events, finish with exactly one final event."""

import json
import logging
import time
from contextlib import contextmanager

from sqlalchemy import select, update

from common import eventlog, events
from common.db import retrying
from common.errors import problem
from common.events import dumps
from common.prompt import count_tokens, render, tool_call_schema, tool_mode
from common.protocol import ResponseRequest
from common.states import CANCELLED, CANCELLING, FAILED, LOADING, QUEUED, RUNNING, SUCCEEDED, transition
from common.tables import Response, Task
from worker.context import Inflight, WorkerContext
from worker.engine import GenParams
from worker.output import OutputBuilder

log = logging.getLogger("lmsp.runner")
TASK_PRIORITY, DIRECT_PRIORITY = 1, 0  # vLLM serves lower values first: people at a screen go first


class EngineStopped(Exception):
    """The worker is shutting down; the task stays unfinished for its restart policy."""


class Job:
    def __init__(self, ctx: WorkerContext, response: Response, task: Task | None, start_seq: int):
        self.ctx = ctx
        self.task = task
        self.rid = response.id
        self.request_data = response.request
        self.req = ResponseRequest.model_validate({k: v for k, v in response.request.items()
                                                   if not k.startswith("_")})
        self.seq = start_seq
        self.logged = task is not None or ctx.log_direct
        self.attempt = task.attempt if task else 1

    # -- event plumbing ---------------------------------------------------------------
    def number(self, emitted) -> list[tuple[int, str, str]]:
        batch = []
        for name, data in emitted:
            self.seq += 1
            batch.append((self.seq, name, dumps(data)))
        return batch

    def emit(self, emitted) -> None:
        batch = self.number(emitted)
        if not batch:
            return
        if self.logged:
            self.ctx.writer.submit(self.rid, batch)
        else:
            self.ctx.publisher.publish(self.rid, batch)

    # -- generation ---------------------------------------------------------------------
    def builder(self) -> OutputBuilder:
        mode = {"none": "text", "auto": "tool_auto"}.get(tool_mode(self.req), "tool_forced")
        return OutputBuilder(self.rid, mode, reasoning=self.ctx.spec.reasoning_parser is not None)

    def run(self, builder: OutputBuilder, prior_output_tokens: int = 0) -> None:
        ctx, settings = self.ctx, self.ctx.settings
        tokenizer = ctx.engine.tokenizer()
        max_tokens = self.request_data["_max_tokens"] - prior_output_tokens
        schema = tool_call_schema(self.req) or self.req.json_schema
        temperature = self.req.temperature if self.req.temperature is not None else ctx.spec.default_temperature
        params = GenParams(max_tokens=max(max_tokens, 1), temperature=temperature, json_schema=schema,
                           priority=TASK_PRIORITY if self.task else DIRECT_PRIORITY)
        prompt = render(tokenizer, self.req, continuation=builder.raw)
        request_id = f"{self.rid}:{self.attempt}:{time.monotonic_ns()}"
        entry = Inflight(request_id, direct=self.task is None)
        with ctx.lock:
            ctx.inflight[self.rid] = entry
        output_tokens, finish_reason, error = prior_output_tokens, None, None
        window, max_window_tokens = settings.delta_window_ms / 1000, settings.delta_max_tokens
        pending, pending_tokens, last_flush, started = "", 0, 0.0, False
        try:
            if max_tokens <= 0:
                finish_reason = "length"
            else:
                for delta in ctx.engine.generate(request_id, prompt, params):
                    if not started:
                        started = True
                        if self.task is not None and not self._mark_running():
                            entry.cancelled = True
                            break
                    output_tokens += delta.token_ids
                    pending += delta.text
                    pending_tokens += delta.token_ids
                    now = time.monotonic()
                    if delta.finish_reason or now - last_flush >= window or pending_tokens >= max_window_tokens:
                        self.emit(builder.feed(pending))
                        pending, pending_tokens, last_flush = "", 0, now
                    finish_reason = delta.finish_reason or finish_reason
                    if entry.cancelled:
                        break
                if pending:
                    self.emit(builder.feed(pending))
        except Exception as exc:  # noqa: BLE001 - any engine failure ends the response as failed
            if ctx.stopping.is_set():
                raise EngineStopped() from exc
            log.exception("generation failed for %s", self.rid)
            error = problem("generation_failed", f"The engine failed: {type(exc).__name__}")
        finally:
            with ctx.lock:
                ctx.inflight.pop(self.rid, None)
        if ctx.stopping.is_set() and not entry.cancelled and finish_reason is None:
            raise EngineStopped()
        if entry.cancelled or finish_reason == "abort":
            status = "cancelled"
        elif error is not None:
            status = "failed"
        elif finish_reason == "length":
            status = "incomplete"
        else:
            status = "completed"
        emitted = builder.finish() if status != "failed" else []
        usage = {"input_tokens": self.request_data["_input_tokens"], "output_tokens": output_tokens,
                 "total_tokens": self.request_data["_input_tokens"] + output_tokens}
        self.finish(status, emitted, builder.items, usage, error)

    def _mark_running(self) -> bool:
        """loading -> running at the first token; False when a cancel got there first."""
        def attempt():
            with self.ctx.sessions() as session:
                won = transition(session, self.task.id, RUNNING, only_from=[LOADING])
                session.commit()
                # A recovered task may already be running: that is ours to continue.
                return won or session.get(Task, self.task.id).status == RUNNING
        return retrying(attempt, log=log)

    # -- the one final event ----------------------------------------------------------------
    def finish(self, status: str, emitted, output, usage, error) -> None:
        ctx = self.ctx
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        if self.logged:
            ctx.writer.flush()  # every earlier event is in the log before the final one
        first_seq = self.seq

        def attempt(status=status):
            self.seq = first_seq  # a replayed transaction numbers its events again
            with ctx.sessions() as session:
                if self.task is not None:
                    status = self._finish_task(session, status, error)
                    if status is None:
                        session.rollback()
                        return None  # someone else finished it (a sweeper after a lease expiry)
                else:
                    won = session.execute(update(Response).where(
                        Response.id == self.rid, Response.status == "in_progress").values(status=status)).rowcount
                    if not won:
                        status = "cancelled"  # the client went away and the api marked it
                name, data = events.final(self.rid, status, usage=usage if status != "cancelled" else None,
                                          error=error, incomplete_details=incomplete)
                batch = self.number(list(emitted) + [(name, data)])
                if self.logged:
                    eventlog.append(session, self.rid, batch)
                session.execute(update(Response).where(Response.id == self.rid).values(
                    status=status, output=output, usage=usage, error=error, incomplete_details=incomplete,
                    updated_at=time.time()))
                session.commit()
            return batch

        batch = retrying(attempt, log=log)
        if batch:
            ctx.publisher.publish(self.rid, batch)

    def _finish_task(self, session, status: str, error) -> str | None:
        task_id = self.task.id
        if status in ("completed", "incomplete"):
            if transition(session, task_id, SUCCEEDED, only_from=[RUNNING]):
                return status
        elif status == "failed":
            if transition(session, task_id, FAILED, only_from=[LOADING, RUNNING], error=error):
                return status
        # Cancelled, or a cancel won the race against completion: finish the cancellation.
        transition(session, task_id, CANCELLING, only_from=[LOADING, RUNNING])
        if transition(session, task_id, CANCELLED, only_from=[CANCELLING]):
            return "cancelled"
        return None


def run_task(ctx: WorkerContext, task_id: str) -> None:
    """A broker delivery: claim the queued task, or drop a duplicate."""
    def claim():
        with ctx.sessions() as session:
            won = transition(session, task_id, LOADING, only_from=[QUEUED], worker_id=ctx.worker_id,
                             attempt=Task.attempt + 1)
            session.commit()
            if not won:
                return None  # a duplicate delivery, or cancelled while queued
            task = session.get(Task, task_id)
            response = session.get(Response, task.response_id)
            return response, task, eventlog.max_seq(session, response.id)

    claimed = retrying(claim, log=log)
    if claimed is None:
        return
    with failing_on_error(ctx, task_id):
        job = Job(ctx, *claimed)
        job.run(job.builder())


@contextmanager
def failing_on_error(ctx: WorkerContext, task_id: str):
    """A bug must not leave a claimed task unfinished forever: fail it with one final event."""
    try:
        yield
    except EngineStopped:
        raise
    except Exception:
        log.exception("task %s failed unexpectedly", task_id)
        error = problem("generation_failed", "The worker failed on this task; the error is logged")
        with ctx.sessions() as session:
            task = session.get(Task, task_id)
            if transition(session, task_id, FAILED, only_from=[LOADING, RUNNING], error=error):
                batch = write_final(session, task.response_id, "failed", error)
                session.commit()
                ctx.publisher.publish(task.response_id, batch)


def write_final(session, response_id: str, status: str, error=None) -> list:
    """The final event of a response nobody is generating any more (its writer is gone)."""
    seq = eventlog.max_seq(session, response_id) + 1
    name, data = events.final(response_id, status, error=error)
    batch = [(seq, name, dumps(data))]
    eventlog.append(session, response_id, batch)
    session.execute(update(Response).where(Response.id == response_id).values(
        status=status, error=error, updated_at=time.time()))
    return batch


def run_recovered(ctx: WorkerContext, task_id: str, resume: bool) -> None:
    """Run again a task this worker owns after a restart: from the start, or from its log."""
    with ctx.sessions() as session:
        task = session.get(Task, task_id)
        if task is None or task.worker_id != ctx.worker_id or task.status not in (LOADING, RUNNING):
            return
        session.execute(update(Task).where(Task.id == task_id).values(attempt=Task.attempt + 1))
        session.commit()
        session.refresh(task)
        response = session.get(Response, task.response_id)
        logged = eventlog.read(session, response.id, 0, limit=10**9)
    with failing_on_error(ctx, task_id):
        job = Job(ctx, response, task, logged[-1][0] if logged else 0)
        builder = job.builder()
        prior_tokens = 0
        if resume:
            # The snapshot is the latest attempt's logged output: it began at output_index 0.
            starts = [i for i, (_, name, data) in enumerate(logged)
                      if name == events.ITEM_ADDED and json.loads(data)["output_index"] == 0]
            for _, name, data in logged[starts[-1]:] if starts else []:
                builder.replay(name, json.loads(data))
            prior_tokens = count_tokens(ctx.engine.tokenizer(), builder.raw) if builder.raw else 0
        job.run(builder, prior_tokens)


def run_direct(ctx: WorkerContext, response_id: str) -> None:
    with ctx.sessions() as session:
        won = session.execute(update(Response).where(
            Response.id == response_id, Response.status == "queued").values(
            status="in_progress", worker_id=ctx.worker_id)).rowcount
        session.commit()
        if not won:
            return
        response = session.get(Response, response_id)
    job = Job(ctx, response, None, 0)
    job.emit([(events.CREATED, events.created(response_id))])
    job.run(job.builder())


def unfinished_direct(ctx: WorkerContext) -> list[str]:
    with ctx.lock:
        ids = [rid for rid, entry in ctx.inflight.items() if entry.direct]
    if not ids:
        return []
    with ctx.sessions() as session:
        return list(session.execute(select(Response.id).where(
            Response.id.in_(ids), Response.status == "cancelled")).scalars())


def cancelling_tasks(ctx: WorkerContext) -> list[str]:
    with ctx.sessions() as session:
        return list(session.execute(select(Task.response_id).where(
            Task.worker_id == ctx.worker_id, Task.status == CANCELLING)).scalars())
