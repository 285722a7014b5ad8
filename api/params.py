"""Numbers a client puts in a query string or a header, read one way everywhere.

ASCII digits only: ``str.isdigit()`` admits "²" (which ``int()`` refuses) and ``float()`` admits
" 1", "1_0", "١", "nan" and "inf"; a bounded length keeps ``int()`` away from its 4300-digit limit.
"""

import math
import re

from flask import request

from common.errors import LMSPError

_INTEGER = re.compile(r"[0-9]{1,12}")
_NUMBER = re.compile(r"-?[0-9]+(\.[0-9]+)?([eE][+-]?[0-9]+)?")  # JSON's number; float() reads any length


def integer(raw: str) -> int | None:
    """A non-negative integer, or None when ``raw`` is not one."""
    return int(raw) if _INTEGER.fullmatch(raw) else None


def number(raw: str) -> float | None:
    """A finite number >= 0 written as JSON writes numbers (2, 0.5, 1e-05, -0.0), or None."""
    value = float(raw) if _NUMBER.fullmatch(raw) else -1.0
    return value if 0 <= value < math.inf else None


def arg(name: str) -> str | None:
    """The query parameter ``name``, given at most once: which of two values counts is a guess."""
    values = request.args.getlist(name)
    if len(values) > 1:
        raise LMSPError("invalid_request", f"Query parameter {name} is given {len(values)} times; give it once",
                        param=name)
    return values[0] if values else None


def resume_point(query: str) -> int:
    """Where a stream resumes (6.4): the query parameter ``query`` wins over ``Last-Event-ID``, the header an
    SSE client sends again by itself when it reconnects; 0 (from the start) without either."""
    raw, param = arg(query), query
    if not raw:
        raw, param = request.headers.get("Last-Event-ID"), "Last-Event-ID"
    if raw is None or raw == "":
        return 0
    after = integer(raw)
    if after is None:
        raise LMSPError("invalid_request", f"{param} must be a non-negative integer event id", param=param)
    return after
