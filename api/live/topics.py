"""The Redis side of the fan-out: a ``Topic`` per followed response (its followers in this process
and the polls of its log), and the ``Listener``, the process's one Redis subscription.

Only the listener thread connects or reconnects to Redis, never under the lock; (un)subscribe
commands go out under the lock on a live connection only, so they stay ordered with a reconnect's
resubscription, and socket timeouts bound them. What the listener hears goes to the fan-out thread
through ``call``."""

import logging
import threading
import time
from collections.abc import Callable

import redis

from api.live.follower import LIVE
from api.live.frames import Batch, Event
from common.bus import HUB, channel, decode, response_of
from common.events import FINAL

log = logging.getLogger("lmsp.live")
PING_SECONDS = 5.0         # the listener pings Redis this often; silence for 3 pings means it is gone
# A topic's newest events kept (their data's length): a short task's whole log (200 tokens: 5-12 KiB), or a
# long one's last seconds. Bounded for a process whose followers each follow a task of their own.
RECENT_BYTES = 16 * 1024


class Recent:
    """A topic's newest contiguous run of the log's events, RECENT_BYTES at most: heard on the channel
    since its subscription was confirmed, or read after that (a ``seed``). What follows the run comes on
    the channel, as to a live follower, so a follower attaching within it is served from here instead of
    by a log read; while the one read that seeds it is in flight, followers attaching after its point
    wait for it (``plan``): a connect storm on one task reads its log once. Request threads plan, the
    fan-out thread hears and seeds: under the run's lock."""

    __slots__ = ("lock", "events", "bytes", "waiting", "seed_after", "generation", "seed_generation")
    SERVED, WAIT, READ, SEED = "served", "wait", "read", "seed"

    def __init__(self):
        self.lock = threading.Lock()
        self.events: list[Event] = []
        self.bytes = 0
        self.waiting: list | None = None  # followers waiting for the seed in flight (None: none in flight)
        self.seed_after = 0
        self.generation = self.seed_generation = 0  # a transport change makes a seed in flight worthless

    def heard(self, events: list[Event]) -> None:
        """Events published (or a poll's page), in seq order: the run goes on with them, or starts again
        at a gap (what the channel lost is not in it)."""
        with self.lock:
            run = self.events
            last = run[-1][0] if run else -1
            for event in events:
                if event[0] <= last:
                    continue  # heard before
                if event[0] != last + 1:
                    run.clear()
                    self.bytes = 0
                run.append(event)
                self.bytes += len(event[2])
                last = event[0]
            self._trim()

    def plan(self, follower, after: int) -> tuple:
        """How an attaching follower (in the topic, its subscription confirmed) gets the events after
        ``after``: (SERVED, batch or None, final) from the run; WAIT for the seed in flight (``seeded``
        serves it); SEED: read the log, then ``seeded`` with the page; READ: read the log."""
        with self.lock:
            recent = self._since(after)
            if recent is not None:
                return (self.SERVED, *recent)
            if self.waiting is None:
                self.waiting, self.seed_after, self.seed_generation = [], after, self.generation
                return (self.SEED,)
            if after >= self.seed_after:
                self.waiting.append(follower)
                return (self.WAIT,)
            return (self.READ,)

    def seeded(self, page: list[Event] | None) -> list:
        """The seed's read came back: ``page``, read whole (up to the log's end then, not cut at a page's
        length), goes in front of the run if they meet (None: not whole, or failed). Returns the followers
        that waited for it, for ``since``."""
        with self.lock:
            run = self.events
            if page and self.seed_generation == self.generation and page[-1][0] - page[0][0] == len(page) - 1 \
                    and not (run and page[-1][0] + 1 < run[0][0]):  # after a gap the run stays as it is
                end = page[-1][0]
                self.events = [*page, *(event for event in run if event[0] > end)]
                self.bytes = sum(len(event[2]) for event in self.events)
                self._trim()
            waiting, self.waiting = self.waiting or [], None
            return waiting

    def since(self, after: int) -> tuple[Batch | None, bool] | None:
        with self.lock:
            return self._since(after)

    def forget(self) -> None:
        """Redis came or went: what was published meanwhile may be lost to the run."""
        with self.lock:
            self.events, self.bytes = [], 0
            self.generation += 1

    def _since(self, after: int) -> tuple[Batch | None, bool] | None:
        """The events after ``after``, up to the final one, and whether the stream ends with them; None
        when the run does not reach back to ``after``."""
        run = self.events
        if not run or not run[0][0] <= after + 1 <= run[-1][0] + 1:
            return None
        events = run[after + 1 - run[0][0]:]
        if not events:
            return None, run[-1][1] in FINAL
        batch = Batch(events)
        if batch.final >= 0:
            return (batch if batch.final == len(events) - 1 else Batch(events[:batch.final + 1])), True
        return batch, False

    def _trim(self) -> None:
        run, drop = self.events, 0
        while self.bytes > RECENT_BYTES and drop < len(run) - 1:
            self.bytes -= len(run[drop][2])
            drop += 1
        if drop:
            del run[:drop]


class Topic:
    """The followers of one response in this process, and the polls of its log (fan-out thread only;
    ``recent`` is shared with request threads under its lock)."""

    __slots__ = ("response_id", "followers", "head", "confirmed", "polling", "last_poll", "last_event",
                 "last_ended", "waiting", "recent")

    def __init__(self, response_id: str):
        self.response_id = response_id
        self.followers: set = set()
        self.head = 0           # the highest seq this process has sent any follower of it
        self.confirmed = False  # Redis confirmed the subscription
        self.polling = False
        self.last_poll = self.last_event = self.last_ended = time.monotonic()
        self.waiting: list[tuple[float, object]] = []  # followers to begin once confirmed, with a deadline
        # Made when a task follower attaches (``Hub._add``): a direct stream's or a long poll's topic keeps none.
        self.recent: Recent | None = None

    def sample(self):
        """A live follower, if any: while all of them read the log, their reads cover it."""
        return next((f for f in self.followers if f.state == LIVE and f.began), None)


class Listener:
    """The Redis subscription: the channels of the followed responses, and its listener thread.

    ``on_message(response_id, events)``, ``on_confirmed(response_id)`` and ``on_change()`` (Redis
    came or went) run on the fan-out thread, by ``call``."""

    def __init__(self, client: redis.Redis, call: Callable, on_message: Callable, on_confirmed: Callable,
                 on_change: Callable):
        self.client, self.call = client, call
        self.on_message, self.on_confirmed, self.on_change = on_message, on_confirmed, on_change
        self._lock = threading.Lock()
        self._channels: set[str] = set()
        self._pubsub = None
        self.connected = False
        threading.Thread(target=self._listen, name="lmsp-hub", daemon=True).start()

    def subscribe(self, response_id: str) -> None:
        with self._lock:
            self._channels.add(response_id)
            if self.connected:
                self._send(lambda ps: ps.subscribe(channel(response_id)))

    def unsubscribe(self, response_id: str) -> None:
        with self._lock:
            self._channels.discard(response_id)
            if self.connected:
                self._send(lambda ps: ps.unsubscribe(channel(response_id)))

    def _send(self, fn) -> None:
        try:
            fn(self._pubsub)
        except (redis.RedisError, OSError, AttributeError):
            pass  # the listener notices the broken connection and resubscribes everything

    def _connect(self) -> None:
        pubsub = self.client.pubsub()
        pubsub.subscribe(HUB)
        with self._lock:
            channels = [channel(rid) for rid in self._channels]
            if channels:
                pubsub.subscribe(*channels)
            self._pubsub, self.connected = pubsub, True
        self.call(self.on_change)  # followers read the log for what they missed, then go live
        log.info("redis connected; followers are live")

    def _disconnect(self) -> None:
        with self._lock:
            pubsub, self._pubsub, self.connected = self._pubsub, None, False
        self.call(self.on_change)
        log.warning("redis connection lost; followers read the log until it is back")
        try:
            pubsub.close()
        except (redis.RedisError, OSError, AttributeError):
            pass

    def _listen(self) -> None:
        heard = pinged = 0.0
        while True:
            if not self.connected:
                try:
                    self._connect()
                except (redis.RedisError, OSError):
                    time.sleep(1.0)
                    continue
                heard = pinged = time.monotonic()
            try:
                message = self._pubsub.get_message(timeout=1.0)
                now = time.monotonic()
                if now - pinged >= PING_SECONDS:
                    self._pubsub.ping()
                    pinged = now
            except (redis.RedisError, OSError, ValueError, AttributeError):
                self._disconnect()
                continue
            if message is None:
                if now - heard > 3 * PING_SECONDS:
                    self._disconnect()  # connected but silent: a hung Redis
                continue
            heard = now
            self._heard(message)

    def _heard(self, message: dict) -> None:
        kind = message["type"]
        if kind == "subscribe":
            name = message["channel"].decode()
            if name != HUB:
                self.call(self.on_confirmed, response_of(name))
        elif kind == "message":
            self.call(self.on_message, response_of(message["channel"]), decode(message["data"]))
