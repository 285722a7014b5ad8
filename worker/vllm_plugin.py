"""A vLLM general plugin (entry point ``vllm.general_plugins``), loaded in each engine process.

vLLM's processes hand every step to each other through shared-memory queues whose readers spin
(``sched_yield``) for a second after each read. On a GPU that saves microseconds a step. On a CPU the
scheduler process spins for the whole forward pass: a 135M model's single stream took 7.8 CPU-s in
8 s in the EngineCore beside 7.8 in the process that computes, and on a machine with fewer cores
than engines the spinners take their cores from the forward passes. With ``ENGINE_NO_SPIN`` set (the worker
sets it for a CPU device, common/registry.py) a reader that would spin waits on the queue's notify
socket instead, as vLLM's own readers do after a second idle, for at most ``POLL_MS`` at a time:
vLLM's idle path can miss a notification and then parks for up to 5 s (measured: one or two such
stalls in a 128-token run without the cap), and its caller reads the queue's flag after every wait.
Once idle for a second, a reader waits as vLLM's does. The patch checks the shape it patches first
(vLLM's internals move between versions); any other shape leaves vLLM as shipped, with one warning.
"""

import inspect
import logging
import os
import time

from common.registry import ENGINE_NO_SPIN

POLL_MS = 2  # while steps come: a missed notification costs at most this, a needless wake-up microseconds
log = logging.getLogger("lmsp.vllm_plugin")
_warned = False


def _fits(cls) -> str | None:
    """Why ``SpinCondition`` is not the shape this patch was written for (vLLM 0.32), else None: a
    ``wait(self, timeout_ms)`` and the reader's ``last_read`` and ``busy_loop_s`` set in ``__init__``."""
    wait = getattr(cls, "wait", None)
    if wait is None:
        return "it has no wait()"
    if list(inspect.signature(wait).parameters) != ["self", "timeout_ms"]:
        return f"its wait{inspect.signature(wait)} takes other arguments"
    init = inspect.getsource(cls.__init__)
    missing = [name for name in ("self.last_read", "self.busy_loop_s") if name not in init]
    return f"its readers keep no {', '.join(missing)}" if missing else None


def register() -> None:
    """Called by vLLM outside any ``try``: whatever it finds, it never raises (an engine that cannot
    start because of a plugin would fail its worker's every load); vLLM as shipped, with one warning."""
    if os.environ.get(ENGINE_NO_SPIN) != "1":
        return  # not a CPU engine this service started
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
        why = _fits(SpinCondition)
    except Exception as exc:  # noqa: BLE001 - an import or a source vLLM moved or reshaped
        SpinCondition, why = None, f"{type(exc).__name__}: {exc}"
    if why is not None:
        _warn(why)
        return
    _patch(SpinCondition)


def _warn(why: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning("the CPU no-spin patch is off: vLLM's shared-memory queue is not the one it was written "
                    "for (%s); its readers spin as vLLM ships them", why)


def _patch(cls) -> None:
    spin_wait = cls.wait
    if getattr(spin_wait, "no_spin", False):
        return  # vLLM may load plugins more than once in a process

    def wait(self, timeout_ms: int | None = None) -> None:
        last = self.last_read
        if time.monotonic() > last + self.busy_loop_s:
            return spin_wait(self, timeout_ms)  # idle: vLLM's own wait on the socket
        self.last_read = float("-inf")  # past the busy window for vLLM's wait: to the socket, not a spin
        try:
            spin_wait(self, POLL_MS if timeout_ms is None else min(timeout_ms, POLL_MS))
        finally:
            self.last_read = last

    wait.no_spin = True
    cls.wait = wait
