"""What a follower writes: a batch of events encoded once for every follower at the same point, as
SSE (a chunk of the HTTP/1.1 body) or as WebSocket text frames (``wsproto`` frames them), and the
stream's own goodbyes (an ``error`` event, the shutdown note)."""

import logging
from operator import itemgetter

from wsproto.frame_protocol import FrameProtocol
from wsproto.utilities import generate_accept_token

from common.errors import LMSPError, problem
from common.events import ERROR, FINAL, HEARTBEAT, ErrorEvent, Event, encode, sse, sse_many, ws_frame

log = logging.getLogger("lmsp.live")
SHUTDOWN_NOTE = ": this server is shutting down; reconnect with Last-Event-ID to continue\n\n"
KEEP_ALIVE = HEARTBEAT.encode()
# A handed-over SSE body is chunked (HTTP/1.1): clients that read a body by size (urllib3, so requests'
# iter_lines) get each frame as it is written, not once 512 bytes have piled up; this ends the body.
LAST_CHUNK = b"0\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def ws_text(payloads: list[str]) -> bytes:
    """Server text frames (unmasked, unfragmented, no extension): the same bytes on every connection."""
    frames = FrameProtocol(client=False, extensions=[])
    return b"".join([frames.send_data(p) for p in payloads])


# A batch's WebSocket frames are queued in pieces of about this size, whole frames each: a pong (or a
# close) goes between two pieces (sinks.SocketSink._urgent), not behind the rest of a replay page of a
# megabyte, which on a 64 kbit/s link outlasted the client's ping timeout.
WS_PIECE = 16 * 1024


def ws_pieces(payloads: list[str]) -> tuple[bytes, ...]:
    """``ws_text`` in pieces of about ``WS_PIECE`` bytes, each a run of whole frames."""
    frames = FrameProtocol(client=False, extensions=[])
    pieces, piece, size = [], [], 0
    for payload in payloads:
        frame = frames.send_data(payload)
        piece.append(frame)
        size += len(frame)
        if size >= WS_PIECE:
            pieces.append(b"".join(piece))
            piece, size = [], 0
    if piece:
        pieces.append(b"".join(piece))
    return tuple(pieces)


def ws_accept(key: str) -> str:
    """The handshake's Sec-WebSocket-Accept for a client's Sec-WebSocket-Key (RFC 6455 4.2.2)."""
    return generate_accept_token(key.encode()).decode()


class Batch:
    """Events in seq order, and their frames, encoded once however many followers send them."""

    __slots__ = ("events", "final", "contiguous", "_sse", "_chunked", "_ws")

    def __init__(self, events: list[Event]):
        self.events = events
        self.final = -1  # the index of the final event, if any (looked for at C speed first)
        if not FINAL.isdisjoint(map(itemgetter(1), events)):
            self.final = next(i for i, e in enumerate(events) if e[1] in FINAL)
        self.contiguous = events[-1][0] - events[0][0] == len(events) - 1
        self._sse = self._chunked = self._ws = None

    def encoded(self, ws: bool, chunked: bool) -> tuple[bytes, ...]:
        """The bytes to queue, in pieces: WebSocket frames (``ws``, ``ws_pieces``), else SSE in one piece,
        a chunk of the body (``chunked``) or plain (HTTP/1.0)."""
        if ws:
            if self._ws is None:
                self._ws = ws_pieces([ws_frame(*e) for e in self.events])
            return self._ws
        if chunked:
            if self._chunked is None:  # the plain body is kept only if an HTTP/1.0 follower asked for it
                self._chunked = (chunk(self._sse[0] if self._sse is not None else sse_many(self.events).encode()),)
            return self._chunked
        if self._sse is None:
            self._sse = (sse_many(self.events).encode(),)
        return self._sse


def error_doc(exc: BaseException | None, path: str | None) -> dict:
    """The problem an ``error`` event carries for a follower that failed with ``exc``."""
    if isinstance(exc, LMSPError):
        return exc.to_problem(instance=path) if path else exc.to_problem()
    log.error("event stream failed", exc_info=exc)
    return problem("server_error", "The stream failed; reconnect with Last-Event-ID to continue")


def stream_error(position: int, doc: dict | None = None) -> str:
    """The SSE ``error`` event that ends a stream the server cannot go on with; without ``doc``, an
    unexpected failure, logged here. It is not one of the response's events (6.3), so no number is made
    for it: its id is the stream's ``position`` (the last id sent), the one to resume from."""
    if doc is None:
        log.exception("event stream failed")
        doc = problem("server_error", "The stream failed; reconnect with Last-Event-ID to continue")
    return sse(position, ERROR, encode(ErrorEvent(error=doc)))


def ws_error(position: int, exc: BaseException | None, path: str | None) -> str:
    """The WebSocket frame of the ``error`` event that ends a failed stream (its id: as ``stream_error``'s)."""
    return ws_frame(position, ERROR, encode(ErrorEvent(error=error_doc(exc, path))))
