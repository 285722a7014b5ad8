"""gunicorn entry point: ``gunicorn api.wsgi:app``."""

from api import create_app
from common import logs

logs.setup()
app = create_app()
