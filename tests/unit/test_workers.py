"""The workers panel's data (GET /lmsp/v1/workers, from the workers' heartbeats) and the task list's
ETag that the dashboard polls with, through the real api on SQLite."""

import threading
import time
from types import SimpleNamespace

from sqlalchemy import update

from common import liveness
from common.tables import Task, Worker
from tests.unit.conftest import problem
from worker.context import WorkerContext
from worker.rate import TokenRate


def test_token_rate_counts_whole_seconds_of_a_sliding_window():
    now = [100.2]
    rate = TokenRate(window=10, clock=lambda: now[0])
    rate.add(30)
    assert rate.per_second() == 0  # the second under way is not counted yet: it would read low
    now[0] = 101.0
    rate.add(20)
    assert rate.per_second() == 3.0
    now[0] = 102.5
    assert rate.per_second() == 5.0
    now[0] = 110.9
    assert rate.per_second() == 5.0  # seconds 100 .. 109
    now[0] = 111.0
    assert rate.per_second() == 2.0  # second 100 left the window
    now[0] = 200.0
    assert rate.per_second() == 0 and not rate.buckets


def test_a_workers_state_is_what_the_panel_shows():
    def ctx(ready=True, draining=False, lost_at=None, broker_lost_at=None):
        flags = SimpleNamespace(draining=threading.Event(), stopping=threading.Event(), engine_lost_at=lost_at,
                                broker_lost_at=broker_lost_at, ready=lambda: ready)
        if draining:
            flags.draining.set()
        return flags
    assert WorkerContext.state(ctx()) == "ready"
    assert WorkerContext.state(ctx(ready=False)) == "loading"
    assert WorkerContext.state(ctx(ready=False, lost_at=5.0)) == "reloading"
    assert WorkerContext.state(ctx(ready=False, draining=True)) == "draining"
    # Its consumer lost the broker: no work reaches it, so it does not say it serves (its heartbeat's ready,
    # /readyz, GET /models); a direct request does not wait for it (found by an operator's probe).
    assert WorkerContext.state(ctx(broker_lost_at=5.0)) == "reconnecting"
    assert WorkerContext.serving(ctx(broker_lost_at=5.0)) is False and WorkerContext.serving(ctx()) is True


def _seed(unit, model: str) -> None:
    now = time.time()
    with unit.sessions() as session:
        liveness.heartbeat(session, f"{model}-0", [model], now, running=2, ready=True, loaded=[model],
                           state="ready", tokens_per_second=12.345, boot=True)
        liveness.heartbeat(session, f"{model}-1", [model], now, running=0, ready=False, loaded=[],
                           state="reloading", boot=True)  # its engine died: nothing loaded
        session.add_all([Worker(id=f"{model}-2", model=model, heartbeat_at=now - 60, started_at=now - 7200,
                                running=1, state="ready", tokens_per_second=99.0,
                                models_loaded=[model]),  # its lease expired
                         Worker(id=f"{model}-4", model=model, heartbeat_at=now - 7200, started_at=now - 9000,
                                running=0, state="ready"),  # long gone: left out
                         Worker(id=f"{model}-3", model=model, heartbeat_at=now, started_at=now, running=0,
                                stopped_at=now)])
        session.commit()


def test_every_token_sees_workers_per_model_and_admin_each_worker(unit):
    model = f"wm-{time.monotonic_ns()}"
    _seed(unit, model)
    user = unit.as_("watcher", "models:read").get("/lmsp/v1/workers")
    assert user.status_code == 200
    doc = user.get_json()
    assert "data" not in doc  # worker ids name hosts: scope admin only
    mine = next(m for m in doc["models"] if m["model"] == model)
    assert mine == {"model": model, "workers": {"ready": 1, "loading": 0, "reloading": 1, "reconnecting": 0, "draining": 0, "lost": 1},
                    "loaded_on": 1}
    assert doc["running"] >= 2 and doc["tokens_per_second"] >= 12.35

    each = unit.as_("ops", "models:read", "admin").get("/lmsp/v1/workers").get_json()
    rows = {w["id"]: w for w in each["data"] if w["model"] == model}
    assert rows == {
        f"{model}-0": {"id": f"{model}-0", "object": "worker", "model": model, "models_loaded": [model],
                       "state": "ready", "running": 2, "tokens_per_second": 12.35},
        f"{model}-1": {"id": f"{model}-1", "object": "worker", "model": model, "models_loaded": [],
                       "state": "reloading", "running": 0, "tokens_per_second": 0.0},
        f"{model}-2": {"id": f"{model}-2", "object": "worker", "model": model, "models_loaded": [model],
                       "state": "lost", "running": 1, "tokens_per_second": 99.0}}


def test_workers_need_a_token_with_models_read(unit):
    problem(unit.anonymous.get("/lmsp/v1/workers"), 401, "unauthorized")
    problem(unit.as_("nobody", "tasks:read").get("/lmsp/v1/workers"), 403, "insufficient_scope")


def test_an_unchanged_task_list_answers_304_until_a_task_comes_or_changes_state(unit, alice):
    first = alice.task("queued")
    page = alice.get("/lmsp/v1/tasks")
    tag = page.headers["ETag"]
    assert tag.startswith('W/"') and [t["id"] for t in page.get_json()["data"]] == [first.id]
    again = alice.get("/lmsp/v1/tasks", headers={"If-None-Match": tag})
    assert again.status_code == 304 and again.data == b"" and again.headers["ETag"] == tag

    with unit.sessions() as session:  # what a transition does (common/states.py)
        session.execute(update(Task).where(Task.id == first.id).values(status="loading",
                                                                        updated_at=time.time() + 1))
        session.commit()
    moved = alice.get("/lmsp/v1/tasks", headers={"If-None-Match": tag})
    assert moved.status_code == 200 and moved.get_json()["data"][0]["status"] == "loading"
    assert moved.headers["ETag"] != tag
    tag = moved.headers["ETag"]
    second = alice.task("queued")
    grown = alice.get("/lmsp/v1/tasks", headers={"If-None-Match": tag})
    assert grown.status_code == 200 and [t["id"] for t in grown.get_json()["data"]] == [second.id, first.id]
    assert alice.get("/lmsp/v1/tasks", headers={"If-None-Match": grown.headers["ETag"]}).status_code == 304
