"""The web dashboard: one static page (api/static/, no build step) served at ``/``.

The page needs no token to load; it asks for one and keeps it in sessionStorage.
"""

from flask import Blueprint, current_app

from api.operations import media_answer, operation

bp = Blueprint("dashboard", __name__)

# Scripts and styles only from this origin, no framing, no referrer (the page's URLs carry task ids).
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; "
                               "base-uri 'none'; form-action 'self'",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


@bp.get("/")
@operation("dashboard", "The web dashboard (it asks for a token)", tag="dashboard", scope=None,
           answers={200: media_answer("The dashboard page", "text/html")})
def index():
    resp = current_app.send_static_file("index.html")
    resp.headers.update(HEADERS)
    return resp
