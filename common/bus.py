"""Live event notification: Redis pub/sub when configured, else the log itself.

Redis is only a transport (docs/architecture.md, invariant 1): a follower always replays the
log and drops sequence numbers it has already sent, so a lost or duplicated
notification changes nothing.
"""

import redis

from common.events import REASONING_DELTA, TEXT_DELTA
from common.tokens import KNOWN_SECONDS, known_key

CHANNEL = "lmsp:events:"   # + response id: the batches of events a writer committed
CONTROL = "lmsp:control"   # response ids whose generation workers should abort
FOLLOWED = "lmsp:followed"  # response ids a follower just began to follow live: pace their windows for it
REVOKED = "lmsp:revoked"   # token ids just revoked: every api process drops them from its cache
HUB = "lmsp:hub"           # never published to: keeps an idle subscriber connection in subscribed mode


# A notice that no event carries: the task changed where its log says nothing (a claim, a cancel's
# ``cancelling``); published for a ``Publish`` entry with no events (common/lifecycle.py).
CHANGED = "changed"

# Events a reader of the task object need not hear of one by one: a long poll (GET /tasks/{id}?wait) is
# told of every other event through its response's notices, not of every token.
TEXT_ONLY = frozenset({TEXT_DELTA, REASONING_DELTA})


def channel(response_id: str) -> str:
    return CHANNEL + response_id


def notices(response_id: str) -> str:
    """The topic (a channel with ``channel``) of ``response_id``'s notices: a batch's last event not of
    ``TEXT_ONLY`` (its data left out), for every batch that holds one, and ``CHANGED`` for an empty one
    (api/live/hub.py ``watch``)."""
    return "notices:" + response_id


def response_of(channel_name: str | bytes) -> str:
    """The response id of an events channel name (the inverse of ``channel``)."""
    if isinstance(channel_name, bytes):
        channel_name = channel_name.decode()
    return channel_name.removeprefix(CHANNEL)


def encode(batch: list[tuple[int, str, str]]) -> str:
    return "\n".join(f"{seq}\t{name}\t{data}" for seq, name, data in batch)


def decode(payload: str | bytes) -> list[tuple[int, str, str]]:
    if isinstance(payload, bytes):
        payload = payload.decode()
    out = []
    for line in payload.split("\n"):
        seq, name, data = line.split("\t", 2)
        out.append((int(seq), name, data))
    return out


class Publisher:
    def __init__(self, redis_url: str):
        self.client = redis.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=2) if redis_url else None

    @property
    def live(self) -> bool:
        return self.client is not None

    def publish(self, response_id: str, batch: list[tuple[int, str, str]]) -> bool:
        return self.publish_many({response_id: batch}) is not None

    def publish_many(self, batches: dict[str, list[tuple[int, str, str]]]) -> dict[str, int] | None:
        """One round trip for every response's batch of a commit cycle (an empty batch: a notice only,
        ``CHANGED``). Returns how many subscribers (api processes with live followers of it) each
        response's events reached; None when Redis is away."""
        if self.client is None:
            return None
        commands, events_at = [], {}
        for response_id, batch in batches.items():
            if not batch:
                commands.append(("PUBLISH", channel(notices(response_id)), encode([(0, CHANGED, "{}")])))
                continue
            events_at[response_id] = len(commands)
            commands.append(("PUBLISH", channel(response_id), encode(batch)))
            notice = next((e for e in reversed(batch) if e[1] not in TEXT_ONLY), None)
            if notice is not None:
                commands.append(("PUBLISH", channel(notices(response_id)), encode([(notice[0], notice[1], "{}")])))
        if not commands:
            return {}
        # redis-py's connection, not its pipeline: the pipeline's per-command bookkeeping was a third of
        # a commit cycle's publish (460 -> 310 µs for 62 responses); what goes on the wire is the same.
        pool = self.client.connection_pool
        try:
            conn = pool.get_connection()
        except redis.RedisError:
            return None
        packed = conn.pack_commands(commands)

        def send():
            conn.send_packed_command(packed)
            return [conn.read_response() for _ in commands]
        try:  # the connection's own retry policy, as the pipeline applied it (a stale socket: reconnect)
            replies = conn.retry.call_with_retry(send, lambda error: conn.disconnect())
        except redis.RedisError:
            conn.disconnect()  # replies may be left unread: never hand the socket on
            return None  # followers fall back to the log; Redis is expendable
        finally:
            pool.release(conn)
        return {response_id: replies[at] for response_id, at in events_at.items()}

    def followed(self, response_id: str) -> None:
        """The api's hint to the worker of ``response_id``: a follower now reads it live (its worker
        would learn as much at its next publish)."""
        self._hint(FOLLOWED, response_id)

    def abort(self, response_id: str) -> None:
        """A hint to workers to stop generating ``response_id``; they also poll the database."""
        self._hint(CONTROL, response_id)

    def _hint(self, channel_name: str, response_id: str) -> None:
        if self.client is None:
            return
        try:
            self.client.publish(channel_name, response_id)
        except redis.RedisError:
            pass  # a hint: what it says is found out another way


def announce_revoked(redis_url: str, token_id: str) -> bool:
    """Tell every api process that ``token_id`` was revoked (after the commit); False when Redis is
    away: their caches then forget it within their expiry (api/token_cache.py)."""
    if not redis_url:
        return True  # no Redis, no cache
    client = redis.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=2)
    try:
        client.publish(REVOKED, token_id)
        return True
    except redis.RedisError:
        return False
    finally:
        client.close()


def mark_known(redis_url: str, digest: str) -> None:
    """Tell every api process that a new token (of hash ``digest``) exists, so that an address past its
    bad-token limit still has it looked up (api/ratelimit.py ``AuthFailures``); best effort."""
    if not redis_url:
        return
    client = redis.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=2)
    try:
        client.set(known_key(digest), 1, ex=KNOWN_SECONDS)
    except redis.RedisError:
        pass  # it becomes known when it first authenticates on a process not locked out
    finally:
        client.close()


def hinted(payload: str | bytes) -> str:
    """The response id of a ``CONTROL`` or ``FOLLOWED`` message (``Publisher.abort``, ``Publisher.followed``)."""
    return payload.decode() if isinstance(payload, bytes) else payload
