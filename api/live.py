"""Following a response's events: replay the log, then live, never a seq twice, always to the end.

Each api process has one ``Hub``: one Redis subscription (its listener thread) and one fan-out thread
that runs every follower of the process (docs/architecture.md, invariants 9 and 12). A follower is a
``Follower`` (states REPLAY, LIVE, GAP, ENDED) whose frames go to a sink:

* ``SocketSink``: the client's own socket, handed over by the WSGI server once the view has checked
  the request (``api/serve.py``), written without blocking by the fan-out thread. A follower costs a
  few KiB and no thread; a batch's frames are encoded once for every follower at the same point.
  A follower goes at its reader's pace: the next page of a replay is read once less than half of
  ``follower_buffer_bytes`` is unsent, and a follower whose unsent frames pass that bound takes no
  more live batches: it reads the log instead, page by page, until it has caught up. Only a client
  that takes nothing for ``follower_stall_seconds`` is cut (it resumes from the log).
* ``QueueSink``: a request thread reads the follower (``follow``): direct responses, which hold
  their thread anyway (their request waits for the model), and servers that cannot hand a socket
  over (the Flask test client).

Database reads (replays, gaps, polls, "has it ended", token rechecks) run on a few reader threads,
never on the fan-out thread. While Redis is away (never configured, down at start, or lost
mid-stream) each followed response's log is read every ``poll_interval_seconds``, once for all its
followers, and live notifications resume when it returns.
"""

import base64
import hashlib
import itertools
import logging
import os
import resource
import selectors
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from operator import itemgetter

import redis

from common import eventlog
from common.bus import HUB, channel, decode, response_of
from common.errors import LMSPError, problem
from common.events import CREATED, ERROR, FINAL, HEARTBEAT, Sequence, created, dumps, sse, sse_many, ws_frame
from common.settings import Settings

log = logging.getLogger("lmsp.live")
Event = tuple[int, str, str]
PING_SECONDS = 5.0         # the listener pings Redis this often; silence for 3 pings means it is gone
CONFIRM_SECONDS = 1.0      # how long a new follower waits for Redis to confirm its subscription
PAGE = 5000  # events per log read (~1 MB), written to the client in one piece; 20,000 cost 10% more CPU (bigger allocations)
SAFETY_NET_SECONDS = 5.0   # a quiet task's log is re-read (then "has it ended" asked) this often
DIRECT_CHECK_SECONDS = 1.0  # a quiet direct stream asks whether its worker died this often
TICK_SECONDS = 0.5         # heartbeats, pings, token rechecks and closing deadlines run this often
PENDING_MAX = 1024         # live events kept while a follower's log read runs; past it, read again
LINGER_SECONDS = 2.0       # after its last frame, how long a socket waits for the client to close
USER_TIMEOUT_MS = 30_000   # unacknowledged data this old: the kernel drops the connection (a vanished peer)
READERS = 4                # threads for the followers' database reads
FD_RESERVE = 512           # open files kept for everything but followers (database, Redis, requests)
WS_MAX_MESSAGE = 65536     # a client message (none is expected) longer than this closes the socket

REPLAY, LIVE, GAP, ENDED = "replay", "live", "gap", "ended"
# How a follower ended: its final event, SIGTERM, a failure (an error event), too far behind, client gone.
FINISHED, SHUTDOWN, FAILED, CUT, GONE = "finished", "shutdown", "failed", "cut", "gone"
SHUTDOWN_NOTE = ": this server is shutting down; reconnect with Last-Event-ID to continue\n\n"
KEEP_ALIVE = HEARTBEAT.encode()
# A handed-over SSE body is chunked (HTTP/1.1): clients that read a body by size (urllib3, so requests'
# iter_lines) get each frame as it is written, not once 512 bytes have piled up; this ends the body.
LAST_CHUNK = b"0\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)

_hubs: "weakref.WeakSet[Hub]" = weakref.WeakSet()


class ShuttingDown(Exception):
    """This api process got SIGTERM: a task follower ends so its client resumes on another one."""


class Batch:
    """Events in seq order, and their frames, encoded once however many followers send them."""

    __slots__ = ("events", "final", "contiguous", "_sse", "_ws")

    def __init__(self, events: list[Event]):
        self.events = events
        self.final = -1  # the index of the final event, if any (looked for at C speed first)
        if not FINAL.isdisjoint(map(itemgetter(1), events)):
            self.final = next(i for i, e in enumerate(events) if e[1] in FINAL)
        self.contiguous = events[-1][0] - events[0][0] == len(events) - 1
        self._sse = self._ws = None

    def encoded(self, ws: bool) -> bytes:
        if ws:
            if self._ws is None:
                self._ws = b"".join([ws_message(ws_frame(*e).encode()) for e in self.events])
            return self._ws
        if self._sse is None:
            self._sse = chunk(sse_many(self.events).encode())
        return self._sse


def ws_message(payload: bytes, opcode: int = 0x1) -> bytes:
    """One unmasked, unfragmented server frame (RFC 6455 5.2)."""
    n = len(payload)
    if n < 126:
        head = bytes((0x80 | opcode, n))
    elif n < 65536:
        head = bytes((0x80 | opcode, 126)) + n.to_bytes(2, "big")
    else:
        head = bytes((0x80 | opcode, 127)) + n.to_bytes(8, "big")
    return head + payload


def ws_close(code: int, reason: str) -> bytes:
    return ws_message(code.to_bytes(2, "big") + reason.encode()[:120], 0x8)


def ws_violation(first: int, second: int) -> str | None:
    """What a client frame's first two bytes break of RFC 6455 5.2, if anything (no extension is agreed)."""
    opcode = first & 0x0F
    if first & 0x70:
        return "a WebSocket frame with reserved bits set"
    if opcode not in (0x0, 0x1, 0x2, 0x8, 0x9, 0xA):
        return f"a WebSocket frame with the reserved opcode {opcode}"
    if not second & 0x80:
        return "an unmasked WebSocket frame from a client"
    if opcode >= 0x8 and (not first & 0x80 or second & 0x7F > 125):
        return "a fragmented or over-long WebSocket control frame"
    return None


def ws_accept(key: str) -> str:
    return base64.b64encode(hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest()).decode()


def error_doc(exc: BaseException | None, path: str | None) -> dict:
    """The problem an ``error`` event carries for a follower that failed with ``exc``."""
    if isinstance(exc, LMSPError):
        return exc.to_problem(instance=path) if path else exc.to_problem()
    log.error("event stream failed", exc_info=exc)
    return problem("server_error", "The stream failed; reconnect with Last-Event-ID to continue")


def stream_error(seq: int, doc: dict | None = None) -> str:
    """The SSE ``error`` event (with id ``seq``) that ends a stream the server cannot go on with;
    without ``doc``, an unexpected failure, logged here."""
    if doc is None:
        log.exception("event stream failed")
        doc = problem("server_error", "The stream failed; reconnect with Last-Event-ID to continue")
    return sse(seq, ERROR, dumps({"error": doc}))


# -- sinks: where a follower's frames go ----------------------------------------------------------------

class SocketSink:
    """A client socket owned by the fan-out thread: SSE (the response head already written) or a
    WebSocket (after its 101). Frames are sent without blocking; what the kernel does not take waits
    in ``out``, bounded."""

    __slots__ = ("hub", "sock", "ws", "path", "on_close", "follower", "out", "queued", "sent_at", "moved_at",
                 "pinged", "pong", "inbuf", "ending", "fin_at", "writing")

    def __init__(self, hub: "Hub", sock: socket.socket, ws: bool, path: str, on_close: Callable[[], None]):
        self.hub, self.sock, self.ws, self.path, self.on_close = hub, sock, ws, path, on_close
        self.follower: Follower | None = None
        self.out: deque = deque()
        self.queued = 0
        self.sent_at = self.moved_at = self.pinged = time.monotonic()
        self.pong = True
        self.inbuf: bytearray | None = None
        self.ending = False  # the follower ended: what is queued goes out, then the socket closes
        self.fin_at: float | None = None  # when the FIN went (all sent): linger until then + LINGER
        self.writing = False

    def events(self, batch: Batch) -> None:
        self.send(batch.encoded(self.ws), framed=True)

    def send(self, data: bytes, framed: bool = False) -> None:
        """Queue ``data`` (an SSE body's chunk framing added unless ``framed``)."""
        if self.sock is None:
            return
        if not (self.ws or framed):
            data = chunk(data)
        if self.out:
            self.out.append(data)
            self.queued += len(data)
            return
        try:
            n = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError:
            self.follower.end(GONE)
            return
        # Progress is bytes the kernel took, by whichever path; nothing was pending before this.
        self.sent_at = self.moved_at = time.monotonic()
        if n < len(data):
            self.out.append(memoryview(data)[n:])
            self.queued += len(data) - n
            self._want_write(True)

    def flush(self) -> None:
        """The socket can take more: send what waits, then go on with a replay or close."""
        while self.out:
            try:
                n = self.sock.sendmsg(list(itertools.islice(self.out, 64)))
            except (BlockingIOError, InterruptedError):
                if self.follower.more and self.wants_more():
                    self.follower.read_on()
                return
            except OSError:
                self.follower.end(GONE)
                return
            self.sent_at = self.moved_at = time.monotonic()
            self.queued -= n
            while n:
                head = self.out[0]
                if n >= len(head):
                    n -= len(head)
                    self.out.popleft()
                else:
                    self.out[0] = memoryview(head)[n:]
                    n = 0
        self._want_write(False)
        if self.ending:
            self._half_close()
        elif self.follower.more:
            self.follower.read_on()

    def wants_more(self) -> bool:
        """Whether a replay's next page may be read: less than the low-water mark is unsent."""
        return self.queued < self.hub.settings.follower_buffer_bytes // 2

    def behind(self) -> bool:
        """More is unsent than the bound: live batches are left to the log."""
        return self.queued > self.hub.settings.follower_buffer_bytes

    def finish(self, how: str, exc: BaseException | None, last: int) -> None:
        """The follower ended: say why in the stream's own terms, then close once it is sent."""
        if self.sock is None:
            return
        if how in (CUT, GONE):
            self.close()  # a client too slow or gone gets no goodbye: it resumes from the log
            return
        if self.ws:
            if how == FINISHED:
                self.send(ws_close(1000, "final event sent"))
            elif how == SHUTDOWN:
                self.send(ws_close(1012, "server restarting; reconnect with after to continue"))
            elif isinstance(exc, LMSPError) and exc.code == "unauthorized":
                self.send(ws_close(1008, exc.detail))  # policy violation: the token was revoked
            elif isinstance(exc, LMSPError) and exc.code == "payload_too_large":
                self.send(ws_close(1009, exc.detail))
            elif isinstance(exc, LMSPError) and exc.code == "invalid_request":
                self.send(ws_close(1002, exc.detail))  # the client broke the protocol
            else:
                frame = ws_frame(last, ERROR, dumps({"error": error_doc(exc, self.path)})).encode()
                self.send(ws_message(frame) + ws_close(1011, "the stream failed; reconnect with after"))
        elif how == SHUTDOWN:
            self.send(SHUTDOWN_NOTE.encode())
        elif how == FAILED:
            self.send(stream_error(last, error_doc(exc, self.path)).encode())
        if not self.ws:
            self.send(LAST_CHUNK, framed=True)
        self._end()

    def _end(self) -> None:
        self.ending = True
        self.hub.draining.add(self)
        if not self.out:
            self._half_close()

    def _half_close(self) -> None:
        """FIN after the last frame, then wait for the client's close (or LINGER): closing at once
        with unread input would reset the connection and could cost the client its last frames."""
        self.fin_at = time.monotonic()
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self.close()

    def on_readable(self) -> None:
        try:
            data = self.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            if self.ending:
                self.close()
            else:
                self.follower.end(GONE)
            return
        if self.ending:
            if len(data) > 1024:
                self.close()  # a goodbye is a few bytes: this client floods instead
            return
        if self.ws:
            self._ws_input(data)
        # SSE: a client has nothing to say on its stream; what it sends anyway is dropped.

    def _ws_input(self, data: bytes) -> None:
        """Client frames: answer pings and closes, note pongs, drop messages (none is expected)."""
        buf = self.inbuf = (self.inbuf or bytearray()) + data
        while len(buf) >= 2:
            opcode, n, at = buf[0] & 0x0F, buf[1] & 0x7F, 2
            broken = ws_violation(buf[0], buf[1])
            if broken:  # RFC 6455 7.1.7: fail the connection, 1002
                self.inbuf = None
                self.follower.end(FAILED, LMSPError("invalid_request", broken))
                return
            if n >= 126:
                at = 4 if n == 126 else 10
                if len(buf) < at:
                    break
                n = int.from_bytes(buf[2:at], "big")
            if n > WS_MAX_MESSAGE:
                self.inbuf = None
                self.follower.end(FAILED, LMSPError("payload_too_large", "A WebSocket message over 64 KiB"))
                return
            mask, at = buf[at:at + 4], at + 4
            if len(buf) < at + n:
                break
            payload = bytes(b ^ mask[i % 4] for i, b in enumerate(buf[at:at + n])) if opcode >= 0x8 else b""
            del buf[:at + n]
            if opcode == 0x8:  # close: answer it (with its code) and end
                self.inbuf = None
                if not self.ending:
                    self.follower.end(GONE, keep_socket=True)
                    self.send(ws_message(payload[:2], 0x8))
                    self._end()
                return
            if opcode == 0x9:
                self.send(ws_message(payload, 0xA))
            elif opcode == 0xA:
                self.pong = True
        if not buf:
            self.inbuf = None

    def tick(self, now: float) -> None:
        settings = self.hub.settings
        if self.ending:
            # Its last frames drain at the client's pace (bounded by the stall), then it lingers.
            if now - (self.moved_at if self.fin_at is None else self.fin_at) > \
                    (settings.follower_stall_seconds if self.fin_at is None else LINGER_SECONDS):
                self.close()
            return
        if self.out and now - self.moved_at > settings.follower_stall_seconds:
            log.info("follower of %s cut: %d bytes unsent, none taken for %.0f s", self.follower.response_id,
                     self.queued, now - self.moved_at)
            self.follower.end(CUT)
        elif self.ws and not self.out:
            # Behind a backlog, the bytes the client takes prove it is there (the stall check above);
            # a ping would wait behind them and its pong come late.
            if now - self.pinged >= settings.ws_ping_seconds:
                if not self.pong:
                    self.follower.end(GONE)  # it missed its pong: a vanished client
                    return
                self.pong, self.pinged = False, now
                self.send(ws_message(b"", 0x9))
        elif not self.out and now - self.sent_at >= settings.follower_heartbeat_seconds:
            self.send(KEEP_ALIVE)

    def _want_write(self, on: bool) -> None:
        if on != self.writing and self.sock is not None:
            self.writing = on
            self.hub.selector.modify(self.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if on else 0), self)

    def close(self) -> None:
        if self.sock is None:
            return
        sock, self.sock = self.sock, None
        self.out.clear()
        self.queued = 0
        try:
            self.hub.selector.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()
        self.hub.draining.discard(self)
        self.on_close()


class Ended:
    __slots__ = ("how", "exc")

    def __init__(self, how: str, exc: BaseException | None):
        self.how, self.exc = how, exc


class QueueSink:
    """A request thread reads this follower (``follow``): batches of events, then an ``Ended``."""

    __slots__ = ("hub", "follower", "items", "queued", "cond")

    def __init__(self, hub: "Hub"):
        self.hub = hub
        self.follower: Follower | None = None
        self.items: deque = deque()
        self.queued = 0
        self.cond = threading.Condition(threading.Lock())

    def events(self, batch: Batch) -> None:
        size = sum(len(e[2]) + 32 for e in batch.events)
        with self.cond:
            self.items.append(batch.events)
            self.queued += size
            self.cond.notify()

    def wants_more(self) -> bool:
        return not self.items

    def behind(self) -> bool:
        return self.queued > self.hub.settings.follower_buffer_bytes

    def finish(self, how: str, exc: BaseException | None, last: int) -> None:
        with self.cond:
            if how == CUT:
                self.items.clear()  # its memory goes at once; the client resumes from the log
            self.items.append(Ended(how, exc))
            self.cond.notify()

    def get(self, timeout: float):
        """The next batch or ``Ended``; None when nothing came for ``timeout`` seconds."""
        with self.cond:
            if not self.items and not self.cond.wait(timeout) and not self.items:
                return None
            item = self.items.popleft()
            if isinstance(item, list):
                self.queued -= sum(len(e[2]) + 32 for e in item)
            empty = not self.items
        if empty and self.follower.more:
            self.hub.call(self.follower.read_on)  # the replay's next page, now this one is taken
        return item

    def tick(self, now: float) -> None:
        pass  # the reading thread sends its own heartbeats

    def close(self) -> None:
        pass


# -- the follower ------------------------------------------------------------------------------------------

class Follower:
    """One client's position in one response's events, run by the fan-out thread only.

    * REPLAY: the log after ``after`` is read page by page (a page more once the last one is sent),
      after the subscription is live, so nothing published meanwhile is missed;
    * LIVE: published batches are sent as they come, each seq once, in order;
    * GAP: a batch did not follow the last seq sent (the channel lost something, or Redis came
      back): the log has what is missing; live batches wait in ``pending`` meanwhile;
    * ENDED: after the final event (also when resuming at or past it), SIGTERM, a failure (an
      ``error`` event), a revoked token, a client too slow (cut) or gone.

    ``ended()`` (asked when the log has nothing new) is None while the response runs, else the events
    that end the stream, numbered after the last sent (a task: none; a direct response whose worker
    died: its final event). ``logged`` is False for a direct stream: its events are in the log only
    when the worker could not publish them, so it starts live and reads the log on a gap or poll."""

    __slots__ = ("hub", "response_id", "sink", "state", "last", "logged", "ended", "authorized",
                 "pending", "reread", "reading", "more", "began", "last_auth", "confirmed", "checking")

    def __init__(self, hub: "Hub", response_id: str, sink):
        self.hub, self.response_id, self.sink = hub, response_id, sink
        sink.follower = self
        self.state = REPLAY
        self.last = 0
        self.logged = True
        self.ended: Callable[[], list[tuple[str, str]] | None] = _running
        self.authorized: Callable[[], bool] | None = None
        self.pending: list[Event] = []
        self.reread = self.reading = self.more = self.began = self.checking = False
        self.last_auth = time.monotonic()
        self.confirmed = threading.Event()  # the subscription is live (or Redis is away)

    def setup(self, after: int, logged: bool, ended, authorized) -> "Follower":
        self.last, self.logged, self.ended, self.authorized = after, logged, ended, authorized
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
        if events[0][0] == self.last + 1 and batch.contiguous and batch.final in (-1, len(events) - 1):
            self.last = events[-1][0]  # the common case: the next events, frames shared with the others
            self.sink.events(batch)
            if batch.final >= 0:
                self.end(FINISHED)
            return
        fresh, final = [], False
        for i, event in enumerate(events):
            if event[0] <= self.last:
                if event[1] in FINAL:
                    final = True  # it ended at or before the resume point: nothing more to send
                    break
                continue  # already sent from the log
            if event[0] != self.last + 1 and not jump:
                self.pending.extend(events[i:])  # the log has what the channel lost, if it was logged
                break
            fresh.append(event)
            self.last = event[0]
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

    def _read(self, ask_ended: bool, known=None) -> None:
        self.reading, self.more = True, False
        if self.state == LIVE:
            self.state = GAP
        self.hub.read(self, self.last, ask_ended, known)

    def read_on(self) -> None:
        """The sink took the last page of a replay: the next one."""
        if self.more and self.state != ENDED and not self.reading:
            self._read(ask_ended=True)  # an empty page after a full one: purged meanwhile (410), or its end

    def read_done(self, page: Batch | list[Event] | None, final: bool, closing, error: BaseException | None) -> None:
        self.reading = False
        if self.state == ENDED:
            return
        if error is not None:
            self.end(FAILED, error)
            return
        gained = bool(page)
        if page:
            batch = page if isinstance(page, Batch) else Batch(page)
            page = batch.events
            self.last = page[-1][0]
            self.hub.advanced(self.response_id, self.last)
            self.sink.events(batch)
            if self.state == ENDED:
                return
        if final:
            self.end(FINISHED)
        elif closing is not None:
            if closing and self.last == 0 and closing[0][0] != CREATED:
                # Nothing reached this stream (a direct response whose worker died before its first
                # event): it starts with response.created all the same.
                closing = [(CREATED, dumps(created(self.response_id))), *closing]
            if closing:
                self.sink.events(Batch(Sequence(self.last).number(closing)))
            self.end(FINISHED)
        elif (page and len(page) >= PAGE) or self.reread:
            self.reread, self.more = False, True
            if self.sink.wants_more():
                self.read_on()
        else:
            self.state = LIVE
            self.hub.advanced(self.response_id, self.last)
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
        self.pending = []
        self.hub.forget(self)
        if not keep_socket:
            self.sink.finish(how, exc, self.last)


def _running():
    return None


class Watcher:
    """A thread waiting for a response to change (the long poll of ``GET /tasks/{id}?wait``): each
    batch published for it, as published, and [] when the transport changed (read again)."""

    __slots__ = ("hub", "response_id", "sink", "confirmed", "began", "state", "logged", "reading", "more",
                 "last_auth")

    def __init__(self, hub: "Hub", response_id: str):
        self.hub, self.response_id = hub, response_id
        self.sink = QueueSink(hub)
        self.sink.follower = self
        self.confirmed = threading.Event()
        self.began, self.state, self.logged, self.reading, self.more = True, "watch", False, False, False
        self.last_auth = float("inf")  # nothing to recheck: the long poll checked its token

    def deliver(self, batch: Batch, jump: bool = False) -> None:
        self.notify(batch.events)

    def notify(self, events: list[Event]) -> None:
        with self.sink.cond:
            if len(self.sink.items) < 64:  # a waiter wants to know that something changed, not what
                self.sink.items.append(events)
                self.sink.cond.notify()

    def transport_changed(self) -> None:
        self.notify([])

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


class Topic:
    """The followers of one response in this process, and the polls of its log."""

    __slots__ = ("response_id", "followers", "head", "confirmed", "polling", "last_poll", "last_event",
                 "last_ended", "waiting")

    def __init__(self, response_id: str):
        self.response_id = response_id
        self.followers: set[Follower] = set()
        self.head = 0           # the highest seq this process has sent any follower of it
        self.confirmed = False  # Redis confirmed the subscription
        self.polling = False
        self.last_poll = self.last_event = self.last_ended = time.monotonic()
        self.waiting: list[tuple[float, Follower]] = []  # followers to begin once confirmed

    def sample(self) -> Follower | None:
        """A live follower, if any: while all of them read the log, their reads cover it."""
        return next((f for f in self.followers if f.state == LIVE and f.began), None)


# -- the hub -----------------------------------------------------------------------------------------------

class Hub:
    """The process's one Redis subscriber and its one fan-out thread.

    Only the listener thread connects or reconnects to Redis, never under the lock; (un)subscribe
    commands go out under the lock on a live connection only, so they stay ordered, and socket
    timeouts bound them. Topics and followers belong to the fan-out thread: other threads hand it
    work with ``call``."""

    def __init__(self, settings: Settings, sessions):
        self.settings = settings
        self.sessions = sessions
        self.client = redis.Redis.from_url(settings.redis_url, socket_timeout=2, socket_connect_timeout=1
                                           ) if settings.redis_url else None
        self._lock = threading.Lock()
        self._topics: dict[str, Topic] = {}
        self._pubsub = None
        self.connected = False
        self.closing = threading.Event()  # set on SIGTERM (api/__init__.py)
        self.closed = threading.Event()   # every task follower has been ended after SIGTERM
        self.selector = selectors.DefaultSelector()
        self._calls: deque = deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._readers = ThreadPoolExecutor(READERS, "lmsp-follow-read")
        self.draining: set[SocketSink] = set()  # sockets whose follower ended: their last frames go, then they close
        threading.Thread(target=self._run, name="lmsp-fanout", daemon=True).start()
        if self.client is not None:
            threading.Thread(target=self._listen, name="lmsp-hub", daemon=True).start()
        _hubs.add(self)

    # -- for request threads ---------------------------------------------------------------------------

    def call(self, fn, *args) -> None:
        """Run ``fn(*args)`` on the fan-out thread."""
        self._calls.append((fn, args))
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # the pipe is full: the thread is awake anyway

    def subscribe(self, response_id: str, confirm: bool = True) -> Follower:
        """A follower read by this thread (``follow``), subscribed: nothing published after this
        returns is missed; with ``confirm=False`` only after ``confirm(sub)`` returns (the caller does
        other work while Redis confirms)."""
        follower = Follower(self, response_id, QueueSink(self))
        self.call(self._add, follower)
        if confirm:
            self.confirm(follower)
        return follower

    def watch(self, response_id: str) -> Watcher:
        """A ``Watcher`` of ``response_id``, subscribed (see ``subscribe``)."""
        watcher = Watcher(self, response_id)
        self.call(self._add, watcher)
        self.confirm(watcher)
        return watcher

    def confirm(self, follower: Follower) -> bool:
        """Whether Redis confirmed the subscription (within CONFIRM_SECONDS): when not (Redis is away or
        slow), what is published meanwhile may not reach the follower."""
        follower.confirmed.wait(CONFIRM_SECONDS)
        topic = self._topics.get(follower.response_id)
        return topic is not None and topic.confirmed

    def attach(self, sock: socket.socket, *, ws: bool, path: str, response_id: str, after: int, ended,
               authorized, on_close: Callable[[], None]) -> None:
        """Hand a client's socket (its response head written) to the fan-out thread as a task follower.
        This request's thread subscribes it and reads its first page of the log, as a thread per
        follower did: a connect storm's reads run on the request threads, not on the few readers."""
        sock.setblocking(False)
        # The kernel's send buffer is bounded too: left to autotune it grows to tcp_wmem's maximum (4 MiB
        # on Linux) for a client that stops reading, hiding it from the follower's own bound for as long.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.settings.follower_buffer_bytes)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a frame is written whole: no wait
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, USER_TIMEOUT_MS)
        except (OSError, AttributeError):
            pass  # not TCP (a test's socket pair) or not Linux
        follower = Follower(self, response_id, SocketSink(self, sock, ws, path, on_close))
        follower.setup(after, True, ended, authorized)
        follower.reading = True  # live batches wait in pending until the first page is in
        self.call(self._add, follower)
        self.confirm(follower)
        try:
            page, final, closing = self._ask(response_id, after, True, ended, None)
            first, error = Batch(page) if page else None, None
            if first is not None:
                first.encoded(ws)
        except Exception as exc:  # noqa: BLE001 - the follower ends with an error event
            first, final, closing, error = None, False, None, exc
        self.call(self._attach, follower, first, final, closing, error)

    def start(self, follower: Follower, after: int, logged: bool, ended, authorized) -> None:
        follower.setup(after, logged, ended, authorized)
        self.call(self._begin, follower)

    def stop(self, follower: Follower) -> None:
        self.call(follower.end, GONE)

    def begin_shutdown(self) -> None:
        """SIGTERM: end every task follower (its client resumes on another process); direct
        streams cannot move and run on within gunicorn's graceful timeout."""
        self.closing.set()
        self.call(self._shutdown)

    # -- on the fan-out thread -------------------------------------------------------------------------

    def _add(self, follower: Follower) -> None:
        rid = follower.response_id
        topic = self._topics.get(rid)
        if topic is None:
            with self._lock:
                topic = self._topics[rid] = Topic(rid)
                if self.connected:
                    self._send(lambda ps: ps.subscribe(channel(rid)))
        topic.followers.add(follower)
        if isinstance(follower.sink, SocketSink):
            self.selector.register(follower.sink.sock, selectors.EVENT_READ, follower.sink)
        if topic.confirmed or not self.connected:
            follower.confirmed.set()

    def _attach(self, follower: Follower, first: Batch | None, final: bool, closing, error) -> None:
        follower.began = True
        if self.closing.is_set():
            follower.end(SHUTDOWN)
        else:
            follower.read_done(first, final, closing, error)

    def _begin(self, follower: Follower) -> None:
        if follower.logged and self.closing.is_set():
            follower.end(SHUTDOWN)
            return
        topic = self._topics.get(follower.response_id)
        if topic is None or follower.state == ENDED:
            return
        if follower.confirmed.is_set() or not follower.logged:
            follower.begin()
        else:
            topic.waiting.append((time.monotonic() + CONFIRM_SECONDS, follower))

    def forget(self, follower: Follower) -> None:
        """The follower ended: its topic (and the Redis subscription) goes with its last follower."""
        rid = follower.response_id
        topic = self._topics.get(rid)
        if topic is None:
            return
        topic.followers.discard(follower)
        if not topic.followers:
            with self._lock:
                del self._topics[rid]
                if self.connected:
                    self._send(lambda ps: ps.unsubscribe(channel(rid)))

    def advanced(self, response_id: str, seq: int) -> None:
        topic = self._topics.get(response_id)
        if topic is not None and seq > topic.head:
            topic.head = seq

    def _deliver(self, response_id: str, events: list[Event] | None) -> None:
        """A batch published for ``response_id`` (or a poll's page)."""
        topic = self._topics.get(response_id)
        if topic is None or not events:
            return
        events.sort()
        batch = Batch(events)
        topic.head = max(topic.head, events[-1][0])
        topic.last_event = time.monotonic()
        for follower in list(topic.followers):
            follower.deliver(batch)

    def _confirmed(self, response_id: str) -> None:
        topic = self._topics.get(response_id)
        if topic is None:
            return
        topic.confirmed = True
        self._begin_waiting(topic)

    def _begin_waiting(self, topic: Topic) -> None:
        waiting, topic.waiting = topic.waiting, []
        for follower in topic.followers:
            follower.confirmed.set()
        for _, follower in waiting:
            follower.begin()

    def _transport_changed(self) -> None:
        """Redis came or went: each topic polls its log now for what the change may have lost."""
        for topic in self._topics.values():
            topic.confirmed = False
            if not self.connected:
                self._begin_waiting(topic)
            topic.last_poll = topic.last_event = -1e9
            for follower in topic.followers:
                follower.transport_changed()

    def _shutdown(self) -> None:
        for topic in list(self._topics.values()):
            for follower in list(topic.followers):
                if follower.logged:
                    follower.end(SHUTDOWN)

    # -- database reads, on the reader threads --------------------------------------------------------

    def read_log(self, response_id: str, after: int) -> tuple[list[Event], bool]:
        """Events after ``after`` from the log (a page), up to the final one, and whether it is among them."""
        with self.sessions() as session:
            page = eventlog.read(session, response_id, after, limit=PAGE)
        final = not FINAL.isdisjoint(map(itemgetter(1), page))  # at C speed: a replay's pages are long
        if final:
            page = page[:next(i for i, event in enumerate(page) if event[1] in FINAL) + 1]
        return page, final

    def _ask(self, response_id: str, after: int, ask_ended: bool, ended, known):
        page, final = self.read_log(response_id, after)
        closing = None
        if not page and ask_ended:
            closing = known if known is not None else ended()
            if closing is not None:
                page, final = self.read_log(response_id, after)  # the final event may have landed since
        return page, final, closing

    def read(self, follower: Follower, after: int, ask_ended: bool, known=None) -> None:
        def job():
            try:
                result = self._ask(follower.response_id, after, ask_ended, follower.ended, known)
            except Exception as exc:  # noqa: BLE001 - the follower ends with an error event
                self.call(follower.read_done, [], False, None, exc)
                return
            self.call(follower.read_done, *result, None)
        self._readers.submit(job)

    def check_auth(self, follower: Follower) -> None:
        def job():
            try:
                valid = follower.authorized()
            except Exception:  # noqa: BLE001 - the database is away: ask again next time
                log.warning("token recheck failed", exc_info=True)
                valid = True
            self.call(follower.auth_done, valid)
        self._readers.submit(job)

    def _poll(self, topic: Topic, now: float) -> None:
        """One log read for every follower of a topic: what Redis did not bring (it is away, or a
        quiet task's safety net), then whether the response ended some other way."""
        sample = topic.sample()
        if sample is None:
            return
        every = SAFETY_NET_SECONDS if sample.logged else DIRECT_CHECK_SECONDS
        ask_ended = now - topic.last_ended >= every
        topic.polling, topic.last_poll = True, now
        if ask_ended:
            topic.last_ended = now
        head, ended = topic.head, sample.ended

        def job():
            try:
                result = self._ask(topic.response_id, head, ask_ended, ended, None)
            except Exception:  # noqa: BLE001 - the database is away: the next poll tries again
                log.warning("event log poll failed", exc_info=True)
                result = None
            self.call(self._polled, topic, result)
        self._readers.submit(job)

    def _polled(self, topic: Topic, result) -> None:
        topic.polling = False
        topic.last_poll = time.monotonic()
        if result is None or self._topics.get(topic.response_id) is not topic:
            return
        page, _final, closing = result
        if page:
            self._deliver(topic.response_id, list(page))
        if closing is not None:
            for follower in list(topic.followers):  # each reads to its own end (or its closing events)
                if follower.began and not follower.reading and follower.state != ENDED:
                    follower._read(ask_ended=True, known=closing)

    # -- the fan-out thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        next_tick = next_poll = 0.0
        while True:
            now = time.monotonic()
            timeout = max(0.0, min(next_tick, next_poll) - now)
            try:
                ready = self.selector.select(timeout)
            except OSError:
                ready = []
            for key, mask in ready:
                sink = key.data
                try:
                    if sink is None:
                        self._run_calls()
                        continue
                    if mask & selectors.EVENT_READ and sink.sock is not None:
                        sink.on_readable()
                    if mask & selectors.EVENT_WRITE and sink.sock is not None:
                        sink.flush()
                except Exception as exc:  # noqa: BLE001 - one follower's failure is not the others'
                    self._failed(sink.follower, exc)
            now = time.monotonic()
            if now >= next_poll:
                next_poll = now + (TICK_SECONDS if self.connected else self.settings.poll_interval_seconds)
                self._poll_topics(now)
            if now >= next_tick:
                next_tick = now + TICK_SECONDS
                self._tick(now)

    def _run_calls(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        calls = self._calls
        while calls:
            fn, args = calls.popleft()
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 - never let one follower stop the thread
                owner = getattr(fn, "__self__", None)
                self._failed(owner if isinstance(owner, Follower) else
                             next((a for a in args if isinstance(a, Follower)), None), exc)

    def _failed(self, follower: Follower | None, exc: BaseException) -> None:
        if follower is None:
            log.error("fan-out failed", exc_info=exc)
            return
        try:
            follower.end(FAILED, exc)
        except Exception:  # noqa: BLE001
            log.exception("a follower could not be ended")
            follower.sink.close()

    def _poll_topics(self, now: float) -> None:
        connected = self.connected
        for topic in list(self._topics.values()):
            if topic.waiting and topic.waiting[0][0] <= now:
                self._begin_waiting(topic)  # Redis did not confirm in time: go on, the polls cover it
            if topic.polling:
                continue
            if not connected:
                due = now - topic.last_poll >= self.settings.poll_interval_seconds
            else:
                sample = topic.sample()
                every = SAFETY_NET_SECONDS if sample is None or sample.logged else DIRECT_CHECK_SECONDS
                due = now - max(topic.last_poll, topic.last_event) >= every
            if due:
                self._poll(topic, now)

    def _tick(self, now: float) -> None:
        # Thousands of followers a tick: the checks that find nothing to do stay inline.
        settings = self.settings
        recheck, beat, ping = settings.stream_auth_recheck_seconds, settings.follower_heartbeat_seconds, \
            settings.ws_ping_seconds
        for topic in list(self._topics.values()):
            for follower in list(topic.followers):
                sink = follower.sink
                try:
                    if sink.__class__ is SocketSink and (sink.out or now - sink.pinged >= ping if sink.ws
                                                         else sink.out or now - sink.sent_at >= beat):
                        sink.tick(now)
                    if now - follower.last_auth >= recheck and follower.state != ENDED:
                        follower.check_auth(now)
                except Exception as exc:  # noqa: BLE001
                    self._failed(follower, exc)
        for sink in list(self.draining):
            sink.tick(now)
        if self.closing.is_set() and not self.draining and \
                not any(f.logged for t in self._topics.values() for f in t.followers):
            self.closed.set()

    # -- Redis --------------------------------------------------------------------------------------------

    def _send(self, fn) -> None:
        try:
            fn(self._pubsub)
        except (redis.RedisError, OSError, AttributeError):
            pass  # the listener notices the broken connection and resubscribes everything

    def _connect(self) -> None:
        pubsub = self.client.pubsub()
        pubsub.subscribe(HUB)
        with self._lock:
            channels = [channel(rid) for rid in self._topics]
            if channels:
                pubsub.subscribe(*channels)
            self._pubsub, self.connected = pubsub, True
        self.call(self._transport_changed)  # followers read the log for what they missed, then go live
        log.info("redis connected; followers are live")

    def _disconnect(self) -> None:
        with self._lock:
            pubsub, self._pubsub, self.connected = self._pubsub, None, False
        self.call(self._transport_changed)
        log.warning("redis connection lost; followers read the log until it is back")
        try:
            pubsub.close()
        except (redis.RedisError, OSError, AttributeError):
            pass

    def _listen(self) -> None:
        heard = pinged = 0.0
        while True:
            if not self.connected:
                try:
                    self._connect()
                except (redis.RedisError, OSError):
                    time.sleep(1.0)
                    continue
                heard = pinged = time.monotonic()
            try:
                message = self._pubsub.get_message(timeout=1.0)
                now = time.monotonic()
                if now - pinged >= PING_SECONDS:
                    self._pubsub.ping()
                    pinged = now
            except (redis.RedisError, OSError, ValueError, AttributeError):
                self._disconnect()
                continue
            if message is None:
                if now - heard > 3 * PING_SECONDS:
                    self._disconnect()  # connected but silent: a hung Redis
                continue
            heard = now
            kind = message["type"]
            if kind == "subscribe":
                name = message["channel"].decode()
                if name != HUB:
                    self.call(self._confirmed, response_of(name))
            elif kind == "message":
                self.call(self._deliver, response_of(message["channel"]), decode(message["data"]))


def follow(hub: Hub, response_id: str, after: int, *, logged: bool, heartbeat: float,
           ended: Callable[[], list[tuple[str, str]] | None],
           authorized: Callable[[], bool] | None = None,
           subscription: Follower | None = None) -> Iterator[list[Event] | None]:
    """A follower read by this thread: lists of events with seq > ``after``, in order, the last list
    ending with the final event; None means "nothing happened for ``heartbeat`` seconds". It raises
    ``ShuttingDown`` on SIGTERM (task followers only), the ``LMSPError`` of a revoked token or an
    expired log, or what a database read raised. ``subscription`` is one the caller opened before
    dispatching the work (so nothing is missed); see ``Follower`` for the rest."""
    follower = subscription or hub.subscribe(response_id)
    hub.start(follower, after, logged, ended, authorized)
    try:
        while True:
            item = follower.sink.get(heartbeat)
            if not isinstance(item, Ended):
                yield item
            elif item.how == SHUTDOWN:
                raise ShuttingDown()
            elif item.how == FAILED:
                raise item.exc
            else:
                return  # the final event was sent; or cut (too slow): the client resumes from the log
    finally:
        hub.stop(follower)


def fd_budget() -> int:
    """How many followers this process's open-file limit allows (raised to its hard limit first)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return max(1, (soft if soft != resource.RLIM_INFINITY else 1 << 20) - FD_RESERVE)


def shutdown_all(timeout: float = 2.0) -> None:
    """The api process is exiting: end every task follower, and give their goodbyes ``timeout``."""
    hubs = list(_hubs)
    for hub in hubs:
        hub.begin_shutdown()
    deadline = time.monotonic() + timeout
    for hub in hubs:
        hub.closed.wait(max(0.0, deadline - time.monotonic()))

