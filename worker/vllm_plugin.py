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
Once idle for a second, a reader waits as vLLM's does.
"""

import os
import time

from common.registry import ENGINE_NO_SPIN

POLL_MS = 2  # while steps come: a missed notification costs at most this, a needless wake-up microseconds


def register() -> None:
    if os.environ.get(ENGINE_NO_SPIN) != "1":
        return  # not a CPU engine this service started
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    spin_wait = SpinCondition.wait
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
    SpinCondition.wait = wait
