"""How the api is launched in production (gunicorn, gthread): the one argv `lmsp serve`, `lmsp dev`,
the test harness and the bench all start."""

import json
import sys

from gunicorn import util
from gunicorn.http.errors import UnsupportedTransferCoding
from gunicorn.workers.gthread import ThreadWorker

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


class Worker(ThreadWorker):
    """gthread, whose own answers to what never reaches the app (a request line or headers too large, a
    malformed request) are problem documents with LMSP-Version too (9.1, 9.3), not gunicorn's HTML; and
    which lets an event stream take its socket to the fan-out thread (api/handover.py), so that a
    follower holds no thread of this pool."""

    def init_process(self) -> None:
        util.write_error = write_problem  # the one function gunicorn's handle_error answers with
        self.detached: set = set()  # sockets a view took: gunicorn must neither close nor reuse them
        super().init_process()

    def load_wsgi(self) -> None:
        super().load_wsgi()
        app = self.wsgi

        def wsgi(environ, start_response):
            # HTTP/1 over plain TCP only: a TLS socket is not ours to write alone. The protocol is the
            # request line's (SERVER_PROTOCOL); HTTP_VERSION would be a client's own "Version:" header.
            if not self.cfg.is_ssl and environ.get("SERVER_PROTOCOL") in ("HTTP/1.0", "HTTP/1.1"):
                environ[DETACH] = self.detached.add
            return app(environ, start_response)
        self.wsgi = wsgi

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


def write_problem(sock, status: int, reason: str, detail: str) -> None:
    body = json.dumps(status_problem(status, reason, detail or reason).wire()).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nConnection: close\r\nContent-Type: application/problem+json\r\n"
            f"Content-Length: {len(body)}\r\nLMSP-Version: {VERSION}\r\n\r\n")
    util.write_nonblock(sock, head.encode("latin-1") + body)
