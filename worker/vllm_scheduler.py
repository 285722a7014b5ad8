"""vLLM's scheduler with a person's prompt computed in a step of its own (the engine's ``scheduler_cls``
on a CPU device; worker/engine.py). Imported in the engine's own process, by name.

vLLM schedules the running requests first and the waiting ones with what budget is left, so a
person's prompt always shares its step with every running decode. On a GPU that step costs about
what the prompt alone does. On a CPU a step of 64 decodes costs more than the prompt's own step
(115-280 ms on these machines, against an idle first token of 70-120 ms), and the person waits for
all of it: B6 was 3-4x the idle first token.

So while a request more urgent than some running ones still has prompt to compute, those less
urgent sit out the step. They keep their KV cache, their slot and their place, exactly as when a
step's token budget runs out before them in vLLM itself, and decode again at the next step: each
person's prompt costs the background one step. A request that waits for something else (its
grammar, remote KV) holds nobody back.
"""

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus


class PersonFirstScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._unfit: set[str] = set()  # held for, and still not scheduled: hold for them no more

    def schedule(self, *args, **kwargs):
        urgent, waiting_for = self._urgent_prompt()
        held = [] if urgent is None else [r for r in self.running if r.priority > urgent]
        if not held:
            return super().schedule(*args, **kwargs)
        running, active = self.running, self.max_num_active_reqs
        self.running = [r for r in running if r.priority <= urgent]
        self.max_num_active_reqs = active - len(held)  # the held keep their slots
        try:
            out = super().schedule(*args, **kwargs)
        finally:
            self.running = self.running + held  # what ran, what it admitted, then the held
            self.max_num_active_reqs = active
        # A prompt that found no KV blocks: vLLM frees them by preempting running requests, which the
        # held are not here, so holding them again would hold everyone until the person is aborted.
        # It waits as vLLM would make it wait.
        self._unfit = set() if waiting_for & out.num_scheduled_tokens.keys() else waiting_for
        return out

    def _urgent_prompt(self) -> tuple[int | None, set[str]]:
        """The most urgent priority of a request with prompt still to compute, and their ids: the
        head of the waiting queue, ready to run, or running requests part way through a chunked prompt."""
        found = [r for r in self.running if r.num_computed_tokens < r.num_prompt_tokens]
        if self.waiting:
            head = self.waiting.peek_request()
            if head.status == RequestStatus.WAITING:
                found.append(head)
        found = [r for r in found if r.request_id not in self._unfit]
        if not found:
            return None, set()
        urgent = min(r.priority for r in found)
        return urgent, {r.request_id for r in found if r.priority == urgent}
