"""Following a response's events: replay the log, then live, never a seq twice, always to the end.

One Redis subscription per api process (the Hub) fans notifications out to
every follower in it. While Redis is away (never configured, down at start,
or lost mid-stream) followers read the log every ``poll_interval_seconds``
instead, and go back to live notifications when it returns.
"""

import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from operator import itemgetter

import redis

from common import eventlog
from common.bus import HUB, channel, decode, response_of
from common.errors import LMSPError, problem
from common.events import ERROR, FINAL, dumps, sse
from common.settings import Settings

log = logging.getLogger("lmsp.live")
Event = tuple[int, str, str]
PING_SECONDS = 5.0         # the listener pings Redis this often; silence for 3 pings means it is gone
CONFIRM_SECONDS = 1.0      # how long a new follower waits for Redis to confirm its subscription


class Subscription:
    def __init__(self, hub: "Hub", response_id: str):
        self.hub = hub
        self.response_id = response_id
        self.queue: queue.SimpleQueue[list[Event]] = queue.SimpleQueue()

    def get(self, timeout: float) -> list[Event] | None:
        """Events announced since the last call, or None when nothing came in ``timeout``.
        An empty list means "the transport changed: read the log"."""
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


class ShuttingDown(Exception):
    """This api process got SIGTERM: a task follower ends so its client resumes on another one."""


class Hub:
    """The process's one Redis subscriber. Only the listener thread connects or reconnects, never
    under the lock; (un)subscribe commands go out under the lock on a live connection only, so
    they stay ordered, and socket timeouts bound them."""

    def __init__(self, settings: Settings, sessions):
        self.settings = settings
        self.sessions = sessions
        self.client = redis.Redis.from_url(settings.redis_url, socket_timeout=2, socket_connect_timeout=1
                                           ) if settings.redis_url else None
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._subs: dict[str, set[Subscription]] = defaultdict(set)
        self._confirmed: set[str] = set()
        self._pubsub = None
        self.connected = False
        self.closing = threading.Event()  # set on SIGTERM (api/__init__.py)
        self._thread = None
        if self.client is not None:
            self._thread = threading.Thread(target=self._listen, name="lmsp-hub", daemon=True)
            self._thread.start()

    def subscribe(self, response_id: str, confirm: bool = True) -> Subscription:
        """Nothing published after this returns is missed; with ``confirm=False`` only after
        ``confirm(sub)`` returns (the caller does other work while Redis confirms)."""
        sub = Subscription(self, response_id)
        with self._lock:
            first = not self._subs[response_id]
            self._subs[response_id].add(sub)
            if first and self.connected:
                self._send(lambda ps: ps.subscribe(channel(response_id)))
        if confirm:
            self.confirm(sub)
        return sub

    def confirm(self, sub: Subscription) -> None:
        name = channel(sub.response_id)
        with self._lock:
            if self.connected:
                self._changed.wait_for(lambda: name in self._confirmed or not self.connected, CONFIRM_SECONDS)

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            subs = self._subs.get(sub.response_id)
            if subs is None:
                return
            subs.discard(sub)
            if not subs:
                del self._subs[sub.response_id]
                self._confirmed.discard(channel(sub.response_id))
                if self.connected:
                    self._send(lambda ps: ps.unsubscribe(channel(sub.response_id)))

    def _send(self, fn) -> None:
        try:
            fn(self._pubsub)
        except (redis.RedisError, OSError, AttributeError):
            pass  # the listener notices the broken connection and resubscribes everything

    def _connect(self) -> None:
        pubsub = self.client.pubsub()
        pubsub.subscribe(HUB)
        with self._lock:
            channels = [channel(rid) for rid in self._subs]
            if channels:
                pubsub.subscribe(*channels)
            self._pubsub, self.connected = pubsub, True
            self._wake()  # followers read the log for what they missed, then go live
        log.info("redis connected; followers are live")

    def _disconnect(self) -> None:
        with self._lock:
            pubsub, self._pubsub, self.connected = self._pubsub, None, False
            self._confirmed.clear()
            self._wake()
        log.warning("redis connection lost; followers read the log until it is back")
        try:
            pubsub.close()
        except (redis.RedisError, OSError, AttributeError):
            pass

    def _wake(self) -> None:
        self._changed.notify_all()
        for subs in self._subs.values():
            for sub in subs:
                sub.queue.put([])

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
            kind = message["type"]
            if kind == "subscribe":
                with self._lock:
                    self._confirmed.add(message["channel"].decode())
                    self._changed.notify_all()
            elif kind == "message":
                response_id = response_of(message["channel"])
                batch = decode(message["data"])
                with self._lock:
                    subs = list(self._subs.get(response_id, ()))
                for sub in subs:
                    sub.queue.put(batch)


PAGE = 5000  # events per log read (~1 MB), written to the client in one piece; 20,000 cost 10% more CPU (bigger allocations)
SAFETY_NET_SECONDS = 5.0   # a quiet task follower re-reads the log (then asks ``ended``) this often
DIRECT_CHECK_SECONDS = 1.0  # a quiet direct stream asks whether its worker died this often


def follow(hub: Hub, response_id: str, after: int, *, logged: bool, heartbeat: float,
           ended: Callable[[], list[tuple[str, str]] | None],
           authorized: Callable[[], bool] | None = None,
           subscription: Subscription | None = None) -> Iterator[list[Event] | None]:
    """Yield lists of events with seq > ``after``, in order, the last list ending with the final
    event; None means "nothing happened for ``heartbeat`` seconds". The stream always ends:

    * a final event at or before ``after`` ends it with nothing sent;
    * ``ended()`` is asked when the log has nothing new (a task stream: at once, then every
      SAFETY_NET_SECONDS; a direct one: every DIRECT_CHECK_SECONDS): None while the response
      runs, else the events that end the stream
      (none for a task whose final event is at or before ``after``; a final event for a direct
      response whose worker died), numbered after the last id sent;
    * ``authorized()`` is asked every ``stream_auth_recheck_seconds``: False (a revoked token)
      raises ``unauthorized``.

    ``logged`` is False for a direct stream: its events are in the log only when the worker could
    not publish them, so it reads the log only while Redis is away or on a gap.
    ``subscription`` is one the caller opened before dispatching the work (so nothing is missed).
    """
    settings = hub.settings
    state = {"last": after}
    sub = subscription or hub.subscribe(response_id)

    def from_log() -> tuple[list[Event], bool]:
        """Events after ``last`` from the log, and whether the final one is among them."""
        with hub.sessions() as session:
            page = eventlog.read(session, response_id, state["last"], limit=PAGE)
        final = not FINAL.isdisjoint(map(itemgetter(1), page))  # at C speed: a replay's pages are long
        if final:
            page = page[:next(i for i, event in enumerate(page) if event[1] in FINAL) + 1]
        if page:
            state["last"] = page[-1][0]
        return page, final

    try:
        need_log = logged  # a direct stream's log is empty unless Redis failed: do not read it for nothing
        now = time.monotonic()
        last_log = last_sent = last_auth = now
        # A resumed task stream asks at once (it may be past its final event); a new direct one
        # only once it has been quiet a while.
        every = SAFETY_NET_SECONDS if logged else DIRECT_CHECK_SECONDS
        last_ended = -every if logged else now
        while True:
            now = time.monotonic()
            if logged and hub.closing.is_set():
                raise ShuttingDown()  # a direct stream cannot move: it runs on within the graceful timeout
            if authorized is not None and now - last_auth >= settings.stream_auth_recheck_seconds:
                last_auth = now
                if not authorized():
                    raise LMSPError("unauthorized", "The token of this stream was revoked")
            if need_log or not hub.connected:
                while True:
                    page, final = from_log()
                    last_log = time.monotonic()
                    if page:
                        last_sent = last_log
                        yield page
                    if final:
                        return
                    if len(page) < PAGE:
                        break
                need_log = False
                if not page and now - last_ended >= every:
                    last_ended = now
                    closing = ended()
                    if closing is not None:
                        page, final = from_log()  # the final event may have landed since the read above
                        if page:
                            yield page
                        if not final and closing:
                            yield [(state["last"] + 1 + i, name, data) for i, (name, data) in enumerate(closing)]
                        return
            batch = sub.get(timeout=heartbeat if hub.connected else settings.poll_interval_seconds)
            now = time.monotonic()
            if batch is None:
                if now - last_sent >= heartbeat:
                    last_sent = now
                    yield None
                if now - max(last_log, last_ended) >= every:
                    need_log = True  # nothing in a while: look at the log, then ask whether it ended
                continue
            if not batch:
                need_log = True  # the transport changed: the log has what it lost
                continue
            fresh, final = [], False
            for event in sorted(batch):
                if event[0] <= state["last"]:
                    if event[1] in FINAL:
                        final = True  # it ended at or before the resume point: nothing more to send
                        break
                    continue  # already sent from the log
                if event[0] != state["last"] + 1:
                    page, final = from_log()  # a gap: the log has what the channel lost, if it was logged
                    fresh += page
                    if final:
                        break
                    if event[0] <= state["last"]:
                        continue
                    if logged:
                        need_log = True  # the log is the truth: wait for it to have the gap
                        break
                    # a direct stream's unlogged events are gone: go on in order
                fresh.append(event)
                state["last"] = event[0]
                if event[1] in FINAL:
                    final = True
                    break
            if fresh:
                last_sent = now
                yield fresh
            if final:
                return
    finally:
        sub.close()


def stream_error(seq: int, doc: dict | None = None) -> str:
    """The SSE ``error`` event (with id ``seq``) that ends a stream the server cannot go on with;
    without ``doc``, an unexpected failure, logged here."""
    if doc is None:
        log.exception("event stream failed")
        doc = problem("server_error", "The stream failed; reconnect with Last-Event-ID to continue")
    return sse(seq, ERROR, dumps({"error": doc}))
