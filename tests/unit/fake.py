"""A worker without an engine, for the unit layer: it claims the direct responses of one model and
answers each with a fixed text through the real output builder, writing every status and event through
the real lifecycle core (common/lifecycle.py) as worker/runner.py does, so the fast tests run the code
they protect."""

import threading
import time

from sqlalchemy import select

from common import events, lifecycle, liveness
from common.resources import response_object
from common.states import R
from common.tables import Response
from worker.output import OutputBuilder


class FakeWorker:
    def __init__(self, sessions, model: str, text: str = "Hello there", gate: threading.Event | None = None,
                 reasoning: bool = False):
        self.sessions = sessions
        self.model = model
        self.text = text
        self.reasoning = reasoning        # <think>...</think> in text is a reasoning item, as a parser makes it
        self.gate = gate                  # when given, each answer waits for it after claiming the response
        self.claimed = threading.Event()  # set when a response has been claimed
        self.id = f"fake-{model}-{time.monotonic_ns()}"
        self.started = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=self.id, daemon=True)

    def __enter__(self):
        self._beat(boot=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)
        self._beat(stopped=True)

    def _beat(self, **kw) -> None:
        with self.sessions() as session:
            liveness.heartbeat(session, self.id, [self.model], self.started, running=0, ready=True, loaded=[self.model], **kw)
            session.commit()

    def _loop(self) -> None:
        while not self._stop.wait(0.01):
            with self.sessions() as session:  # what the broker would deliver
                waiting = session.execute(select(Response.id).where(
                    Response.model == self.model, Response.status == "queued")).scalars().all()
            for response_id in waiting:
                self._answer(response_id)

    def _answer(self, response_id: str) -> None:
        with self.sessions() as session:
            claimed = lifecycle.claim_direct(session, response_id, self.id, self.model)
            session.commit()
        if claimed is None:
            return
        attempt, row = claimed
        self.claimed.set()
        if self.gate is not None:
            self.gate.wait(30)
        builder = OutputBuilder(response_id, "text", reasoning=self.reasoning)
        seq = events.Sequence()
        batch = seq.number([events.ResponseCreated(response_id=response_id, response=response_object(row)),
                            *builder.feed(self.text), *builder.finish()])
        usage = {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5}
        with self.sessions() as session:
            if lifecycle.append(session, {attempt: batch}):
                return  # no longer ours (the api aborted it): as the runner, write nothing more
            try:
                lifecycle.finish(session, attempt, R.COMPLETED, seq=seq, emitted=[],
                                 output=builder.items, usage=usage)
            except lifecycle.Fenced:
                return
            session.commit()
