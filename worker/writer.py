"""Group commit for the event log: many responses' events in one transaction, then publish.

Generation threads never wait for Postgres per token; one writer thread commits
whatever accumulated while the previous commit ran (DESIGN invariant 2:
committed before published).
"""

import logging
import threading
from collections import defaultdict

from common import eventlog
from common.bus import Publisher
from common.db import retrying

log = logging.getLogger("lmsp.writer")
Event = tuple[int, str, str]


class EventWriter:
    def __init__(self, sessions, publisher: Publisher):
        self.sessions = sessions
        self.publisher = publisher
        self._cond = threading.Condition()
        self._pending: list[tuple[str, Event]] = []
        self._submitted = 0
        self._committed = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="lmsp-event-writer", daemon=True)
        self._thread.start()

    def submit(self, response_id: str, batch: list[Event]) -> None:
        with self._cond:
            self._pending.extend((response_id, e) for e in batch)
            self._submitted += 1
            self._cond.notify_all()

    def flush(self) -> None:
        """Wait until everything submitted so far is committed."""
        with self._cond:
            target = self._submitted
            while self._committed < target:
                self._cond.wait()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stop:
                    self._cond.wait()
                if not self._pending and self._stop:
                    return
                pending, self._pending = self._pending, []
                upto = self._submitted
            grouped: dict[str, list[Event]] = defaultdict(list)
            for rid, event in pending:
                grouped[rid].append(event)
            self._commit(grouped)
            self.publisher.publish_many(grouped)
            with self._cond:
                self._committed = upto
                self._cond.notify_all()

    def _commit(self, grouped: dict[str, list[Event]]) -> None:
        def attempt():
            with self.sessions() as session:
                for rid, batch in grouped.items():
                    eventlog.append(session, rid, batch)
                session.commit()

        # Postgres restarting: keep the events and try again, never drop them.
        retrying(attempt, seconds=float("inf"), log=log)
