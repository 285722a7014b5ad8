"""Host of one vLLM ``AsyncLLM`` inside a (threads-pool) Celery worker process, behind the
admission gate of ``worker.gate`` (which says why the engine has a loop thread of its own and how
a person's request pauses background work)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from pathlib import Path

from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.inputs import TextPrompt, TokensPrompt
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError

from common.prompt import load_tokenizer
from common.registry import EngineSettings
from worker.gate import Delta, Deltas, GatedHost, GenParams, Request
from worker.procs import (
    _descendants,
    _pin_process,
    engine_markers,
    engine_processes,
    kill,
    vllm_process_prefix,
    wait_gone,
)

__all__ = ["Delta", "EngineHost", "GenParams"]

PERSON_FIRST = "worker.vllm_scheduler.PersonFirstScheduler"  # imported by name in the engine's process


class EngineHost(GatedHost):
    dead_errors = (EngineDeadError,)

    def __init__(self, checkpoint: str, settings: EngineSettings, tag: str | None = None, pin: bool = False):
        """``pin``: keep this process's threads off the CPUs the engine binds (the worker does)."""
        self._checkpoint = checkpoint
        self._settings = settings
        self._engine_args = settings.args
        super().__init__(int(settings.args.get("max_num_seqs", 64)), "vllm-engine-loop")
        self._tag = tag
        self._llm: AsyncLLM | None = None
        self._sampling_defaults: dict = {}
        self._tok_params = None
        self._engine_procs: list[multiprocessing.Process] = []
        self._pids: set[int] = set()  # every process the load started: all gone after shutdown()
        self._pin = pin
        self._pinned = False  # this process's threads kept off the engine's CPUs

    def start(self) -> None:
        before = set(_descendants(os.getpid()))
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._load(), self._loop).result()
        except BaseException as exc:
            # A failed load, or SIGTERM while loading (the worker's handler raises SystemExit here): end
            # the engine's processes. After a failed load the loop is idle and stops; after SIGTERM it is
            # still inside vLLM's wait for the engine (seconds more): the process exits without it.
            kill(set(_descendants(os.getpid())) - before)
            if isinstance(exc, Exception):
                self._stop_loop()
            raise
        self._pids = engine_processes(set(_descendants(os.getpid())) - before)
        if self._pin:
            self._keep_off_engine_cpus()

    def _keep_off_engine_cpus(self) -> None:
        """Pin every thread of this process to the CPUs the engine's compute threads are not bound
        to: a token's bookkeeping here must never preempt the forward pass (threads started later
        inherit the mask of the thread that starts them)."""
        bound: set[int] = set()
        for pid in _descendants(os.getpid()):
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(f"{vllm_process_prefix()}::Worker".encode()):
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
        os.environ.update(self._settings.env)  # read by the engine processes this spawns
        if self._tag is not None:
            for name, value in engine_markers(self._tag).items():
                os.environ.pop(name, None)  # set anew: the environment's last entry (see engine_markers)
                os.environ[name] = value
        # Priority scheduling by default: a person's request (GenParams.priority) outranks tasks.
        # vLLM's own stats off: the worker keeps its own metrics (worker/metrics.py), and vLLM's cost
        # about a tenth of this process's CPU a token (its loggers, per-step and per-request stats). A
        # model's engine args may turn them on again ("disable_log_stats": false): vllm:* metrics then
        # join the worker's /metrics.
        defaults = {"enforce_eager": True, "scheduling_policy": "priority", "disable_log_stats": True}
        if self._settings.resolved.get("device") == "cpu":
            # A person's prompt in a step of its own (worker/vllm_scheduler.py). On a GPU the step it
            # shares with the running decodes costs about what it does alone, and vLLM's own (async)
            # scheduler is kept.
            defaults["scheduler_cls"] = PERSON_FIRST
        args = AsyncEngineArgs(
            **{**defaults, **self._engine_args},
            model=self._checkpoint,
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

    async def _pump(self, req: Request, prompt: str | list[int], out: Deltas) -> None:
        (engine_input,) = await self._llm.renderer.render_cmpl_async(
            [
                TextPrompt(prompt=prompt)
                if isinstance(prompt, str)
                else TokensPrompt(prompt_token_ids=prompt)
            ],
            self._tok_params,
        )
        prompt_ids = list(engine_input["prompt_token_ids"])
        await self._admitted(req, out, len(prompt_ids), lambda: self._generate(req, engine_input, prompt_ids, out))

    async def _generate(self, req: Request, engine_input, prompt_ids: list[int], out: Deltas) -> bool:
        """One admission: True once the request ended, False when the gate paused it."""
        if req.output_ids:  # resuming after a pause
            engine_input = TokensPrompt(prompt_token_ids=prompt_ids + req.output_ids)
        try:
            async for res in self._llm.generate(
                engine_input,
                self._sampling_params(req.params, len(req.output_ids)),
                req.engine_id,
                priority=req.params.priority,
            ):
                c = res.outputs[0]
                if req.paused and c.finish_reason == "abort" and not req.cancelled:
                    return False  # paused by the gate, not ended: the consumer sees nothing
                req.output_ids += c.token_ids
                self._started(req)
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
                    return True
        except asyncio.CancelledError:
            # generate() aborts only requests it finished adding; a cancel that
            # lands mid-add would leave the request running in the engine core.
            await self._llm.abort(req.engine_id)
            raise
        return False

    def _sampling_params(self, p: GenParams, done: int = 0) -> SamplingParams:
        kw = dict(self._sampling_defaults)
        if p.temperature is not None:
            kw["temperature"] = p.temperature
        return SamplingParams(
            **kw,
            max_tokens=p.max_tokens - done,
            seed=p.seed,
            stop_token_ids=p.stop_token_ids,
            stop=p.stop,
            ignore_eos=p.ignore_eos,
            structured_outputs=(
                StructuredOutputsParams(json=p.json_schema) if p.json_schema is not None else None
            ),
            output_kind=RequestOutputKind.DELTA,
        )

    async def _engine_abort(self, engine_id: str) -> None:
        await self._llm.abort(engine_id)

    @property
    def dead(self) -> bool:
        """The engine core died (killed, out of memory, a CUDA error): no request can run any more."""
        return self._llm is None or self._llm.errored

    def tokenizer(self):
        # The api renders and counts with the same tokenizer, so both sides see one prompt.
        return load_tokenizer(self._checkpoint)

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            # A worker of several models unloads engines while it runs: whatever vLLM's shutdown left (a
            # worker process of a core that had to be killed) must not hold the memory the next model needs.
            kill(self._pids)
            wait_gone(self._pids)
        if self._pinned:  # the engine is gone: its CPUs are this process's again
            _pin_process(set(self._settings.cpus))
            self._pinned = False

    async def _close(self) -> None:
        await self._cancel_pumps()
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
