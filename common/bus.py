"""Live event notification: Redis pub/sub when configured, else the log itself.

Redis is only a transport (DESIGN invariant 1): a follower always replays the
log and drops sequence numbers it has already sent, so a lost or duplicated
notification changes nothing.
"""

import redis

CHANNEL = "lmsp:events:"


def channel(response_id: str) -> str:
    return CHANNEL + response_id


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

    def publish(self, response_id: str, batch: list[tuple[int, str, str]]) -> None:
        self.publish_many({response_id: batch})

    def publish_many(self, batches: dict[str, list[tuple[int, str, str]]]) -> None:
        """One round trip for every response's batch of a commit cycle."""
        if self.client is None:
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            for response_id, batch in batches.items():
                if batch:
                    pipe.publish(channel(response_id), encode(batch))
            pipe.execute()
        except redis.RedisError:
            pass  # followers fall back to the log; Redis is expendable

    def control(self, channel_name: str, message: str) -> None:
        """A hint to workers (e.g. abort a request); they also poll the database."""
        if self.client is None:
            return
        try:
            self.client.publish(channel_name, message)
        except redis.RedisError:
            pass
