"""A worker without an engine, for the unit layer: it claims the direct responses of one model and
answers each with a fixed text through the real output builder, logged as worker/runner.py logs them."""

import threading
import time

from sqlalchemy import select, update

from common import eventlog, events
from common.tables import Response, Worker
from worker.output import OutputBuilder


class FakeWorker:
    def __init__(self, sessions, model: str, text: str = "Hello there", gate: threading.Event | None = None):
        self.sessions = sessions
        self.model = model
        self.text = text
        self.gate = gate                  # when given, each answer waits for it after claiming the response
        self.claimed = threading.Event()  # set when a response has been claimed
        self.id = f"fake-{model}-{time.monotonic_ns()}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=self.id, daemon=True)

    def __enter__(self):
        self._beat(stopped=None)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)
        self._beat(stopped=time.time())

    def _beat(self, stopped) -> None:
        with self.sessions() as session:
            now = time.time()
            session.merge(Worker(id=self.id, model=self.model, heartbeat_at=now, started_at=now, stopped_at=stopped,
                                 running=0))
            session.commit()

    def _loop(self) -> None:
        while not self._stop.wait(0.01):
            with self.sessions() as session:
                waiting = session.execute(select(Response.id).where(
                    Response.model == self.model, Response.status == "queued")).scalars().all()
            for response_id in waiting:
                self._answer(response_id)

    def _answer(self, response_id: str) -> None:
        with self.sessions() as session:
            won = session.execute(update(Response).where(Response.id == response_id, Response.status == "queued")
                                  .values(status="in_progress", worker_id=self.id)).rowcount
            session.commit()
        if not won:
            return
        self.claimed.set()
        if self.gate is not None:
            self.gate.wait(30)
        builder = OutputBuilder(response_id, "text")
        emitted = [(events.CREATED, events.created(response_id)), *builder.feed(self.text), *builder.finish()]
        usage = {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5}
        emitted.append(events.final(response_id, "completed", usage=usage))
        with self.sessions() as session:
            eventlog.append(session, response_id,
                            [(seq, name, events.dumps(data)) for seq, (name, data) in enumerate(emitted, 1)])
            session.execute(update(Response).where(Response.id == response_id).values(
                status="completed", output=builder.items, usage=usage, updated_at=time.time()))
            session.commit()
