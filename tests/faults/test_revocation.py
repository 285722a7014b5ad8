"""A revoke made while Redis is away (its announcement lost) is refused by every api process within
the token cache's expiry (api/token_cache.py), and the processes answer from their caches meanwhile."""

import time

import psutil

from tests.per_process import PerProcess, token_id

EXPIRY = 3.0


def test_a_revoke_while_redis_is_down_is_refused_within_the_expiry(stack, private_servers):
    base = stack.start_api(workers=2, threads=8, LMSP_TOKEN_CACHE_SECONDS=str(EXPIRY))
    api = stack.procs[-1]
    probe = PerProcess(base, psutil.Process(api.pid))
    redis_server = private_servers[1]
    try:
        secret = stack.token("cached-ursula")
        assert set(probe.every(secret).values()) == {200}
        redis_server.stop()
        revoked = stack.lmsp("tokens", "revoke", token_id(stack, "cached-ursula"))
        assert "Redis is unreachable" in revoked.stderr and "within LMSP_TOKEN_CACHE_SECONDS" in revoked.stderr
        started = time.monotonic()
        took = probe.until_every(secret, 401, timeout=EXPIRY + 2)
        assert time.monotonic() - started <= EXPIRY + 1, took
        # Redis back: the processes subscribe again and forget what they cached meanwhile.
        redis_server.start()
        other = stack.token("cached-vera")
        assert set(probe.every(other).values()) == {200}
    finally:
        if not redis_server._pings():
            redis_server.start()
        stack.stop(api)
