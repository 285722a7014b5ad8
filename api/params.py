"""Numbers a client puts in a query string or a header, read one way everywhere.

ASCII digits only: ``str.isdigit()`` admits "²" (which ``int()`` refuses) and ``float()`` admits
" 1", "1_0", "١" and "nan"; a bounded length keeps ``int()`` away from its 4300-digit limit.
"""

import re

from flask import request

from common.errors import LMSPError

_INTEGER = re.compile(r"[0-9]{1,12}")
_DECIMAL = re.compile(r"[0-9]{1,12}(\.[0-9]{1,9})?")


def integer(raw: str) -> int | None:
    """A non-negative integer, or None when ``raw`` is not one."""
    return int(raw) if _INTEGER.fullmatch(raw) else None


def decimal(raw: str) -> float | None:
    """A non-negative decimal number such as 2 or 0.5, or None when ``raw`` is not one."""
    return float(raw) if _DECIMAL.fullmatch(raw) else None


def arg(name: str) -> str | None:
    """The query parameter ``name``, given at most once: which of two values counts is a guess."""
    values = request.args.getlist(name)
    if len(values) > 1:
        raise LMSPError("invalid_request", f"Query parameter {name} is given {len(values)} times; give it once",
                        param=name)
    return values[0] if values else None
