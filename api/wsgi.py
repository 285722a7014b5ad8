"""gunicorn entry point: ``gunicorn api.wsgi:app``."""

import sys

from gunicorn.arbiter import Arbiter

from api import create_app
from common import logs
from common.settings import ConfigError

try:
    logs.setup()
    app = create_app()
except ConfigError as exc:
    # One line, and the exit status that makes gunicorn's master stop ("App failed to load") instead
    # of booting workers that fail the same way, one after another.
    print(f"lmsp api: {exc}", file=sys.stderr, flush=True)
    sys.exit(Arbiter.APP_LOAD_ERROR)
