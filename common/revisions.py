"""The snapshot every host uses of a hub model whose revision is not pinned.

A branch moves: two hosts pulling `main` an hour apart could get two snapshots, and the api would count
tokens with another tokenizer than the worker's. The first `lmsp models pull` (or a worker's own pull)
records the commit it resolved, in the database every host shares; later pulls, on any host, take that
commit and point this host's cache's branch at it, so the api and the workers, which read the local
cache, resolve the same snapshot. A `revision:` in the models file is used as written; `lmsp models
pull ID --update` records the branch's newest commit."""

import time
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from common.tables import ModelRevision


def _session(url: str):
    from common.db import make_engine, session_factory
    engine = make_engine(url)
    return engine, session_factory(engine)()


def recorded(url: str, model_id: str, checkpoint: str) -> str | None:
    engine, session = _session(url)
    try:
        row = session.execute(select(ModelRevision).where(ModelRevision.model_id == model_id)).scalar_one_or_none()
        return row.commit if row is not None and row.checkpoint == checkpoint else None
    finally:
        session.close()
        engine.dispose()


def record(url: str, model_id: str, checkpoint: str, commit: str, *, replace: bool = False) -> str:
    """Record ``commit`` unless another host did first (then theirs wins); the commit on record."""
    engine, session = _session(url)
    try:
        insert = pg_insert if engine.dialect.name == "postgresql" else sqlite_insert
        values = {"model_id": model_id, "checkpoint": checkpoint, "commit": commit, "recorded_at": time.time()}
        stmt = insert(ModelRevision).values(**values)
        # A changed checkpoint (another repo under the same id) or --update replaces the record.
        stale = ModelRevision.checkpoint != checkpoint if not replace else True
        stmt = stmt.on_conflict_do_update(index_elements=["model_id"], set_=values, where=stale)
        session.execute(stmt)
        session.commit()
        return session.execute(select(ModelRevision.commit).where(ModelRevision.model_id == model_id)).scalar_one()
    finally:
        session.close()
        engine.dispose()


def point_branch(snapshot: str, branch: str | None) -> None:
    """Make this host's cache resolve ``branch`` (default main) to ``snapshot``'s commit, as a download
    of that branch would have (huggingface_hub's cache: <repo>/refs/<branch> holds the commit)."""
    folder = Path(snapshot)
    refs = folder.parent.parent / "refs"
    refs.mkdir(parents=True, exist_ok=True)
    (refs / (branch or "main")).write_text(folder.name)
