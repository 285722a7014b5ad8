"""A follower: one client's position in one response's events, run by the fan-out thread only;
and a ``Watcher``, which waits for a response to change.

A follower's frames go to a sink (api/live/sinks.py); its log reads run on the hub's reader threads
(api/live/reads.py) and come back to ``read_done``; live batches come from its topic
(api/live/topics.py) through the hub."""

import logging
import threading
import time
from collections.abc import Callable

from api.live import reads
from api.live.frames import Batch, Event
from common.errors import LMSPError
from common.events import FINAL, EventData, Sequence

log = logging.getLogger("lmsp.live")
# A follower's states (``Watcher``: WATCHING, then ENDED).
REPLAY, LIVE, GAP, ENDED, WATCHING = "replay", "live", "gap", "ended", "watching"
# How a follower ended: its final event, SIGTERM, a failure (an error event), cut (its client took
# nothing for too long), its client gone, or its WebSocket closed (the client's close, a protocol
# error, a flood: the close frame is already written).
FINISHED, SHUTDOWN, FAILED, CUT, GONE, CLOSED = "finished", "shutdown", "failed", "cut", "gone", "closed"
PENDING_MAX = 1024         # live events kept while a follower's log read runs; past it, read again
READING_AHEAD = ()         # a follower's ``ahead`` while the page after the one it sends is read
WATCH_MAX = 64             # changes kept for a watcher (it wants to know that something changed, not what)


class Follower:
    """One client's position in one response's events, run by the fan-out thread only.

    * REPLAY: the log after ``after`` is read page by page (a page more once the last one is sent),
      after the subscription is live, so nothing published meanwhile is missed;
    * LIVE: published batches are sent as they come, each seq once, in order;
    * GAP: a batch did not follow the last seq sent (the channel lost something, or Redis came
      back): the log has what is missing; live batches wait in ``pending`` meanwhile;
    * ENDED: after the final event (also when resuming at or past it), SIGTERM, a failure (an
      ``error`` event), a revoked token, a client too slow (cut) or gone.

    ``seq`` is the stream's position: the last event sent. ``ended()`` (asked when the log has nothing
    new) is None while the response runs, else the events that end the stream, which ``seq`` numbers
    after the last sent (a task: none; a direct response whose worker died: its final event). ``logged`` is False for a direct stream: its events are in the log only
    when the worker could not publish them, so it starts live and reads the log on a gap or poll."""

    __slots__ = ("hub", "response_id", "sink", "state", "seq", "logged", "ended", "authorized",
                 "pending", "reread", "reading", "more", "ahead", "began", "last_auth", "confirmed", "checking")

    def __init__(self, hub, response_id: str, sink):
        self.hub, self.response_id, self.sink = hub, response_id, sink
        sink.follower = self
        self.state = REPLAY
        self.seq = Sequence()
        self.logged = True
        self.ended: Callable[[], list[EventData] | None] = _running
        self.authorized: Callable[[], bool] | None = None
        self.pending: list[Event] = []
        self.ahead: tuple | None = None  # a replay's next page, read while this one was sent
        self.reread = self.reading = self.more = self.began = self.checking = False
        self.last_auth = time.monotonic()
        self.confirmed = threading.Event()  # the subscription is live (or Redis is away)

    def setup(self, after: int, logged: bool, ended, authorized) -> "Follower":
        self.seq, self.logged, self.ended, self.authorized = Sequence(after), logged, ended, authorized
        self.state = REPLAY if logged else LIVE
        return self

    def begin(self) -> None:
        """Start: a task follower replays its log (asking at once whether it already ended: it may
        resume at or past its final event); a direct one goes live with what came meanwhile."""
        self.began = True
        if self.state == ENDED:
            return
        if self.logged:
            self._read(ask_ended=True)
        else:
            self._take_pending(jump=True)

    def deliver(self, batch: Batch, jump: bool = False) -> None:
        """A batch from the channel or a poll; ``jump``: a gap is not worth a read (see below)."""
        if self.state == ENDED:
            return
        if self.reading or self.more or not self.began:
            self._hold(batch)
            return
        if self.sink.behind():
            if not self.logged:  # a direct stream's events are not in the log: it resumes
                log.info("follower of %s cut: %d bytes unsent", self.response_id, self.sink.queued)
                self.end(CUT)
                return
            # The reader is slower than the response: it reads the log at its own pace from here on.
            self.state, self.more = REPLAY, True
            self._hold(batch)
            return
        events = batch.events
        if events[0][0] == self.seq.last + 1 and batch.contiguous and batch.final in (-1, len(events) - 1):
            self.seq.last = events[-1][0]  # the common case: the next events, frames shared with the others
            self.sink.events(batch)
            if batch.final >= 0:
                self.end(FINISHED)
            return
        fresh, final = [], False
        for i, event in enumerate(events):
            if event[0] <= self.seq.last:
                if event[1] in FINAL:
                    final = True  # it ended at or before the resume point: nothing more to send
                    break
                continue  # already sent from the log
            if event[0] != self.seq.last + 1 and not jump:
                self.pending.extend(events[i:])  # the log has what the channel lost, if it was logged
                break
            fresh.append(event)
            self.seq.last = event[0]
            if event[1] in FINAL:
                final = True
                break
        if fresh and self.state != ENDED:
            self.sink.events(Batch(fresh))
        if final:
            self.end(FINISHED)
        elif self.pending and self.state != ENDED:
            self._read(ask_ended=False)

    def _hold(self, batch: Batch) -> None:
        """A live batch that waits for a log read (or is left to it, when too many wait)."""
        if len(self.pending) + len(batch.events) > PENDING_MAX:
            self.pending.clear()
            self.reread = True  # the read in flight (or the next) is followed by another
        else:
            self.pending.extend(batch.events)

    def read_to_end(self, known) -> None:
        """The response ended (a poll saw it): read the log to its end, or send ``known``, its ending."""
        if self.began and not self.reading and self.state != ENDED:
            self._read(ask_ended=True, known=known)

    def _read(self, ask_ended: bool, known=None) -> None:
        self.reading, self.more = True, False
        if self.state == LIVE:
            self.state = GAP
        self.hub.read(self, self.seq.last, ask_ended, known)

    def read_on(self) -> None:
        """The sink took the last page of a replay: the next one (read already, or read now)."""
        if self.more and self.state != ENDED and not self.reading:
            if self.ahead is not None:  # not READING_AHEAD: that one is ``reading``
                ahead, self.ahead, self.more = self.ahead, None, False
                self.read_done(*ahead, None)
            else:
                self._read(ask_ended=True)  # an empty page after a full one: purged meanwhile (410), or its end

    def read_done(self, page: Batch | list[Event] | None, final: bool, ending, error: BaseException | None) -> None:
        """A log read came back: its page, whether the final event is in it, and (asked when the page
        was empty) the events that end the stream another way (``ended()``), or what it raised.

        A full page that comes while the sink is idle (its reader keeps up) has the next page read
        while it is framed and sent: the database's time overlaps ours. That page waits in ``ahead`` if
        the reader has fallen behind meanwhile, so a replay holds at most one page more than it sends."""
        self.reading = False
        if self.state == ENDED:
            return
        if error is not None:
            self.end(FAILED, error)
            return
        if self.ahead is READING_AHEAD:
            self.ahead = None
            if page and not self.sink.wants_more():
                self.ahead, self.more = (page, final, ending), True  # the sink's drain takes it (read_on)
                return
        gained = bool(page)
        if page:
            batch = page if isinstance(page, Batch) else Batch(page)
            page = batch.events
            self.seq.last = page[-1][0]
            self.hub.advanced(self.response_id, self.seq.last)
            if len(page) >= reads.PAGE and not final and not self.reread and self.sink.idle():
                self._read(ask_ended=True)  # the next page, while this one goes out
                self.ahead = READING_AHEAD
                self.sink.events(batch)
                return
            self.sink.events(batch)
            if self.state == ENDED:
                return
        if final:
            self.end(FINISHED)
        elif ending is not None:
            if ending:
                self.sink.events(Batch(self.seq.closing(ending)))
            self.end(FINISHED)
        elif (page and len(page) >= reads.PAGE) or self.reread:
            self.reread, self.more = False, True
            if self.sink.wants_more():
                self.read_on()
        else:
            self.state = LIVE
            self.hub.advanced(self.response_id, self.seq.last)
            if self.logged and not gained:
                self.pending = []  # a gap the log does not fill (published means logged): the polls see to it
            self._take_pending(jump=not self.logged)

    def _take_pending(self, jump: bool) -> None:
        """Live batches that came during a read. ``jump``: a direct stream's unlogged events are gone:
        go on in order."""
        pending, self.pending = self.pending, []
        if pending:
            pending.sort()
            self.deliver(Batch(pending), jump=jump)

    def transport_changed(self) -> None:
        pass  # its topic polls the log for what the change may have lost

    def check_auth(self, now: float) -> None:
        """Every ``stream_auth_recheck_seconds``: a revoked token ends the stream (on a reader thread:
        the check may ask the database)."""
        if self.authorized is None or self.checking or now - self.last_auth < self.hub.settings.stream_auth_recheck_seconds:
            return
        self.last_auth = now
        peek = getattr(self.authorized, "peek", None)
        valid = peek() if peek is not None else None
        if valid is None:
            self.checking = True
            self.hub.check_auth(self)
        elif not valid:
            self.auth_done(False)

    def auth_done(self, valid: bool) -> None:
        self.checking = False
        if not valid and self.state != ENDED:
            self.end(FAILED, LMSPError("unauthorized", "The token of this stream was revoked"))

    def close(self) -> None:
        """From any thread: a subscription that will not be followed after all."""
        self.hub.stop(self)

    def end(self, how: str, exc: BaseException | None = None, keep_socket: bool = False) -> None:
        if self.state == ENDED:
            return
        self.state = ENDED
        self.pending, self.ahead = [], None
        self.hub.forget(self)
        if not keep_socket:
            self.sink.finish(how, exc, self.seq.last)


def _running():
    return None


class Watcher:
    """A thread waiting for a response to change (the long poll of ``GET /tasks/{id}?wait``): each
    batch published for it, as published, and [] when the transport changed (read again).

    Not a ``Follower``: it has no position in the events (it is told that something changed, not
    what came after a seq), so nothing is replayed, ordered or sent for it, and it never falls
    behind. It answers the few calls a topic makes of its members (``deliver``,
    ``transport_changed``, ``check_auth``, ``end``) and has the fields the hub reads of them."""

    __slots__ = ("hub", "response_id", "sink", "confirmed", "began", "state", "logged", "reading", "more",
                 "last_auth")

    def __init__(self, hub, response_id: str, sink):
        self.hub, self.response_id, self.sink = hub, response_id, sink
        sink.follower = self
        self.confirmed = threading.Event()
        self.began, self.state, self.logged, self.reading, self.more = True, WATCHING, False, False, False
        self.last_auth = float("inf")  # nothing to recheck: the long poll checked its token

    def deliver(self, batch: Batch, jump: bool = False) -> None:
        self.sink.notify(batch.events, WATCH_MAX)

    def transport_changed(self) -> None:
        self.sink.notify([], WATCH_MAX)

    def check_auth(self, now: float) -> None:
        pass

    def end(self, how: str, exc: BaseException | None = None, keep_socket: bool = False) -> None:
        if self.state != ENDED:
            self.state = ENDED
            self.hub.forget(self)

    def get(self, timeout: float) -> list[Event] | None:
        return self.sink.get(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.hub.stop(self)
