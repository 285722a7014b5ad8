"""Idempotency-Key (spec 9.2): scoped to principal + method + path, keyed by a canonical body hash."""

import hashlib
import json
import logging
import re
import threading
import time
from dataclasses import dataclass

from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from common.db import db_now
from common.errors import LMSPError
from common.tables import IdempotencyRecord

log = logging.getLogger("lmsp.idempotency")
# Visible ASCII but the comma: a request with two Idempotency-Key lines reaches us as one value, the two
# joined by a comma (RFC 9110 5.3), which must not pass for a key of its own.
_KEY = re.compile(r"^[\x21-\x2b\x2d-\x7e]{1,255}$")


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
        raise LMSPError("invalid_request", "Idempotency-Key must be one key of 1-255 visible ASCII characters "
                        "other than a comma", param="Idempotency-Key")
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


class Claims:
    """Keys claimed by long requests running in this process (POST /responses).

    A claim is as alive as its request: while the request runs, a heartbeat here refreshes
    the record's ``created_at`` every ``beat`` seconds; a record not refreshed for three beats
    belongs to a request whose process died, and a retry may take it over. A request that ends
    without an outcome (dropped, failed) gives its key back at once (``abandon``).
    """

    def __init__(self, sessions: sessionmaker[Session], beat: float):
        self.sessions, self.beat = sessions, beat
        self.live: set[tuple] = set()
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def begin(self, key: Key) -> IdempotencyRecord | None:
        """Claim the key; return a finished record to replay instead."""
        for _ in range(2):
            with self.sessions() as session:
                # Staleness by the database's clock: replicas' clocks may disagree, and a live claim
                # taken for stale would run the request twice.
                if session.execute(delete(IdempotencyRecord).where(
                        *key.where(), IdempotencyRecord.status_code.is_(None),
                        IdempotencyRecord.created_at < db_now() - 3 * self.beat)).rowcount:
                    session.commit()
                record = existing(session, key)
                if record is not None:
                    return check_replay(record, key)
                claim = record_for_insert(key)
                claim.created_at = db_now()  # its heartbeats and staleness are judged by this clock too
                session.add(claim)
                try:
                    session.commit()
                except IntegrityError:
                    session.rollback()  # someone else claimed it first: look again
                    continue
            with self.lock:
                self.live.add(_ident(key))
                if self.thread is None:
                    self.thread = threading.Thread(target=self._beat, name="lmsp-idempotency", daemon=True)
                    self.thread.start()
            return None
        raise LMSPError("idempotency_key_in_use", "This Idempotency-Key is being processed", retry_after=1)

    def finish(self, key: Key, status_code: int, body: str) -> None:
        with self.sessions() as session:
            session.execute(update(IdempotencyRecord).where(*key.where())
                            .values(status_code=status_code, body=body, created_at=db_now()))
            session.commit()
        self._drop(key)

    def abandon(self, key: Key) -> None:
        """The request ended without an outcome worth replaying (e.g. a dropped stream, a failure)."""
        self._drop(key)
        with self.sessions() as session:
            session.execute(delete(IdempotencyRecord).where(*key.where(),
                                                            IdempotencyRecord.status_code.is_(None)))
            session.commit()

    def _drop(self, key: Key) -> None:
        with self.lock:
            self.live.discard(_ident(key))

    def _beat(self) -> None:
        while True:
            time.sleep(self.beat)
            with self.lock:
                keys = list(self.live)
            if not keys:
                continue
            try:
                with self.sessions() as session:
                    now = db_now()
                    for principal, method, path, name in keys:
                        session.execute(update(IdempotencyRecord).where(
                            IdempotencyRecord.principal_id == principal, IdempotencyRecord.method == method,
                            IdempotencyRecord.path == path, IdempotencyRecord.key == name,
                            IdempotencyRecord.status_code.is_(None)).values(created_at=now))
                    session.commit()
            except Exception:  # noqa: BLE001 - try again next beat; the database may be back
                log.exception("idempotency heartbeat failed")


def _ident(key: Key) -> tuple:
    return key.principal, key.method, key.path, key.key
