"""gunicorn entry point: ``gunicorn api.wsgi:app``."""

import ctypes
import ctypes.util
import sys

from gunicorn.arbiter import Arbiter

from api import create_app
from common import logs
from common.settings import ConfigError

# glibc gives each new thread's allocations an arena of their own (up to 8 per core): with a thread
# per open stream that is most of this process's RSS. Two arenas serve gthread's threads as well.
M_ARENA_MAX = -8
try:
    ctypes.CDLL(ctypes.util.find_library("c")).mallopt(M_ARENA_MAX, 2)
except (OSError, AttributeError):
    pass  # not glibc

try:
    logs.setup()
    app = create_app()
except ConfigError as exc:
    # One line, and the exit status that makes gunicorn's master stop ("App failed to load") instead
    # of booting workers that fail the same way, one after another.
    print(f"lmsp api: {exc}", file=sys.stderr, flush=True)
    sys.exit(Arbiter.APP_LOAD_ERROR)
