"""The process's ``Hub``: its followers' topics, and the one place other threads reach the fan-out
(request threads subscribe, hand over sockets, start and stop followers; the listener delivers).
It owns the fan-out thread (``Loop``), the Redis subscription (``Listener``) and the reader
threads (``LogReader``); topics and followers belong to the fan-out thread."""

import logging
import resource
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator

import redis
from sqlalchemy.engine import Engine

from api.live import reads
from api.live.follower import ENDED, FAILED, GONE, SHUTDOWN, Follower, Watcher
from api.live.frames import Batch, Event
from api.live.loop import TICK_SECONDS, Loop
from api.live.sinks import Ended, QueueSink, SocketSink
from api.live.topics import Listener, Recent, Topic
from common.bus import Publisher, notices
from common.errors import LMSPError
from common.settings import Settings

log = logging.getLogger("lmsp.live")
CONFIRM_SECONDS = 1.0      # how long a new follower waits for Redis to confirm its subscription
SAFETY_NET_SECONDS = 5.0   # a quiet task's log is re-read (then "has it ended" asked) this often
DIRECT_CHECK_SECONDS = 1.0  # a quiet direct stream asks whether its worker died this often
# A WebSocket follower's unsent bytes in the kernel: a pong (or a close) is queued ahead of the follower's
# own frames but behind these, and clients time their pings out (python-websockets: 20 s). At 64 kbit/s
# this is 8 s; the kernel's send buffer (``follower_buffer_bytes``, doubled) would be 60.
WS_NOTSENT_BYTES = 64 * 1024
HINT_SECONDS = 1.0         # a response's worker is told of a new live follower at most this often (``hint``)
FD_RESERVE = 512           # open files kept for everything but followers (database, Redis, requests)

_hubs: "weakref.WeakSet[Hub]" = weakref.WeakSet()


def tune(sock: socket.socket, settings: Settings, ws: bool) -> None:
    """A follower's socket options. No TCP_USER_TIMEOUT: Linux counts a zero window's probes against it
    even while a slow reader's window opens a little at a time, so it reset clients on slow links that
    were reading (``SocketSink._acked_lately`` tells a vanished client instead)."""
    # The kernel's send buffer is bounded too: left to autotune it grows to tcp_wmem's maximum (4 MiB
    # on Linux) for a client that stops reading, hiding it from the follower's own bound for as long.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, settings.follower_buffer_bytes)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a frame is written whole: no wait
        if ws:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, WS_NOTSENT_BYTES)
    except (OSError, AttributeError):
        pass  # not TCP (a test's socket pair) or not Linux


class ShuttingDown(Exception):
    """This api process got SIGTERM: a task follower ends so its client resumes on another one."""


# SIGTERM: a direct stream (or a synchronous request) cannot move to another process, so it runs on
# this long; then it ends with a 503 or an error event and its generation is aborted, before gunicorn's
# --graceful-timeout (10 s, api/serve.py) would cut it unsaid and leave its generation running.
DIRECT_GRACE_SECONDS = 7.0


def restarting() -> LMSPError:
    return LMSPError("overloaded", "This api process is restarting; send the request again (a task, unlike a "
                     "direct response, carries on elsewhere)", retry_after=1)


class Hub:
    """One per api process: see the module. Other threads hand the fan-out thread work with ``call``."""

    def __init__(self, settings: Settings, engine: Engine, publisher: Publisher | None = None):
        """``engine``: the followers' reads' (``db.autocommit``'s); ``publisher``: the process's, for the
        hints to workers (``hint``); else one of its own."""
        self.settings = settings
        self._topics: dict[str, Topic] = {}
        self.closing = threading.Event()  # set on SIGTERM (api/__init__.py)
        self.closing_at = 0.0             # when (monotonic)
        self.closed = threading.Event()   # every task follower has been ended after SIGTERM
        self.listener: Listener | None = None  # (the loop's thread asks it from its start)
        self.loop = Loop(self._poll_topics, self._tick, self._poll_every, self._failed)
        self.call = self.loop.call
        self.reads = reads.LogReader(engine, self.call)
        client = redis.Redis.from_url(settings.redis_url, socket_timeout=2, socket_connect_timeout=1
                                      ) if settings.redis_url else None
        self.listener = Listener(client, self.call, self._deliver, self._confirmed, self._transport_changed
                                 ) if client is not None else None
        self._publisher = publisher or Publisher(settings.redis_url)
        self._hinted: dict[str, float] = {}  # response id -> when its worker was last told (``hint``)
        self._hint_lock = threading.Lock()
        _hubs.add(self)

    def topic(self, response_id: str) -> Topic | None:
        """The topic of a followed response (what the tests look at)."""
        return self._topics.get(response_id)

    @property
    def connected(self) -> bool:
        return self.listener is not None and self.listener.connected

    # -- for request threads ---------------------------------------------------------------------------

    def subscribe(self, response_id: str, confirm: bool = True) -> Follower:
        """A follower read by this thread (``follow``), subscribed: nothing published after this
        returns is missed; with ``confirm=False`` only after ``confirm(sub)`` returns (the caller does
        other work while Redis confirms)."""
        follower = Follower(self, response_id, QueueSink(self.call, self.settings))
        self.call(self._add, follower)
        if confirm:
            self.confirm(follower)
        return follower

    def watch(self, response_id: str) -> Watcher:
        """A ``Watcher`` of ``response_id``'s notices (common/bus.py ``notices``), subscribed (see
        ``subscribe``): told of each batch with an event that may change its task or response object,
        never of its text alone (a long poll of a report costs nothing a token)."""
        watcher = Watcher(self, notices(response_id), QueueSink(self.call, self.settings))
        self.call(self._add, watcher)
        self.confirm(watcher)
        return watcher

    def hint(self, response_id: str) -> None:
        """Tell the worker of a task's response that a follower reads it live (its windows, quiet while
        unfollowed, shorten at once: worker/gate.py ``Deltas``); once per HINT_SECONDS per response in
        this process, whatever the connect rate (a storm's thousand followers make one message)."""
        if not self._publisher.live:
            return
        now = time.monotonic()
        with self._hint_lock:
            if now - self._hinted.get(response_id, -HINT_SECONDS) < HINT_SECONDS:
                return
            if len(self._hinted) >= 4096:
                self._hinted = {r: at for r, at in self._hinted.items() if now - at < HINT_SECONDS}
            self._hinted[response_id] = now
        self._publisher.followed(response_id)

    def confirm(self, follower: Follower) -> bool:
        """Whether Redis confirmed the subscription (within CONFIRM_SECONDS): when not (Redis is away or
        slow), what is published meanwhile may not reach the follower."""
        follower.confirmed.wait(CONFIRM_SECONDS)
        topic = self._topics.get(follower.response_id)
        return topic is not None and topic.confirmed

    def attach(self, sock: socket.socket, *, ws: bool, chunked: bool, path: str, response_id: str, after: int,
               ended, authorized, on_close: Callable[[], None]) -> None:
        """Hand a client's socket (its response head written) to the fan-out thread as a task follower:
        its frames WebSocket's (``ws``), else SSE in a chunked body (``chunked``) or a plain one (HTTP/1.0).
        This request's thread subscribes it and reads its first page of the log, as a thread per
        follower did: a connect storm's reads run on the request threads, not on the few readers."""
        sock.setblocking(False)
        tune(sock, self.settings, ws)
        follower = Follower(self, response_id, SocketSink(self.loop, self.settings, sock, ws, path, on_close,
                                                          chunked))
        follower.setup(after, True, ended, authorized)
        follower.reading = True  # live batches wait in pending until the first page is in
        self.call(self._add, follower, True)
        confirmed = self.confirm(follower)
        self.hint(response_id)  # subscribed first: what its worker sends at the hint is heard
        topic = self._topics.get(response_id) if confirmed else None
        recent = topic.recent if topic is not None and follower in topic.followers else None
        plan = recent.plan(follower, after) if recent is not None else (Recent.READ,)
        if plan[0] == Recent.SERVED:  # its topic's recent events reach back to ``after``: no read
            self.call(self._attach, follower, plan[1], plan[2], None, None)
            return
        if plan[0] == Recent.WAIT:
            return  # the read in flight for its topic serves it (``_attach``)
        try:
            page, final, ending = self.reads.ask(response_id, after, True, ended, None)
            first, error = Batch(page) if page else None, None
            if first is not None:
                first.encoded(ws, chunked)
        except Exception as exc:  # noqa: BLE001 - the follower ends with an error event
            first, final, ending, error = None, False, None, exc
        seed = recent if plan[0] == Recent.SEED else None
        whole = first is not None and (final or len(first.events) < reads.PAGE)  # the log up to its end then
        self.call(self._attach, follower, first, final, ending, error, seed, whole)

    def start(self, follower: Follower, after: int, logged: bool, ended, authorized) -> None:
        follower.setup(after, logged, ended, authorized)
        self.call(self._begin, follower)

    def stop(self, follower: Follower) -> None:
        self.call(follower.end, GONE)

    def begin_shutdown(self) -> None:
        """SIGTERM: end every task follower (its client resumes on another process) and answer every
        long poll; direct streams cannot move and run on for DIRECT_GRACE_SECONDS."""
        self.closing_at = time.monotonic()
        self.closing.set()
        self.call(self._shutdown)

    # -- for followers, on the fan-out thread ------------------------------------------------------

    def read(self, follower: Follower, after: int, ask_ended: bool, known=None) -> None:
        self.reads.read(follower, after, ask_ended, known)

    def check_auth(self, follower: Follower) -> None:
        self.reads.check_auth(follower)

    def forget(self, follower: Follower) -> None:
        """The follower ended: its topic (and the Redis subscription) goes with its last follower."""
        rid = follower.response_id
        topic = self._topics.get(rid)
        if topic is None:
            return
        topic.followers.discard(follower)
        if not topic.followers:
            del self._topics[rid]
            if self.listener is not None:
                self.listener.unsubscribe(rid)

    def advanced(self, response_id: str, seq: int) -> None:
        topic = self._topics.get(response_id)
        if topic is not None and seq > topic.head:
            topic.head = seq

    # -- on the fan-out thread -------------------------------------------------------------------------

    def _add(self, follower: Follower, attaching: bool = False) -> None:
        """``attaching``: a task follower (``attach``): its topic keeps its recent events from now on."""
        rid = follower.response_id
        topic = self._topics.get(rid)
        if topic is None:
            topic = self._topics[rid] = Topic(rid)
            if self.listener is not None:
                self.listener.subscribe(rid)
        if attaching and topic.recent is None:
            topic.recent = Recent()
        topic.followers.add(follower)
        if isinstance(follower.sink, SocketSink):
            self.loop.register(follower.sink.sock, follower.sink)
        if topic.confirmed or not self.connected:
            follower.confirmed.set()

    def _attach(self, follower: Follower, first: Batch | None, final: bool, ending, error,
                seed: Recent | None = None, whole: bool = False) -> None:
        """A follower's first page (read, or from its topic's recent events); ``seed``: the recent events
        its read was to seed (``whole``: it may), and whose waiting followers go on from them."""
        if seed is not None:
            for waiter in seed.seeded(first.events if whole else None):
                recent = seed.since(waiter.seq.last)
                if recent is None:
                    self._begin(waiter)  # its point is not among them: it reads the log
                else:
                    self._attach(waiter, *recent, None, None)
        follower.began = True
        if self.closing.is_set():
            follower.end(SHUTDOWN)
        else:
            follower.read_done(first, final, ending, error)

    def _begin(self, follower: Follower) -> None:
        if follower.logged and self.closing.is_set():
            follower.end(SHUTDOWN)
            return
        topic = self._topics.get(follower.response_id)
        if topic is None or follower.state == ENDED:
            return
        if follower.confirmed.is_set() or not follower.logged:
            follower.begin()
        else:
            topic.waiting.append((time.monotonic() + CONFIRM_SECONDS, follower))

    def _deliver(self, response_id: str, events: list[Event] | None) -> None:
        """A batch published for ``response_id`` (or a poll's page)."""
        topic = self._topics.get(response_id)
        if topic is None or not events:
            return
        events.sort()
        if topic.recent is not None and topic.confirmed:  # a poll's page while Redis is away is not heard
            topic.recent.heard(events)
        batch = Batch(events)
        topic.head = max(topic.head, events[-1][0])
        topic.last_event = time.monotonic()
        for follower in list(topic.followers):
            follower.deliver(batch)

    def _confirmed(self, response_id: str) -> None:
        topic = self._topics.get(response_id)
        if topic is None:
            return
        topic.confirmed = True
        self._begin_waiting(topic)

    def _begin_waiting(self, topic: Topic) -> None:
        waiting, topic.waiting = topic.waiting, []
        for follower in topic.followers:
            follower.confirmed.set()
        for _, follower in waiting:
            follower.begin()

    def _transport_changed(self) -> None:
        """Redis came or went: each topic polls its log now for what the change may have lost."""
        for topic in self._topics.values():
            topic.confirmed = False
            if topic.recent is not None:
                topic.recent.forget()
            if not self.connected:
                self._begin_waiting(topic)
            topic.last_poll = topic.last_event = -1e9
            for follower in topic.followers:
                follower.transport_changed()

    def _shutdown(self, direct: bool = False) -> None:
        """End the task followers and wake the long polls (they answer at once); with ``direct``, end
        the direct streams too."""
        for topic in list(self._topics.values()):
            for follower in list(topic.followers):
                if isinstance(follower, Watcher):
                    follower.transport_changed()
                elif follower.logged or direct:
                    follower.end(SHUTDOWN)

    def _failed(self, follower: Follower | None, exc: BaseException) -> None:
        if follower is None:
            log.error("fan-out failed", exc_info=exc)
            return
        try:
            follower.end(FAILED, exc)
        except Exception:  # noqa: BLE001
            log.exception("a follower could not be ended")
            follower.sink.close()

    # -- polls: the log read for what Redis did not bring -------------------------------------------

    def _poll_every(self) -> float:
        return TICK_SECONDS if self.connected else self.settings.poll_interval_seconds

    def _poll_topics(self, now: float) -> None:
        connected = self.connected
        for topic in list(self._topics.values()):
            if topic.waiting and topic.waiting[0][0] <= now:
                self._begin_waiting(topic)  # Redis did not confirm in time: go on, the polls cover it
            if topic.polling:
                continue
            if not connected:
                due = now - topic.last_poll >= self.settings.poll_interval_seconds
            else:
                sample = topic.sample()
                every = SAFETY_NET_SECONDS if sample is None or sample.logged else DIRECT_CHECK_SECONDS
                due = now - max(topic.last_poll, topic.last_event) >= every
            if due:
                self._poll(topic, now)

    def _poll(self, topic: Topic, now: float) -> None:
        """One log read for every follower of a topic: what Redis did not bring (it is away, or a
        quiet task's safety net), then whether the response ended some other way."""
        sample = topic.sample()
        if sample is None:
            return
        every = SAFETY_NET_SECONDS if sample.logged else DIRECT_CHECK_SECONDS
        ask_ended = now - topic.last_ended >= every
        topic.polling, topic.last_poll = True, now
        if ask_ended:
            topic.last_ended = now
        self.reads.poll(topic.response_id, topic.head, ask_ended, sample.ended, lambda r: self._polled(topic, r))

    def _polled(self, topic: Topic, result) -> None:
        topic.polling = False
        topic.last_poll = time.monotonic()
        if result is None or self._topics.get(topic.response_id) is not topic:
            return
        page, _final, ending = result
        if page:
            self._deliver(topic.response_id, list(page))
        if ending is not None:
            for follower in list(topic.followers):  # each reads to its own end (or is sent the ending)
                follower.read_to_end(ending)

    def _tick(self, now: float) -> None:
        # Thousands of followers a tick: the checks that find nothing to do stay inline.
        settings = self.settings
        recheck, beat, ping = settings.stream_auth_recheck_seconds, settings.follower_heartbeat_seconds, \
            settings.ws_ping_seconds
        for topic in list(self._topics.values()):
            for follower in list(topic.followers):
                sink = follower.sink
                try:
                    if sink.__class__ is SocketSink and (sink.out or now - sink.pinged >= ping if sink.ws
                                                         else sink.out or now - sink.sent_at >= beat):
                        sink.tick(now)
                    if now - follower.last_auth >= recheck and follower.state != ENDED:
                        follower.check_auth(now)
                except Exception as exc:  # noqa: BLE001
                    self._failed(follower, exc)
        if self.closing.is_set() and now - self.closing_at >= DIRECT_GRACE_SECONDS:
            self._shutdown(direct=True)
        if self.closing.is_set() and not self.loop.draining and \
                not any(f.logged for t in self._topics.values() for f in t.followers):
            self.closed.set()


def follow(hub: Hub, response_id: str, after: int, *, logged: bool, heartbeat: float,
           ended: Callable[[], list[tuple[str, str]] | None],
           authorized: Callable[[], bool] | None = None,
           subscription: Follower | None = None) -> Iterator[list[Event] | None]:
    """A follower read by this thread: lists of events with seq > ``after``, in order, the last list
    ending with the final event; None means "nothing happened for ``heartbeat`` seconds". It raises
    ``ShuttingDown`` on SIGTERM (a direct follower: ``restarting()``, after DIRECT_GRACE_SECONDS), the
    ``LMSPError`` of a revoked token or an expired log, or what a database read raised.
    ``subscription`` is one the caller opened before dispatching the work (so nothing is missed); see
    ``Follower`` for the rest."""
    follower = subscription or hub.subscribe(response_id)
    if logged:
        hub.hint(response_id)
    hub.start(follower, after, logged, ended, authorized)
    try:
        while True:
            item = follower.sink.get(heartbeat)
            if not isinstance(item, Ended):
                yield item
            elif item.how == SHUTDOWN:
                raise ShuttingDown() if logged else restarting()
            elif item.how == FAILED:
                raise item.exc
            else:
                return  # the final event was sent; or cut (too slow): the client resumes from the log
    finally:
        hub.stop(follower)


def fd_budget() -> int:
    """How many followers this process's open-file limit allows (raised to its hard limit first)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return max(1, (soft if soft != resource.RLIM_INFINITY else 1 << 20) - FD_RESERVE)


def shutdown_all(timeout: float = 2.0) -> None:
    """The api process is exiting: end every task follower, and give their goodbyes ``timeout``."""
    hubs = list(_hubs)
    for hub in hubs:
        hub.begin_shutdown()
    deadline = time.monotonic() + timeout
    for hub in hubs:
        hub.closed.wait(max(0.0, deadline - time.monotonic()))
