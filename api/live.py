"""Following a response's events: replay the log, then live, never a seq twice.

One Redis subscription per api process (the Hub) fans notifications out to
every follower in it. Without Redis the log is simply read again every
``poll_interval_seconds``.
"""

import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Iterator

import redis

from common import eventlog
from common.bus import HUB, channel, decode, response_of
from common.errors import problem
from common.events import ERROR, FINAL, dumps, sse
from common.settings import Settings

log = logging.getLogger("lmsp.live")
Event = tuple[int, str, str]


class Subscription:
    def __init__(self, hub: "Hub", response_id: str):
        self.hub = hub
        self.response_id = response_id
        self.queue: queue.SimpleQueue[list[Event]] = queue.SimpleQueue()

    def get(self, timeout: float) -> list[Event] | None:
        """Events announced since the last call, or None when nothing came in ``timeout``."""
        try:
            batch = self.queue.get(timeout=timeout)
        except queue.Empty:
            return None
        while True:  # drain what else is waiting
            try:
                batch = batch + self.queue.get_nowait()
            except queue.Empty:
                return batch

    def close(self) -> None:
        self.hub.unsubscribe(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Hub:
    def __init__(self, settings: Settings, sessions):
        self.settings = settings
        self.sessions = sessions
        self.client = redis.Redis.from_url(settings.redis_url) if settings.redis_url else None
        self._lock = threading.Lock()
        self._subs: dict[str, set[Subscription]] = defaultdict(set)
        self._pubsub = None
        self._thread = None

    @property
    def live(self) -> bool:
        return self.client is not None

    def subscribe(self, response_id: str) -> Subscription:
        sub = Subscription(self, response_id)
        with self._lock:
            first = not self._subs[response_id]
            self._subs[response_id].add(sub)
            if self.client is not None:
                self._ensure_thread()
                if first:
                    self._redis_call(lambda ps: ps.subscribe(channel(response_id)))
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            subs = self._subs.get(sub.response_id)
            if subs is None:
                return
            subs.discard(sub)
            if not subs:
                del self._subs[sub.response_id]
                if self.client is not None:
                    self._redis_call(lambda ps: ps.unsubscribe(channel(sub.response_id)))

    def _redis_call(self, fn) -> None:
        try:
            fn(self._pubsub)
        except (redis.RedisError, OSError, AttributeError):
            pass  # the listener thread reconnects and resubscribes everything

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            self._pubsub.subscribe(HUB)
            self._thread = threading.Thread(target=self._listen, name="lmsp-hub", daemon=True)
            self._thread.start()

    def _listen(self) -> None:
        while True:
            try:
                message = self._pubsub.get_message(timeout=1.0)
            except (redis.RedisError, OSError, ValueError):
                self._reconnect()
                continue
            if message is None or message["type"] != "message":
                continue
            response_id = response_of(message["channel"])
            batch = decode(message["data"])
            with self._lock:
                subs = list(self._subs.get(response_id, ()))
            for sub in subs:
                sub.queue.put(batch)

    def _reconnect(self) -> None:
        log.warning("redis connection lost; followers fall back to the log until it is back")
        time.sleep(0.5)
        with self._lock:
            try:
                self._pubsub = self.client.pubsub(ignore_subscribe_messages=True)
                self._pubsub.subscribe(HUB, *map(channel, self._subs))
            except (redis.RedisError, OSError):
                return
            for subs in self._subs.values():
                for sub in subs:
                    sub.queue.put([])  # wake followers so they read the log for what they missed


PAGE = 20000  # events per log read, written to the client in one piece (small pages cost 2x on replays)


def follow(hub: Hub, response_id: str, after: int, *, logged: bool, heartbeat: float,
           is_final_in_db=None) -> Iterator[list[Event] | None]:
    """Yield lists of events with seq > ``after``, in order, the last list ending with the final event;
    None means "nothing happened for ``heartbeat`` seconds".

    ``logged`` is False for a direct stream whose events exist only in transit;
    then ``is_final_in_db`` is asked now and then so a worker that died without a
    final event still ends the stream.
    """
    last = after
    with hub.subscribe(response_id) as sub:  # subscribe before reading the log: nothing falls between
        need_log = logged
        last_log_read = last_sent = time.monotonic()
        while True:
            if need_log:
                with hub.sessions() as session:
                    page = eventlog.read(session, response_id, last, limit=PAGE)
                last_log_read = time.monotonic()
                need_log = len(page) == PAGE  # a full page: read on
                if page:
                    last = page[-1][0]
                    last_sent = last_log_read
                    final = _final_index(page)
                    if final is not None:
                        yield page[:final + 1]
                        return
                    yield page
                if need_log:
                    continue
            wait = heartbeat if hub.live else hub.settings.poll_interval_seconds
            batch = sub.get(timeout=wait)
            now = time.monotonic()
            if batch is None:
                if now - last_sent >= heartbeat:
                    last_sent = now
                    yield None
                if not hub.live:
                    need_log = True  # no notifications without Redis: the log is polled
                elif logged and now - last_log_read > 5:
                    need_log = True  # a safety net for lost notifications (Redis restarted mid-stream)
                elif not logged and is_final_in_db is not None:
                    final_event = is_final_in_db()
                    if final_event is not None:
                        yield [final_event]
                        return
                continue
            fresh = []
            for event in sorted(batch):
                if event[0] <= last:
                    continue  # already sent from the log
                if event[0] != last + 1 and logged:
                    need_log = True  # a gap: the log has what the channel lost
                    break
                fresh.append(event)
                last = event[0]
                if event[1] in FINAL:
                    yield fresh
                    return
            if fresh:
                last_sent = now
                yield fresh
            if not batch:
                need_log = logged


def stream_failed() -> str:
    """The SSE ``error`` event that ends a stream the server cannot go on with (logged first)."""
    log.exception("event stream failed")
    doc = problem("server_error", "The stream failed; reconnect with Last-Event-ID to continue")
    return sse(None, ERROR, dumps({"error": doc}))


def _final_index(page: list[Event]) -> int | None:
    return next((i for i, event in enumerate(page) if event[1] in FINAL), None)
