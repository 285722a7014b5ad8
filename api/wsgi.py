"""gunicorn entry point: ``gunicorn api.wsgi:app``."""

import ctypes
import ctypes.util

from api import create_app
from common import logs

# glibc gives each new thread's allocations an arena of their own (up to 8 per core): with a thread
# per open stream that is most of this process's RSS. Two arenas serve gthread's threads as well.
M_ARENA_MAX = -8
try:
    ctypes.CDLL(ctypes.util.find_library("c")).mallopt(M_ARENA_MAX, 2)
except (OSError, AttributeError):
    pass  # not glibc

logs.setup()
app = create_app()
