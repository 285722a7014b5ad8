"""How the api is launched in production (gunicorn, gthread): the one argv `lmsp serve`, `lmsp dev`,
the test harness and the bench all start."""

import sys

from common.settings import Settings


def gunicorn_argv(settings: Settings) -> list[str]:
    return [sys.executable, "-m", "gunicorn", "-k", "gthread", "-w", str(settings.api_workers),
            "--threads", str(settings.api_threads), "-b", f"{settings.host}:{settings.port}",
            "--timeout", "120", "--graceful-timeout", "10", "api.wsgi:app"]
