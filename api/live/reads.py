"""The followers' database reads (replays, gaps, polls, "has it ended", token rechecks), on a few
reader threads, never on the fan-out thread: each hands its result back with ``call``."""

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from operator import itemgetter

from sqlalchemy.engine import Engine

from api.live.frames import Event
from common import eventlog
from common.events import FINAL

log = logging.getLogger("lmsp.live")
PAGE = 5000  # events per log read (~1 MB), written to the client in one piece; 20,000 cost 10% more CPU (bigger allocations)
READERS = 4  # threads for the followers' database reads


class LogReader:
    """Reads for followers, on ``READERS`` threads; ``call`` runs a result's handler on the fan-out thread."""

    def __init__(self, engine: Engine, call: Callable):
        """``engine``: one of ``db.autocommit``'s (a page is one query string)."""
        self.engine, self.call = engine, call
        self._pool = ThreadPoolExecutor(READERS, "lmsp-follow-read")

    def page(self, response_id: str, after: int) -> tuple[list[Event], bool]:
        """Events after ``after`` from the log (a page), up to the final one, and whether it is among them."""
        with self.engine.connect() as conn:
            page = eventlog.read_on(conn, response_id, after, limit=PAGE)
        final = not FINAL.isdisjoint(map(itemgetter(1), page))  # at C speed: a replay's pages are long
        if final:
            page = page[:next(i for i, event in enumerate(page) if event[1] in FINAL) + 1]
        return page, final

    def ask(self, response_id: str, after: int, ask_ended: bool, ended, known):
        """A page; when it is empty and ``ask_ended``, also the events that end the stream another way
        (``known``, or ``ended()``: None while the response runs), read again after that answer."""
        page, final = self.page(response_id, after)
        ending = None
        if not page and ask_ended:
            ending = known if known is not None else ended()
            if ending is not None:
                page, final = self.page(response_id, after)  # the final event may have landed since
        return page, final, ending

    def read(self, follower, after: int, ask_ended: bool, known=None) -> None:
        """``ask`` for ``follower``; the answer goes to its ``read_done``."""
        def job():
            try:
                result = self.ask(follower.response_id, after, ask_ended, follower.ended, known)
            except Exception as exc:  # noqa: BLE001 - the follower ends with an error event
                self.call(follower.read_done, [], False, None, exc)
                return
            self.call(follower.read_done, *result, None)
        self._pool.submit(job)

    def check_auth(self, follower) -> None:
        def job():
            try:
                valid = follower.authorized()
            except Exception:  # noqa: BLE001 - the database is away: ask again next time
                log.warning("token recheck failed", exc_info=True)
                valid = True
            self.call(follower.auth_done, valid)
        self._pool.submit(job)

    def poll(self, response_id: str, head: int, ask_ended: bool, ended, done: Callable) -> None:
        """``ask`` for a topic's poll; ``done(result)`` gets it, or None when the database is away."""
        def job():
            try:
                result = self.ask(response_id, head, ask_ended, ended, None)
            except Exception:  # noqa: BLE001 - the database is away: the next poll tries again
                log.warning("event log poll failed", exc_info=True)
                result = None
            self.call(done, result)
        self._pool.submit(job)
