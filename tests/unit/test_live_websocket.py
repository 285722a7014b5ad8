"""One handed-over WebSocket's protocol (api/live/websocket.py), bytes in and out, no server: the
client's frames are made by wsproto's client side, so they are masked as a real client's are."""

import struct

import pytest
from wsproto.connection import Connection, ConnectionType
from wsproto.events import Ping, TextMessage

from api.live.websocket import MAX_MESSAGE, PING_FLOOD, WebSocket


def masked(opcode: int, payload: bytes) -> bytes:
    """A client frame wsproto would refuse to make (a bad close payload), masked with a zero key."""
    assert len(payload) < 126
    return bytes((0x80 | opcode, 0x80 | len(payload))) + b"\0\0\0\0" + payload


def frames(data: bytes) -> list[tuple[int, bytes]]:
    out, at = [], 0
    while at < len(data):
        n = data[at + 1] & 0x7F
        out.append((data[at] & 0x0F, data[at + 2:at + 2 + n]))
        at += 2 + n
    return out


def test_pings_read_together_get_one_pong_for_the_latest():
    ws = WebSocket()
    client = Connection(ConnectionType.CLIENT)
    data = b"".join(client.send(Ping(payload=b"%d" % i)) for i in range(5))
    pong, closing = ws.receive(data)
    assert closing is None and frames(pong) == [(0xA, b"4")]


def test_a_ping_flood_is_closed_with_1008_without_parsing_the_rest():
    ws = WebSocket()
    client = Connection(ConnectionType.CLIENT)
    flood = b"".join(client.send(Ping()) for _ in range(PING_FLOOD * 100))
    pong, closing = ws.receive(flood)
    assert closing is not None and closing.code == 1008
    assert frames(closing.frame)[0][0] == 0x8 and struct.unpack("!H", frames(closing.frame)[0][1][:2])[0] == 1008
    assert ws.pings == PING_FLOOD + 1  # the rest of the input was never parsed


@pytest.mark.parametrize("payload, code", [
    (b"\x03", 1002),                         # a 1-byte close payload (RFC 6455 5.5.1): not echoed
    (struct.pack("!H", 999), 1002),          # below the range of close codes (7.4.2)
    (struct.pack("!H", 1005), 1002),         # a code that must never be sent (7.4.1)
    (struct.pack("!H", 1016), 1002),         # reserved for the protocol, not defined
    (struct.pack("!H", 1000) + b"\xff", 1007),  # a reason that is not UTF-8 (8.1)
])
def test_a_bad_close_frame_is_answered_with_a_protocol_error(payload, code):
    _, closing = WebSocket().receive(masked(0x8, payload))
    assert closing is not None and not closing.answer
    assert frames(closing.frame) and struct.unpack("!H", frames(closing.frame)[0][1][:2])[0] == code


@pytest.mark.parametrize("payload, echoed", [
    (struct.pack("!H", 1000) + b"bye", struct.pack("!H", 1000) + b"bye"),
    (struct.pack("!H", 4000), struct.pack("!H", 4000)),   # an application's own code
    (b"", b""),                                            # no code: none in the answer (1005 is never sent)
])
def test_a_good_close_is_answered_with_its_code(payload, echoed):
    _, closing = WebSocket().receive(masked(0x8, payload))
    assert closing is not None and closing.answer
    assert frames(closing.frame) == [(0x8, echoed)]


def test_broken_frames_close_with_1002():
    for frame in (b"\x81\x02hi", b"\xc1\x80\0\0\0\0", b"\x83\x80\0\0\0\0", b"\x09\x80\0\0\0\0"):
        _, closing = WebSocket().receive(frame)
        assert closing is not None and closing.code == 1002, frame


def test_a_message_longer_than_the_bound_closes_with_1009():
    client = Connection(ConnectionType.CLIENT)
    ws = WebSocket()
    closing = None
    for _ in range(MAX_MESSAGE // 4096 + 2):
        _, closing = ws.receive(client.send(TextMessage(data="x" * 4096, message_finished=False)))
        if closing:
            break
    assert closing is not None and closing.code == 1009


def test_a_message_over_the_bound_in_one_frame_closes_with_1009():
    client = Connection(ConnectionType.CLIENT)
    _, closing = WebSocket().receive(client.send(TextMessage(data="x" * (MAX_MESSAGE + 1))))
    assert closing is not None and closing.code == 1009


def test_a_flood_of_small_messages_is_closed_with_1008():
    client = Connection(ConnectionType.CLIENT)
    ws = WebSocket()
    _, closing = ws.receive(b"".join(client.send(TextMessage(data="x" * 1000)) for _ in range(10)))
    assert closing is None  # a client may say a little
    flood = b"".join(client.send(TextMessage(data="x" * 1000)) for _ in range(MAX_MESSAGE // 1000 + 10))
    _, closing = ws.receive(flood)
    assert closing is not None and closing.code == 1008


def test_our_ping_waits_for_its_pong():
    ws = WebSocket()
    assert frames(ws.ping()) == [(0x9, b"")] and not ws.answered
    client = Connection(ConnectionType.CLIENT)
    client.receive_data(ws.ping())
    (ping,) = client.events()
    ws.receive(client.send(ping.response()))
    assert ws.answered


def test_our_close_after_the_clients_close_is_not_sent_twice():
    ws = WebSocket()
    ws.close(1000, "final event sent")
    assert ws.close(1000, "again").frame == b""


def test_a_close_reason_is_cut_to_fit_a_control_frame():
    frame = WebSocket().close(1008, "é" * 200).frame
    assert len(frame) <= 2 + 125  # a control frame holds 125 bytes
