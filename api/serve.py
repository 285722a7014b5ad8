"""How the api is launched in production (gunicorn, gthread): the one argv `lmsp serve`, `lmsp dev`,
the test harness and the bench all start."""

import json
import sys

from gunicorn import util
from gunicorn.workers.gthread import ThreadWorker

from api.problems import status_problem
from common.settings import Settings
from common.wire import VERSION


def gunicorn_argv(settings: Settings) -> list[str]:
    return [sys.executable, "-m", "gunicorn", "-k", "api.serve.Worker", "-w", str(settings.api_workers),
            "--threads", str(settings.api_threads), "-b", f"{settings.host}:{settings.port}",
            "--timeout", "120", "--graceful-timeout", "10", "api.wsgi:app"]


class Worker(ThreadWorker):
    """gthread, whose own answers to what never reaches the app (a request line or headers too large, a
    malformed request) are problem documents with LMSP-Version too (9.1, 9.3), not gunicorn's HTML."""

    def init_process(self) -> None:
        util.write_error = write_problem  # the one function gunicorn's handle_error answers with
        super().init_process()


def write_problem(sock, status: int, reason: str, detail: str) -> None:
    body = json.dumps(status_problem(status, reason, detail or reason)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nConnection: close\r\nContent-Type: application/problem+json\r\n"
            f"Content-Length: {len(body)}\r\nLMSP-Version: {VERSION}\r\n\r\n")
    util.write_nonblock(sock, head.encode("latin-1") + body)
