"""How the api is launched in production (gunicorn, gthread): the one argv `lmsp serve`, `lmsp dev`,
the test harness and the bench all start."""

import json
import socket
import sys
import time

from gunicorn import util
from gunicorn.http.errors import UnsupportedTransferCoding
from gunicorn.workers.gthread import ThreadWorker
from werkzeug.exceptions import RequestTimeout

from api import live
from api.handover import DETACH
from api.problems import status_problem
from common.settings import Settings
from common.wire import VERSION


def gunicorn_argv(settings: Settings) -> list[str]:
    return [sys.executable, "-m", "gunicorn", "-k", "api.serve.Worker", "-w", str(settings.api_workers),
            "--threads", str(settings.api_threads), "-b", f"{settings.host}:{settings.port}",
            "--timeout", "120", "--graceful-timeout", "10", "--keep-alive", str(settings.api_keepalive_seconds),
            # One fixed path per host by default: the api processes of one host would take it from each other.
            "--no-control-socket", "api.wsgi:app"]


# A request is read on one of the pool's threads, blocking: a client that sends part of its headers (or
# body) and stops would hold that thread for good, and a few dozen such connections, no token needed,
# would hold them all. So a request has HEAD_SECONDS for its line and headers (gunicorn's wait of up to
# 5 s for the first byte included) and its body as much again plus a second for every BODY_RATE bytes
# it declares (1 MiB: 64 s more); then the read side of its socket is shut, which ends the blocked read.
HEAD_SECONDS = 15.0
BODY_RATE = 16 * 1024
# A body refused for its size is read and dropped for at most this long (api/body.py refuse_too_large), so
# that a client sending it at once gets its 413 and keeps its connection; one sending it slowly, or not at
# all, holds its thread no longer (no token needed to send one) and gets its 413 as the connection closes.
DRAIN_SECONDS = 5.0


class Worker(ThreadWorker):
    """gthread, whose own answers to what never reaches the app (a request line or headers too large, a
    malformed request) are problem documents with LMSP-Version too (9.1, 9.3), not gunicorn's HTML; and
    which lets an event stream take its socket to the fan-out thread (api/handover.py), so that a
    follower holds no thread of this pool."""

    def init_process(self) -> None:
        util.write_error = write_problem  # the one function gunicorn's handle_error answers with
        self.detached: set = set()  # sockets a view took: gunicorn must neither close nor reuse them
        self.reading: dict = {}  # socket -> when the read of its request is cut (monotonic)
        self.cut: set = set()  # sockets whose read side that watch shut, while their request is handled
        self.body_limit = Settings().max_body_bytes
        super().init_process()

    def load_wsgi(self) -> None:
        super().load_wsgi()
        app = self.wsgi

        def wsgi(environ, start_response):
            # HTTP/1 over plain TCP only: a TLS socket is not ours to write alone. The protocol is the
            # request line's (SERVER_PROTOCOL); HTTP_VERSION would be a client's own "Version:" header.
            if not self.cfg.is_ssl and environ.get("SERVER_PROTOCOL") in ("HTTP/1.0", "HTTP/1.1"):
                environ[DETACH] = self.detached.add
            self._watch_body(environ, start_response)
            return app(environ, start_response)
        self.wsgi = wsgi

    def enqueue_req(self, conn) -> None:
        """(The main thread: a new connection, or bytes on a kept-alive one.) The request's time runs from
        here, its wait for a thread included: a queue of stalled requests must not delay the cut."""
        self.reading[conn.sock] = time.monotonic() + HEAD_SECONDS
        super().enqueue_req(conn)

    def handle(self, conn):
        try:
            return super().handle(conn)
        finally:
            self.reading.pop(conn.sock, None)
            self.cut.discard(conn.sock)

    def _watch_body(self, environ, start_response) -> None:
        """The head is read: the body's own time, or none (a view without a body may run for hours)."""
        sock = environ["gunicorn.socket"]
        self.reading.pop(sock, None)
        length = environ.get("CONTENT_LENGTH")
        declared = int(length) if length and length.isdigit() else None
        if declared == 0 or (declared is None and not environ.get("wsgi.input_terminated")):
            return
        seconds = HEAD_SECONDS + min(declared or self.body_limit, 2 * self.body_limit) / BODY_RATE
        if sock not in self.cut:  # (a head that waited past its time for a thread: its body cannot come)
            self.reading[sock] = time.monotonic() + seconds

        def done() -> bool:
            self.reading.pop(sock, None)
            return sock in self.cut

        def hurry(within: float) -> None:
            deadline = time.monotonic() + within
            if self.reading.get(sock, deadline) > deadline:  # (still being read, and later than that)
                self.reading[sock] = deadline
        # gunicorn's response (start_response's) closes the connection after it when told, and says so
        # (Connection: close): an application's own Connection header is dropped as hop-by-hop.
        close = getattr(getattr(start_response, "__self__", None), "force_close", lambda: None)
        environ["wsgi.input"] = _WatchedBody(environ["wsgi.input"], declared, seconds, done, hurry, close)

    def murder_pending(self) -> None:
        """(The main thread, at least once a second.) Cut the reads of requests past their time."""
        super().murder_pending()
        now = time.monotonic()
        for sock, deadline in list(self.reading.items()):
            if deadline < now and self.reading.pop(sock, None) is not None:
                self.log.info("request not read in time: its connection is closed")
                self.cut.add(sock)
                try:
                    sock.shutdown(socket.SHUT_RD)
                except OSError:
                    pass  # the client is gone already

    def handle_error(self, req, client, addr, exc) -> None:
        # gunicorn answers a transfer coding it does not know with 501 (RFC 9112 6.1): a client's request
        # refused, where a 5xx would say the service failed.
        if isinstance(exc, UnsupportedTransferCoding):
            self.log.warning("Invalid request from ip=%s: %s", (addr or ("",))[0], exc)
            try:
                write_problem(client, 400, "Bad Request", str(exc))
            except OSError:
                pass  # the client is gone
            return
        super().handle_error(req, client, addr, exc)

    def finish_request(self, conn, fs) -> None:
        if conn.sock in self.detached:  # (on the main thread, after the request's thread is done)
            self.detached.discard(conn.sock)
            self.nr_conns -= 1
            return
        super().finish_request(conn, fs)

    def run(self) -> None:
        try:
            super().run()
        finally:
            live.shutdown_all()  # followers are not gunicorn's connections: they end here, resumable


class _WatchedBody:
    """``wsgi.input`` of a request whose body is being read under the watch: ``done()`` takes it off once
    the body is in (and says whether the watch had cut it first: a 408, not a truncated body)."""

    def __init__(self, body, declared: int | None, seconds: float, done, hurry, close):
        self._body, self._left, self._seconds, self._done = body, declared, seconds, done
        self._hurry, self._close = hurry, close

    def discard(self, size: int) -> None:
        """Read and drop up to ``size`` bytes of the body within DRAIN_SECONDS; then the read is cut, and
        the answer closes the connection (what is left of the body would be read as the next request)."""
        self._hurry(DRAIN_SECONDS)
        try:
            while size > 0 and (chunk := self.read(min(size, 65536))):
                size -= len(chunk)
        except (OSError, RequestTimeout):
            self._close()  # cut (or the client left): what was sent so far is dropped, all we wanted

    def _read(self, how, size) -> bytes:
        try:
            data = how(size)
        except OSError:  # gunicorn's NoMoreData: a chunked body cut short, by the watch or by the client
            self._end(complete=False)
            raise
        if self._left is not None:
            self._left -= len(data)
        if not data or (self._left is not None and self._left <= 0):
            self._end(complete=self._left is None or self._left <= 0)  # a chunked body ends with b""
        return data

    def _end(self, complete: bool) -> None:
        if self._done is None:
            return
        cut, self._done = self._done(), None
        if cut and not complete:
            raise RequestTimeout(f"The request's body did not arrive within {self._seconds:.0f} s; "
                                 "send it again, faster")

    def read(self, size=-1):
        return self._read(self._body.read, size)

    def readline(self, size=-1):
        return self._read(self._body.readline, size)

    def __iter__(self):
        while line := self.readline():
            yield line


def write_problem(sock, status: int, reason: str, detail: str) -> None:
    body = json.dumps(status_problem(status, reason, detail or reason).answer()).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nConnection: close\r\nContent-Type: application/problem+json\r\n"
            f"Content-Length: {len(body)}\r\nLMSP-Version: {VERSION}\r\n\r\n")
    util.write_nonblock(sock, head.encode("latin-1") + body)
