"""The event log's partitions on Postgres (docs/architecture.md, invariant 13: retention drops partitions).

``events`` is partitioned by range of ``response_id``. Ids sort by creation time (ULIDs), so partition
``events_p<time>`` holds every event of the responses made in one period (``LMSP_EVENT_PARTITION_SECONDS``,
an hour by default): a response's events never span partitions, its key stays unique, and a follower's
reads touch one partition. ``events_p0`` holds the rows from before partitioning; ``events_ptail`` every
id past the last period made, so no insert ever lacks a partition.

Retention stays exact per task (spec 11.2: ``410`` once the event retention after the task's end has
passed, never before): a partition is detached and dropped only when no response made in its period
still needs its events — every task made then has ended more than the retention ago (its
``events_expired`` is set first, the flag the events endpoint also reads), and no direct response made
then is still open. A task running for days holds its period back for that long; the rows of the tasks
that did expire stay unread until then. Nothing deletes events row by row.

Both run from the sweeper (``maintain``: one worker at a time, under an advisory lock) and from
``lmsp migrate``. Every lock taken on ``events`` itself is one inserts and reads never wait for: a new
period is created as a table and attached (SHARE UPDATE EXCLUSIVE), an old one detached CONCURRENTLY.
"""

from __future__ import annotations

import logging
import math
import re
from contextlib import contextmanager
from dataclasses import dataclass

from sqlalchemy.engine import Engine

from common.ids import id_floor, id_time

log = logging.getLogger("lmsp.partitions")

PARENT = "events"
TAIL = "events_ptail"
_LOCK = 0x6C6D7370  # pg_try_advisory_lock key: one maintainer at a time
# created_at and a response id's time are two reads of one host's clock: a period's responses are
# looked for with this much slack on either side, so a boundary never hides one.
_SLACK = 60.0


def is_partition(name: str) -> bool:
    """Whether a table name is one of the log's partitions (not a table of the models)."""
    return re.fullmatch(r"events_p\w+", name) is not None


@dataclass(frozen=True)
class Part:
    name: str
    low: str | None    # None: MINVALUE
    high: str | None   # None: MAXVALUE
    pending: bool      # a concurrent detach that did not finish


_NOW = "SELECT EXTRACT(EPOCH FROM clock_timestamp())::float8"  # the database's clock (common.db.db_now)


@contextmanager
def _admin(engine: Engine):
    """A psycopg connection of the pool in autocommit (a concurrent detach runs outside any transaction;
    ``conn.transaction()`` makes one where needed)."""
    pooled = engine.raw_connection()
    conn = pooled.driver_connection
    try:
        conn.autocommit = True
        yield conn
    finally:
        conn.autocommit = False
        pooled.close()


_BOUND = re.compile(r"FOR VALUES FROM \((.+)\) TO \((.+)\)")


def _value(expr: str) -> str | None:
    if expr in ("MINVALUE", "MAXVALUE"):
        return None
    return re.match(r"'((?:[^']|'')*)'", expr).group(1).replace("''", "'")


def parts(conn) -> list[Part]:
    """The partitions of the log, oldest period first ([] when it is not partitioned)."""
    rows = conn.execute(
        "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid), i.inhdetachpending FROM pg_inherits i "
        "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = to_regclass(%s)", (PARENT,)).fetchall()
    found = []
    for name, bound, pending in rows:
        low, high = _BOUND.match(bound).groups()
        found.append(Part(name, _value(low), _value(high), pending))
    return sorted(found, key=lambda p: (p.low is not None, p.low or ""))


def partitioned(engine: Engine) -> bool:
    if engine.dialect.name != "postgresql":
        return False
    with _admin(engine) as conn:
        return conn.execute("SELECT 1 FROM pg_partitioned_table WHERE partrelid = to_regclass(%s)",
                            (PARENT,)).fetchone() is not None


def _name(low: str) -> str:
    return "events_p" + format(int(id_time(low)), "d")


def _attach(conn, name: str, low: str, high: str | None) -> None:
    """Make ``name`` (a new table, or one detached) the partition [low, high)."""
    conn.execute(f'CREATE TABLE IF NOT EXISTS "{name}" (LIKE {PARENT} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)')
    upper = "MAXVALUE" if high is None else f"'{high}'"
    conn.execute(f"ALTER TABLE {PARENT} ATTACH PARTITION \"{name}\" FOR VALUES FROM ('{low}') TO ({upper})")


class _Leave(Exception):
    pass


def ensure_ahead(engine: Engine, until: float, width: float) -> int:
    """Periods of ``width`` seconds (on a grid of ``width``) made up to at least ``until``; returns how many
    were made. The tail moves up past them: detached concurrently when empty (it is, unless the periods
    ran out: then, under a short lock, it is closed as a period of its own at its last id)."""
    if not partitioned(engine):
        return 0
    with _admin(engine) as conn:
        tail = next((p for p in parts(conn) if p.high is None), None)
        low = tail.low if tail else None
        if low is None or id_time(low) >= until:
            return 0
        steps = []
        at = id_time(low)
        while at < until:
            nxt = (math.floor(at / width) + 1) * width
            steps.append((id_floor("response", at), id_floor("response", nxt)))
            at = nxt
        empty = conn.execute(f"SELECT NOT EXISTS (SELECT 1 FROM {TAIL})").fetchone()[0]
        if empty:
            conn.execute(f"ALTER TABLE {PARENT} DETACH PARTITION {TAIL} CONCURRENTLY")
        try:
            with conn.transaction():
                if not empty:
                    # Ids past the last period arrived (the maintenance was late): close the tail at its last
                    # id's period, as one more partition, under a lock inserts wait for at most this long.
                    conn.execute("SET LOCAL lock_timeout = '200ms'")
                    conn.execute(f"ALTER TABLE {PARENT} DETACH PARTITION {TAIL}")
                    last = conn.execute(f"SELECT max(response_id) FROM {TAIL}").fetchone()[0]
                    end = (math.floor(id_time(last) / width) + 1) * width if last.startswith("resp_") else None
                    if end is None or end >= until:
                        raise _Leave()  # ids we cannot place (not ours, or far ahead): leave the tail as it is
                    conn.execute(f'ALTER TABLE {TAIL} RENAME TO "{_name(low)}"')
                    _attach(conn, _name(low), low, id_floor("response", end))
                    steps = [(lo, hi) for lo, hi in steps if id_time(lo) >= end]
                for lo, hi in steps:
                    _attach(conn, _name(lo), lo, hi)
                _attach(conn, TAIL, steps[-1][1], None)
        except BaseException as exc:
            if empty:  # never leave ids past the last period without a partition
                _attach(conn, TAIL, low, None)
            if isinstance(exc, _Leave):
                return 0
            raise
    log.info("event log: %d partitions made, up to %s", len(steps), steps[-1][1])
    return len(steps)


def drop_expired(engine: Engine, retention: float) -> int:
    """Detach and drop each partition whose responses all no longer need their events (module
    docstring); returns how many were dropped."""
    if not partitioned(engine):
        return 0
    dropped = 0
    with _admin(engine) as conn:
        cutoff = conn.execute(_NOW).fetchone()[0] - retention
        for part in parts(conn):
            if part.pending:  # a detach cut short (its connection died): finish it
                conn.execute(f'ALTER TABLE {PARENT} DETACH PARTITION "{part.name}" FINALIZE')
                conn.execute(f'DROP TABLE "{part.name}"')
                continue
            if part.high is None or id_time(part.high) > cutoff:
                break  # this period's responses and every later one's may still be in their retention
            if not _expire(conn, part, cutoff):
                continue
            conn.execute(f'ALTER TABLE {PARENT} DETACH PARTITION "{part.name}" CONCURRENTLY')
            conn.execute(f'DROP TABLE "{part.name}"')
            log.info("event log: dropped %s (events past their retention)", part.name)
            dropped += 1
    return dropped


def _expire(conn, part: Part, cutoff: float) -> bool:
    """Mark the tasks of ``part``'s period whose events are past their retention, and say whether none
    of its responses needs its events any more. Both read the partial indexes of what is still kept."""
    low = -1e300 if part.low is None else id_time(part.low) - _SLACK
    high = id_time(part.high) + _SLACK
    period = {"low": low, "high": high, "cutoff": cutoff}
    with conn.transaction():
        conn.execute("UPDATE tasks SET events_expired = true WHERE NOT events_expired AND created_at >= %(low)s "
                     "AND created_at < %(high)s AND ended_at < %(cutoff)s", period)
        held = conn.execute(
            "SELECT EXISTS (SELECT 1 FROM tasks WHERE NOT events_expired AND created_at >= %(low)s "
            "AND created_at < %(high)s) OR EXISTS (SELECT 1 FROM responses WHERE status IN ('queued', 'in_progress') "
            "AND created_at >= %(low)s AND created_at < %(high)s AND updated_at >= %(cutoff)s)", period).fetchone()[0]
    return not held


def maintain(engine: Engine, *, retention: float, width: float, ahead: float) -> None:
    """Periods made ``ahead`` seconds past now (and more only when fewer than half are left), expired
    ones dropped; by one process at a time (the others skip)."""
    if not partitioned(engine):
        return
    with _admin(engine) as conn:
        if not conn.execute("SELECT pg_try_advisory_lock(%s)", (_LOCK,)).fetchone()[0]:
            return
        try:
            now = conn.execute(_NOW).fetchone()[0]
            tail = next((p for p in parts(conn) if p.high is None), None)
            if tail is not None and tail.low is not None and id_time(tail.low) < now + ahead / 2:
                ensure_ahead(engine, now + ahead, width)
            drop_expired(engine, retention)
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (_LOCK,))
