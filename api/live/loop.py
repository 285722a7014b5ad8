"""The fan-out thread: one selector over every handed-over socket (their sinks), the calls other
threads hand it, and its clock (the hub's polls and ticks). Everything a follower does runs here,
so followers need no lock; a call or a socket that raises ends its own follower, never the thread."""

import logging
import os
import selectors
import threading
import time
from collections import deque
from collections.abc import Callable

log = logging.getLogger("lmsp.live")
TICK_SECONDS = 0.5         # heartbeats, pings, token rechecks and closing deadlines run this often


class Loop:
    """``on_poll(now)`` runs every ``poll_every()`` seconds, ``on_tick(now)`` every TICK_SECONDS;
    ``failed(follower or None, exc)`` is told what raised."""

    def __init__(self, on_poll: Callable, on_tick: Callable, poll_every: Callable[[], float], failed: Callable):
        self.on_poll, self.on_tick, self.poll_every, self.failed = on_poll, on_tick, poll_every, failed
        self.selector = selectors.DefaultSelector()
        self._calls: deque = deque()
        self._woken = False  # a wake-up byte is written and its calls not yet taken: no other is needed
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.selector.register(self._wake_r, selectors.EVENT_READ, None)
        self.draining: set = set()  # sinks whose follower ended: their last frames go, then they close
        threading.Thread(target=self._run, name="lmsp-fanout", daemon=True).start()

    def call(self, fn, *args) -> None:
        """Run ``fn(*args)`` on the fan-out thread (from any thread)."""
        self._calls.append((fn, args))
        if self._woken:  # the thread takes the calls after clearing the flag: this one with them
            return
        self._woken = True
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # the pipe is full: the thread is awake anyway

    # -- sockets, on the fan-out thread -------------------------------------------------------------

    def register(self, sock, sink) -> None:
        self.selector.register(sock, selectors.EVENT_READ, sink)

    def want_write(self, sock, sink, on: bool) -> None:
        self.selector.modify(sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if on else 0), sink)

    def unregister(self, sock) -> None:
        try:
            self.selector.unregister(sock)
        except (KeyError, ValueError):
            pass

    # -- the thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        next_tick = next_poll = 0.0
        while True:
            now = time.monotonic()
            try:
                ready = self.selector.select(max(0.0, min(next_tick, next_poll) - now))
            except OSError:
                ready = []
            for key, mask in ready:
                sink = key.data
                try:
                    if sink is None:
                        self._run_calls()
                        continue
                    if mask & selectors.EVENT_READ and sink.sock is not None:
                        sink.on_readable()
                    if mask & selectors.EVENT_WRITE and sink.sock is not None:
                        sink.flush()
                except Exception as exc:  # noqa: BLE001 - one follower's failure is not the others'
                    self.failed(sink.follower, exc)
            now = time.monotonic()
            if now >= next_poll:
                next_poll = now + self.poll_every()
                self.on_poll(now)
            if now >= next_tick:
                next_tick = now + TICK_SECONDS
                self.on_tick(now)
                for sink in list(self.draining):
                    sink.tick(now)

    def _run_calls(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        # Cleared after the bytes are read and before the calls are taken: a call that saw it set is
        # taken below, and one that sees it clear writes a byte that stays for the next wake-up. (Cleared
        # before the read, a byte written meanwhile was read here while the flag stayed set: the next
        # call wrote none and waited.) A tailed report's events are a call each: one write a wake-up,
        # not one a call (9% of the api's CPU there).
        self._woken = False
        calls = self._calls
        while calls:
            fn, args = calls.popleft()
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 - never let one follower stop the thread
                owner = getattr(fn, "__self__", None)
                self.failed(owner if hasattr(owner, "sink") else
                            next((a for a in args if hasattr(a, "sink")), None), exc)
