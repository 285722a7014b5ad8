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


def _encode(value: int) -> str:
    chars = []
    for _ in range(26):
        chars.append(_ALPHABET[value & 31])
        value >>= 5
    return "".join(reversed(chars))


def ulid() -> str:
    """26 characters: 48-bit millisecond time then 80 random bits; sorts by creation time."""
    return _encode((int(time.time() * 1000) << 80) | int.from_bytes(os.urandom(10), "big"))


def id_floor(kind: str, at: float) -> str:
    """The least id of ``kind`` that ``new_id`` makes at or after Unix time ``at`` (whole ms): ids sort by
    time, so a range of ids is a range of creation times."""
    return f"{PREFIXES[kind]}_{_encode(round(at * 1000) << 80)[:10]}"


def id_time(text: str) -> float:
    """The Unix time (ms) an id of ``new_id`` or ``id_floor`` was made at."""
    ms = 0
    for char in text.split("_", 1)[1][:10]:
        ms = ms * 32 + _ALPHABET.index(char)
    return ms / 1000


def new_id(kind: str) -> str:
    return f"{PREFIXES[kind]}_{ulid()}"


def is_id(kind: str, text: str) -> bool:
    """Whether ``text`` has the shape of an id ``new_id(kind)`` makes. Anything else names nothing, so
    it is answered without a lookup: a client's NUL byte or megabyte-long id never reaches the
    database (Postgres refuses NUL in text and would turn a 404 into a 500)."""
    return re.fullmatch(f"{PREFIXES[kind]}_[{_ALPHABET}]{{26}}", text) is not None
