"""Per-principal request rate limit (spec 10): a token bucket shared by every api process via Redis.

Without Redis (the embedded mode, one machine) the bucket lives in process memory.
"""

import math
import threading
import time

import redis

from common.errors import LMSPError
from common.tokens import KNOWN_SECONDS, known_key

# KEYS[1] bucket; ARGV: rate/s, burst, now (s). Returns seconds to wait (0 = allowed).
_LUA = """
local rate, burst, now = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(state[1]) or burst
local at = tonumber(state[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - at) * rate)
local wait = 0
if tokens >= 1 then tokens = tokens - 1 else wait = (1 - tokens) / rate end
redis.call('HSET', KEYS[1], 'tokens', tokens, 'at', now)
redis.call('EXPIRE', KEYS[1], math.ceil(burst / rate) + 1)
return tostring(wait)
"""


class RateLimiter:
    def __init__(self, rate: float, burst: int, redis_url: str):
        self.rate, self.burst = rate, max(1, burst)
        self.client = redis.Redis.from_url(redis_url, socket_timeout=1) if redis_url else None
        self.script = self.client.register_script(_LUA) if self.client else None
        self.local: dict[str, tuple[float, float]] = {}
        self.lock = threading.Lock()

    def check(self, principal: str) -> None:
        if self.rate <= 0:
            return
        wait = self._wait(principal)
        if wait > 0:
            raise LMSPError("rate_limited", f"More than {self.rate:g} requests per second for this principal; "
                            f"retry after {math.ceil(wait)} s", retry_after=max(1, math.ceil(wait)))

    def _wait(self, principal: str) -> float:
        now = time.time()
        if self.script is not None:
            try:
                return float(self.script(keys=[f"lmsp:rate:{principal}"], args=[self.rate, self.burst, now]))
            except redis.RedisError:
                pass  # Redis is expendable: fall back to this process's bucket until it is back
        with self.lock:
            tokens, at = self.local.get(principal, (self.burst, now))
            tokens = min(self.burst, tokens + max(0.0, now - at) * self.rate)
            wait = 0.0 if tokens >= 1 else (1 - tokens) / self.rate
            self.local[principal] = (tokens - 1 if tokens >= 1 else tokens, now)
            return wait


class AuthFailures:
    """Failed lookups of well-formed tokens per client address in this process, per clock minute.

    Past the limit, an address's *unknown* tokens are refused with 429 before any database lookup,
    so guessing costs the database nothing. A *known* token is still looked up (a revocation takes
    effect at once), so clients that share the address (NAT, a proxy) go on: one that authenticated
    in this process in the last hour, or, with Redis, in any api process (a restarted one too) or that
    ``lmsp tokens create`` made then (common/bus.py ``mark_known``). A malformed token never costs a
    lookup and is not counted.
    """

    def __init__(self, per_minute: int, redis_url: str = ""):
        self.limit = per_minute
        self.window = 0
        self.counts: dict[str, int] = {}
        self.known: dict[str, float] = {}  # token hash -> when it last authenticated here
        self.told: dict[str, float] = {}   # token hash -> when this process last marked it known in Redis
        self.lock = threading.Lock()
        # Short timeouts: asked only for a locked-out address's token, on the request's thread.
        self.client = redis.Redis.from_url(redis_url, socket_timeout=0.5, socket_connect_timeout=0.5) \
            if redis_url else None

    def _roll(self, now: float) -> None:
        window = int(now // 60)
        if window != self.window:
            self.window, self.counts = window, {}
            self.known = {d: t for d, t in self.known.items() if now - t < KNOWN_SECONDS}
            self.told = {d: t for d, t in self.told.items() if now - t < KNOWN_SECONDS / 2}

    def check(self, address: str, digest: str) -> None:
        now = time.time()
        with self.lock:
            self._roll(now)
            blocked = (self.limit > 0 and self.counts.get(address, 0) >= self.limit
                       and digest not in self.known)
        if blocked and not self._known_elsewhere(digest):
            wait = max(1, math.ceil(60 - now % 60))
            raise LMSPError("rate_limited", f"Too many bad tokens from {address}; retry after {wait} s",
                            retry_after=wait)

    def _known_elsewhere(self, digest: str) -> bool:
        if self.client is None:
            return False
        try:
            return bool(self.client.exists(known_key(digest)))
        except redis.RedisError:
            return False  # as without Redis: this process's own knowledge

    def failed(self, address: str) -> None:
        with self.lock:
            self._roll(time.time())
            self.counts[address] = self.counts.get(address, 0) + 1

    def succeeded(self, digest: str) -> None:
        now = time.time()
        with self.lock:
            self.known[digest] = now
            # Marked anew every half of its expiry while in use (a write a token and process per half hour):
            # then every process knows it, for as long as it is used anywhere.
            tell = self.client is not None and now - self.told.get(digest, -KNOWN_SECONDS) >= KNOWN_SECONDS / 2
            if tell:
                self.told[digest] = now
        if tell:
            try:
                self.client.set(known_key(digest), 1, ex=KNOWN_SECONDS)
            except redis.RedisError:
                self.told.pop(digest, None)  # told nobody: the next success tries again


class StreamSlots:
    """Open streams in this process, per principal and in all. Two instances: requests that hold a
    gthread for their whole life (direct responses, long polls, an event stream the server could
    not hand over), where the process keeps ``stream_reserved_threads`` back for health probes and
    short requests; and followers on the fan-out thread (``max_followers_per_*``)."""

    def __init__(self, total: int, per_principal: int):
        self.total, self.per_principal = max(1, total), max(1, per_principal)
        self.open = 0
        self.mine: dict[str, int] = {}
        self.lock = threading.Lock()

    def acquire(self, principal: str):
        """Take a slot or raise 429; return the function that gives it back (safe to call twice)."""
        with self.lock:
            if self.open >= self.total:
                raise LMSPError("rate_limited", f"This server has {self.open} streams open, its limit; "
                                "retry shortly", retry_after=5)
            held = self.mine.get(principal, 0)
            if held >= self.per_principal:
                raise LMSPError("rate_limited", f"You have {held} streams open on this server, the limit "
                                f"is {self.per_principal}; close some first", retry_after=5)
            self.open += 1
            self.mine[principal] = held + 1
        released = threading.Event()

        def release() -> None:
            with self.lock:
                if released.is_set():
                    return
                released.set()
                self.open -= 1
                left = self.mine[principal] - 1
                if left:
                    self.mine[principal] = left
                else:
                    del self.mine[principal]
        return release
