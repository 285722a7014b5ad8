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

Both run from the sweeper (``maintain``) and from ``lmsp migrate`` (``prepare``), one process at a time
under an advisory lock (a sweeper skips its pass while another holds it; a migrate waits). Every step can be killed and rerun (invariant 15). Periods are made in one transaction
with the tail's move past them (nothing is ever left without a partition; the tail's detach is the one
lock inserts wait for, at most 200 ms, once per half look-ahead); retention detaches CONCURRENTLY, a lock
inserts and reads never wait for. Every pass first finishes what a killed one left (``repair``: a detach
left pending is finalized, a detached tail attached again, a table detached but not dropped dropped once
its rows are past their retention). A look-ahead shorter than half the promised one is an alarm:
``lmsp_event_partitions_ahead_seconds`` and an error in the log.
"""

from __future__ import annotations

import logging
import math
import re
from contextlib import contextmanager
from dataclasses import dataclass

from prometheus_client import Gauge
from sqlalchemy.engine import Engine

from common.ids import id_floor, id_time

log = logging.getLogger("lmsp.partitions")

PARENT = "events"
TAIL = "events_ptail"
_LOCK = 0x6C6D7370  # the advisory lock's key: one maintainer at a time (``_maintainer``)
# created_at and a response id's time are two reads of one host's clock: a period's responses are
# looked for with this much slack on either side, so a boundary never hides one.
_SLACK = 60.0
AHEAD = Gauge("lmsp_event_partitions_ahead_seconds",
              "How far past now the event log's periods reach (alarm when under half the promised look-ahead).")


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
    """Make ``name`` (a new table, or one detached) the partition [low, high), in the log's tablespace
    (an operator may give the log a disk of its own: ``ALTER TABLE events SET TABLESPACE``)."""
    space = conn.execute("SELECT t.spcname FROM pg_class c JOIN pg_tablespace t ON t.oid = c.reltablespace "
                         "WHERE c.oid = to_regclass(%s)", (PARENT,)).fetchone()
    where = f' TABLESPACE "{space[0]}"' if space else ""
    conn.execute(f'CREATE TABLE IF NOT EXISTS "{name}" (LIKE {PARENT} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)'
                 f"{where}")
    upper = "MAXVALUE" if high is None else f"'{high}'"
    conn.execute(f"ALTER TABLE {PARENT} ATTACH PARTITION \"{name}\" FOR VALUES FROM ('{low}') TO ({upper})")


def _detached(conn) -> list[str]:
    """The log's tables that are no partition of it (a drop was cut short after its detach)."""
    rows = conn.execute(
        "SELECT c.relname FROM pg_class c WHERE c.relkind = 'r' AND c.relnamespace = current_schema()::regnamespace "
        "AND c.relname LIKE 'events\\_p%' AND NOT c.relispartition").fetchall()
    return [name for (name,) in rows if is_partition(name) and name != TAIL]


def repair(conn, retention: float | None = None) -> None:
    """Finish what a killed pass left; each step is idempotent. A detach left pending is finalized; a log
    without a tail gets it back (the detached one, rows and all, else a new one) past its last period; with
    ``retention``, a detached period table is dropped once none of its responses needs its events (else it
    is kept, with an error in the log)."""
    for part in parts(conn):
        if part.pending:
            conn.execute(f'ALTER TABLE {PARENT} DETACH PARTITION "{part.name}" FINALIZE')
            log.warning("event log: finished the detach of %s a killed pass left pending", part.name)
    found = parts(conn)
    if found and found[-1].high is not None:
        with conn.transaction():
            _attach(conn, TAIL, found[-1].high, None)
        log.warning("event log: %s attached again past %s (a killed pass had detached it)", TAIL, found[-1].high)
    for name in _detached(conn) if retention is not None else ():
        low, high = conn.execute(f'SELECT min(response_id), max(response_id) FROM "{name}"').fetchone()
        if low is not None and not _past(conn, low, high, retention):
            log.error("event log: table %s was detached but holds events still in their retention; left as it is",
                      name)
            continue
        conn.execute(f'DROP TABLE "{name}"')
        log.warning("event log: dropped %s, detached by a pass that was killed before its drop", name)


def _past(conn, low: str, high: str, retention: float) -> bool:
    if not (low.startswith("resp_") and high.startswith("resp_")):
        return False
    cutoff = conn.execute(_NOW).fetchone()[0] - retention
    return _expire(conn, id_time(low), id_time(high), cutoff)


def _steps(low: str, until: float, width: float) -> list[tuple[str, str]]:
    steps, at = [], id_time(low)
    while at < until:
        nxt = (math.floor(at / width) + 1) * width
        steps.append((id_floor("response", at), id_floor("response", nxt)))
        at = nxt
    return steps


def _tail(conn) -> Part | None:
    return next((p for p in parts(conn) if p.high is None and not p.pending), None)


class _Leave(Exception):
    pass


def ensure_ahead(engine: Engine, until: float, width: float) -> int:
    """Periods of ``width`` seconds (on a grid of ``width``) made up to at least ``until``; returns how many
    were made. The tail moves up past them in the same transaction (it is detached under a lock inserts
    wait for at most 200 ms, so the pass is retried rather than queueing them), so a pass killed anywhere
    leaves either every period or none, and the tail attached."""
    if not partitioned(engine):
        return 0
    with _admin(engine) as conn:
        repair(conn)
        tail = _tail(conn)
        low = tail.low if tail else None
        if low is None or id_time(low) >= until:
            return 0
        steps = _steps(low, until, width)
        try:
            with conn.transaction():
                conn.execute("SET LOCAL lock_timeout = '200ms'")
                conn.execute(f"ALTER TABLE {PARENT} DETACH PARTITION {TAIL}")
                steps = _close_tail(conn, low, until, width, steps)
                for lo, hi in steps:
                    _attach(conn, _name(lo), lo, hi)
                _attach(conn, TAIL, steps[-1][1], None)
        except _Leave:
            return 0
    log.info("event log: %d partitions made, up to %s", len(steps), steps[-1][1])
    return len(steps)


def _close_tail(conn, low: str, until: float, width: float, steps: list) -> list:
    """Ids past the last period that arrived (the maintenance was late): the tail, rows and all, becomes
    the period of its last id; returns the steps left after it. Ids it cannot place (not ours, or far
    ahead) leave the tail as it was (``_Leave`` rolls the transaction back)."""
    last = conn.execute(f"SELECT max(response_id) FROM {TAIL}").fetchone()[0]
    if last is None:
        return steps
    end = (math.floor(id_time(last) / width) + 1) * width if last.startswith("resp_") else None
    if end is None or end >= until:
        log.error("event log: the tail partition holds ids no period can take (up to %s)", last)
        raise _Leave()
    conn.execute(f'ALTER TABLE {TAIL} RENAME TO "{_name(low)}"')
    _attach(conn, _name(low), low, id_floor("response", end))
    return [(lo, hi) for lo, hi in steps if id_time(lo) >= end]  # not empty: end < until


def drop_expired(engine: Engine, retention: float) -> int:
    """Detach and drop each partition whose responses all no longer need their events (module
    docstring); returns how many were dropped."""
    if not partitioned(engine):
        return 0
    dropped = 0
    with _admin(engine) as conn:
        repair(conn, retention)
        cutoff = conn.execute(_NOW).fetchone()[0] - retention
        for part in parts(conn):
            if part.high is None or id_time(part.high) > cutoff:
                break  # this period's responses and every later one's may still be in their retention
            low = -1e300 if part.low is None else id_time(part.low)
            if not _expire(conn, low, id_time(part.high), cutoff):
                continue
            conn.execute(f'ALTER TABLE {PARENT} DETACH PARTITION "{part.name}" CONCURRENTLY')
            conn.execute(f'DROP TABLE "{part.name}"')
            log.info("event log: dropped %s (events past their retention)", part.name)
            dropped += 1
    return dropped


def _expire(conn, low: float, high: float, cutoff: float) -> bool:
    """Mark the tasks made in [low, high] whose events are past their retention, and say whether none
    of the responses made then needs its events any more. Both read the partial indexes of what is still kept."""
    period = {"low": low - _SLACK, "high": high + _SLACK, "cutoff": cutoff}
    with conn.transaction():
        conn.execute("UPDATE tasks SET events_expired = true WHERE NOT events_expired AND created_at >= %(low)s "
                     "AND created_at < %(high)s AND ended_at < %(cutoff)s", period)
        held = conn.execute(
            "SELECT EXISTS (SELECT 1 FROM tasks WHERE NOT events_expired AND created_at >= %(low)s "
            "AND created_at < %(high)s) OR EXISTS (SELECT 1 FROM responses WHERE status IN ('queued', 'in_progress') "
            "AND created_at >= %(low)s AND created_at < %(high)s AND updated_at >= %(cutoff)s)", period).fetchone()[0]
    return not held


def lookahead(engine: Engine) -> float | None:
    """Seconds from now (the database's clock) to the end of the last period made."""
    with _admin(engine) as conn:
        tail = _tail(conn)
        return None if tail is None or tail.low is None else id_time(tail.low) - conn.execute(_NOW).fetchone()[0]


def maintain(engine: Engine, *, retention: float, width: float, ahead: float) -> None:
    """Periods made ``ahead`` seconds past now (and more only when fewer than half are left), expired
    ones dropped; by one process at a time (the others skip). Every pass repairs first; a look-ahead
    still under half the promise afterwards is the alarm."""
    if not partitioned(engine):
        return
    with _maintainer(engine, wait=False) as conn:
        if conn is None:
            return
        try:
            repair(conn, retention)
            now = conn.execute(_NOW).fetchone()[0]
            tail = _tail(conn)
            if tail is not None and tail.low is not None and id_time(tail.low) < now + ahead / 2:
                ensure_ahead(engine, now + ahead, width)
            drop_expired(engine, retention)
        finally:
            _alarm(engine, ahead)


def prepare(engine: Engine, until: float, width: float) -> int:
    """``ensure_ahead`` for ``lmsp migrate``: it waits for a maintainer at work (a sweeper, or another
    migrate: replicas that each migrate on start run at once, and two passes' detaches and attaches of the
    tail collide)."""
    if not partitioned(engine):
        return 0
    with _maintainer(engine, wait=True):
        return ensure_ahead(engine, until, width)


@contextmanager
def _maintainer(engine: Engine, *, wait: bool):
    """The maintainer's advisory lock, held by a connection of its own (yielded; None when ``wait`` is
    false and another process holds it). The passes' own connections do the work."""
    with _admin(engine) as conn:
        take = "pg_advisory_lock" if wait else "pg_try_advisory_lock"
        got = conn.execute(f"SELECT {take}(%s)", (_LOCK,)).fetchone()[0]
        if got is False:
            yield None
            return
        try:
            yield conn
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (_LOCK,))


def _alarm(engine: Engine, ahead: float) -> None:
    try:
        left = lookahead(engine)
    except Exception:  # noqa: BLE001 - the pass's own error is the one to raise
        return
    AHEAD.set(left or 0.0)
    if left is None or left < ahead / 2:
        log.error("event log: partitions reach only %.0f s ahead (%.0f promised): maintenance is failing "
                  "(past them new responses' events go to the tail)", left or 0.0, ahead)
