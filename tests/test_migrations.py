"""Alembic upgrade head, downgrade base, upgrade head on Postgres and SQLite; refusal when unmigrated."""

import pytest
from sqlalchemy import inspect

from common.db import NotMigrated, downgrade, ensure_migrated, make_engine, upgrade
from common.tables import Base
from tests.harness import create_database, drop_database

TABLES = {"principals", "api_tokens", "responses", "tasks", "events", "idempotency_records", "workers"}


def _roundtrip(url):
    upgrade(url)
    downgrade(url, "base")
    engine = make_engine(url)
    assert not TABLES & set(inspect(engine).get_table_names())
    upgrade(url)
    names = set(inspect(engine).get_table_names())
    assert TABLES <= names
    # The migrations build exactly the columns the ORM declares.
    for table in Base.metadata.sorted_tables:
        columns = {c["name"] for c in inspect(engine).get_columns(table.name)}
        assert columns == set(table.columns.keys()), table.name
    ensure_migrated(engine)
    engine.dispose()


def test_postgres_roundtrip():
    url = create_database("lmsp_migr")
    try:
        _roundtrip(url)
    finally:
        drop_database(url)


def test_sqlite_roundtrip(tmp_path):
    _roundtrip(f"sqlite:///{tmp_path / 'lmsp.db'}")


def test_unmigrated_database_is_refused(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'empty.db'}")
    with pytest.raises(NotMigrated, match="lmsp migrate"):
        ensure_migrated(engine)
