"""WebSocket mode (api/views/realtime.py, api/services/lanes.py) without servers: the refusals before
the handshake are documented problem documents, and the client's messages and the server's frames
have the shapes the OpenAI SDK reads. tests/functional/test_ws_mode.py drives it with the SDK."""

import json

import pytest

from api.services.lanes import error_event, frame, parse
from common.errors import LMSPError, problem
from tests.unit.conftest import unit_settings
from tests.unit.test_openapi import SPEC, check

PATH = "/lmsp/v1/responses"
KEY = "dGhlIHNhbXBsZSBub25jZQ=="  # RFC 6455's example nonce
UPGRADE = {"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13"}


@pytest.fixture(scope="module")
def doc(unit):
    return unit.client.get(SPEC, headers={"Authorization": f"Bearer {unit.token('openapi', 'models:read')}"}).get_json()


def test_refusals_come_before_the_handshake_as_documented_problems(doc, alice):
    op = doc["paths"][PATH]["get"]
    assert "101" in op["responses"] and op["x-lmsp-scope"] == "responses:write"
    # Not an upgrade: only POST takes a plain request, and Allow says so (GET is the WebSocket mode's)
    check(doc, alice, "GET", PATH, PATH, 405)
    plain = alice.get(PATH)
    assert plain.headers["Allow"] == "OPTIONS, POST"
    # what a proxy that drops the upgrade's headers makes of a client's handshake: said so
    assert plain.get_json()["detail"] == (f"GET {PATH} is served only as a WebSocket upgrade (Connection: Upgrade, "
                                          "Upgrade: websocket); a proxy in front must pass both headers on")
    assert alice.open("PUT", PATH).get_json()["detail"] == f"PUT is not allowed on {PATH}"
    check(doc, alice, "GET", PATH, PATH, 400, headers={**UPGRADE, "Sec-WebSocket-Key": "short"})
    reader = alice.unit.as_(alice.principal, "responses:read")
    check(doc, reader, "GET", PATH, PATH, 403, headers={**UPGRADE, "Sec-WebSocket-Key": KEY})
    check(doc, alice.unit.anonymous, "GET", PATH, PATH, 401, headers={**UPGRADE, "Sec-WebSocket-Key": KEY})
    # A well-formed handshake on a server that has no socket to give (the test client) is refused too.
    body = check(doc, alice, "GET", PATH, PATH, 400, headers={**UPGRADE, "Sec-WebSocket-Key": KEY})
    assert "lmsp serve" in body["detail"]


def test_a_create_event_is_the_create_body_flat(tmp_path):
    settings = unit_settings(tmp_path)
    create = parse(json.dumps({"type": "response.create", "model": "m", "input": "hi", "stream_id": "a",
                               "max_output_tokens": 4}), settings)
    assert create.stream_id == "a" and create.generate
    assert create.body == {"model": "m", "input": "hi", "max_output_tokens": 4, "stream": True}
    warm = parse(b'{"type": "response.create", "model": "m", "input": "hi", "generate": false}', settings)
    assert warm.stream_id is None and not warm.generate and warm.body["stream"] is False


@pytest.mark.parametrize("message, param", [
    ('{"type": "response.cancel"}', "type"),
    ('{"type": "response.create", "stream_id": 7}', "stream_id"),
    ('{"type": "response.create", "stream_id": ""}', "stream_id"),
    ('{"type": "response.create", "generate": "no"}', "generate"),
    ('{"type": "response.create", "background": true}', "background"),
    ('{"type": "response.create", "stream": true}', "stream"),
    ('[1]', None),
    ('{"type": ', None),
    (b'\xff', None),
])
def test_a_bad_message_is_an_invalid_request(tmp_path, message, param):
    with pytest.raises(LMSPError) as caught:
        parse(message, unit_settings(tmp_path))
    assert caught.value.code == "invalid_request" and caught.value.param == param


def test_error_event_has_the_websocket_shape():
    event = json.loads(error_event(problem("invalid_request", "bad", param="input"), "lane"))
    assert event["type"] == "error" and event["status"] == 400 and event["stream_id"] == "lane"
    assert event["error"]["code"] == "invalid_request" and event["error"]["message"] == "bad"
    assert event["error"]["param"] == "input"
    assert "stream_id" not in json.loads(error_event(problem("server_error", "x")))


def test_frames_are_the_sse_data_with_the_lane():
    event = (3, "response.output_text.delta", '{"response_id":"resp_1","delta":"hi"}')
    assert json.loads(frame(event, None)) == {"type": "response.output_text.delta", "sequence_number": 3,
                                              "response_id": "resp_1", "delta": "hi"}
    assert json.loads(frame(event, 'a"b'))["stream_id"] == 'a"b'
