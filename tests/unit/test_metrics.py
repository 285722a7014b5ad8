"""Metrics and readiness without an engine: the api's /metrics on a SQLite database through the Flask
test client, the worker's own port as a real HTTP server, and the structured logs of a real process."""

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests import factories
from tests.harness import free_port

ROOT = Path(__file__).resolve().parents[2]


def samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture
def app(tmp_path):
    from api import create_app
    from common.db import upgrade
    from common.settings import Settings

    url = f"sqlite:///{tmp_path / 'lmsp.db'}"
    upgrade(url)
    (tmp_path / "models.yaml").write_text(yaml.safe_dump({"models": [
        {"id": "m", "checkpoint": str(tmp_path / "none"), "context_window": 64, "max_output_tokens": 16},
        {"id": "idle", "checkpoint": str(tmp_path / "none"), "context_window": 64, "max_output_tokens": 16}]}))
    return create_app(Settings(home=tmp_path, database_url=url))


def test_api_metrics_count_tasks_queues_and_workers_from_the_database(app):
    from common.tables import Worker
    from common.tokens import create_token

    svc = app.extensions["lmsp"]
    with svc.sessions() as session:
        for status in ("queued", "queued", "running", "cancelled"):
            factories.task(session, status, model="m")
        now = time.time()
        session.add_all([Worker(id="h:gpu0", model="m", heartbeat_at=now, started_at=now, running=3),
                         Worker(id="h:gpu1", model="m", heartbeat_at=now - 600, started_at=now - 7200, running=0),
                         # lost for over an hour, without a last heartbeat (killed, its node gone): no series
                         Worker(id="h:gpu3", model="m", heartbeat_at=now - 7200, started_at=now - 9000, running=0),
                         # beating, but its engine is reloading: it takes no work, as GET /models says too
                         Worker(id="h:gpu2", model="m", heartbeat_at=now, started_at=now, running=0, ready=False)])
        _, admin = create_token(session, "ops", ("admin",))
        _, user = create_token(session, "alice", ("tasks:read",))
        session.commit()
    client = app.test_client()
    assert client.get("/metrics", headers={"Authorization": f"Bearer {user}"}).status_code == 403
    answer = client.get("/metrics", headers={"Authorization": f"Bearer {admin}"})
    assert answer.status_code == 200 and answer.content_type.startswith("text/plain")
    got = samples(answer.text)
    assert got[("lmsp_tasks", (("model", "m"), ("status", "queued")))] == 2
    assert got[("lmsp_tasks", (("model", "m"), ("status", "running")))] == 1
    assert got[("lmsp_queue_depth", (("model", "m"),))] == 2
    assert got[("lmsp_queue_depth", (("model", "idle"),))] == 0   # every registered model has a series
    assert got[("lmsp_worker_up", (("model", "m"), ("worker", "h:gpu0")))] == 1
    assert got[("lmsp_worker_up", (("model", "m"), ("worker", "h:gpu1")))] == 0
    assert got[("lmsp_worker_up", (("model", "m"), ("worker", "h:gpu2")))] == 0
    assert ("lmsp_worker_up", (("model", "m"), ("worker", "h:gpu3"))) not in got
    assert got[("lmsp_worker_running_requests", (("model", "m"), ("worker", "h:gpu0")))] == 3



def fake_ctx(port: int, ready: list[bool]):
    from common.settings import Settings
    settings = Settings(worker_metrics_host="127.0.0.1", worker_metrics_port=port)
    return SimpleNamespace(settings=settings, serving=lambda: ready[0],
                           hosts=SimpleNamespace(slots={"fake:1": None}, running=lambda model=None: 5))


def test_worker_port_serves_readiness_and_prometheus_metrics():
    from worker import metrics

    ready = [False]
    server = metrics.start_metrics_server(fake_ctx(free_port(), ready))
    try:
        base = "http://{}:{}".format(*server.server_address[:2])
        answer = requests.get(base + "/readyz", timeout=5)
        assert answer.status_code == 503 and answer.headers["Content-Type"] == "application/problem+json"
        assert answer.json()["status"] == 503
        assert requests.get(base + "/healthz", timeout=5).status_code == 200   # alive while loading
        ready[0] = True
        assert requests.get(base + "/readyz", timeout=5).status_code == 200
        assert requests.get(base + "/nope", timeout=5).json()["code"] == "not_found"

        before = samples(requests.get(base + "/metrics", timeout=5).text)
        metrics.TAKEOVERS.labels(model="fake:1").inc()
        metrics.EVENTS_WRITTEN.inc(7)
        metrics.observe_generation("fake:1", "task", 0.3, 101, 2.0)
        got = samples(requests.get(base + "/metrics", timeout=5).text)
        assert got[("lmsp_worker_ready", (("model", "fake:1"),))] == 1
        assert got[("lmsp_engine_running_requests", (("model", "fake:1"),))] == 5
        key = ("lmsp_takeovers_total", (("model", "fake:1"),))
        assert got[key] == before.get(key, 0) + 1
        assert got[("lmsp_events_written_total", ())] == before.get(("lmsp_events_written_total", ()), 0) + 7
        rate = (("kind", "task"), ("le", "50.0"), ("model", "fake:1"))  # 100 tokens in 2 s
        assert got[("lmsp_output_tokens_per_second_bucket", rate)] >= 1
        assert got[("lmsp_output_tokens_per_second_bucket", (("kind", "task"), ("le", "35.0"),
                                                             ("model", "fake:1")))] == \
            before.get(("lmsp_output_tokens_per_second_bucket", (("kind", "task"), ("le", "35.0"),
                                                                 ("model", "fake:1"))), 0)
    finally:
        server.shutdown()
        server.server_close()


def test_worker_port_taken_or_off_leaves_the_worker_running():
    from worker import metrics

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert metrics.start_metrics_server(fake_ctx(taken.getsockname()[1], [True])) is None
    assert metrics.start_metrics_server(fake_ctx(0, [True])) is None


LOGGING_CHILD = """
import logging, threading
from common import logs
logs.setup()
logs.bind_process(worker_id="host:gpu1")
log = logging.getLogger("lmsp.test")
with logs.bound(task_id="task_1", response_id="resp_1"):
    log.info("claimed %s", "it")
    t = threading.Thread(target=lambda: log.warning("other thread"))
    t.start(); t.join()
try:
    1 / 0
except ZeroDivisionError:
    log.exception("boom")
"""


def run_logging_child(fmt: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", LOGGING_CHILD], cwd=ROOT, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "LMSP_LOG_FORMAT": fmt}, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stderr.strip().splitlines()


def test_json_logs_carry_worker_task_and_response_ids():
    lines = [json.loads(line) for line in run_logging_child("json") if line.startswith("{")]
    claimed, other, boom = lines
    assert claimed["message"] == "claimed it" and claimed["level"] == "INFO" and claimed["logger"] == "lmsp.test"
    assert (claimed["worker_id"], claimed["task_id"], claimed["response_id"]) == ("host:gpu1", "task_1", "resp_1")
    assert other["worker_id"] == "host:gpu1" and "task_id" not in other   # ids are per thread of work
    assert "ZeroDivisionError" in boom["exception"] and "task_id" not in boom


def test_text_logs_name_the_ids_and_a_bad_format_is_refused():
    assert run_logging_child("text")[0].endswith(
        "lmsp.test: claimed it [worker_id=host:gpu1 task_id=task_1 response_id=resp_1]")
    done = subprocess.run([sys.executable, "-c", "from common import logs; logs.setup()"], cwd=ROOT,
                          capture_output=True, text=True, env={"LMSP_LOG_FORMAT": "xml"}, timeout=60)
    assert done.returncode == 1 and "LMSP_LOG_FORMAT" in done.stderr
