"""ULID-based ids with the spec's prefixes (``resp_01J8...``)."""

import os
import re
import time

_ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"  # Crockford base32

PREFIXES = {
    "response": "resp",
    "task": "task",
    "message": "msg",
    "function_call": "fc",
    "call": "call",
    "reasoning": "rs",
    "token": "tok",
}


def ulid() -> str:
    """26 characters: 48-bit millisecond time then 80 random bits; sorts by creation time."""
    value = (int(time.time() * 1000) << 80) | int.from_bytes(os.urandom(10), "big")
    chars = []
    for _ in range(26):
        chars.append(_ALPHABET[value & 31])
        value >>= 5
    return "".join(reversed(chars))


def new_id(kind: str) -> str:
    return f"{PREFIXES[kind]}_{ulid()}"


def is_id(kind: str, text: str) -> bool:
    """Whether ``text`` has the shape of an id ``new_id(kind)`` makes. Anything else names nothing, so
    it is answered without a lookup: a client's NUL byte or megabyte-long id never reaches the
    database (Postgres refuses NUL in text and would turn a 404 into a 500)."""
    return re.fullmatch(f"{PREFIXES[kind]}_[{_ALPHABET}]{{26}}", text) is not None
