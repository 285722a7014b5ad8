"""Idempotency-Key (spec 9.2): scoped to principal + method + path, keyed by a canonical body hash."""

import hashlib
import json
import re
import time
from dataclasses import dataclass

from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from common.errors import LMSPError
from common.tables import IdempotencyRecord

_KEY = re.compile(r"^[\x21-\x7e]{1,255}$")
STALE_SECONDS = 15 * 60  # an in-flight record this old belongs to a request that died


@dataclass
class Key:
    principal: str
    method: str
    path: str
    key: str
    request_hash: str

    def where(self):
        return (IdempotencyRecord.principal_id == self.principal, IdempotencyRecord.method == self.method,
                IdempotencyRecord.path == self.path, IdempotencyRecord.key == self.key)


def key_from(header: str | None, principal: str, method: str, path: str, body) -> Key | None:
    if header is None:
        return None
    if not _KEY.match(header):
        raise LMSPError("invalid_request", "Idempotency-Key must be 1-255 visible ASCII characters",
                        param="Idempotency-Key")
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return Key(principal, method, path, header, hashlib.sha256(canonical.encode()).hexdigest())


def existing(session: Session, key: Key) -> IdempotencyRecord | None:
    return session.execute(select(IdempotencyRecord).where(*key.where())).scalar_one_or_none()


def check_replay(record: IdempotencyRecord, key: Key) -> IdempotencyRecord:
    """Raise for a reused or in-flight key; return a finished record to replay."""
    if record.request_hash != key.request_hash:
        raise LMSPError("idempotency_key_reused", "This Idempotency-Key was used with another request "
                        "body; use a new key for a new request")
    if record.status_code is None:
        raise LMSPError("idempotency_key_in_use", "A request with this Idempotency-Key is still being "
                        "processed; retry after it finishes", retry_after=1)
    return record


def record_for_insert(key: Key, *, status_code=None, body=None, task_id=None) -> IdempotencyRecord:
    return IdempotencyRecord(principal_id=key.principal, method=key.method, path=key.path, key=key.key,
                             request_hash=key.request_hash, status_code=status_code, body=body,
                             task_id=task_id, created_at=time.time())


def begin(sessions: sessionmaker[Session], key: Key) -> IdempotencyRecord | None:
    """Claim the key for a long request; return a finished record to replay instead."""
    for _ in range(2):
        with sessions() as session:
            record = existing(session, key)
            if record is not None:
                if record.status_code is None and time.time() - record.created_at > STALE_SECONDS:
                    session.execute(delete(IdempotencyRecord).where(*key.where()))
                    session.commit()
                    continue
                return check_replay(record, key)
            session.add(record_for_insert(key))
            try:
                session.commit()
                return None
            except IntegrityError:
                session.rollback()  # someone else claimed it first: look again
    raise LMSPError("idempotency_key_in_use", "This Idempotency-Key is being processed", retry_after=1)


def finish(sessions: sessionmaker[Session], key: Key, status_code: int, body: str) -> None:
    with sessions() as session:
        session.execute(update(IdempotencyRecord).where(*key.where()).values(status_code=status_code, body=body))
        session.commit()


def abandon(sessions: sessionmaker[Session], key: Key) -> None:
    """The request ended without an outcome worth replaying (e.g. a dropped stream)."""
    with sessions() as session:
        session.execute(delete(IdempotencyRecord).where(*key.where(), IdempotencyRecord.status_code.is_(None)))
        session.commit()
