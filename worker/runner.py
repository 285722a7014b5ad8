"""Running one response on the engine: claim, stream events, finish with exactly one final event.

Every write goes through ``common.lifecycle`` with this worker's attempt, so a
worker that lost its task stops at its next write (docs/architecture.md, invariant 4).
"""

import json
import logging
import os
import time
from functools import partial
from types import SimpleNamespace

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from common import events, lifecycle, liveness, logs, timeline
from common.broker import BACKGROUND, dispatch
from common.errors import problem
from common.events import AttemptStarted, ResponseCreated, Sequence
from common.lifecycle import Attempt, Fenced
from common.prompt import count_tokens, render, tool_call_schema, tool_mode
from common.protocol import ResponseRequest
from common.registry import queue_name
from common.resources import response_object
from common.states import LIVE, QUEUED, TASK_OUTCOME, R
from common.tables import Response, Task
from worker import apart, metrics
from worker.context import WorkerContext
from worker.gate import GenParams
from worker.output import OutputBuilder
from worker.residency import Closed, Unservable

log = logging.getLogger("lmsp.runner")
TASK_PRIORITY, DIRECT_PRIORITY = 1, 0  # vLLM serves lower values first: people at a screen go first
# For the benchmark only (tests/bench B4, B6): a file that gets "response_id seq t tokens" for each text
# delta, t being when the engine gave its first token: a follower's lag is measured from the token,
# and the tokens per second the engine delivers.
_TOKEN_TIMES = os.environ.get("LMSP_TRACE_TOKEN_TIMES")


class EngineStopped(Exception):
    """The worker is shutting down; the task stays unfinished for its restart policy."""


class EngineLost(Exception):
    """The engine died under this request; the attempt is handed on, not failed. ``suspect``: the request
    was in the engine then (prefilling or decoding), so it may be what killed it (worker/apart.py)."""

    def __init__(self, suspect: bool = False):
        super().__init__()
        self.suspect = suspect


class Job:
    def __init__(self, ctx: WorkerContext, attempt: Attempt, response: Response, seq: Sequence, engine):
        self.ctx = ctx
        self.spec = ctx.spec(response.model)
        self.engine = engine
        self.attempt = attempt
        self.rid = response.id
        self.response = response
        self.req = ResponseRequest.model_validate(response.request)
        self.seq = seq  # this response's numbering (after the log, or from #1), its final event's too
        self.logged = attempt.task_id is not None or ctx.log_direct
        self.entry = ctx.register(attempt)
        self.created_at: float | None = None  # the task's, for its timeline's phase metrics
        self.points: dict = {}  # this attempt's timeline so far (common/timeline.py), Unix seconds
        self.window_since = 0.0  # wall time of the oldest token not yet emitted (LMSP_TRACE_TOKEN_TIMES)
        self.window_tokens = 0
        self.rank = 0.0  # the task's virtual finish: its place in the engine's admission (worker/gate.py)
        # The generation so far (``_run``, ``_generate``).
        self.output_tokens, self.finish_reason, self.started, self.first_token_at = 0, None, False, 0.0

    # -- event plumbing ---------------------------------------------------------------------
    def emit(self, emitted) -> None:
        batch = self.seq.number(emitted)
        if not batch:
            return
        if not self.logged and not self.ctx.publisher.publish(self.rid, batch):
            # Redis is away: this direct stream goes on through the log, where its followers look then.
            self.logged = True
        if self.logged:
            self.ctx.writer.submit(self.attempt, batch)
        if _TOKEN_TIMES:
            _trace(self.rid, batch, self.window_since, self.window_tokens)

    # -- generation ---------------------------------------------------------------------------
    def constrained(self) -> bool:
        return tool_mode(self.req) not in ("none", "auto") or self.req.json_schema is not None

    def builder(self) -> OutputBuilder:
        mode = {"none": "text", "auto": "tool_auto"}.get(tool_mode(self.req), "tool_forced")
        return OutputBuilder(self.rid, mode, reasoning=self.spec.reasoning_parser is not None)

    def run(self, builder: OutputBuilder, prior_output_tokens: int = 0, prompt_ids: list[int] | None = None,
            alone: bool = False) -> None:
        """``prompt_ids``: the prompt as the api tokenized it (a direct request's message), used instead
        of rendering and tokenizing it again when nothing is to be continued. ``alone``: a suspect of an
        engine crash, run with nothing else in the engine (worker/apart.py)."""
        try:
            with apart.of(self.engine).turn(alone, self.ctx.stopping):
                self._run(builder, prior_output_tokens, prompt_ids)
        except apart.Stopped:
            raise EngineStopped() from None
        finally:
            self.ctx.release(self.attempt)
            self.ctx.writer.forget(self.attempt)  # every end, fenced and engine losses too

    def _run(self, builder: OutputBuilder, prior_output_tokens: int, prompt_ids: list[int] | None) -> None:
        ctx, entry = self.ctx, self.entry
        engine = self.engine
        max_tokens = self.response.max_tokens - prior_output_tokens
        params, prompt = self._request(builder, max_tokens, prompt_ids)
        self.output_tokens, self.finish_reason, self.started, error = prior_output_tokens, None, False, None
        began = self.first_token_at = time.monotonic()
        with ctx.lock:
            entry.request_id = f"{self.rid}:{self.attempt.number}:{time.monotonic_ns()}"
            entry.engine = engine
        try:
            if max_tokens <= 0:
                self.finish_reason = "length"
            elif not (entry.cancelled or entry.fenced):
                self._generate(builder, prompt, params)
        except Fenced:
            entry.fenced = True
        except Exception as exc:  # noqa: BLE001 - any engine failure ends the response as failed
            if ctx.stopping.is_set():
                raise EngineStopped() from exc
            if engine.dead or isinstance(exc, engine.dead_errors):
                raise EngineLost(self.started or engine.failed_prefilling(entry.request_id)) from exc
            log.exception("generation failed for %s", self.rid)
            error = problem("generation_failed", f"The engine failed: {type(exc).__name__}")
        if self.started:
            metrics.observe_generation(self.spec.id, "task" if self.attempt.task_id else "direct",
                                       self.first_token_at - began, self.output_tokens - prior_output_tokens,
                                       time.monotonic() - self.first_token_at)
        if entry.fenced:
            return
        if ctx.stopping.is_set() and not entry.cancelled and self.finish_reason is None:
            raise EngineStopped()
        if entry.cancelled or self.finish_reason == "abort":
            status = R.CANCELLED
            # (a direct response's client went away, or a task was cancelled: operators see why it stopped)
            log.info("%s %s stopped: cancelled after %d output tokens", "task" if self.attempt.task_id else
                     "direct response", self.rid, self.output_tokens)
        elif error is not None:
            status = R.FAILED
        elif self.finish_reason == "length":
            status = R.INCOMPLETE
        else:
            status = R.COMPLETED
        emitted = builder.finish(cut=status in (R.INCOMPLETE, R.CANCELLED)) if status != R.FAILED else []
        usage = {"input_tokens": self.response.input_tokens, "output_tokens": self.output_tokens,
                 "total_tokens": self.response.input_tokens + self.output_tokens}
        self.finish(status, emitted, builder.items, usage, error)

    def _request(self, builder: OutputBuilder, max_tokens: int, prompt_ids: list[int] | None):
        """The engine's parameters and the prompt: rendered again when output is to be continued."""
        schema = tool_call_schema(self.req) or self.req.json_schema
        temperature = self.req.temperature if self.req.temperature is not None else self.spec.default_temperature
        params = GenParams(max_tokens=max(max_tokens, 1), temperature=temperature, json_schema=schema,
                           priority=TASK_PRIORITY if self.attempt.task_id else DIRECT_PRIORITY, rank=self.rank,
                           seed=self.req.seed, stop=self.req.stop)
        prompt = prompt_ids if prompt_ids and not builder.raw else render(self.engine.tokenizer(), self.req,
                                                                          continuation=builder.raw)
        return params, prompt

    def _generate(self, builder: OutputBuilder, prompt, params: GenParams) -> None:
        """The engine's deltas as events, a window of tokens at a time, until it finishes or the
        response is cancelled, fenced or cannot be written."""
        ctx, settings, entry = self.ctx, self.ctx.settings, self.entry
        # A person reading a stream gets every token at once; a task's log and a non-streamed response
        # get them a few at a time: per event, a row, a publish and a wake-up of every follower.
        streamed = self.attempt.task_id is None and self.req.stream
        window = (settings.delta_window_ms if streamed else settings.task_delta_window_ms) / 1000
        submitted_at = time.time()
        # The host merges the engine's deltas over the window (its first one at once): one a window here.
        # A logged stream's windows after its first are taken on the engine's loop thread (``on_delta``),
        # so no thread is woken for them; a streamed response's go on here (its publish waits for Redis).
        take = partial(self._take, builder)
        handed = self.logged and not streamed
        # Unfollowed, a task's windows are quiet (gate.Deltas): the writer tells them of its audience.
        quiet = settings.task_quiet_window_ms / 1000 if handed else None
        for delta in self.engine.generate(entry.request_id, prompt, params, window, settings.delta_max_tokens,
                                          on_delta=take if handed else None, quiet=quiet,
                                          opened=partial(setattr, entry, "deltas")):
            if not self.started:
                self.started, self.first_token_at = True, time.monotonic()
                marks = {"submitted_at": submitted_at, "admitted_at": delta.admitted_at,
                         "first_token_at": time.time()}
                if self.attempt.task_id is not None and not ctx.write(partial(self._start, marks=marks)):
                    entry.cancelled = True
                    break
            if not take(delta):
                break
        if self.started:
            self.points["last_token_at"] = time.time()

    def _take(self, builder: OutputBuilder, delta) -> bool:
        """A window's Delta as events; False once the response is to stop (cancelled, fenced, or its
        events refused). On the consumer's thread, or on the engine's loop thread (``_generate``)."""
        self.window_since, self.window_tokens = delta.since, delta.token_ids
        self.output_tokens += delta.token_ids
        self.ctx.tokens.add(delta.token_ids)
        self.emit(builder.feed(delta.text))
        self.finish_reason = delta.finish_reason or self.finish_reason
        entry = self.entry
        return not (entry.cancelled or entry.fenced or entry.write_error)

    def _start(self, session, *, marks: dict) -> bool:
        """loading -> running, with the attempt's points up to its first token."""
        self.points.update(marks)
        timeline.record(session, self.attempt, **marks)
        return lifecycle.start(session, self.attempt)

    # -- the one final event ---------------------------------------------------------------------
    def finish(self, status: R, emitted, output, usage, error) -> None:
        ctx, entry = self.ctx, self.entry
        if self.logged:
            ctx.writer.flush()  # every earlier event is in the log (or refused) before the final one
        lag = ctx.writer.commit_lag(self.attempt)
        at = self.seq.last
        try:
            if entry.write_error is None:
                publish = ctx.write(lambda s: self._finish(s, at, status, emitted, output, usage, error, lag))
                if self.attempt.task_id is not None:
                    final = json.loads(next(iter(publish.values()))[-1][2])  # a cancel may have won
                    metrics.TASKS_FINISHED.labels(model=self.spec.id, status=TASK_OUTCOME[final["status"]]).inc()
                    self._observe_timeline()
                return
        except IntegrityError:
            entry.write_error = problem("generation_failed", "the final event collides with one already logged")
        except Fenced:
            log.warning("%s: attempt %s was taken over before it finished; its outcome is dropped",
                        self.attempt.task_id or self.rid, self.attempt.number)
            return
        try:
            used = (usage or {}).get("total_tokens")
            ctx.write(lambda s: lifecycle.fail_write(s, self.attempt, entry.write_error, used))
        except Fenced:
            pass

    def _finish(self, session, at: int, status, emitted, output, usage, error, lag):
        self.seq.last = at  # a transaction replayed (its commit's reply lost) numbers the same events again
        if self.attempt.task_id is not None:
            self.points["finished_at"] = time.time()
            timeline.record(session, self.attempt, last_token_at=self.points.get("last_token_at"),
                            finished_at=self.points["finished_at"], commit_lag=lag)
        return lifecycle.finish(session, self.attempt, status, seq=self.seq, emitted=emitted,
                                output=output, usage=usage, error=error, logged=self.logged)

    def _observe_timeline(self) -> None:
        """This attempt's phases as this process saw them (up to its final transaction)."""
        if self.created_at is not None and "claimed_at" in self.points:
            point = SimpleNamespace(**{name: self.points.get(name) for name in timeline.POINTS})
            metrics.observe_timeline(self.spec.id, timeline.durations(
                self.created_at, self.points["finished_at"], [point]))


def _trace(rid: str, batch, since: float, tokens: int) -> None:
    deltas = [seq for seq, name, _ in batch if name == events.TEXT_DELTA]
    with open(_TOKEN_TIMES, "a") as f:  # the window's tokens on its first delta
        f.writelines(f"{rid} {seq} {since:.6f} {tokens if i == 0 else 0}\n" for i, seq in enumerate(deltas))


def run_task(ctx: WorkerContext, task_id: str, model: str | None = None) -> None:
    """A broker delivery: claim its task if handed on mid-run, else the queue's next in fair-share order
    (lifecycle.claim); nothing when the queue is empty (a duplicate, a cancelled task's message).
    ``model``: the task's, as its queue says (else read from the database)."""
    with logs.bound(task_id=task_id):
        if model is None:
            with ctx.sessions() as session:
                model = session.execute(select(Task.model).where(Task.id == task_id)).scalar()
        if model not in ctx.hosts.slots:
            log.warning("task %s is not of a model this worker serves (%s); dropped", task_id, model)
            return
        if model not in ctx.hosts.loaded() and not _claimable(ctx, task_id, model):
            return  # nothing a claim could take (a copy of a message whose work ran): no model load for it
        _run_task(ctx, task_id, model)


def _claimable(ctx: WorkerContext, task_id: str, model: str) -> bool:
    """Whether a claim could take a task now: the message's own, handed on and unowned, or any queued
    task of its model (the claim takes the queue's next in fair-share order, not always the message's)."""
    with ctx.sessions() as session:
        own = session.execute(select(Task.status, Task.worker_id).where(Task.id == task_id)).one_or_none()
        if own is not None and own.status in LIVE and own.worker_id is None:
            return True
        return session.execute(select(Task.id).where(Task.model == model, Task.status == QUEUED)
                               .limit(1)).first() is not None


def _run_task(ctx: WorkerContext, task_id: str, model: str) -> None:
    if not ctx.ready():
        # Not claiming (engine down, draining): give the message back for another worker, or for us
        # once ready again, without spinning.
        ctx.stopping.wait(1.0)
        dispatch(ctx.celery, queue_name(model), {"task_id": task_id}, BACKGROUND)
        return
    try:
        # A cold model is loaded first (worker/residency.py): the task stays queued meanwhile, so a
        # worker that stops or unloads the model before its turn loses nothing (the load shows in the
        # timeline's queue phase).
        with ctx.hosts.use(model, ctx.stopping) as engine:
            _claim_and_run(ctx, task_id, model, engine)
    except Closed:
        raise EngineStopped() from None
    except Unservable as exc:
        _fail_unservable(ctx, task_id, model, str(exc))


def _fail_unservable(ctx: WorkerContext, task_id: str, model: str, cause: str) -> None:
    """A model whose load failed too often here (worker/residency.py): the message's claim takes the
    queue's next task of it and fails it ``model_unavailable`` naming the cause, unless another live
    worker serves the model (then the sweeper's re-send reaches it)."""
    with ctx.sessions() as session:
        if liveness.live_workers(session, ctx.settings.lease_seconds).get(model, 0):
            return
    error = problem("model_unavailable", f"The model cannot be loaded: {cause}")

    def tx(session):
        claimed, publish = lifecycle.claim(session, task_id, ctx.worker_id, model=model)
        if claimed is None:
            return None, publish
        log.warning("task %s failed: %s is unservable", claimed.task.id, model)
        return claimed.task.id, {**publish, **lifecycle.fail_write(session, claimed.attempt, error, 0)}

    ctx.write(tx)


def _claim_and_run(ctx: WorkerContext, task_id: str, model: str, engine) -> None:
    points = {"delivered_at": time.time()}
    tries = 0

    def claim(session):
        nonlocal tries
        tries += 1  # a replay: the first commit's reply may have been lost after it committed
        return _claim(session, ctx, task_id, model, points, retried=tries > 1)

    claimed = ctx.write(claim)[0]
    if claimed is None or ctx.running(claimed.attempt):
        return  # a thread here runs this very attempt: its claim was lost by a database crash, then redone
    with logs.bound(task_id=claimed.task.id):  # not always the message's own
        _run_claimed(ctx, claimed, points, engine)


def _run_claimed(ctx: WorkerContext, claimed, points: dict, engine) -> None:
    task_id = claimed.task.id
    job = None
    try:
        job = Job(ctx, claimed.attempt, claimed.response, claimed.sequence(), engine)
        job.created_at, job.points, job.rank = claimed.task.created_at, points, claimed.task.virtual_finish
        builder = job.builder()
        prior_tokens = 0
        if not claimed.fresh:
            if claimed.task.on_restart == "resume" and not job.constrained():
                # The snapshot is the latest attempt's logged output (6: resume is real).
                for _, name, data in _latest_attempt(claimed.log):
                    builder.replay(name, json.loads(data))
                prior_tokens = count_tokens(engine.tokenizer(), builder.raw) if builder.raw else 0
            else:
                # Constrained output cannot continue a partial JSON: a fresh attempt, marked as one and
                # numbered as a client counts them (the fencing token also counts hand-overs).
                runs = 2 + sum(1 for _, name, _ in claimed.log if name == events.ATTEMPT_STARTED)
                job.emit([AttemptStarted(response_id=job.rid, attempt=runs)])
        job.run(builder, prior_tokens, alone=claimed.task.crashes > 0)
    except EngineStopped:
        raise  # the task stays with its attempt: the drain or the next boot hands it on
    except Exception as exc:  # noqa: BLE001 - a bug must not leave a claimed task unfinished forever
        # What the attempt used, for its fair share (lifecycle.hand_on): unknown before its first token.
        used = job.response.input_tokens + job.output_tokens if job is not None and job.started else None
        if isinstance(exc, EngineLost) or engine.dead or not ctx.engine_ok.is_set():
            crashed = isinstance(exc, EngineLost) and exc.suspect
            apply_restart_policy(ctx, task_id, claimed.attempt.number, f"The engine of worker {ctx.worker_id} "
                                 "failed", unstarted_again=True,
                                 crashed_after=ctx.settings.max_attempts if crashed else None, used=used)
            return
        log.exception("task %s failed unexpectedly", task_id)
        error = problem("generation_failed", "The worker failed on this task; the error is logged")
        try:
            ctx.write(lambda s: lifecycle.fail_write(s, claimed.attempt, error, used))
        except Fenced:
            pass


def _claim(session, ctx: WorkerContext, task_id: str, model: str, points: dict, retried: bool = False):
    """The claim, and its attempt's first points on the timeline, in one transaction (committed with the
    claim: on Postgres one round trip)."""
    return lifecycle.claim(session, task_id, ctx.worker_id, model=model, retried=retried,
                           busy=frozenset(ctx.running_ids()), points=points, commit=True)


def _latest_attempt(log_events):
    marks = [i for i, (_, name, _) in enumerate(log_events) if name == events.ATTEMPT_STARTED]
    return log_events[marks[-1] + 1:] if marks else log_events


def apply_restart_policy(ctx: WorkerContext, task_id: str, attempt: int | None, why: str, **kw) -> None:
    """A task's attempt ended without an outcome: hand it on by its on_restart policy
    (``lifecycle.hand_on``, in its own transaction), count how, and send its message if it waits again."""
    error = lifecycle.restarted_error(f"{why}; submit it again (or use on_restart retry/resume)")

    def tx(session):
        send, publish = lifecycle.hand_on(session, task_id, error=error, attempt=attempt, **kw)
        task = session.get(Task, task_id)
        return (send, task.model, task.on_restart, task.status), publish

    (send, model, policy, status), publish = ctx.write(tx)
    if send or publish:
        outcome = {"cancelled": "cancelled", "failed": "failed"}.get(status, "requeued")
        metrics.POLICY_OUTCOMES.labels(model=model, policy=policy, outcome=outcome).inc()
    if send:  # it waits for a worker of its model, at the front of the queue
        dispatch(ctx.celery, queue_name(model), {"task_id": task_id}, BACKGROUND - 1)


def run_direct(ctx: WorkerContext, model: str, response_id: str, prompt_ids: list[int] | None = None,
               logged: bool = False) -> None:
    """``logged``: the api's stream is not subscribed to the channel (interactive_wire.encode)."""
    with logs.bound(response_id=response_id):
        try:
            with ctx.hosts.use(model, ctx.stopping) as engine:  # loaded first if cold: worker/interactive.py
                _run_direct(ctx, model, engine, response_id, prompt_ids, logged)
        except Closed:
            raise EngineStopped() from None


def _run_direct(ctx: WorkerContext, model: str, engine, response_id: str, prompt_ids: list[int] | None,
                logged: bool) -> None:
    claimed = ctx.write(lambda s: lifecycle.claim_direct(s, response_id, ctx.worker_id, model, commit=True))
    if claimed is None:
        return
    attempt, response = claimed
    job = Job(ctx, attempt, response, Sequence(), engine)
    job.logged = job.logged or logged
    job.emit([ResponseCreated(response_id=response_id, response=response_object(response))])
    try:
        job.run(job.builder(), prompt_ids=prompt_ids)
    except EngineStopped:
        raise  # the drain (or the next boot) fails it: recovery.fail_direct_of
    except EngineLost:
        # A direct stream cannot be resumed: its client gets response.failed and may send it again.
        job.finish(R.FAILED, [], None, None, lifecycle.restarted_error(
            "The engine serving this response failed; send the request again"))
    except Exception:  # noqa: BLE001 - as for tasks: whatever failed, its client must get a final event
        # e.g. an output the database refuses (a NUL in a tool call's name): left in_progress under a
        # live worker, the api's watch would never end the stream.
        log.exception("direct response %s failed unexpectedly", response_id)
        job.finish(R.FAILED, [], None, None, problem(
            "generation_failed", "The worker failed on this response; the error is logged"))
