"""Bearer tokens: random secrets shown once, stored as SHA-256 hashes, scoped (spec 10)."""

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass

from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session

from common.fairshare import MAX_WEIGHT, MIN_WEIGHT
from common.ids import is_id, new_id
from common.tables import ApiToken, Principal

SCOPES = ("models:read", "responses:write", "responses:read", "tasks:write", "tasks:read",
          "tasks:cancel", "admin")
DEFAULT_SCOPES = tuple(s for s in SCOPES if s != "admin")
RESERVED_SCOPES = ("tools:execute",)  # reserved by spec 6.5/10.3: never granted in 1.0
TOKEN_PREFIX = "lmsp_"
_SHAPE = re.compile(r"lmsp_[A-Za-z0-9_-]{43}")  # what create_token makes: 32 random bytes, base64url


@dataclass(frozen=True)
class Identity:
    token_id: str
    principal: str
    scopes: frozenset[str]


def hash_secret(secret: str) -> str:
    # The secret has 256 random bits, so a fast hash is as safe as a slow KDF.
    return hashlib.sha256(secret.encode()).hexdigest()


KNOWN_SECONDS = 3600  # a token that authenticated (or was made) this recently is known (api/ratelimit.py)


def known_key(digest: str) -> str:
    """The Redis key saying that the token of hash ``digest`` is known: an address past its bad-token limit
    still has it looked up. A hash of the hash: Redis never holds what the tokens table does."""
    return "lmsp:auth:known:" + hashlib.sha256(b"known:" + digest.encode()).hexdigest()[:32]


def parse_scopes(text: str | None) -> tuple[str, ...]:
    if text is None or not text.strip():
        return DEFAULT_SCOPES
    scopes = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    if not scopes:  # (",,,": a token that can do nothing was surely not meant)
        raise ValueError(f"no scope in {text!r}; give one or more of {', '.join(SCOPES)}, comma-separated")
    for scope in scopes:
        if scope in RESERVED_SCOPES:
            raise ValueError(f"scope {scope} is reserved and never granted in LMSP 1.0")
        if scope not in SCOPES:
            raise ValueError(f"unknown scope {scope!r}; scopes are: {', '.join(SCOPES)}")
    return scopes


_PRINCIPAL = re.compile(r"[^\s\x00-\x1f\x7f]{1,128}")  # tables.Principal.id is 128 characters


def check_principal(principal: str, name: str | None = None) -> None:
    """Raise ValueError for a principal (or token name) the database cannot hold or a log line would garble."""
    if not _PRINCIPAL.fullmatch(principal):
        raise ValueError(f"principal {principal!r} must be 1-128 characters, none of them spaces or control "
                         "characters")
    if name is not None and (len(name) > 200 or "\x00" in name):
        raise ValueError("a token name is at most 200 characters, without NUL")


def check_weight(weight: float) -> None:
    """Raise ValueError for a fair-share weight out of range (common/fairshare.py)."""
    if not MIN_WEIGHT <= weight <= MAX_WEIGHT:  # NaN fails too
        raise ValueError(f"a weight is from {MIN_WEIGHT:g} to {MAX_WEIGHT:g}, not {weight:g}")


def create_token(session: Session, principal: str, scopes: tuple[str, ...], name: str | None = None,
                 weight: float | None = None) -> tuple[str, str]:
    """Create a token; return (token id, secret). The caller shows the secret once. ``weight``: the
    principal's share of each model from now on (a new principal gets 1 without it)."""
    now = time.time()
    row = session.get(Principal, principal)
    if row is None:
        session.add(Principal(id=principal, created_at=now, weight=1.0 if weight is None else weight))
        session.flush()
    elif weight is not None:
        row.weight = weight
    secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
    token_id = new_id("token")
    session.add(ApiToken(id=token_id, principal_id=principal, name=name, token_hash=hash_secret(secret),
                         scopes=" ".join(scopes), created_at=now))
    return token_id, secret


def well_formed(secret: str) -> bool:
    """Whether ``secret`` could be a token at all: anything else is refused without a lookup."""
    return _SHAPE.fullmatch(secret) is not None


_BY_HASH = select(ApiToken.id, ApiToken.principal_id, ApiToken.scopes, ApiToken.revoked_at, ApiToken.token_hash
                  ).where(ApiToken.token_hash == bindparam("digest"))


def authenticate(session: Session, secret: str) -> Identity | None:
    digest = hash_secret(secret)
    # Every request asks this: one Core query on the session's connection costs a third of an ORM query.
    row = session.connection().execute(_BY_HASH, {"digest": digest}).first()
    # The lookup is by hash, so timing reveals nothing of the secret; compare anyway in constant time.
    if row is None or row.revoked_at is not None or not hmac.compare_digest(row.token_hash, digest):
        return None
    return Identity(row.id, row.principal_id, frozenset(row.scopes.split()))


def is_active(session: Session, token_id: str) -> bool:
    """Still valid (not revoked, not deleted): open streams ask this now and then."""
    row = session.get(ApiToken, token_id)
    return row is not None and row.revoked_at is None


def list_tokens(session: Session) -> list[tuple[ApiToken, float]]:
    """Every token, and its principal's weight."""
    return [tuple(row) for row in session.execute(select(ApiToken, Principal.weight).join(
        Principal, Principal.id == ApiToken.principal_id).order_by(ApiToken.created_at))]


def revoke_token(session: Session, token_id: str) -> bool:
    row = session.get(ApiToken, token_id) if is_id("token", token_id) else None
    if row is None:
        return False
    if row.revoked_at is None:
        row.revoked_at = time.time()
    return True
