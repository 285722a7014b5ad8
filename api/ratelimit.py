"""Per-principal request rate limit (spec 10): a token bucket shared by every api process via Redis.

Without Redis (the embedded mode, one machine) the bucket lives in process memory.
"""

import math
import threading
import time

import redis

from common.errors import LMSPError

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
