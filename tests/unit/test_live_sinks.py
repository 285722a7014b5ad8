"""A handed-over socket (api/live/sinks.py) through the app's own WebSocket route, on a socket pair:
the fan-out thread writes the server's end, the test is the client (issue 33, defects 2 and 4)."""

import socket
import struct
import threading
import time

import pytest
from wsproto.connection import Connection, ConnectionType
from wsproto.events import CloseConnection, Ping, Pong

from api.live.websocket import PING_FLOOD
from tests.harness import wait_for

WS_HANDSHAKE = {"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
                "Sec-WebSocket-Version": "13"}


def _handed_over(caller, task_id: str, server_socket) -> None:
    with pytest.raises(StopIteration):  # the app ends the request: the socket is the fan-out's
        caller.get(f"/lmsp/v1/tasks/{task_id}/ws", headers=WS_HANDSHAKE,
                   environ_overrides={"werkzeug.socket": server_socket})


def _open(alice):
    task = alice.task("running")
    server, peer = socket.socketpair()
    view = threading.Thread(target=_handed_over, args=(alice, task.id, server), daemon=True)
    view.start()
    peer.settimeout(5)
    got = peer.recv(4096)
    assert got.startswith(b"HTTP/1.1 101")
    return server, peer, got.partition(b"\r\n\r\n")[2]


def _close_code(peer, got: bytes) -> int | None:
    """The code of the server's close frame, read raw (a client library would turn a broken close
    into its own 1002); None if it closed without one or with a 1-byte payload."""
    while True:
        at = 0
        while at + 2 <= len(got):  # server frames: unmasked, short here
            opcode, n = got[at] & 0x0F, got[at + 1] & 0x7F
            if n >= 126 or at + 2 + n > len(got):
                break
            if opcode == 0x8:
                return struct.unpack("!H", got[at + 2:at + 4])[0] if n >= 2 else None
            at += 2 + n
        data = peer.recv(4096)
        if not data:
            return None
        got += data


def test_a_one_byte_close_payload_is_a_protocol_error_not_echoed(alice):
    """RFC 6455 5.5.1: a close body starts with a 2-byte code; 1 byte breaks the protocol (1002)."""
    server, peer, got = _open(alice)
    with peer:
        peer.sendall(b"\x88\x81\0\0\0\0\x03")
        assert _close_code(peer, got) == 1002
    wait_for(lambda: server.fileno() == -1, 10, "the fan-out kept the socket")


def test_a_close_with_a_code_no_endpoint_may_send_is_1002(alice):
    server, peer, got = _open(alice)
    with peer:
        peer.sendall(b"\x88\x82\0\0\0\0" + struct.pack("!H", 1005))  # 1005: never on the wire (7.4.1)
        assert _close_code(peer, got) == 1002


def test_a_ping_flood_from_a_client_that_does_not_read_is_closed_with_1008(alice):
    """Issue 33, defect 2: pongs are not queued without bound for a client that never reads; the
    flooder gets 1008 and its socket goes."""
    server, peer, got = _open(alice)
    client = Connection(ConnectionType.CLIENT)
    ping = client.send(Ping(payload=b"x" * 100))
    sent, deadline = 0, time.monotonic() + 10
    with peer:
        peer.settimeout(0.2)
        try:
            while sent < 20 * PING_FLOOD and time.monotonic() < deadline:
                peer.sendall(ping * 10)  # never reads
                sent += 10
        except OSError:
            pass  # the server closed: what it wrote before is still readable
        peer.settimeout(5)
        try:
            while chunk := peer.recv(65536):  # the server's FIN follows its close frame
                got += chunk
        except OSError:
            pass
    reader = Connection(ConnectionType.CLIENT)
    reader.receive_data(got)
    seen = list(reader.events())
    assert isinstance(seen[-1], CloseConnection) and seen[-1].code == 1008, seen[-3:]
    assert sum(isinstance(e, Pong) for e in seen) < sent / 10  # one pong for the latest ping of a read
    wait_for(lambda: server.fileno() == -1, 10, "the fan-out kept the flooder's socket")


# --- a SocketSink alone, on a socket pair, with a stand-in loop and follower ---------------------------

class Loop:
    def __init__(self):
        self.draining = set()

    def want_write(self, sock, sink, on):
        pass

    def unregister(self, sock):
        pass


class Follower:
    response_id, more = "resp_1", False

    def __init__(self):
        self.ended = []

    def end(self, how, exc=None, keep_socket=False):
        self.ended.append(how)

    def read_on(self):
        pass


def _sink(unit, **settings):
    from api.live.sinks import SocketSink
    server, peer = socket.socketpair()
    server.setblocking(False)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sink = SocketSink(Loop(), unit.settings.model_copy(update=settings), server, True, "/x", lambda: None, False)
    sink.follower = Follower()
    return sink, peer


def test_a_socket_sink_reads_more_below_its_low_water_mark_only(unit):
    sink, peer = _sink(unit, follower_buffer_bytes=65536)
    with peer:
        sink.send(b"x" * 200_000)  # a replay page: far past what the kernel takes at once
        assert sink.queued > 65536 and sink.behind() and not sink.wants_more()
        while sink.queued >= 65536 // 2:
            peer.recv(1 << 20)
            sink.flush()
        assert sink.wants_more() and not sink.behind()


def test_progress_is_any_byte_the_kernel_took_and_only_a_stall_cuts(unit):
    sink, peer = _sink(unit, follower_stall_seconds=60, ws_ping_seconds=10)
    with peer:
        sink.send(b"x" * 200_000)
        sink.tick(sink.moved_at + 59)
        assert sink.follower.ended == []
        sink.pinged, sink.ws.answered = sink.moved_at - 100, False  # a ping long unanswered, behind a backlog
        sink.tick(sink.moved_at + 30)
        assert sink.follower.ended == []  # the bytes it takes prove it is there
        sink.tick(sink.moved_at + 61)
        assert sink.follower.ended == ["cut"]


def test_a_pong_goes_before_the_queued_events_and_replaces_an_unsent_one(unit):
    sink, peer = _sink(unit)
    with peer:
        sink.send(b"a" * 100_000)
        sink.send(b"b" * 1000)
        sink._urgent(b"\x8a\x01" + b"1")
        sink._urgent(b"\x8a\x01" + b"2")
        assert [bytes(item[:3]) for item in sink.out][1:] == [b"\x8a\x012", b"bbb"]
        assert sink.queued == sum(len(item) for item in sink.out)


def test_a_ping_while_the_stream_drains_to_its_close_is_answered_before_the_close(unit):
    """Found on a 64 kbit/s link: a whole log's replay (one page with its final event) ends the follower at
    once, and its frames then drain at the client's pace; its pings were dropped unread, and the client
    (python-websockets: 20 s) dropped the stream after ~1,100 of 2,800 frames. The pong goes after the
    frames being written and before the close; once the close is being written, no pong follows it."""
    from api.live.follower import FINISHED

    sink, peer = _sink(unit)
    with peer:
        sink.send(b"x" * 100_000)
        sink.finish(FINISHED, None, 7)
        assert sink.ending and len(sink.out) == 2
        client = Connection(ConnectionType.CLIENT)
        peer.sendall(client.send(Ping(b"p1")))
        wait_for(lambda: sink.on_readable() or len(sink.out) == 3, 5, "the ping was not answered")
        got = b""
        while sink.out or len(got) < 100_000:
            sink.flush()
            got += peer.recv(1 << 20)  # flush wrote, or the kernel's buffer is full: either way a read
        client.receive_data(got[100_000:])  # past the stand-in events: the server's control frames
        seen = list(client.events())
        assert isinstance(seen[0], Pong) and seen[0].payload == b"p1"
        assert isinstance(seen[1], CloseConnection) and seen[1].code == 1000
        # Once its close is being written, a ping gets no pong: nothing may follow the close.
        peer.sendall(client.send(Ping(b"p2")) if client.state.name == "OPEN" else b"\x89\x82\0\0\0\0p2")
        sink.on_readable()
        assert not sink.out
