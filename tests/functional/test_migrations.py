"""Migrations as history (Postgres and SQLite): head builds exactly the models' schema, every revision
upgrades a database filled at the revision before it without losing a row, and landed revisions are
never edited (a schema change is a new revision)."""

import hashlib
import json

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import JSON, Boolean, Float, Integer, MetaData, String, Text, inspect, select

from common.db import (
    MIGRATIONS,
    NotMigrated,
    alembic_config,
    downgrade,
    ensure_migrated,
    make_engine,
    upgrade,
)
from common.partitions import is_partition
from common.tables import Base
from tests.harness import create_database, drop_database

# sha256 of each released revision file. A landed revision is history: change the schema in a new one,
# and add its hash here once it has landed on main.
LANDED = {"0001": "b71065550b8a5086bf38abd627c8fd6ccfb01e922fefa2366d2cc2035b420fbf",
          "0002": "8895ddb517a59ffe9122125453c3e839492fa468360ec90a0eeeb6da6f5f48a3",
          "0003": "84530b2d36bed01d5d44baafbde0ff75b50149cfde3c83e7326cf1520c1b6481",
          "0004": "66aa8d8e8c96304eda0df545f2b6847470d8810ae4953ea265e3ed5402a9bc24",
          "0005": "38d795c9a35485397501e1d36170dd05e714d6d784290fbfdf8c2c95c2bf6d53",
          "0006": "ab70c6019e2e774855a8752ea16c9d5b8ca5e28eea4764a4e18e75e2b73013d1",
          "0007": "d3667c8da3224c175faea5e5599e3056998008f64aa28ff5cdc5a579567b78df",
          "0008": "efd09c1f5cacf48552da57f5cf46d52256891ef307d1fbb32de26275d85b50c4",
          "0009": "8e0edacfeb43861edec80abbcc341373a1634156c20f3936e4cd77fba047e0f6",
          "0010": "7511890bce67a537a4f7721d8c89fcc77bd14d260e387677bb22f868ea6943be",
          "0011": "2e4a94fc784f1b12bbc1dbad5a10f0463e239dfa18aad569cee8f769bfc97a61"}


@pytest.fixture(params=["sqlite", "postgres"])
def url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'lmsp.db'}"
        return
    url = create_database("lmsp_migr")
    try:
        yield url
    finally:
        drop_database(url)


def _script() -> ScriptDirectory:
    return ScriptDirectory.from_config(alembic_config("sqlite://"))


def test_landed_revisions_are_unchanged():
    script = _script()
    for revision, digest in LANDED.items():
        path = script.get_revision(revision).path
        assert hashlib.sha256(open(path, "rb").read()).hexdigest() == digest, (
            f"{path} was released and must not change; add a new revision instead")
    assert set(LANDED) <= {r.revision for r in script.walk_revisions()}


def test_head_is_exactly_the_models(url):
    upgrade(url)
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            opts = {"compare_type": True, "include_name": lambda name, kind, _: not (
                kind == "table" and is_partition(name))}  # made at run time
            diff = compare_metadata(MigrationContext.configure(conn, opts=opts), Base.metadata)
        assert diff == [], "the migrations and common/tables.py disagree; write a new revision"
        ensure_migrated(engine)
    finally:
        engine.dispose()


def test_downgrade_to_base_and_back(url):
    upgrade(url)
    downgrade(url, "base")
    engine = make_engine(url)
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    upgrade(url)
    assert {t.name for t in Base.metadata.sorted_tables} <= set(inspect(engine).get_table_names())
    engine.dispose()


def _sample(column, referenced: dict):
    """A value for ``column`` of the schema a database was created with (not the models' schema)."""
    if column.foreign_keys:
        fk = next(iter(column.foreign_keys))
        return referenced[fk.column.table.name][fk.column.name]
    kind = column.type
    if isinstance(kind, Boolean):
        return True
    if isinstance(kind, Integer):
        return 7
    if isinstance(kind, Float):
        return 1.5
    if isinstance(kind, JSON) or kind.__class__.__name__ == "JSONB":
        return {"kept": [1, "two"]}
    if isinstance(kind, String | Text):
        return f"{column.table.name[:8]}-{column.name[:20]}"[: kind.length or 64]
    raise AssertionError(f"no sample for {column.table.name}.{column.name} ({kind!r})")


@pytest.mark.parametrize("revision", [r.revision for r in _script().walk_revisions()])
def test_upgrade_keeps_the_data_of_the_revision_before(url, revision):
    """A database created at the revision before ``revision`` (a previous release), with a row in every
    table, upgrades to head with every row and value still there."""
    before = _script().get_revision(revision).down_revision or "base"
    if before != "base":
        upgrade(url, before)
    engine = make_engine(url)
    try:
        old = MetaData()
        old.reflect(engine)
        rows: dict[str, dict] = {}
        with engine.begin() as conn:
            for table in old.sorted_tables:
                if table.name == "alembic_version" or is_partition(table.name):
                    continue  # a partition's rows are its parent's (events), which gets one
                rows[table.name] = {c.name: _sample(c, rows) for c in table.columns}
                conn.execute(table.insert().values(**rows[table.name]))
        upgrade(url)
        ensure_migrated(engine)
        new = MetaData()
        new.reflect(engine)
        with engine.connect() as conn:
            for name, row in rows.items():
                table = new.tables[name]
                kept = {k: v for k, v in row.items() if k in table.c}
                found = conn.execute(select(*(table.c[k] for k in kept))).mappings().all()
                assert [json.loads(json.dumps(dict(r))) for r in found] == [kept], name
    finally:
        engine.dispose()


def test_unmigrated_database_is_refused(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'empty.db'}")
    with pytest.raises(NotMigrated, match="lmsp migrate"):
        ensure_migrated(engine)
    assert MIGRATIONS.is_dir()


def test_migrations_run_at_once_on_a_new_database_all_succeed():
    """Replicas that each migrate on their first start (an init container per pod) run `lmsp migrate` at
    once: without the advisory lock (migrations/env.py) both found no alembic_version and one failed."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    url = create_database("lmsp_migr")
    try:
        lmsp = Path(sys.executable).with_name("lmsp")
        runs = [subprocess.Popen([str(lmsp), "migrate"], env={**os.environ, "LMSP_DATABASE_URL": url},
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(3)]
        outs = [(run.wait(300), run.stdout.read()) for run in runs]
        assert [code for code, _ in outs] == [0, 0, 0], outs
        with make_engine(url).connect() as conn:
            assert MigrationContext.configure(conn).get_current_revision() == _script().get_current_head()
    finally:
        drop_database(url)
