"""What every WebSocket route checks of an upgrade request before it answers 101 (RFC 6455 4.1), so that
a bad handshake is a problem document, like any other refusal, and never reaches a WebSocket library."""

import base64
import binascii

from flask import request

from common.errors import LMSPError


def check_handshake() -> str:
    """The request's Sec-WebSocket-Key, checked with its version; a 400 problem if either is wrong."""
    if request.environ.get("SERVER_PROTOCOL") == "HTTP/1.0":
        raise LMSPError("invalid_request", "A WebSocket handshake is an HTTP/1.1 request (RFC 6455 4.1)")
    key = request.headers.get("Sec-WebSocket-Key", "")
    try:
        nonce = base64.b64decode(key.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        nonce = b""
    if len(nonce) != 16:
        raise LMSPError("invalid_request", "Sec-WebSocket-Key must be 16 bytes in base64 (RFC 6455 4.1)",
                        param="Sec-WebSocket-Key")
    if request.headers.get("Sec-WebSocket-Version") != "13":
        raise LMSPError("invalid_request", "Only WebSocket version 13 is spoken here",
                        param="Sec-WebSocket-Version", headers={"Sec-WebSocket-Version": "13"})
    return key
