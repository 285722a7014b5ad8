"""Where a follower's frames go.

* ``SocketSink``: the client's own socket, handed over by the WSGI server once the view has checked
  the request (``api/serve.py``, ``api/handover.py``), written without blocking by the fan-out
  thread: SSE (the response head already written) or a WebSocket (after its 101). What the kernel
  does not take waits in ``out``; the follower reads no more of the log while more than the
  low-water mark waits (``wants_more``) and takes no live batch past the bound (``behind``). Progress
  is any byte the kernel takes; a client that takes none for ``follower_stall_seconds`` is cut.
* ``QueueSink``: a request thread reads the follower (``follow``): direct responses, which hold
  their thread anyway (their request waits for the model), and servers that cannot hand a socket
  over (the Flask test client).

A sink is told by its follower (``events``, ``finish``) and tells it back only through the
follower's public methods (``end``, ``read_on``, ``more``).
"""

import array
import fcntl
import itertools
import logging
import socket
import termios
import threading
import time
from collections import deque
from collections.abc import Callable
from operator import itemgetter

from api.live.follower import CLOSED, CUT, FAILED, FINISHED, GONE, SHUTDOWN
from api.live.frames import (
    KEEP_ALIVE,
    LAST_CHUNK,
    SHUTDOWN_NOTE,
    Batch,
    chunk,
    error_doc,
    stream_error,
    ws_error,
    ws_text,
)
from api.live.websocket import Closing, WebSocket
from common.errors import LMSPError
from common.settings import Settings

log = logging.getLogger("lmsp.live")
LINGER_SECONDS = 2.0       # after its last frame is sent, how long a socket waits for the client to close
GOODBYE_MAX = 1024         # what a client may send once its stream ended (a close frame) before it is reset
# A WebSocket's close code for how a follower ended (the rest: 1011, after an error event).
WS_CODES = {"unauthorized": 1008, "payload_too_large": 1009, "invalid_request": 1002}


class SocketSink:
    """A client socket owned by the fan-out thread (``loop``: api/live/loop.py)."""

    __slots__ = ("loop", "settings", "sock", "ws", "chunked", "path", "on_close", "follower", "out", "queued",
                 "sent_at", "moved_at", "pinged", "pong", "ending", "fin_at", "writing", "written", "acked",
                 "acked_at")

    def __init__(self, loop, settings: Settings, sock: socket.socket, ws: bool, path: str,
                 on_close: Callable[[], None], chunked: bool):
        """``chunked``: an SSE body in chunks (HTTP/1.1); else plain, ended by the close (HTTP/1.0)."""
        self.loop, self.settings, self.sock, self.path, self.on_close = loop, settings, sock, path, on_close
        self.ws = WebSocket() if ws else None
        self.chunked = chunked and not ws
        self.follower = None
        self.out: deque = deque()
        self.queued = 0
        self.sent_at = self.moved_at = self.pinged = self.acked_at = time.monotonic()
        self.written = self.acked = 0  # bytes the kernel took; of those, the client acknowledged (``_acked_lately``)
        self.pong: bytes | None = None  # a pong waiting in ``out`` (one at a time: the latest ping's)
        self.ending = False  # the follower ended: what is queued goes out, then the socket closes
        self.fin_at: float | None = None  # when the FIN went (all sent): linger until then + LINGER
        self.writing = False

    def events(self, batch: Batch) -> None:
        for piece in batch.encoded(self.ws is not None, self.chunked):
            self.send(piece, framed=True)

    def send(self, data: bytes, framed: bool = False) -> None:
        """Queue ``data`` (a chunked SSE body's chunk framing added unless ``framed``)."""
        if self.sock is None:
            return
        if self.chunked and not framed:
            data = chunk(data)
        if self.out:
            self.out.append(data)
            self.queued += len(data)
            return
        self._write(data)

    def _write(self, data: bytes) -> None:
        try:
            n = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError:
            self.follower.end(GONE)
            return
        # Progress is bytes the kernel took, by whichever path; nothing was pending before this.
        self.sent_at = self.moved_at = time.monotonic()
        self.written += n
        if n < len(data):
            self.out.append(memoryview(data)[n:])
            self.queued += len(data) - n
            self._want_write(True)

    def _urgent(self, frame: bytes) -> None:
        """A control frame goes before the queued events (after the frame being written): a pong
        behind a backlog would come too late for the client's ping timeout. One pong waits at most
        (the latest ping's), so the control frames a client provokes stay within a few bytes."""
        if not self.out:
            self._write(frame)
            return
        if self.pong is not None:
            for i, item in enumerate(self.out):
                if item is self.pong:
                    self.queued -= len(item)
                    del self.out[i]
                    break
        self.out.insert(1, frame)
        self.queued += len(frame)
        self.pong = frame

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
            self.written += n
            self.queued -= n
            while n:
                head = self.out[0]
                if n >= len(head):
                    n -= len(head)
                    if self.out.popleft() is self.pong:
                        self.pong = None
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
        return self.queued < self.settings.follower_buffer_bytes // 2

    def idle(self) -> bool:
        """Nothing is unsent: its reader keeps up (a replay reads its next page ahead)."""
        return not self.out

    def behind(self) -> bool:
        """More is unsent than the bound: live batches are left to the log."""
        return self.queued > self.settings.follower_buffer_bytes

    def finish(self, how: str, exc: BaseException | None, last: int) -> None:
        """The follower ended: say why in the stream's own terms, then close once it is sent."""
        if self.sock is None:
            return
        if how in (CUT, GONE):
            self.close()  # a client too slow or gone gets no goodbye: it resumes from the log
            return
        if self.ws is not None:
            self._ws_goodbye(how, exc, last)
        else:
            if how == SHUTDOWN:
                self.send(SHUTDOWN_NOTE.encode())
            elif how == FAILED:
                self.send(stream_error(last, error_doc(exc, self.path)).encode())
            if self.chunked:
                self.send(LAST_CHUNK, framed=True)
        self._end()

    def _ws_goodbye(self, how: str, exc: BaseException | None, last: int) -> None:
        if how == FINISHED:
            self.send(self.ws.close(1000, "final event sent").frame)
        elif how == SHUTDOWN:
            self.send(self.ws.close(1012, "server restarting; reconnect with after to continue").frame)
        elif isinstance(exc, LMSPError) and exc.code in WS_CODES:
            self.send(self.ws.close(WS_CODES[exc.code], exc.detail).frame)  # 1008: the token was revoked
        else:
            self.send(ws_text([ws_error(last, exc, self.path)]) +
                      self.ws.close(1011, "the stream failed; reconnect with after").frame)

    def _end(self) -> None:
        self.ending = True
        self.loop.draining.add(self)
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
            if len(data) > GOODBYE_MAX:
                self.close()  # a goodbye is a few bytes: this client floods instead
            elif self.ws is not None and len(self.out) > 1:
                # Our close frame (the last item) is not being written yet: a ping still gets its pong,
                # ahead of it. A whole log's replay drains at the client's pace, minutes on a slow link,
                # and a client whose pings go unanswered for 20 s drops the stream (python-websockets).
                pong, _ = self.ws.receive(data)
                if pong is not None:
                    self._urgent(pong)
            return
        if self.ws is not None:
            pong, closing = self.ws.receive(data)
            if pong is not None:
                self._urgent(pong)
            if closing is not None:
                self._ws_closed(closing)
        # SSE: a client has nothing to say on its stream; what it sends anyway is dropped.

    def _ws_closed(self, closing: Closing) -> None:
        """The client closed, broke the protocol or flooded: our close frame is the last one sent."""
        if closing.code == 1008:
            log.info("follower of %s closed: %s", self.follower.response_id, closing.reason)
        self.follower.end(CLOSED, keep_socket=True)
        self.send(closing.frame)
        self._end()

    def tick(self, now: float) -> None:
        settings = self.settings
        if self.ending:
            # Its last frames drain at the client's pace (bounded by the stall); after its FIN it lingers
            # while the kernel still sends them (closing then would reset the connection and lose them).
            if self.fin_at is None:
                if now - self.moved_at > settings.follower_stall_seconds:
                    log.info("follower of %s cut at its end: %d bytes unsent, none taken for %.0f s",
                             self.follower.response_id, self.queued, now - self.moved_at)
                    self.close()
            elif now - self.fin_at > LINGER_SECONDS and (not _unacked(self.sock) or not self._acked_lately(now)):
                self.close()
            return
        if self.out and now - self.moved_at > settings.follower_stall_seconds:
            log.info("follower of %s cut: %d bytes unsent, none taken for %.0f s", self.follower.response_id,
                     self.queued, now - self.moved_at)
            self.follower.end(CUT)
        elif not self.out and not self._acked_lately(now):
            log.info("follower of %s gone: no byte acknowledged for over %.0f s", self.follower.response_id,
                     now - self.acked_at)
            self.follower.end(GONE)
        elif self.ws is not None and not self.out:
            # Behind a backlog, the bytes the client takes prove it is there (the stall check above);
            # a ping would wait behind them and its pong come late.
            if now - self.pinged >= settings.ws_ping_seconds:
                if not self.ws.answered:
                    self.follower.end(GONE)  # it missed its pong: a vanished client
                    return
                self.pinged = now
                self.send(self.ws.ping())
        elif self.ws is None and not self.out and now - self.sent_at >= settings.follower_heartbeat_seconds:
            self.send(KEEP_ALIVE)

    def _acked_lately(self, now: float) -> bool:
        """Whether the client acknowledged a byte within ``follower_stall_seconds``, or has nothing left to
        acknowledge (the kernel asked once that long has passed since the last acknowledgement seen). What
        tells a vanished client from a slow one when nothing waits here: the kernel's own timeout
        (TCP_USER_TIMEOUT) also cut slow readers, whose windows open a little at a time."""
        if now - self.acked_at <= self.settings.follower_stall_seconds:
            return True
        acked = self.written - _unacked(self.sock)
        if acked > self.acked or acked >= self.written:
            self.acked, self.acked_at = acked, now
            return True
        return False

    def _want_write(self, on: bool) -> None:
        if on != self.writing and self.sock is not None:
            self.writing = on
            self.loop.want_write(self.sock, self, on)

    def close(self) -> None:
        if self.sock is None:
            return
        sock, self.sock = self.sock, None
        self.out.clear()
        self.queued = 0
        self.pong = None
        self.loop.unregister(sock)
        sock.close()
        self.loop.draining.discard(self)
        self.on_close()


def _unacked(sock: socket.socket) -> int:
    """Bytes the kernel holds for the client, sent or not, until it acknowledges them (SIOCOUTQ; a FIN
    counts one)."""
    left = array.array("i", [0])
    try:
        fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, left)  # TIOCOUTQ is SIOCOUTQ on a socket
    except OSError:
        return 0
    return left[0]


class Ended:
    """The last item of a ``QueueSink``: how its follower ended."""

    __slots__ = ("how", "exc")

    def __init__(self, how: str, exc: BaseException | None):
        self.how, self.exc = how, exc


def _size(events: list) -> int:
    """What a batch of events weighs against the bound (their data, and 32 for the rest), at C speed:
    a replay's pages hold thousands."""
    return sum(map(len, map(itemgetter(2), events))) + 32 * len(events)


class QueueSink:
    """A request thread reads this follower (``follow``): batches of events, then an ``Ended``."""

    __slots__ = ("call", "settings", "follower", "items", "queued", "cond")

    def __init__(self, call: Callable, settings: Settings):
        self.call, self.settings = call, settings  # call: run on the fan-out thread
        self.follower = None
        self.items: deque = deque()
        self.queued = 0
        self.cond = threading.Condition(threading.Lock())

    def events(self, batch: Batch) -> None:
        size = _size(batch.events)
        with self.cond:
            self.items.append(batch.events)
            self.queued += size
            self.cond.notify()

    def notify(self, events: list, most: int) -> None:
        """A change for a waiter (``Watcher``): kept only while fewer than ``most`` wait."""
        with self.cond:
            if len(self.items) < most:
                self.items.append(events)
                self.cond.notify()

    def wants_more(self) -> bool:
        return not self.items

    idle = wants_more  # its reader took every batch: nothing waits

    def behind(self) -> bool:
        return self.queued > self.settings.follower_buffer_bytes

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
                self.queued -= _size(item)
            empty = not self.items
        if empty and self.follower.more:
            self.call(self.follower.read_on)  # the replay's next page, now this one is taken
        return item

    def tick(self, now: float) -> None:
        pass  # the reading thread sends its own heartbeats

    def close(self) -> None:
        pass
