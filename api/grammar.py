"""The compile budget of structured-output grammars, checked at the door.

A constrained request (``response_format`` json_schema, or ``tool_choice`` required / named, which
constrain to an ``anyOf`` of the tools) is compiled by the worker's grammar backend, xgrammar
(vLLM's default), on threads every tenant shares. So before a request is accepted:

1. static limits: values in the schema, its nesting, and its anyOf/oneOf branches (a nested
   alternation counts once per enclosing branch: that product is what explodes); and an instance of
   finite size (common/finite.py: a generation held to an endless schema never ends valid);
2. the backend's own compile, once per (checkpoint, schema), in a helper process with a timeout
   (api/grammar_pool.py): a schema xgrammar cannot handle, or cannot compile in time, is
   ``400 invalid_request`` here rather than ``generation_failed`` later;
3. a compile budget per principal, so one tenant's slow schemas cannot stall the others': one
   compile at a time (a helper its timeout killed is replaced on its turn) and compile-seconds
   per minute, past which its new schemas are ``429 rate_limited`` with Retry-After.

When the helpers fail (the spawner does not answer, a helper gives no answer while it loads a
tokenizer), the gate is down for that checkpoint (or for all) for a backoff (1 s, doubling up to
``OUTAGE_MAX`` s), then tried again by the next schema. While it is down a schema request is ``503
overloaded`` with Retry-After: never accepted unchecked, since what the gate protects (the workers'
shared compile threads) is what an unchecked schema could stall. A tokenizer a helper answers it
cannot load, and a backend that is not installed at all (an api-only install), are not outages: only
the static limits apply then (for a tokenizer, until the backoff's retry), each such request counted
(``bypassed``) and the condition logged.
"""

import hashlib
import json
import logging
import math
import threading
import time
from collections import OrderedDict, deque
from itertools import accumulate

from api.grammar_pool import Helper, HelperPool, Unavailable
from common.errors import LMSPError
from common.finite import has_finite_instance
from common.settings import Settings

log = logging.getLogger("lmsp.grammar")
CACHE_SIZE = 4096
OUTAGE_MAX = 60.0
EVERY = ""  # the outage key of the whole backend (else a checkpoint's)


def check_budget(schema, param: str, settings: Settings) -> None:
    nodes = alternatives = 0
    stack = [(schema, 1, 1)]  # value, depth, how many alternatives enclose it
    while stack:
        value, depth, weight = stack.pop()
        nodes += 1
        if nodes > settings.grammar_max_nodes:
            _refuse(param, f"has more than {settings.grammar_max_nodes} JSON values")
        if depth > settings.grammar_max_depth:
            _refuse(param, f"is nested deeper than {settings.grammar_max_depth} levels")
        if isinstance(value, dict):
            for key, member in value.items():
                if key in ("anyOf", "oneOf") and isinstance(member, list):
                    alternatives += weight * len(member)
                    if alternatives > settings.grammar_max_alternatives:
                        _refuse(param, f"has more than {settings.grammar_max_alternatives} anyOf/oneOf "
                                       "branches (nested ones count once per enclosing branch)")
                    stack.extend((m, depth + 1, weight * max(1, len(member))) for m in member)
                else:
                    stack.append((member, depth + 1, weight))
        elif isinstance(value, list):
            stack.extend((m, depth + 1, weight) for m in value)


def check_finite(schema, param: str) -> None:
    """A schema whose every instance nests without end could never be completed (common/finite.py)."""
    if not has_finite_instance(schema):
        raise LMSPError("invalid_request", f"{param} has no JSON value of finite size: every instance nests "
                        "without end (a required member, or an item, that must again be the same schema)",
                        param=param)


def _refuse(param: str, why: str) -> None:
    raise LMSPError("invalid_request", f"{param} {why}: too costly to compile into a grammar", param=param)


class CompileBudget:
    """Per principal, in this api process: one compile at a time, and ``seconds_per_minute`` of compile
    time in any minute. A principal waits up to ``wait`` seconds for its own turn, never for another's."""

    WINDOW = 60.0

    def __init__(self, seconds_per_minute: float, wait: float):
        self.limit, self.wait = seconds_per_minute, wait
        self._busy: set[str] = set()
        self._spent: dict[str, deque[tuple[float, float]]] = {}  # principal -> (when, compile seconds)
        self._cond = threading.Condition()

    def take(self, principal: str) -> None:
        """The principal's turn (give it back with ``release``), or ``429 rate_limited``."""
        deadline = time.monotonic() + self.wait
        with self._cond:
            while True:
                retry = self._retry_after(principal)
                if retry:
                    raise LMSPError("rate_limited", f"This principal's structured-output schemas took more than "
                                    f"{self.limit:g} s to compile in the last minute; retry after {retry} s",
                                    retry_after=retry)
                if principal not in self._busy:
                    self._busy.add(principal)
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LMSPError("rate_limited", "Another structured-output schema of this principal is "
                                    "still being compiled; send new schemas one at a time",
                                    retry_after=max(1, math.ceil(self.wait)))
                self._cond.wait(left)

    def charge(self, principal: str, seconds: float) -> None:
        with self._cond:
            self._spent.setdefault(principal, deque()).append((time.monotonic(), seconds))

    def release(self, principal: str) -> None:
        with self._cond:
            self._busy.discard(principal)
            self._cond.notify_all()

    def _retry_after(self, principal: str) -> int:
        """0 while the principal's last minute has room, else the seconds until it has."""
        spent = self._spent.get(principal)
        now = time.monotonic()
        while spent and spent[0][0] <= now - self.WINDOW:
            spent.popleft()
        if not spent:
            self._spent.pop(principal, None)
            return 0
        total = sum(seconds for _, seconds in spent)
        if total < self.limit:
            return 0
        # Room once enough of the oldest charges have left the window (all of them free all of it).
        freed = accumulate(seconds for _, seconds in spent)
        leaves = next(when for (when, _), gone in zip(spent, freed, strict=True) if total - gone < self.limit)
        return max(1, math.ceil(leaves + self.WINDOW - now))


class Outage:
    """A failure of the gate's helpers for a key, retried after a backoff that doubles per failure."""

    def __init__(self):
        self.failures, self.until, self.why, self.bypass = 0, 0.0, "", False

    def failed(self, why: str, bypass: bool) -> None:
        self.failures += 1
        self.until = time.monotonic() + min(OUTAGE_MAX, 2.0 ** (self.failures - 1))
        self.why, self.bypass = why, bypass


class GrammarGate:
    def __init__(self, settings: Settings):
        self.settings = settings
        self._results: OrderedDict[str, str | None] = OrderedDict()  # key -> None (compiles) or why not
        self._results_lock = threading.Lock()
        self._pool = HelperPool(settings.grammar_helpers)
        self._budget = CompileBudget(settings.grammar_compile_seconds_per_minute,
                                     settings.grammar_compile_timeout_seconds)
        self._outages: dict[str, Outage] = {}  # EVERY or a checkpoint -> its current outage
        self._absent = False  # xgrammar is not installed: only the static limits apply
        self.bypassed = 0  # schemas accepted on the static limits alone (absent backend, unloadable tokenizer)

    def check(self, schema: dict, param: str, checkpoint: str, principal: str) -> None:
        """Whether the backend compiles ``schema`` (within its size limits: ``check_budget`` first)."""
        if self._absent or self._down(checkpoint):
            self.bypassed += 1
            return
        text = json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        key = hashlib.sha256(f"{checkpoint}\n{text}".encode()).hexdigest()
        if key not in self._results:
            self._budget.take(principal)
            try:
                helper = self._pool.take(self.settings.grammar_compile_timeout_seconds)
            except LMSPError:
                self._budget.release(principal)
                raise
            self._compile(helper, key, text, checkpoint, principal)
        if key not in self._results:
            self._down(checkpoint)  # it failed just now: 503, or the static limits
            self.bypassed += 1
            return
        why = self._results.get(key)
        if why is not None:
            raise LMSPError("invalid_request", f"{param} cannot be used for structured output: {why}",
                            param=param)

    def _down(self, checkpoint: str) -> bool:
        """True: the schema is let through on the static limits; 503 while the helpers are failing."""
        now = time.monotonic()
        for outage in (self._outages.get(EVERY), self._outages.get(checkpoint)):
            if outage is not None and outage.until > now:
                if outage.bypass:
                    return True
                raise LMSPError("overloaded", "The structured-output schema checker is failing "
                                f"({outage.why}); retry shortly", retry_after=max(1, math.ceil(outage.until - now)))
        return False

    def _failed(self, key: str, why: str, bypass: bool = False) -> None:
        outage = self._outages.setdefault(key, Outage())
        outage.failed(why, bypass)
        log.warning("grammar helpers failed for %s (%s, %d in a row): %s for %.0f s, then tried again",
                    key or "every checkpoint", why, outage.failures,
                    "only static schema limits apply" if bypass else "schema requests get 503", outage.until -
                    time.monotonic())

    def _compile(self, helper: Helper, key: str, text: str, checkpoint: str, principal: str) -> None:
        """On ``helper``, which is then given back; the principal's turn ends when it is in the pool
        again, so a helper its timeout killed is replaced on its own turn, not on another's."""
        timeout = self.settings.grammar_compile_timeout_seconds
        unavailable = False
        try:
            if not helper.alive:
                helper.start()
            why = helper.load(checkpoint)
            if why is not None:  # "no answer": the helper died or overran; else the tokenizer's error
                self._failed(checkpoint, f"its tokenizer: {why}", bypass=why != "no answer")
            elif key not in self._results:
                self._outages.pop(EVERY, None)
                self._outages.pop(checkpoint, None)
                started = time.monotonic()
                answer = helper.ask({"schema": text, "checkpoint": checkpoint}, timeout)
                self._budget.charge(principal, time.monotonic() - started)
                self._remember(key, f"the grammar does not compile within {timeout:g} s" if answer is None
                               else answer["error"])
        except Unavailable as exc:
            unavailable = True
            if exc.absent:
                log.warning("the grammar backend cannot run here (%s); only static schema limits apply", exc)
                self._absent = True
            else:
                self._failed(EVERY, str(exc))
        finally:
            if helper.alive or unavailable:
                self._pool.give(helper)
                self._budget.release(principal)
            else:
                self._pool.replace(helper, then=lambda: self._budget.release(principal))

    def _remember(self, key: str, why: str | None) -> None:
        with self._results_lock:
            self._results[key] = why
            while len(self._results) > CACHE_SIZE:
                self._results.popitem(last=False)
