"""What every engine host shares, without importing an engine: the request and output types, one
long-lived asyncio loop thread, and the admission gate.

``AsyncLLM`` binds to the asyncio loop that first uses it, and Celery has no asyncio pool, so an
engine lives on one long-lived loop in a daemon thread. Pool threads hand requests to that loop
with ``run_coroutine_threadsafe`` and read the streamed outputs from a ``Deltas`` channel, which
merges them over the consumer's window so its thread wakes once a window, not once a token; every
in-flight task is one concurrent engine request, which keeps continuous batching full.

Admission is ours: at most ``max_num_seqs`` requests are in the engine, the most urgent first: a
person's request, then tasks in the claim's fair-share order (their virtual finish times).
vLLM's priority scheduler preempts only when KV blocks run out, never for a batch slot, so a
person's request arriving at a full batch would wait for a background one to finish; instead the
host pauses the least urgent background request (aborts it, keeps its tokens) and resubmits it as
prompt + output so far once a slot frees (the prefix cache makes that cheap). Structured-output
requests are never paused: their grammar cannot restart mid-output.

Until a person's request has its first token, the step that computes it carries no less urgent
prefill: background requests not yet started are paused (they lose at most a partial prefill) and
none is admitted or resumed; on a CPU the running background decodes sit that step out too
(worker/vllm_scheduler.py). So its time to first token is what is left of the step under way plus
its own prompt, not a refill of the batch nor a step of the batch's decodes.

A host (``worker.engine.EngineHost`` for vLLM, ``worker.sim.SimEngine``) implements ``_pump`` (one
request: its prompt, then ``_admitted`` with what runs it once admitted) and ``_engine_abort`` (stop an
admitted request).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass
class GenParams:
    max_tokens: int
    temperature: float | None = None  # None -> the model's generation_config, else 1.0; 0 = greedy
    json_schema: dict | None = None  # structured output: constrain to this JSON schema
    stop_token_ids: list[int] | None = None
    stop: list[str] | None = None  # strings that end generation, left out of the text
    priority: int = 0  # lower value = served earlier (vLLM priority scheduling)
    rank: float = 0.0  # within a priority, lower is admitted first: a task's virtual finish (common/fairshare.py)
    seed: int | None = None
    ignore_eos: bool = False  # keep generating past EOS (benchmarks, equal-length tests)


@dataclass
class Delta:
    text: str  # new text since the previous Delta
    token_ids: int  # number of new output tokens in this delta
    finish_reason: str | None  # None while running; "stop" / "length" / "abort" at the end
    prompt_tokens: int  # number of prompt tokens (same on every delta)
    admitted_at: float | None = None  # when the request first got a slot in the batch (the task's timeline)
    since: float = 0.0  # wall time the engine gave its first token of this Delta (LMSP_TRACE_TOKEN_TIMES)


class Deltas:
    """One request's output, from the loop thread to its consumer, merged over a window.

    Handing each token over woke the consumer once a token (a thread switch and the GIL for every
    stream, every engine step); the consumer reads the log's deltas a window at a time anyway. So the
    loop only appends, and the consumer wakes when its window has passed, or at once for its first
    Delta, the last one, an error, or ``max_tokens`` piled up. Windows after the first end on a grid
    of the window's length, the same for every stream.

    Once the consumer hands the middle over (``hand_over``), no thread is woken for them at all: the
    loop thread gives each window's Delta to the consumer's handler itself, and the consumer waits
    only for the end.

    With a ``quiet`` window, the windows are that long while nobody follows the stream live
    (``audience``): its events then only go to the log and to polls, and a window's cost (its events,
    row, publish and commit share) is paid for several times the tokens. The first follower brings
    the short window back at once, its pending tokens delivered now."""

    def __init__(self, window: float = 0.0, max_tokens: int = 1 << 30, loop: asyncio.AbstractEventLoop | None = None,
                 quiet: float | None = None):
        """``loop``: the loop thread's, where a window a handler takes that no later Delta closes ends by
        a timer (its clock is ``time.monotonic``). ``quiet``: the window while unfollowed (its token cap
        grows by as much); None: the stream is always paced as followed."""
        self.window, self.max_tokens, self._loop = window, max_tokens, loop
        self._quiet = None if quiet is None or quiet <= window else \
            (quiet, max(max_tokens, int(max_tokens * quiet / window)) if window else max_tokens)
        self.followed = self._quiet is None  # until a publish says otherwise (``audience``)
        self._heard_at = float("-inf")  # when the report ``followed`` comes from was sent or heard
        self._cond = threading.Condition(threading.Lock())
        self._items: list[Delta | BaseException] = []
        self._tokens = 0
        self._wake_at = 0.0  # monotonic time from which any Delta wakes the consumer
        self._handler = None  # takes the middle Deltas on the loop thread, once handed over
        self._timer = None
        self._stopped = False  # the handler said stop: the consumer gets STOP

    def hand_over(self, handler) -> None:
        """(Consumer.) From now on each window's merged Delta but the last goes to ``handler(delta)``
        on the loop thread; ``get`` returns only the rest: the last Delta (with what is pending), an
        error, or ``STOP`` once ``handler`` returned False. An error ``handler`` raises is the
        consumer's, as from the engine."""
        with self._cond:
            self._handler = handler
            if self._items:  # put before this: their window needs its timer
                self._loop.call_soon_threadsafe(self._arm)

    def audience(self, listeners: int, at: float) -> None:
        """(Any thread.) How many live followers the stream's publish sent at ``at`` reached (or a
        follower's hint, 1, heard at ``at``; monotonic): none makes the windows after this one quiet;
        some end the current window now. A report older than one already applied is stale: a publish
        sent just before a follower subscribed counts none, and its reply can come after the hint."""
        followed = listeners > 0
        if self._quiet is None:
            return
        with self._cond:
            if at < self._heard_at:
                return
            self._heard_at = at
            if followed == self.followed:
                return
            self.followed = followed
        if followed and self._loop is not None:
            self._loop.call_soon_threadsafe(self._now_followed)

    def _now_followed(self) -> None:
        """(Loop thread.) A follower came: its window is now (what is pending goes at once)."""
        with self._cond:
            self._wake_at = 0.0
            if self._handler is not None:
                self._arm_locked()
            else:
                self._cond.notify()  # the consumer's wait for this window ends

    def put(self, item: Delta | BaseException) -> None:
        """(Loop thread.)"""
        with self._cond:
            if isinstance(item, Delta):
                item.since = item.since or time.time()
                self._tokens += item.token_ids
            self._items.append(item)
            if self._handler is None or _ends(item):
                if self._due(item):
                    self._cond.notify()
            else:
                self._arm_locked()

    def _arm(self) -> None:
        with self._cond:
            self._arm_locked()

    def _arm_locked(self) -> None:
        """(Loop thread, under the lock.) The handler's window: taken now if it is due, else at its end."""
        if not self._items or any(_ends(i) for i in self._items):
            return
        if self._due(self._items[-1]):
            self._flush()
        elif self._timer is None:
            self._timer = self._loop.call_at(self._wake_at, self._window_ended)

    def _due(self, item) -> bool:
        cap = self.max_tokens if self.followed else self._quiet[1]
        return (not isinstance(item, Delta) or item.finish_reason is not None or self._tokens >= cap
                or time.monotonic() >= self._wake_at)

    def _next_window(self) -> None:
        # Windows end on one clock for every stream: the writer's next commit then carries every
        # stream's window at once, as when the engine's step woke them all (windows of each stream's
        # own phase arrive one by one, a commit and a publish each).
        window = self.window if self.followed else self._quiet[0]
        self._wake_at = (time.monotonic() // window + 1) * window if window else 0.0
        self._tokens = 0

    def _window_ended(self) -> None:
        """(Loop thread, at a window's end.)"""
        with self._cond:
            self._timer = None  # a flush before it would have cancelled it: this window is the current one
            if self._items:
                self._flush()

    def _flush(self) -> None:
        """(Loop thread, under the lock.) The window's Deltas to the handler, unless what ends the stream
        is among them (the consumer takes them all then)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._stopped or any(_ends(i) for i in self._items):
            return
        taken, self._items = self._items, []
        self._next_window()
        try:
            go_on = self._handler(_merged(taken))
        except Exception as exc:  # noqa: BLE001 - the consumer's, as an engine error would be
            self._items.insert(0, exc)
            self._cond.notify()
            return
        if go_on is False:
            self._stopped = True
            self._cond.notify()

    def _wanted(self) -> bool:
        """(Under the lock.) What the consumer waits for is here."""
        if self._stopped:
            return True
        if self._handler is not None:
            return any(_ends(i) for i in self._items)
        return bool(self._items) and any(self._due(i) for i in self._items)

    def get(self) -> Delta | BaseException | object:
        """(Consumer thread.) Every Delta since the last get, merged; an error once those are taken;
        ``STOP`` once a handler said stop."""
        with self._cond:
            while not self._wanted():
                left = self._wake_at - time.monotonic()
                self._cond.wait(left if left > 0 and self._handler is None else None)  # past the window, a put wakes us
            if self._stopped:
                return STOP
            self._next_window()
            if not isinstance(self._items[0], Delta):
                return self._items.pop(0)
            n = next((k for k, i in enumerate(self._items) if not isinstance(i, Delta)), len(self._items))
            taken, self._items = self._items[:n], self._items[n:]
        return _merged(taken)


STOP = object()  # Deltas.get: the handler the middle was handed to said stop


def _ends(item) -> bool:
    """What a handler never takes: an error, or the last Delta."""
    return not isinstance(item, Delta) or item.finish_reason is not None


def _merged(deltas: list[Delta]) -> Delta:
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    return Delta(text="".join(d.text for d in deltas), token_ids=sum(d.token_ids for d in deltas),
                 finish_reason=last.finish_reason, prompt_tokens=last.prompt_tokens,
                 admitted_at=next((d.admitted_at for d in deltas if d.admitted_at is not None), None),
                 since=deltas[0].since)


class Request:
    """One generate() call as the admission gate sees it (touched only on the loop thread)."""

    _arrivals = itertools.count()

    def __init__(self, request_id: str, params: GenParams):
        self.request_id = request_id
        self.params = params
        self.order = (params.priority, params.rank, next(self._arrivals))  # lower is more urgent
        self.attempt = 0
        self.output_ids: list[int] = []  # delivered so far: a paused request resumes after them
        self.paused = False  # aborted by the gate, to be resubmitted
        self.cancelled = False  # abort(): end it, whether admitted or waiting
        self.slot: asyncio.Future | None = None  # set while waiting for admission
        self.admitted_at: float | None = None  # its first admission (Unix seconds)

    @property
    def engine_id(self) -> str:
        return self.request_id if self.attempt == 0 else f"{self.request_id}~{self.attempt}"

    def yields_to(self, other: Request) -> bool:
        return self.params.priority > other.params.priority

    def pausable_for(self, other: Request) -> bool:
        return self.yields_to(other) and self.params.json_schema is None

    def __lt__(self, other: Request) -> bool:
        return self.order < other.order


class GatedHost:
    """An engine on its own loop thread behind the admission gate."""

    # Exceptions from generate() that mean the engine itself is gone (the runner hands the task on).
    dead_errors: tuple[type[BaseException], ...] = ()

    def __init__(self, max_num_seqs: int, thread_name: str):
        self._max_seqs = max_num_seqs
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=thread_name, daemon=True)
        self._pumps: set[asyncio.Task] = set()  # touched only on the loop thread
        self._active: dict[str, Request] = {}  # admitted to the engine (loop thread)
        self._waiting: list[Request] = []  # a heap: the most urgent first (loop thread)
        self._first_pending: set[Request] = set()  # admitted, no output yet (loop thread)
        self._requests: dict[str, Request] = {}  # every request being generated (loop thread)
        self._failed_prefilling: set[str] = set()  # requests that were in their first step when it failed

    # -- to implement -----------------------------------------------------------------------------
    async def _pump(self, req: Request, prompt: str | list[int], out: Deltas) -> None:
        raise NotImplementedError

    async def _engine_abort(self, engine_id: str) -> None:
        raise NotImplementedError

    async def _close(self) -> None:
        """On the loop: end every request, then the engine."""
        raise NotImplementedError

    # -- the interface the worker uses -----------------------------------------------------------
    def generate(self, request_id: str, prompt: str | list[int], params: GenParams, window: float = 0.0,
                 max_tokens: int = 1 << 30, on_delta=None, quiet: float | None = None, opened=None) -> Iterator[Delta]:
        """Stream one request's output, merged over ``window`` seconds (or ``max_tokens``) after the first
        Delta; it is submitted on the first next(). ``on_delta``: once the first Delta is taken, the
        ones before the last go to ``on_delta(delta)`` on the loop thread instead (``Deltas.hand_over``),
        and the stream ends early when it returns False. ``quiet``: the window while nobody follows it
        (``Deltas``); ``opened(deltas)`` is given the stream's ``Deltas`` (to tell it of its audience)."""
        out = Deltas(window, max_tokens, self._loop, quiet)
        if opened is not None:
            opened(out)
        future = asyncio.run_coroutine_threadsafe(self._run(request_id, prompt, params, out), self._loop)
        try:
            while True:
                item = out.get()
                if item is STOP:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
                if on_delta is not None:  # once, after the first Delta
                    out.hand_over(on_delta)
                    on_delta = None
        finally:
            # Consumer gone early (closed, GeneratorExit, error): cancelling the
            # task makes the engine abort the request.
            future.cancel()

    async def _run(self, request_id: str, prompt: str | list[int], params: GenParams, out: Deltas) -> None:
        self._pumps.add(asyncio.current_task())
        req = Request(request_id, params)
        try:
            await self._pump(req, prompt, out)
        except asyncio.CancelledError:
            out.put(RuntimeError(f"request {request_id} cancelled"))
            raise
        except BaseException as e:
            if req in self._first_pending:
                self._failed_prefilling.add(request_id)  # before the consumer sees the error
            out.put(e)
            raise
        finally:
            self._requests.pop(request_id, None)
            self._release(req)
            self._pumps.discard(asyncio.current_task())

    def abort(self, request_id: str) -> None:
        # Ends the request with a final "abort" Delta to its consumer.
        asyncio.run_coroutine_threadsafe(self._abort(request_id), self._loop).result()

    def running(self) -> int:
        return len(self._pumps)

    def shutdown(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._close(), self._loop).result()
        self._stop_loop()

    def failed_prefilling(self, request_id: str) -> bool:
        """Whether ``request_id`` ended in an error while its prompt was being prefilled (admitted, no
        token yet): when the engine died then, this request may be what killed it."""
        return request_id in self._failed_prefilling

    # -- the gate (loop thread) ---------------------------------------------------------------------
    async def _admitted(self, req: Request, out: Deltas, prompt_tokens: int, run) -> None:
        """The admission loop of one request, every host's: ``run()`` once per admission, until it returns
        True (the request ended; its final Delta is out). False: the gate paused it (aborted in the engine,
        its tokens kept), and it is resubmitted as prompt + output so far once admitted again, unseen by
        its consumer."""
        self._requests[req.request_id] = req
        while True:
            await self._admit(req)
            if req.cancelled:
                out.put(Delta(text="", token_ids=0, finish_reason="abort", prompt_tokens=prompt_tokens))
                return
            if req.paused:  # paused again before it started
                req.paused = False
                continue
            if await run():
                return
            req.paused = False
            req.attempt += 1

    async def _admit(self, req: Request) -> None:
        """Return once ``req`` holds an engine slot (or is cancelled), pausing a less urgent
        request if the batch is full."""
        await self._take_slot(req)
        if req.admitted_at is None and not req.cancelled:
            req.admitted_at = time.time()

    async def _take_slot(self, req: Request) -> None:
        if req.cancelled:
            return
        if not self._held_back(req):
            if len(self._active) < self._max_seqs:
                self._seat(req)
                await self._clear_first_step(req)
                return
            victims = [r for r in self._active.values() if r.pausable_for(req)]
            if victims:
                await self._pause(max(victims))  # the least urgent, and of those the latest
                self._seat(req)
                await self._clear_first_step(req)
                return
        req.slot = self._loop.create_future()
        heapq.heappush(self._waiting, req)
        try:
            await req.slot
        finally:
            req.slot = None
        if not req.cancelled:
            await self._clear_first_step(req)

    def _started(self, req: Request) -> None:
        """``req`` has its first output: what it held back may start now."""
        if req in self._first_pending:
            self._first_pending.discard(req)
            self._fill()

    def _held_back(self, req: Request) -> bool:
        return any(req.yields_to(p) for p in self._first_pending)

    def _seat(self, req: Request) -> None:
        self._active[req.request_id] = req
        if not req.output_ids:
            self._first_pending.add(req)

    async def _clear_first_step(self, req: Request) -> None:
        """Pause the less urgent requests that have not started: their prefill would share
        ``req``'s first step."""
        if req in self._first_pending:
            for victim in [r for r in self._active.values() if r.pausable_for(req) and not r.output_ids]:
                await self._pause(victim)

    async def _pause(self, victim: Request) -> None:
        victim.paused = True  # its pump sees the abort and comes back to _admit
        del self._active[victim.request_id]
        self._first_pending.discard(victim)
        await self._engine_abort(victim.engine_id)

    def _release(self, req: Request) -> None:
        self._first_pending.discard(req)
        if self._active.pop(req.request_id, None) is None and req in self._waiting:
            self._waiting.remove(req)
            heapq.heapify(self._waiting)
        self._fill()

    def _fill(self) -> None:
        # The heap is the most urgent first: once its head is held back, so is everything after it.
        while self._waiting and len(self._active) < self._max_seqs and not self._held_back(self._waiting[0]):
            nxt = heapq.heappop(self._waiting)
            self._seat(nxt)
            nxt.slot.set_result(None)

    async def _abort(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is None:
            return
        req.cancelled = True
        if req.slot is not None:  # waiting for admission: give up waiting
            self._waiting.remove(req)
            heapq.heapify(self._waiting)
            req.slot.set_result(None)
        elif request_id in self._active:
            await self._engine_abort(req.engine_id)

    # -- the loop ----------------------------------------------------------------------------------
    async def _cancel_pumps(self) -> None:
        pumps = list(self._pumps)
        for task in pumps:
            task.cancel()  # consumers get an error instead of waiting forever
        await asyncio.gather(*pumps, return_exceptions=True)

    def _stop_loop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self._loop.close()
