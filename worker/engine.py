"""Host of one vLLM ``AsyncLLM`` inside a (threads-pool) Celery worker process.

``AsyncLLM`` binds to the asyncio loop that first uses it, and Celery has no
asyncio pool, so the engine lives on one long-lived loop in a daemon thread.
Pool threads hand requests to that loop with ``run_coroutine_threadsafe`` and
read the streamed outputs from a thread-safe queue; every in-flight task is one
concurrent engine request, which keeps vLLM's continuous batching full.

Admission is ours: at most ``max_num_seqs`` requests are in the engine, the most urgent
first. vLLM's priority scheduler preempts only when KV blocks run out, never for a
batch slot, so a person's request arriving at a full batch would wait for a background
one to finish; instead the host pauses the least urgent background request (aborts it,
keeps its tokens) and resubmits it as prompt + output so far once a slot frees (the
prefix cache makes that cheap). Structured-output requests are never paused: their
grammar cannot restart mid-output.

Until a person's request has its first token, the step that computes it carries no less
urgent prefill: background requests not yet started are paused (they lose at most a partial
prefill) and none is admitted or resumed, so its time to first token is the batch's decode
step plus its own prompt, not a refill of the batch.
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import itertools
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from vllm import SamplingParams, envs
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.inputs import TextPrompt, TokensPrompt
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from vllm.v1.engine.async_llm import AsyncLLM

from common.prompt import load_tokenizer
from common.registry import EngineSettings

# Inherited by the spawned EngineCore process, so a restarted worker can find
# the engine its SIGKILLed predecessor left behind (see kill_stale_engines).
ENGINE_TAG_ENV = "LMSP_ENGINE_TAG"
# The same for the database a worker serves: two deployments on one host (two `lmsp dev`, say) may
# reuse a worker id, and must never end each other's engines.
DEPLOYMENT_ENV = "LMSP_ENGINE_DEPLOYMENT"


def mark_deployment(database_url: str) -> None:
    os.environ[DEPLOYMENT_ENV] = hashlib.sha256(database_url.encode()).hexdigest()[:16]


@dataclass
class GenParams:
    max_tokens: int
    temperature: float | None = None  # None -> the model's generation_config, else 1.0; 0 = greedy
    json_schema: dict | None = None  # structured output: constrain to this JSON schema
    stop_token_ids: list[int] | None = None
    priority: int = 0  # lower value = served earlier (vLLM priority scheduling)
    seed: int | None = None
    ignore_eos: bool = False  # keep generating past EOS (benchmarks, equal-length tests)


@dataclass
class Delta:
    text: str  # new text since the previous Delta
    token_ids: int  # number of new output tokens in this delta
    finish_reason: str | None  # None while running; "stop" / "length" / "abort" at the end
    prompt_tokens: int  # number of prompt tokens (same on every delta)
    admitted_at: float | None = None  # when the request first got a slot in the batch (Unix seconds)


class _Request:
    """One generate() call as the admission gate sees it (touched only on the loop thread)."""

    _arrivals = itertools.count()

    def __init__(self, request_id: str, params: GenParams):
        self.request_id = request_id
        self.params = params
        self.order = (params.priority, next(self._arrivals))  # lower is more urgent
        self.attempt = 0
        self.output_ids: list[int] = []  # delivered so far: a paused request resumes after them
        self.paused = False  # aborted by the gate, to be resubmitted
        self.cancelled = False  # EngineHost.abort: end it, whether admitted or waiting
        self.slot: asyncio.Future | None = None  # set while waiting for admission
        self.admitted_at: float | None = None  # its first admission (the task's timeline)

    @property
    def engine_id(self) -> str:
        return self.request_id if self.attempt == 0 else f"{self.request_id}~{self.attempt}"

    def yields_to(self, other: _Request) -> bool:
        return self.params.priority > other.params.priority

    def pausable_for(self, other: _Request) -> bool:
        return self.yields_to(other) and self.params.json_schema is None

    def __lt__(self, other: _Request) -> bool:
        return self.order < other.order


class EngineHost:
    def __init__(self, checkpoint: str, settings: EngineSettings, tag: str | None = None, pin: bool = False):
        """``pin``: keep this process's threads off the CPUs the engine binds (the worker does)."""
        self._checkpoint = checkpoint
        self._settings = settings
        self._engine_args = settings.args
        self._max_seqs = int(settings.args.get("max_num_seqs", 64))
        self._tag = tag
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-engine-loop", daemon=True)
        self._llm: AsyncLLM | None = None
        self._sampling_defaults: dict = {}
        self._tok_params = None
        self._engine_procs: list[multiprocessing.Process] = []
        self._pumps: set[asyncio.Task] = set()  # touched only on the loop thread
        self._active: dict[str, _Request] = {}  # admitted to the engine (loop thread)
        self._waiting: list[_Request] = []  # a heap: the most urgent first (loop thread)
        self._first_pending: set[_Request] = set()  # admitted, no output yet (loop thread)
        self._requests: dict[str, _Request] = {}  # every request being generated (loop thread)
        self._pin = pin
        self._pinned = False  # this process's threads kept off the engine's CPUs

    def start(self) -> None:
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._load(), self._loop).result()
        except BaseException:
            self._stop_loop()
            raise
        if self._pin:
            self._keep_off_engine_cpus()

    def _keep_off_engine_cpus(self) -> None:
        """Pin every thread of this process to the CPUs the engine's compute threads are not bound
        to: a token's bookkeeping here must never preempt the forward pass (threads started later
        inherit the mask of the thread that starts them)."""
        bound: set[int] = set()
        for pid in _descendants(os.getpid()):
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(f"{envs.VLLM_PROCESS_NAME_PREFIX}::Worker".encode()):
                    bound |= os.sched_getaffinity(pid)
            except OSError:
                continue
        free = set(self._settings.cpus) - bound
        if bound and free:  # else not a CPU engine, or no CPU left over: the kernel decides
            _pin_process(free)
            self._pinned = True

    async def _load(self) -> None:
        if self._settings.cpus:
            # The engine binds its threads within the mask it inherits: a restart after
            # _keep_off_engine_cpus pinned this process must see every CPU again.
            os.sched_setaffinity(0, self._settings.cpus)
        if self._tag is not None:
            os.environ[ENGINE_TAG_ENV] = self._tag
        os.environ.update(self._settings.env)  # read by the engine processes this spawns
        args = AsyncEngineArgs(
            **{"enforce_eager": True, **self._engine_args},
            model=self._checkpoint,
            scheduling_policy="priority",
            enable_prefix_caching=True,  # resume re-submits prompt + output so far
        )
        before = set(multiprocessing.active_children())
        # Created on the loop so its output handler task is bound to this loop.
        self._llm = AsyncLLM.from_engine_args(args)
        self._engine_procs = [p for p in multiprocessing.active_children() if p not in before]
        # The model's generation_config (temperature, top_p, ...) is the default
        # for every knob GenParams leaves unset, as in vLLM's OpenAI server.
        self._sampling_defaults = self._llm.model_config.get_diff_sampling_param()
        self._sampling_defaults.pop("max_tokens", None)
        # Prompts arrive chat-templated: adding BOS etc. again would corrupt them.
        self._tok_params = self._llm.renderer.default_cmpl_tok_params.with_kwargs(add_special_tokens=False)

    def generate(self, request_id: str, prompt: str | list[int], params: GenParams) -> Iterator[Delta]:
        """Stream one request's output; it is submitted on the first next()."""
        out: queue.Queue[Delta | BaseException] = queue.Queue()
        future = asyncio.run_coroutine_threadsafe(self._pump(request_id, prompt, params, out), self._loop)
        try:
            while True:
                item = out.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            # Consumer gone early (closed, GeneratorExit, error): cancelling the
            # task makes vLLM's generate() abort the engine request.
            future.cancel()

    async def _pump(
        self,
        request_id: str,
        prompt: str | list[int],
        params: GenParams,
        out: queue.Queue,
    ) -> None:
        self._pumps.add(asyncio.current_task())
        req = _Request(request_id, params)
        try:
            (engine_input,) = await self._llm.renderer.render_cmpl_async(
                [
                    TextPrompt(prompt=prompt)
                    if isinstance(prompt, str)
                    else TokensPrompt(prompt_token_ids=prompt)
                ],
                self._tok_params,
            )
            prompt_ids = list(engine_input["prompt_token_ids"])
            self._requests[request_id] = req
            while True:
                await self._admit(req)
                if req.admitted_at is None:
                    req.admitted_at = time.time()
                if req.cancelled:
                    out.put(Delta(text="", token_ids=0, finish_reason="abort", prompt_tokens=len(prompt_ids)))
                    return
                if req.paused:  # paused again before it started
                    req.paused = False
                    continue
                if req.output_ids:  # resuming after a pause
                    engine_input = TokensPrompt(prompt_token_ids=prompt_ids + req.output_ids)
                try:
                    async for res in self._llm.generate(
                        engine_input,
                        self._sampling_params(params, len(req.output_ids)),
                        req.engine_id,
                        priority=params.priority,
                    ):
                        c = res.outputs[0]
                        if req.paused and c.finish_reason == "abort" and not req.cancelled:
                            break  # paused by the gate, not ended: the consumer sees nothing
                        req.output_ids += c.token_ids
                        if req in self._first_pending:
                            self._first_pending.discard(req)
                            self._fill()  # what it held back may start now
                        out.put(
                            Delta(
                                text=c.text,
                                token_ids=len(c.token_ids),
                                finish_reason=c.finish_reason,
                                prompt_tokens=len(prompt_ids),
                                admitted_at=req.admitted_at,
                            )
                        )
                        if c.finish_reason is not None:
                            return
                except asyncio.CancelledError:
                    # generate() aborts only requests it finished adding; a cancel that
                    # lands mid-add would leave the request running in the engine core.
                    await self._llm.abort(req.engine_id)
                    raise
                req.paused = False
                req.attempt += 1
        except asyncio.CancelledError:
            out.put(RuntimeError(f"request {request_id} cancelled"))
            raise
        except BaseException as e:
            out.put(e)
            raise
        finally:
            self._requests.pop(request_id, None)
            self._release(req)
            self._pumps.discard(asyncio.current_task())

    async def _admit(self, req: _Request) -> None:
        """Return once ``req`` holds an engine slot (or is cancelled), pausing a less urgent
        request if the batch is full."""
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

    def _held_back(self, req: _Request) -> bool:
        return any(req.yields_to(p) for p in self._first_pending)

    def _seat(self, req: _Request) -> None:
        self._active[req.request_id] = req
        if not req.output_ids:
            self._first_pending.add(req)

    async def _clear_first_step(self, req: _Request) -> None:
        """Pause the less urgent requests that have not started: their prefill would share
        ``req``'s first step."""
        if req in self._first_pending:
            for victim in [r for r in self._active.values() if r.pausable_for(req) and not r.output_ids]:
                await self._pause(victim)

    async def _pause(self, victim: _Request) -> None:
        victim.paused = True  # its pump sees the abort and comes back to _admit
        del self._active[victim.request_id]
        self._first_pending.discard(victim)
        await self._llm.abort(victim.engine_id)

    def _release(self, req: _Request) -> None:
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

    def _sampling_params(self, p: GenParams, done: int = 0) -> SamplingParams:
        kw = dict(self._sampling_defaults)
        if p.temperature is not None:
            kw["temperature"] = p.temperature
        return SamplingParams(
            **kw,
            max_tokens=p.max_tokens - done,
            seed=p.seed,
            stop_token_ids=p.stop_token_ids,
            ignore_eos=p.ignore_eos,
            structured_outputs=(
                StructuredOutputsParams(json=p.json_schema) if p.json_schema is not None else None
            ),
            output_kind=RequestOutputKind.DELTA,
        )

    def abort(self, request_id: str) -> None:
        # Ends the request with a final "abort" Delta to its consumer.
        asyncio.run_coroutine_threadsafe(self._abort(request_id), self._loop).result()

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
            await self._llm.abort(req.engine_id)

    def running(self) -> int:
        return len(self._pumps)

    @property
    def dead(self) -> bool:
        """The engine core died (killed, out of memory, a CUDA error): no request can run any more."""
        return self._llm is None or self._llm.errored

    def tokenizer(self):
        # The api renders and counts with the same tokenizer, so both sides see one prompt.
        return load_tokenizer(self._checkpoint)

    def shutdown(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._close(), self._loop).result()
        self._stop_loop()
        if self._pinned:  # the engine is gone: its CPUs are this process's again
            _pin_process(set(self._settings.cpus))
            self._pinned = False

    async def _close(self) -> None:
        pumps = list(self._pumps)
        for task in pumps:
            task.cancel()  # consumers get an error instead of waiting forever
        await asyncio.gather(*pumps, return_exceptions=True)
        if self._llm is not None:
            # A clean exit takes ~6 s on CPU; vLLM's default 5 s grace before
            # SIGKILL would cut it short.
            self._llm.shutdown(timeout=15)
            # Dropped now: AsyncLLM.__del__ shuts down again, and at interpreter
            # exit that fails ("'NoneType' object is not callable").
            self._llm = None
        for proc in self._engine_procs:
            # vLLM does not reap an EngineCore it had to SIGKILL, which would
            # linger as a <defunct> "VLLM::EngineCor".
            proc.join(timeout=10)

    def _stop_loop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self._loop.close()


def kill_stale_engines(tag: str, timeout: float = 10.0) -> list[int]:
    """SIGKILL the vLLM processes (EngineCore and its Worker) carrying ``tag`` (and this process's
    deployment, once ``mark_deployment`` ran).

    A SIGKILLed worker leaves its engine running (on a GPU, holding the card's
    memory); call this at boot, before start(), with the worker's stable id as
    the tag. Our own descendants are spared. Returns the pids killed.
    """
    markers = {f"{ENGINE_TAG_ENV}={tag}".encode()}
    if DEPLOYMENT_ENV in os.environ:
        markers.add(f"{DEPLOYMENT_ENV}={os.environ[DEPLOYMENT_ENV]}".encode())
    title = f"{envs.VLLM_PROCESS_NAME_PREFIX}::".encode()
    killed = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        pid = int(proc.name)
        try:
            if not (proc / "cmdline").read_bytes().startswith(title):
                continue
            if not markers <= set((proc / "environ").read_bytes().split(b"\0")):
                continue
            if _descends_from_us(pid):
                continue
            os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError):
            continue  # exited meanwhile, or not ours to read or kill
        killed.append(pid)
    deadline = time.monotonic() + timeout
    while any(_alive(pid) for pid in killed):
        if time.monotonic() > deadline:
            raise TimeoutError(f"stale engine processes did not exit: {killed}")
        time.sleep(0.1)
    return killed


def _stat(pid: int) -> list[str]:
    # Fields after "(comm)", which may itself contain spaces: [state, ppid, ...].
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _pin_process(cpus: set[int]) -> None:
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass  # the thread ended meanwhile


def _descendants(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                parents[int(proc.name)] = int(_stat(int(proc.name))[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = [], [root]
    while frontier:
        kids = [pid for pid, ppid in parents.items() if ppid in frontier]
        found += kids
        frontier = kids
    return found


def _descends_from_us(pid: int) -> bool:
    me = os.getpid()
    while pid > 1:
        if pid == me:
            return True
        pid = int(_stat(pid)[1])
    return False


def _alive(pid: int) -> bool:
    # A killed orphan may stay a zombie until its new parent reaps it; a
    # zombie holds no memory, so it counts as gone.
    try:
        return _stat(pid)[0] != "Z"
    except OSError:
        return False
