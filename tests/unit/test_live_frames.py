"""What followers write (api/live/frames.py): a batch encoded once, as SSE chunks or WebSocket frames
that a WebSocket client library reads back."""

import json

from wsproto.connection import Connection, ConnectionType
from wsproto.events import TextMessage

from api.live.frames import LAST_CHUNK, WS_PIECE, Batch, chunk, stream_error, ws_accept
from common import events


def _events(n: int, final: bool = False) -> list[tuple[int, str, str]]:
    out = [(seq, events.TEXT_DELTA, events.dumps({"delta": "é" * seq})) for seq in range(1, n + 1)]
    if final:
        out.append((n + 1, events.COMPLETED, events.dumps({"status": "completed"})))
    return out


def test_a_batch_is_one_sse_chunk_encoded_once():
    batch = Batch(_events(3))
    (data,) = batch.encoded(False, True)
    assert batch.encoded(False, True)[0] is data
    size, _, rest = data.partition(b"\r\n")
    assert int(size, 16) == len(rest) - 2 and rest.endswith(b"\r\n") and rest.count(b"id: ") == 3
    assert batch.encoded(False, False) == (rest[:-2],)  # an HTTP/1.0 body: the same events, no chunk framing
    assert chunk(b"") == b"0\r\n\r\n" == LAST_CHUNK


def test_a_batch_as_websocket_frames_reads_back_as_one_message_an_event():
    batch = Batch(_events(200, final=True))  # some frames over 125 bytes: 16-bit lengths
    client = Connection(ConnectionType.CLIENT)
    pieces = batch.encoded(True, False)
    docs = []
    for piece in pieces:  # each piece reads back as whole messages on its own
        client.receive_data(piece)
        got = [e for e in client.events() if isinstance(e, TextMessage)]
        assert got and all(e.message_finished for e in got)
        docs += [json.loads(e.data) for e in got]
    assert [d["id"] for d in docs] == list(range(1, 202)) and docs[-1]["event"] == events.COMPLETED
    # A pong waits behind one piece, not the whole batch (issue: a ping timeout on a 64 kbit/s link).
    assert len(pieces) > 1 and max(map(len, pieces)) < WS_PIECE + 1024
    assert batch.final == 200 and batch.contiguous


def test_a_batch_knows_its_final_event_and_its_gaps():
    batch = Batch([(1, events.TEXT_DELTA, "{}"), (3, events.COMPLETED, "{}")])
    assert batch.final == 1 and not batch.contiguous


def test_the_handshake_accept_is_rfc_6455s_example():
    assert ws_accept("dGhlIHNhbXBsZSBub25jZQ==") == "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="


def test_a_stream_error_is_an_sse_error_event_with_the_resume_id():
    text = stream_error(7, {"type": "about:blank", "code": "x"})
    assert text.startswith("id: 7\nevent: error\n") and text.endswith("\n\n")
