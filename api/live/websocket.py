"""The WebSocket protocol of one handed-over socket, after its 101: ``wsproto`` parses the client's
frames (masking, reserved bits and opcodes, control-frame sizes, close codes, UTF-8) and frames the
server's control frames. No socket here: bytes in, what to do out, so the fan-out thread drives it
without blocking and the unit tests drive it without a server.

A client has nothing to say on an event stream but pings, pongs and its close. Its pings are
answered with one pong for the latest of those read together (RFC 6455 5.5.3 allows it); a client
that sends more than ``PING_FLOOD`` pings, or more than ``MAX_MESSAGE`` bytes of messages, in a
``PING_WINDOW`` floods it, and is closed with 1008 without the rest of its input being parsed (each
frame costs the one fan-out thread Python time that every other follower waits for).
"""

import time

from wsproto.connection import Connection, ConnectionState, ConnectionType
from wsproto.events import CloseConnection, Message, Ping, Pong
from wsproto.frame_protocol import FrameProtocol
from wsproto.utilities import LocalProtocolError

PING_FLOOD = 50          # pings in one PING_WINDOW: more is a flood
PING_WINDOW = 1.0        # seconds
MAX_MESSAGE = 65536      # a client message (none is expected) longer than this closes the socket (1009)
# A server's control frames depend on no state: a pong is framed here, as wsproto's connection refuses one
# once our close is made, though that close may still wait behind frames the pong can go before.
_CONTROL = FrameProtocol(client=False, extensions=[])


class Closing:
    """The connection is to end: ``frame`` (a close frame) goes out last; ``answer`` when it answers
    the client's own close."""

    __slots__ = ("frame", "code", "reason", "answer")

    def __init__(self, frame: bytes, code: int, reason: str, answer: bool):
        self.frame, self.code, self.reason, self.answer = frame, code, reason, answer


class WebSocket:
    """One server-side connection's protocol state."""

    __slots__ = ("conn", "pings", "said", "window", "answered", "message")

    def __init__(self):
        self.conn = Connection(ConnectionType.SERVER)
        self.pings = 0          # pings read in this window
        self.said = 0           # bytes of messages read in this window
        self.window = 0.0       # when it began
        self.answered = True    # the client answered our last ping (a pong)
        self.message = 0        # bytes of the client message being read

    def receive(self, data: bytes) -> tuple[bytes | None, Closing | None]:
        """The client's bytes: the pong to send (for the latest ping read), and whether to close."""
        try:
            self.conn.receive_data(data)
        except LocalProtocolError:  # after both closes: nothing more is read
            return None, None
        now = time.monotonic()
        if now - self.window >= PING_WINDOW:
            self.window, self.pings, self.said = now, 0, 0
        latest = None
        for event in self.conn.events():
            if isinstance(event, Ping):
                self.pings += 1
                if self.pings > PING_FLOOD:
                    return None, self.close(1008, "too many pings")
                latest = event
            elif isinstance(event, Pong):
                self.answered = True
            elif isinstance(event, CloseConnection):
                return None, self._answer(event)
            elif isinstance(event, Message):
                self.message += len(event.data)
                self.said += len(event.data)
                if self.message > MAX_MESSAGE:
                    return None, self.close(1009, "a WebSocket message over 64 KiB")
                if self.said > MAX_MESSAGE:
                    return None, self.close(1008, "too many messages")
                if event.message_finished:
                    self.message = 0
        return (_CONTROL.pong(latest.payload) if latest is not None else None), None

    def _answer(self, event: CloseConnection) -> Closing:
        """The client's close (or a frame wsproto refused, as the close it calls for): answered with
        its code per RFC 6455 5.5.1 (none when it sent none); a broken frame gets 1002/1007."""
        if self.conn.state is ConnectionState.REMOTE_CLOSING:
            return Closing(self.conn.send(event.response()), event.code, event.reason or "", True)
        return self.close(event.code, event.reason or "")  # wsproto refused the input (still OPEN)

    def close(self, code: int, reason: str) -> Closing:
        """Our close frame (``code``, ``reason`` cut to fit a control frame)."""
        reason = reason.encode()[:120].decode(errors="ignore")
        try:
            frame = self.conn.send(CloseConnection(code=code, reason=reason))
        except LocalProtocolError:
            frame = b""  # a close went already
        return Closing(frame, code, reason, False)

    def ping(self) -> bytes:
        self.answered = False
        return self.conn.send(Ping())
