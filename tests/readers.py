"""Clients that follow a task's events as a person on a slow link would: one raw connection, read
as it comes (or with a pause), then the whole body parsed, so the test sees exactly what the server
sent (every id, repeats too, and whether the stream ended with the final event); and the long
report they follow, made by a simulated engine.

Used by the slow-link tests (tests/functional/test_slow_links.py) and make bench's B7.
"""

import base64
import json
import os
import socket
import time
from dataclasses import dataclass, field

from tests.harness import model_entry, user

# The worker writes each token as an event (a task's deltas are otherwise coalesced over 200 ms).
REPORT_WORKER = {"LMSP_TASK_DELTA_WINDOW_MS": "0", "LMSP_DELTA_MAX_TOKENS": "1"}
FINALS = ("response.completed", "response.incomplete", "response.failed", "response.cancelled")


@dataclass
class Stream:
    """What one connection got: (id, event) pairs in order, the WebSocket close code, the body's size."""

    events: list[tuple[int, str]] = field(default_factory=list)
    status: int = 0
    close_code: int | None = None
    nbytes: int = 0
    seconds: float = 0.0
    complete: bool = False  # the body ended as the protocol ends it (last chunk, or a close frame)

    @property
    def ids(self) -> list[int]:
        return [seq for seq, _ in self.events]

    @property
    def final(self) -> bool:
        return bool(self.events) and self.events[-1][1] in FINALS


def report_model(model: str, tokens: int, rate: int = 1000) -> dict:
    """A sim model whose every tick makes one text delta (an event) of one token, ``rate`` a second
    (at 1,000 a loaded worker falls behind now and then and writes two tokens as one event)."""
    return model_entry(model, context_window=tokens + 512, max_output_tokens=tokens, engine={
        "kind": "sim", "max_num_seqs": 4, "ttft_ms": 10, "tokens_per_s": rate, "tick_ms": 1})


def start_report(client, model: str, tokens: int) -> dict:
    """POST a report task of ``tokens`` tokens (``client``: tests.harness.Client); its 202 body."""
    resp = client.post("/lmsp/v1/tasks", {"type": "response", "input": {
        "model": model, "input": user("Write the annual report."), "max_output_tokens": tokens}})
    assert resp.status_code == 202, resp.text
    return resp.json()


def request(path: str, token: str, ws: bool, headers: dict | None = None) -> bytes:
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    if ws:
        key = base64.b64encode(os.urandom(16)).decode()
        extra += f"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: {key}\r\n"
    return (f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n{extra}\r\n").encode()


def follow(port: int, path: str, token: str, *, ws: bool, timeout: float = 300, pause_after: int = 0,
           pause: float = 0.0, rcvbuf: int = 0, headers: dict | None = None) -> Stream:
    """Read one stream to its end; ``pause_after`` bytes in, stop reading for ``pause`` seconds."""
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(timeout)
    started = time.monotonic()
    sock.connect(("127.0.0.1", port))
    sock.sendall(request(path, token, ws, headers))
    got, paused = bytearray(), not pause
    try:
        while True:
            data = sock.recv(1 << 16)
            if not data:
                break
            got += data
            if ws and len(got) > 2 and _ws_closed(got):
                break  # the server's close frame: the body is whole (its FIN follows)
            if not paused and len(got) >= pause_after:
                paused = True
                time.sleep(pause)
    except (TimeoutError, ConnectionResetError):
        pass
    finally:
        sock.close()
    stream = Stream(nbytes=len(got), seconds=time.monotonic() - started)
    head, _, body = bytes(got).partition(b"\r\n\r\n")
    stream.status = int(head.split()[1]) if head.startswith(b"HTTP/") else 0
    if stream.status in (101, 200):
        (_parse_ws if ws else _parse_sse)(body, stream)
    return stream


def _ws_closed(got: bytearray) -> bool:
    # Cheap: a close frame is the last thing the server writes; look at the tail only.
    tail = bytes(got[-130:])
    return b"\x88" in tail and _ws_frames(bytes(got).partition(b"\r\n\r\n")[2])[1] is not None


def _ws_frames(body: bytes) -> tuple[list[bytes], int | None]:
    frames, close, at = [], None, 0
    while at + 2 <= len(body):
        opcode, n, start = body[at] & 0x0F, body[at + 1] & 0x7F, at + 2
        if n == 126:
            n, start = int.from_bytes(body[at + 2:at + 4], "big"), at + 4
        elif n == 127:
            n, start = int.from_bytes(body[at + 2:at + 10], "big"), at + 10
        if start + n > len(body):
            break
        payload = body[start:start + n]
        if opcode == 0x1:
            frames.append(payload)
        elif opcode == 0x8:
            close = int.from_bytes(payload[:2], "big") if len(payload) >= 2 else 1005
        at = start + n
    return frames, close


def _parse_ws(body: bytes, stream: Stream) -> None:
    frames, stream.close_code = _ws_frames(body)
    stream.complete = stream.close_code is not None
    for payload in frames:
        doc = json.loads(payload)
        stream.events.append((doc["id"], doc["event"]))


def _parse_sse(body: bytes, stream: Stream) -> None:
    text, at = bytearray(), 0
    while True:  # the body is chunked (RFC 9112 7.1); a cut one ends mid-chunk
        end = body.find(b"\r\n", at)
        if end < 0:
            break
        size = int(body[at:end].split(b";")[0] or b"0", 16)
        if size == 0:
            stream.complete = True
            break
        text += body[end + 2:end + 2 + size]
        at = end + 4 + size
    for block in bytes(text).decode(errors="replace").split("\n\n")[:-1]:  # whole events only
        fields = dict(line.split(": ", 1) for line in block.split("\n") if ": " in line and line[0] != ":")
        if "id" in fields and "event" in fields:
            stream.events.append((int(fields["id"]), fields["event"]))


def follow_resuming(port: int, path: str, token: str, *, ws: bool, timeout: float = 120, pause_after: int = 0,
                    pause: float = 0.0, rcvbuf: int = 0, most: int = 5) -> tuple[list[tuple[int, str]], int]:
    """Follow to the final event as a client that reconnects does: after an end without it, again
    from the last whole event (Last-Event-ID). The events of every connection, and how many it took."""
    got: list[tuple[int, str]] = []
    for n in range(1, most + 1):
        last = got[-1][0] if got else 0
        stream = follow(port, path, token, ws=ws, timeout=timeout, rcvbuf=rcvbuf,
                        pause_after=pause_after if n == 1 else 0, pause=pause if n == 1 else 0.0,
                        headers={"Last-Event-ID": str(last)} if last else None)
        got += stream.events
        if stream.final:
            return got, n
    return got, most
