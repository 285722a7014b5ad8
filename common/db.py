"""Database engine, sessions and migrations (Alembic, run from code)."""

import json
import re
import select
from contextlib import contextmanager
from pathlib import Path

import psycopg
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from psycopg import ClientCursor
from psycopg.pq import ExecStatus
from sqlalchemy import JSON, Float, create_engine, event, text
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import (
    ArgumentError,
    DBAPIError,
    InterfaceError,
    InvalidatePoolError,
    NoSuchModuleError,
    OperationalError,
)
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.sql.expression import FunctionElement

from common.settings import ConfigError, get_settings

MIGRATIONS = Path(__file__).resolve().parent.parent / "migrations"


class NotMigrated(ConfigError):
    pass


def shown_url(url) -> str:
    """A database URL (str or sqlalchemy URL) fit for a message: no password (a str may not parse)."""
    return make_url(url).render_as_string(hide_password=True) if not isinstance(url, str) else \
        re.sub(r"//[^@/]*@", "//***@", url)


@contextmanager
def _reachable(url):
    """Turn "no such database server" and "not a database URL" into one line for the operator."""
    try:
        yield
    except (ArgumentError, NoSuchModuleError, ImportError) as exc:  # ImportError: a dialect whose driver we lack
        raise ConfigError(f"LMSP_DATABASE_URL {shown_url(url)!r} is not a database URL ({exc}); use e.g. "
                          "postgresql://user:password@host/db or sqlite:///path/to/lmsp.db") from None
    except (OperationalError, InterfaceError, OSError) as exc:  # OSError: a SQLite folder we cannot make
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        raise ConfigError(f"cannot reach the database {shown_url(url)}: {reason}; check LMSP_DATABASE_URL "
                          "and that the server is up") from None


# libpq's multi-host URI: postgresql://user@host1:port1,host2:port2/db?target_session_attrs=read-write
_MULTI_HOST = re.compile(r"^(?P<scheme>[^:]+://)(?P<user>[^@/]*@)?(?P<hosts>[^/?@]*,[^/?]*)(?P<path>/[^?]*)?"
                         r"(?:\?(?P<query>.*))?$")


def normalize_url(url: str) -> str:
    """psycopg 3 is the driver we ship (plain postgresql:// would mean psycopg2). A libpq multi-host URI
    (a primary and its standbys, for failover: README, "Postgres for zero loss") becomes SQLAlchemy's
    form of it, one ``host=`` parameter a host, which the psycopg dialect hands to libpq as ``host=a,b``:
    libpq tries them in order and, with ``target_session_attrs=read-write``, connects to the primary."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            url = "postgresql+psycopg://" + url[len(prefix):]
    multi = _MULTI_HOST.match(url) if url.startswith("postgresql+psycopg://") else None
    if multi:
        hosts = "&".join(f"host={host}" for host in multi["hosts"].split(","))
        query = f"{hosts}&{multi['query']}" if multi["query"] else hosts
        url = f"{multi['scheme']}{multi['user'] or ''}{multi['path'] or '/'}?{query}"
    return url


def make_engine(url: str, **kwargs) -> Engine:
    with _reachable(url):
        return _make_engine(normalize_url(url), **kwargs)


def _make_engine(url: str, **kwargs) -> Engine:
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, **kwargs)

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _record):
            # WAL lets followers read the log while a worker writes it.
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    if "poolclass" not in kwargs:
        # Bounded: requests wait up to pool_timeout for a connection rather than exhaust Postgres'
        # max_connections when hundreds of followers are open (they hold one only while reading).
        settings = get_settings()
        kwargs.setdefault("pool_size", settings.db_pool_size)
        kwargs.setdefault("max_overflow", settings.db_max_overflow)
        kwargs.setdefault("pool_timeout", 30)
        # No pre-ping (a round trip on every checkout): a connection is replaced when it gets old, or
        # at checkout when its server has closed it (below).
        kwargs.setdefault("pool_recycle", settings.db_pool_recycle_seconds)
    engine = create_engine(url, **kwargs)
    if engine.dialect.driver == "psycopg":
        event.listen(engine, "checkout", _replace_if_closed)
    return engine


def _replace_if_closed(dbapi_conn, _record, _proxy) -> None:
    """What pre-ping caught, without its round trip: a Postgres restart, or a failover, ends every
    session, and the server closes its socket; an idle connection's socket that has anything to read
    (the end, or the server's last words) is one the server left. The pool then connects anew, once,
    and drops every connection as old (the same restart closed them)."""
    try:
        fd = None if dbapi_conn.closed else dbapi_conn.pgconn.socket
    except psycopg.OperationalError:  # libpq has lost it already
        fd = None
    if fd is not None:
        poll = select.poll()
        poll.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
        if not poll.poll(0):
            return
    raise InvalidatePoolError("the server closed this pooled connection")


def session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def autocommit(engine: Engine) -> Engine:
    """``engine`` (its pool) for reads that need no transaction of their own: each query string runs as
    its own, so a read is one round trip where a session's is three (its BEGIN, the read, and the
    ROLLBACK at its close). A follower's connect reads twice (api/services/streams.py, api/live/reads.py)."""
    return engine.execution_options(isolation_level="AUTOCOMMIT")


@contextmanager
def transaction(factory: sessionmaker[Session]):
    """A session whose work commits at the end of the block, or rolls back on error."""
    with factory() as session, session.begin():
        yield session


def commit_lazily(session: Session) -> None:
    """Let this transaction's commit return before its WAL reaches the disk (Postgres'
    ``synchronous_commit = off``: ~1 ms less per commit here). Only for rows a crash of the
    database server may lose without losing a task or a logged event: a direct response, which
    belongs to its HTTP connection (6.4). A later ordinary commit makes it durable too."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SET LOCAL synchronous_commit = off"))


class Compiled:
    """A Core statement compiled once per dialect, for ``run_batch``: the hottest writes skip the ORM's
    unit of work and SQLAlchemy's per-call compile-cache lookup. Parameters are bound by name, as
    the driver takes them (JSON as text)."""

    def __init__(self, statement):
        self.statement = statement
        self._by_dialect: dict[str, tuple[str, tuple | None, dict]] = {}

    def bind(self, dialect, params: dict):
        sql, order, defaults = self._by_dialect.get(dialect.name) or self._compile(dialect)
        values = {**defaults, **params}
        return sql, values if order is None else [values[name] for name in order]

    def _compile(self, dialect):
        compiled = self.statement.compile(dialect=dialect)
        self._by_dialect[dialect.name] = entry = (compiled.string, compiled.positiontup, compiled.params)
        return entry


def run_batch(session: Session, steps: list[tuple[Compiled, dict]], *, commit: bool = False) -> list[int]:
    """Run ``steps`` in order in the session's transaction (and commit it, with ``commit``); return each
    one's row count. Driver errors come out as SQLAlchemy's, as from ``Session.execute``.

    On psycopg they go as one query string (its parameters quoted by psycopg, client-side), the
    commit included: one write, one wait for the database, and the database runs the statements back
    to back, so a lock one of them takes is held for no wait of ours (nor of our GIL)."""
    return _batch(session, steps, commit, lambda cursor: cursor.rowcount)


def fetch_batch(session: Session, steps: list[tuple[Compiled, dict]], *, commit: bool = False) -> list[list]:
    """``run_batch`` that returns each step's rows (driver tuples; [] for a statement without any)."""
    return _batch(session, steps, commit, _rows)


def fetch_on(conn: Connection, steps: list[tuple[Compiled, dict]]) -> list[list]:
    """``fetch_batch`` on a Core connection, with no session: on one of ``autocommit``'s, the steps are
    one round trip and one transaction (Postgres runs a query string of several as one)."""
    return _send(conn, steps, False, _rows)


def _rows(cursor) -> list:
    # psycopg's ``description`` builds a Python object per column; libpq's result status says as much.
    result = getattr(cursor, "pgresult", None)
    returned = cursor.description if result is None else result.status == ExecStatus.TUPLES_OK
    return cursor.fetchall() if returned else []


def json_at(columns) -> tuple[int, ...]:
    """The places of ``columns``' JSON columns in a row of them, for ``driver_row``."""
    return tuple(i for i, c in enumerate(columns) if isinstance(c.type, JSON))


def driver_row(kind, row, json_places: tuple[int, ...], pg: bool):
    """A row as the driver's cursor gives it (``fetch_on``, ``fetch_batch``), as the named tuple ``kind``:
    Postgres's JSON comes decoded, SQLite's as text (decoded here, at ``json_places``)."""
    if not pg:
        row = list(row)
        for i in json_places:
            row[i] = None if row[i] is None else json.loads(row[i])
    return kind._make(row)


def _batch(session: Session, steps: list[tuple[Compiled, dict]], commit: bool, result) -> list:
    session.flush()  # rows the caller added go first (foreign keys)
    results = _send(session.connection(), steps, commit, result)
    if commit:
        session.commit()  # after the database's own commit, only the session's bookkeeping
    return results


def _send(conn: Connection, steps: list[tuple[Compiled, dict]], commit: bool, result) -> list:
    raw = conn.connection.driver_connection
    sql = None
    try:
        if conn.dialect.driver == "psycopg":
            quote = ClientCursor(raw)
            sql = ";\n".join([quote.mogrify(*step.bind(conn.dialect, values)) for step, values in steps]
                             + (["COMMIT"] if commit else []))
            with raw.cursor() as cursor:
                cursor.execute(sql)
                results = [result(cursor)]
                while cursor.nextset():
                    results.append(result(cursor))
            return results[:len(steps)]
        cursor = raw.cursor()
        try:
            results = []
            for step, values in steps:
                sql, params = step.bind(conn.dialect, values)
                cursor.execute(sql, params)
                results.append(result(cursor))
            return results
        finally:
            cursor.close()
    except conn.dialect.loaded_dbapi.Error as exc:
        broken = bool(getattr(raw, "broken", False))
        if broken:
            conn.invalidate(exc)
        raise DBAPIError.instance(sql, None, exc, conn.dialect.loaded_dbapi.Error,
                                  connection_invalidated=broken, dialect=conn.dialect) from exc


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", normalize_url(url).replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    with _reachable(url):
        try:
            command.upgrade(alembic_config(url), revision)
        except CommandError as exc:
            newer = "; a newer lmsp migrated it: run that version" if "locate revision" in str(exc) else ""
            raise ConfigError(f"cannot migrate {shown_url(url)}: {exc}{newer}") from None
        _make_partitions(url)


def _make_partitions(url: str) -> None:
    """The event log's partitions for the periods ahead (then the workers' sweeper keeps them ahead)."""
    import time

    from sqlalchemy.pool import NullPool

    from common import partitions
    from common.settings import get_settings

    settings = get_settings()
    engine = make_engine(url, poolclass=NullPool)
    try:
        partitions.prepare(engine, time.time() + settings.event_partitions_ahead_seconds,
                                settings.event_partition_seconds)
    finally:
        engine.dispose()


def downgrade(url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(url), revision)


def ensure_migrated(engine: Engine) -> None:
    """Refuse to run against a database that is not at the latest migration."""
    head = ScriptDirectory.from_config(alembic_config(str(engine.url))).get_current_head()
    with _reachable(engine.url), engine.connect() as conn:
        current = MigrationContext.configure(conn).get_current_revision()
    if current is not None and current != head and current not in _known_revisions():
        raise NotMigrated(
            f"database {shown_url(engine.url)} is at migration {current}, which "
            f"this code does not know (the code needs {head}): a newer lmsp migrated it; run that version")
    if current != head:
        raise NotMigrated(
            f"database {shown_url(engine.url)} is at migration "
            f"{current or 'none'}, the code needs {head}: run `lmsp migrate` first")


def _known_revisions() -> set[str]:
    return {script.revision for script in ScriptDirectory.from_config(alembic_config("")).walk_revisions()}


def transact_retrying(factory: sessionmaker[Session], fn, *, log=None, stop=None):
    """``fn(session)`` as one transaction, replayed for as long as the database is unreachable (until
    ``stop`` is set): a worker keeps its events and outcomes through a Postgres restart, and the fence
    decides, once it is back, whether the work is still its own."""
    def attempt():
        with transaction(factory) as session:
            return fn(session)
    return retrying(attempt, seconds=float("inf"), log=log, stop=stop)


def retrying(fn, *, seconds: float = 300.0, log=None, stop=None):
    """Run ``fn()`` (one whole transaction) again while the database is unreachable.

    A Postgres restart must not turn a finished generation into a lost outcome:
    the caller's transaction is simply replayed once the server is back. ``stop``
    (a threading.Event) ends the wait early: the error is raised.
    """
    import time

    deadline = time.monotonic() + seconds
    delay = 0.1
    while True:
        try:
            return fn()
        except (OperationalError, DBAPIError) as exc:
            if not (isinstance(exc, OperationalError) or exc.connection_invalidated) or \
                    time.monotonic() > deadline or (stop is not None and stop.is_set()):
                raise
            if log is not None:
                log.warning("database unavailable (%s); retrying", type(exc.orig).__name__)
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


class db_now(FunctionElement):
    """The database's clock in Unix seconds: leases are compared with one clock, never a host's own."""
    type = Float()
    inherit_cache = True


@compiles(db_now, "postgresql")
def _db_now_pg(_element, _compiler, **_kw):
    return "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)"


@compiles(db_now, "sqlite")
def _db_now_sqlite(_element, _compiler, **_kw):
    return "((julianday('now') - 2440587.5) * 86400.0)"
