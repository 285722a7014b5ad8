"""The worker's recent generated tokens per second, reported with each heartbeat (the dashboard's
workers panel): counted as deltas arrive, in one-second buckets over a sliding window, so reading it
costs nothing and needs no scan of the event log."""

import threading
import time
from collections import deque

WINDOW_SECONDS = 10


class TokenRate:
    def __init__(self, window: int = WINDOW_SECONDS, clock=time.monotonic):
        self.window = window
        self.clock = clock
        self.buckets: deque[list[int]] = deque()  # [whole second, tokens], oldest first
        self.lock = threading.Lock()

    def add(self, tokens: int) -> None:
        second = int(self.clock())
        with self.lock:
            if self.buckets and self.buckets[-1][0] == second:
                self.buckets[-1][1] += tokens
            else:
                self.buckets.append([second, tokens])
                self._expire(second)

    def per_second(self) -> float:
        """Tokens generated over the last ``window`` whole seconds, per second."""
        now = int(self.clock())
        with self.lock:
            self._expire(now)
            total = sum(tokens for second, tokens in self.buckets if second < now)  # whole seconds only
        return total / self.window

    def _expire(self, now: int) -> None:
        while self.buckets and self.buckets[0][0] < now - self.window:
            self.buckets.popleft()
