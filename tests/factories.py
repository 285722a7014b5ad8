"""Rows for tests that talk to the database directly."""

import time

from common.ids import new_id
from common.tables import Principal, Response, Task


def principal(session, name: str) -> str:
    if session.get(Principal, name) is None:
        session.add(Principal(id=name, created_at=time.time()))
        session.flush()
    return name


def task(session, status: str, *, owner: str = "factory", model: str = "m", on_restart: str = "fail") -> Task:
    principal(session, owner)
    now = time.time()
    response = Response(id=new_id("response"), principal_id=owner, model=model, request={"input": []},
                        status="in_progress", stored=True, created_at=now, updated_at=now)
    session.add(response)
    session.flush()
    # A task past queued is owned by the attempt of a worker, as a claim leaves it.
    live = status in ("loading", "running", "cancelling")
    row = Task(id=new_id("task"), principal_id=owner, response_id=response.id, type="response", model=model,
               status=status, on_restart=on_restart, attempt=1 if live else 0,
               worker_id="factory-worker" if live else None, created_at=now, updated_at=now,
               events_expired=False)
    session.add(row)
    session.flush()
    return row
