"""Stream tickets: how a browser's EventSource, which cannot send an Authorization header, opens
``GET /lmsp/v1/tasks/{id}/events``.

The page first asks for a ticket with its bearer token (``POST .../events/ticket``), then opens
``.../events?ticket=...``. A ticket is not the token: it reads one task's events, only for a minute
after it was minted (an open stream outlives it), and dies with its token when that is revoked. So
a ticket that ends up in a proxy's log or a browser's history is worth little, unlike a token in a
URL (RFC 6750 §2.3 advises against that). It is signed with a key derived from the token's stored
hash, so every api process and replica can check it with no shared secret to configure.
"""

import base64
import hashlib
import hmac
import time

from flask import g, request

from api import params
from api.extensions import services
from common import wire
from common.errors import LMSPError
from common.ids import is_id
from common.tables import ApiToken
from common.tokens import Identity

TICKET_SECONDS = 60
VERSION = "st1"
STREAM_ENDPOINT = "events.sse"


def _signature(token_hash: str, token_id: str, task_id: str, expires: int) -> str:
    key = hmac.new(bytes.fromhex(token_hash), b"lmsp stream ticket", hashlib.sha256).digest()
    mac = hmac.new(key, f"{VERSION}|{token_id}|{task_id}|{expires}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


def mint(session, identity: Identity, task_id: str) -> wire.StreamTicket:
    row = session.get(ApiToken, identity.token_id)
    expires = int(time.time()) + TICKET_SECONDS
    ticket = f"{VERSION}.{row.id}.{expires}.{_signature(row.token_hash, row.id, task_id, expires)}"
    return wire.StreamTicket(ticket=ticket, expires_at=expires,
                             events_url=f"{wire.API}/tasks/{task_id}/events?ticket={ticket}")


def _redeem(session, ticket: str, task_id: str) -> Identity | None:
    version, _, rest = ticket.partition(".")
    token_id, _, rest = rest.partition(".")
    expires, _, signature = rest.partition(".")
    expires = params.integer(expires)
    if version != VERSION or expires is None or expires < time.time() or not is_id("token", token_id):
        return None
    row = session.get(ApiToken, token_id)
    if row is None or row.revoked_at is not None:
        return None
    # As bytes: compare_digest refuses a str with non-ASCII characters (a client's choice) with TypeError.
    if not hmac.compare_digest(signature.encode(), _signature(row.token_hash, row.id, task_id, expires).encode()):
        return None
    return Identity(row.id, row.principal_id, frozenset(row.scopes.split()))


def admit() -> bool:
    """Authenticate a ticket on the events stream (the only route that takes one); False when the
    request carries none, so the bearer check applies."""
    ticket = request.args.get("ticket")
    if ticket is None or request.endpoint != STREAM_ENDPOINT or request.method not in ("GET", "HEAD") \
            or "Authorization" in request.headers:
        return False
    with services().sessions() as session:
        identity = _redeem(session, ticket, request.view_args["task_id"])
    if identity is None:
        raise LMSPError("unauthorized", "The stream ticket is invalid, expired or not for this task; "
                                        "POST .../events/ticket mints a new one")
    g.identity = identity
    services().limiter.check(identity.principal)
    return True
