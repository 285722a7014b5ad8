"""Token lookups cached in each api process, with revocation kept immediate.

A request whose token this process looked up within ``token_cache_seconds`` is answered without the
database. A revoke (``lmsp tokens revoke``) commits, then publishes the token id on Redis
(``common.bus.REVOKED``); every api process listens, and before answering from the cache applies
whatever invalidation its socket already holds, so a revoked token is refused by every process one
round trip after the revoke. The expiry bounds everything Redis cannot promise: while the
subscription is down (or was, and a revoke published then was lost) an entry is trusted no longer
than the expiry, and a resubscription empties the cache. Only positive answers are cached, so a token
created a moment ago is never refused for having been unknown. Without Redis (the embedded mode)
nothing could tell this process of a revoke: it does not cache, and a revoke takes effect at once.
"""

import logging
import os
import select
import threading
import time

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from common.bus import REVOKED
from common.tokens import Identity

log = logging.getLogger("lmsp.api")
MAX_ENTRIES = 10000   # tokens per process; past it the oldest entries go
PING_SECONDS = 5.0    # the listener pings Redis this often and resubscribes after 3 without a pong


class TokenCache:
    def __init__(self, redis_url: str, expiry: float, on_revoked=None):
        self.expiry = expiry if redis_url else 0.0
        self._entries: dict[str, tuple[float, Identity]] = {}  # token hash -> (looked up at, identity)
        self._lock = threading.Lock()
        self._generation = 0  # moved on by every invalidation: a lookup that straddles one is not kept
        self._on_revoked = on_revoked
        self._listener = _Listener(redis_url, self._invalidate) if self.expiry > 0 else None

    def get(self, digest: str) -> Identity | None:
        """The identity of the token with this hash while it is cached and fresh, else None."""
        if self._listener is None:
            return None
        self._listener.apply_pending()  # a revoke published before this request is seen by it
        entry = self._entries.get(digest)
        if entry is None or time.monotonic() - entry[0] >= self.expiry:
            return None
        return entry[1]

    def begin(self) -> tuple[float, int]:
        """Call before the database lookup whose answer ``put`` keeps."""
        return time.monotonic(), self._generation

    def put(self, digest: str, identity: Identity, begun: tuple[float, int]) -> None:
        if self._listener is None:
            return
        with self._lock:
            # An invalidation that arrived while we looked up may be of this very token (the lookup
            # read it before the revoke committed): keep nothing, the next request looks up again.
            if self._generation != begun[1]:
                return
            if len(self._entries) >= MAX_ENTRIES:
                for old in sorted(self._entries, key=lambda d: self._entries[d][0])[:MAX_ENTRIES // 10]:
                    del self._entries[old]
            self._entries[digest] = (begun[0], identity)  # its age counts from before the lookup

    def _invalidate(self, token_id: str | None) -> None:
        """Forget ``token_id`` (None: every token, after the subscription was down)."""
        with self._lock:
            self._generation += 1
            for digest in [d for d, (_, i) in self._entries.items() if token_id is None or i.token_id == token_id]:
                del self._entries[digest]
        if token_id is not None and self._on_revoked is not None:
            self._on_revoked(token_id)


class _Listener:
    """The subscription to revocations: one Redis connection, read by a thread of its own started
    in the process that uses it (gunicorn forks its workers after the app is built), and drained by
    request threads of what has already arrived before they trust the cache. A plain connection,
    not redis-py's PubSub, which would reconnect and resubscribe by itself, hiding the gap."""

    def __init__(self, redis_url: str, invalidate):
        self._pool = redis.ConnectionPool.from_url(redis_url, socket_timeout=5, socket_connect_timeout=2,
                                                   retry=Retry(NoBackoff(), 0), protocol=2)  # RESP2: pushes are replies
        self._invalidate = invalidate
        self._lock = threading.Lock()  # one reader of the connection at a time
        self._conn = None              # the subscribed connection, while it is
        self._heard = 0.0              # when it last gave anything (a message, a pong)
        self._pid = None

    def apply_pending(self) -> None:
        self._ensure_started()
        conn = self._conn
        if conn is not None and _readable(conn, 0):
            with self._lock:
                if self._conn is conn:
                    try:
                        self._drain(conn)
                    except (redis.RedisError, OSError, ValueError):
                        self._conn = None  # the listener thread sees it and subscribes again

    def _ensure_started(self) -> None:
        if self._pid != os.getpid():
            with self._lock:
                if self._pid != os.getpid():
                    self._pid, self._conn = os.getpid(), None
                    threading.Thread(target=self._run, name="lmsp-token-revocations", daemon=True).start()

    def _run(self) -> None:
        down_logged = False
        while True:
            try:
                self._listen()
            except (redis.RedisError, OSError, ValueError) as exc:
                if not down_logged:
                    log.warning("token revocations: Redis unavailable (%s); a cached token is trusted "
                                "for the cache's expiry at most until it is back", exc)
                down_logged = True
            time.sleep(1.0)

    def _listen(self) -> None:
        conn = self._pool.make_connection()
        try:
            conn.connect()
            conn.send_command("SUBSCRIBE", REVOKED)
            conn.read_response()
            self._invalidate(None)  # revokes published while we were not subscribed are lost: forget all
            self._heard = pinged = time.monotonic()
            self._conn = conn
            while self._conn is conn:
                if _readable(conn, 1.0):
                    with self._lock:
                        if self._conn is conn:
                            self._drain(conn)
                now = time.monotonic()
                if now - self._heard > 3 * PING_SECONDS:  # a connection gone silent (no FIN) would hide revokes
                    raise redis.ConnectionError("no pong from Redis")
                if now - pinged >= PING_SECONDS:
                    with self._lock:
                        conn.send_command("PING")
                    pinged = now
        finally:
            self._conn = None
            conn.disconnect()

    def _drain(self, conn) -> None:
        """Apply every reply already arrived (the caller holds ``_lock``)."""
        while True:
            if conn._sock is None:  # can_read would connect again, unsubscribed
                raise redis.ConnectionError("the subscription was closed")
            if not conn.can_read(timeout=0):
                return
            reply = conn.read_response()
            self._heard = time.monotonic()
            if isinstance(reply, list) and len(reply) == 3 and reply[0] == b"message":
                self._invalidate(reply[2].decode())


def _readable(conn, timeout: float) -> bool:
    sock = conn._sock  # redis-py has no public handle on it
    if sock is None:
        if timeout:
            time.sleep(timeout)
        return False
    try:
        poll = select.poll()  # not select(): an api process with thousands of followers has fds past 1024
        poll.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
        return bool(poll.poll(timeout * 1000))
    except (OSError, ValueError):  # closed under us: the next read says so
        return True
