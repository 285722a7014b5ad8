"""A libpq multi-host database URL (a primary and its standbys: README, "Postgres for zero loss") is taken
as it is written and reaches psycopg as libpq's ``host=a,b`` (SQLAlchemy's own URL parser refused it).
The failover itself is tests/faults/test_failover.py. <1 s."""

from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.engine import make_url

from common.db import normalize_url, shown_url


def _connect_args(url: str) -> dict:
    return PGDialect_psycopg().create_connect_args(make_url(normalize_url(url)))[1]


def test_a_multi_host_url_reaches_libpq_with_every_host():
    args = _connect_args("postgresql://lmsp:secret@db-a:5432,db-b:5433/lmsp?target_session_attrs=read-write")
    assert args == {"dbname": "lmsp", "user": "lmsp", "password": "secret", "host": "db-a,db-b",
                    "port": "5432,5433", "target_session_attrs": "read-write"}
    assert _connect_args("postgres://u@a,b/db")["host"] == "a,b"
    assert "secret" not in shown_url(normalize_url("postgresql://lmsp:secret@db-a:5432,db-b:5433/lmsp"))


def test_single_host_urls_are_as_before():
    assert normalize_url("postgresql://u@h:5/db?sslmode=require") == "postgresql+psycopg://u@h:5/db?sslmode=require"
    assert normalize_url("sqlite:////tmp/x.db") == "sqlite:////tmp/x.db"
