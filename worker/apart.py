"""Suspects of an engine crash run apart (issue 36, defect 4).

When an engine dies, any request that was in it, prefilling or decoding, may be what killed it: each is
handed on with its crash counted (lifecycle.hand_on). A task with a crash behind it is a suspect, and
its next attempt runs alone: it waits for the engine to empty, and nothing else (task or direct
request) enters until it ends. So an innocent suspect finishes by itself, and a poison request kills
only itself, until the crash cap (``LMSP_MAX_ATTEMPTS`` crashes) fails it. The price is a drained
engine per suspect; crashes are rare, and a poison request that goes round every worker failing the
others' tasks each time costs more.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager


class Stopped(Exception):
    """The worker is stopping while this request waited for its turn."""


class Apart:
    """One engine's turns: any number of ordinary requests at once, or one suspect alone. A suspect
    waiting stops new ordinary requests from entering, so the engine drains for it."""

    def __init__(self):
        self._cond = threading.Condition()
        self._running = 0
        self._alone = False
        self._suspects_waiting = 0

    @contextmanager
    def turn(self, alone: bool, stop: threading.Event):
        with self._cond:
            if alone:
                self._suspects_waiting += 1
            try:
                while self._alone or (self._running if alone else self._suspects_waiting):
                    if stop.is_set():
                        raise Stopped()
                    self._cond.wait(0.5)
            finally:
                if alone:
                    self._suspects_waiting -= 1
            if alone:
                self._alone = True
            self._running += 1
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                self._alone = self._alone and not alone
                self._cond.notify_all()


_engines: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def of(engine) -> Apart:
    """The turns of ``engine`` (a new engine, after a crash, starts empty)."""
    with _lock:
        apart = _engines.get(engine)
        if apart is None:
            apart = _engines[engine] = Apart()
        return apart
