"""Group commit for the event log: many responses' events in one transaction, then publish.

Generation threads never wait for Postgres per token; one writer thread commits
whatever accumulated while the previous commit ran (docs/architecture.md, invariant 2:
committed before published). Every batch belongs to an attempt and is logged
only while that attempt is current (invariant 4). The thread never dies of a
bad batch: a batch the database refuses fails its own response, nobody else's.
"""

import logging
import threading
import time
from collections import defaultdict

from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from common import lifecycle
from common.bus import Publisher
from common.db import autocommit, retrying, transact_retrying
from common.errors import problem
from common.events import Event
from common.lifecycle import Attempt
from worker import metrics

log = logging.getLogger("lmsp.writer")
# A commit waits up to LINGER_S after its first event for others, unless LINGER_EVENTS are pending: a few
# ms on a task's 200 ms delta window, for half as many commits (measured with simulated workers).
LINGER_S, LINGER_EVENTS = 0.005, 256


class WriterDead(RuntimeError):
    pass


class EventWriter:
    def __init__(self, sessions, publisher: Publisher, on_lost, stop: threading.Event, heard=None):
        """``on_lost(attempt, write_error)``: the attempt's events were refused (write_error None: it was
        fenced; else the problem it fails with). ``heard(audience, sent)``: how many live followers each
        response's published batch reached (``Publisher.publish_many``), sent at monotonic ``sent``."""
        self.sessions = sessions
        engine = sessions.kw["bind"]
        # On Postgres a group commit is one statement, run as its own transaction (lifecycle.append_on).
        self._autocommit = autocommit(engine) if engine.dialect.name == "postgresql" else None
        self.publisher = publisher
        self.on_lost = on_lost
        self.heard = heard
        self.stop_event = stop
        self._cond = threading.Condition()
        self._pending: list[tuple[Attempt, Event]] = []
        self._since: dict[Attempt, float] = {}  # when each attempt's oldest pending event was submitted
        self._lags: dict[Attempt, list] = {}    # per attempt: [batches, total lag, max lag] (its timeline)
        # Attempts a batch of which was refused: their later batches are dropped, never logged after the
        # gap the refused one left (the generation is being stopped; its outcome is written without us).
        self._refused: set[Attempt] = set()
        # Attempts that ended (``forget``) with events still pending or in the commit running: what the
        # commit leaves of them in the two maps above is removed at its end. Every end path forgets, so
        # neither map outlives its attempt (fenced ones and engine losses never ask ``commit_lag``).
        self._ended: set[Attempt] = set()
        self._inflight: set[Attempt] = set()
        self._submitted = 0
        self._committed = 0
        self._stop = False
        self.dead: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="lmsp-event-writer", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self.dead is None and self._thread.is_alive()

    def submit(self, attempt: Attempt, batch: list[Event]) -> None:
        with self._cond:
            if self.dead is not None:
                raise WriterDead() from self.dead
            self._pending.extend((attempt, e) for e in batch)
            self._since.setdefault(attempt, time.time())
            self._submitted += 1
            self._cond.notify_all()

    def flush(self) -> None:
        """Wait until everything submitted so far is committed (or refused)."""
        with self._cond:
            target = self._submitted
            while self._committed < target:
                if self.dead is not None:
                    raise WriterDead() from self.dead
                self._cond.wait(1.0)

    def commit_lag(self, attempt: Attempt) -> tuple[int, float, float] | None:
        """(batches, total, max) seconds from an event's submission to its commit, for ``attempt``'s
        events so far (after ``flush``: all of them). Asked once the attempt has written its last
        event: everything about it is forgotten then."""
        with self._cond:
            lag = self._lags.pop(attempt, None)
            self._refused.discard(attempt)
        return None if lag is None else tuple(lag)

    def forget(self, attempt: Attempt) -> None:
        """The attempt ended, whichever way: nothing about it is kept (now, or once its events in the
        writer's hands are committed or refused)."""
        with self._cond:
            self._lags.pop(attempt, None)
            self._refused.discard(attempt)
            if attempt in self._since or attempt in self._inflight:
                self._ended.add(attempt)

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def _main(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - a bug: say so, and take readiness with it
            log.critical("the event writer died; this worker stops taking work", exc_info=True)
            with self._cond:
                self.dead = exc
                self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stop:
                    self._cond.wait()
                if not self._pending and self._stop:
                    return
                # Streams hand their deltas over one thread at a time: wait a moment for the rest of a
                # step's before committing, so one commit (its round trips, its WAL flush) carries them all.
                linger_until = time.monotonic() + LINGER_S
                while len(self._pending) < LINGER_EVENTS and not self._stop and \
                        (left := linger_until - time.monotonic()) > 0:
                    self._cond.wait(left)
                pending, self._pending = self._pending, []
                since, self._since = self._since, {}
                upto = self._submitted
                self._inflight = set(since)
            grouped: dict[Attempt, list[Event]] = defaultdict(list)
            for attempt, event in pending:
                if attempt not in self._refused:
                    grouped[attempt].append(event)
            accepted = self._commit(grouped) if grouped else []
            metrics.EVENTS_WRITTEN.inc(sum(len(grouped[a]) for a in accepted))
            sent = time.monotonic()
            audience = self.publisher.publish_many({a.response_id: grouped[a] for a in accepted})
            if audience and self.heard is not None:
                self.heard(audience, sent)
            now = time.time()
            with self._cond:
                for attempt in accepted:
                    lag = self._lags.setdefault(attempt, [0, 0.0, 0.0])
                    lag[0] += 1
                    lag[1] += now - since[attempt]
                    lag[2] = max(lag[2], now - since[attempt])
                self._inflight = set()
                self._drop_ended()
                self._committed = upto
                self._cond.notify_all()

    def _drop_ended(self) -> None:
        """(Under the lock.) Ended attempts with nothing left in the writer leave the maps."""
        for attempt in [a for a in self._ended if a not in self._since]:
            self._lags.pop(attempt, None)
            self._refused.discard(attempt)
            self._ended.discard(attempt)

    def _commit(self, grouped: dict[Attempt, list[Event]]) -> list[Attempt]:
        """Log what is still fenced in; return the attempts whose batches were committed."""
        try:
            refused = self._append(grouped)
        except SQLAlchemyError:
            # One batch the database refuses must not stop the others: commit each on its own.
            return [a for a, batch in grouped.items() if self._commit_one(a, batch)]
        for attempt in refused:
            self._lose(attempt, None)
        return [a for a in grouped if a not in refused]

    def _commit_one(self, attempt: Attempt, batch: list[Event]) -> bool:
        try:
            if self._append({attempt: batch}):
                self._lose(attempt, None)
                return False
            return True
        except IntegrityError:
            # A commit whose reply was lost (Postgres restarted) and that we replayed is no error.
            if self._retrying(lambda session: lifecycle.already_logged(session, attempt.response_id, batch)):
                return True
            detail = "an event of this response collides with one already logged"
        except SQLAlchemyError as exc:
            detail = f"the database refused an event of this response ({type(getattr(exc, 'orig', None) or exc).__name__})"
        self._lose(attempt, problem("generation_failed", detail))
        return False

    def _lose(self, attempt: Attempt, write_error: dict | None) -> None:
        with self._cond:
            self._refused.add(attempt)
        self.on_lost(attempt, write_error)

    def _append(self, grouped: dict[Attempt, list[Event]]) -> set[Attempt]:
        if self._autocommit is None:
            return self._retrying(lambda session: lifecycle.append(session, grouped))

        def once():
            with self._autocommit.connect() as conn:
                return lifecycle.append_on(conn, grouped)
        return retrying(once, seconds=float("inf"), log=log, stop=self.stop_event)

    def _retrying(self, fn):
        # Postgres restarting: keep the events and try again, never drop them.
        return transact_retrying(self.sessions, fn, log=log, stop=self.stop_event)

