"""Spec 10: bearer tokens stored only as hashes, scopes per operation, principals that never see each other."""

import pytest
from sqlalchemy import select

from common.tables import ApiToken
from common.tokens import SCOPES, hash_secret, revoke_token
from tests.unit.conftest import MODEL, problem, request_body, task_body

FAKE_TASK = "task_" + "0" * 26

# Every operation with its scope; {task} is a task of the caller's.
OPERATIONS = [
    ("GET", "/lmsp/v1", "models:read"),
    ("GET", "/lmsp/v1/openapi.json", "models:read"),
    ("GET", "/lmsp/v1/models", "models:read"),
    ("GET", f"/lmsp/v1/models/{MODEL}", "models:read"),
    ("POST", "/lmsp/v1/responses", "responses:write"),
    ("GET", "/lmsp/v1/responses/{response}", "responses:read"),
    ("POST", "/lmsp/v1/tasks", "tasks:write"),
    ("GET", "/lmsp/v1/tasks/{task}", "tasks:read"),
    ("POST", "/lmsp/v1/tasks/{task}/cancel", "tasks:cancel"),
    ("GET", "/lmsp/v1/tasks/{task}/events", "tasks:read"),
    ("GET", "/lmsp/v1/tasks/{task}/ws", "tasks:read"),
    ("GET", "/metrics", "admin"),
]


HANDSHAKE = {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
             "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}


def _call(unit, caller, method, template, task, **kw):
    path = template.format(task=task.id, response=task.response_id)
    if path.endswith("/ws"):
        kw["headers"] = HANDSHAKE
    body = {"/lmsp/v1/tasks": task_body(), "/lmsp/v1/responses": request_body()}.get(path)
    return caller.open(method, path, json=body, **kw) if body else caller.open(method, path, **kw)


@pytest.mark.parametrize("method,template,scope", OPERATIONS)
def test_every_operation_needs_a_token(unit, alice, method, template, scope):
    task = alice.task("succeeded")
    path = template.format(task=task.id, response=task.response_id)
    for headers in ({}, {"Authorization": "Basic abc"}, {"Authorization": "Bearer"},
                    {"Authorization": "Bearer lmsp_not-a-token"}):
        resp = unit.client.open(path, method=method, headers=headers)
        problem(resp, 401, "unauthorized")
        assert resp.headers["WWW-Authenticate"] == "Bearer"  # spec 10, exactly


@pytest.mark.parametrize("method,template,scope", OPERATIONS)
def test_every_operation_needs_its_scope(unit, method, template, scope):
    others = tuple(s for s in SCOPES if s != scope)
    caller = unit.as_(f"scoped-{scope}", *others)
    task = caller.task("succeeded")
    doc = problem(_call(unit, caller, method, template, task), 403, "insufficient_scope")
    assert doc["scope"] == scope and scope in doc["detail"]
    if template.endswith("/ws"):
        return  # the test client has no socket to hand over; tests/functional/test_tasks.py opens real WebSockets
    allowed = unit.as_(f"allowed-{scope}", scope)
    task = allowed.task("queued")
    # Past the scope check (POST /responses then finds no live worker: 503).
    assert _call(unit, allowed, method, template, task).status_code in (200, 202, 503)


def test_health_probes_need_no_token(unit):
    assert unit.client.get("/healthz").get_json() == {"status": "ok"}
    ready = unit.client.get("/readyz")
    assert ready.status_code == 200 and ready.get_json()["checks"] == {"database": "ok", "broker": "ok"}


def test_readiness_says_at_once_that_the_broker_refuses_connections(tmp_path):
    """kombu's retries took /readyz 6 s to answer while Redis refused connections: past the probe's timeout
    (3 s in k8s/), which then recorded a timeout instead of the reason."""
    import socket
    import time

    from tests.unit.conftest import make_unit

    with socket.socket() as spare:
        spare.bind(("127.0.0.1", 0))
        port = spare.getsockname()[1]  # nothing listens there once it is closed
    unit = make_unit(tmp_path, broker_url=f"redis://127.0.0.1:{port}/0")
    started = time.monotonic()
    ready = unit.client.get("/readyz")
    assert ready.status_code == 503 and ready.get_json()["checks"]["broker"].startswith("error")
    assert ready.get_json()["checks"]["database"] == "ok" and time.monotonic() - started < 2.5


def test_tokens_are_stored_only_as_hashes(unit):
    secret = unit.token("hashed", "models:read")
    with unit.sessions() as session:
        rows = session.execute(select(ApiToken).where(ApiToken.principal_id == "hashed")).scalars().all()
    assert [r.token_hash for r in rows] == [hash_secret(secret)]
    assert all(secret not in str(value) for r in rows for value in vars(r).values())


def test_revoked_token_is_refused(unit):
    secret = unit.token("revoked", "models:read")
    headers = {"Authorization": f"Bearer {secret}"}
    assert unit.client.get("/lmsp/v1/models", headers=headers).status_code == 200
    with unit.sessions() as session:
        token_id = session.execute(select(ApiToken.id).where(ApiToken.token_hash == hash_secret(secret))).scalar_one()
        assert revoke_token(session, token_id)
        session.commit()
    problem(unit.client.get("/lmsp/v1/models", headers=headers), 401, "unauthorized")


@pytest.mark.parametrize("template", ["/lmsp/v1/tasks/{}", "/lmsp/v1/tasks/{}/events", "/lmsp/v1/tasks/{}/cancel"])
def test_foreign_tasks_look_exactly_like_missing_ones(alice, bob, template):
    task = alice.task("queued")
    method = "POST" if template.endswith("cancel") else "GET"
    theirs = bob.open(method, template.format(task.id))
    never = bob.open(method, template.format(FAKE_TASK))
    problem(theirs, 404, "task_not_found")
    assert theirs.get_data() == never.get_data().replace(FAKE_TASK.encode(), task.id.encode())
    assert alice.get(f"/lmsp/v1/tasks/{task.id}").get_json()["status"] == "queued"  # bob changed nothing


def test_foreign_responses_look_exactly_like_missing_ones(alice, bob):
    task = alice.task("succeeded")
    fake = "resp_" + "0" * 26
    theirs = bob.get(f"/lmsp/v1/responses/{task.response_id}")
    never = bob.get(f"/lmsp/v1/responses/{fake}")
    problem(theirs, 404, "response_not_found")
    assert theirs.get_data() == never.get_data().replace(fake.encode(), task.response_id.encode())
    assert alice.get(f"/lmsp/v1/responses/{task.response_id}").status_code == 200


def test_rate_limit_per_principal(tmp_path):
    from tests.unit.conftest import make_unit

    unit = make_unit(tmp_path, rate_limit_per_second=0.01, rate_limit_burst=3)
    grace, heidi = unit.as_("grace", "models:read"), unit.as_("heidi", "models:read")
    assert [grace.get("/lmsp/v1/models").status_code for _ in range(3)] == [200] * 3
    resp = grace.get("/lmsp/v1/models")
    problem(resp, 429, "rate_limited")
    assert int(resp.headers["Retry-After"]) >= 1
    assert heidi.get("/lmsp/v1/models").status_code == 200  # another principal's bucket is its own


def test_a_queue_limit_of_0_is_a_closed_door_said_so(tmp_path):
    """0 is a value (a service taking no tasks for now), and its 429 said "You have 0 queued tasks, the
    limit is 0; wait for some to finish": waiting changes nothing."""
    from tests.unit.conftest import make_unit

    unit = make_unit(tmp_path, max_queued_tasks_per_principal=0)
    resp = unit.as_("kim").post("/lmsp/v1/tasks", task_body())
    assert "takes no tasks" in problem(resp, 429, "rate_limited")["detail"]
    assert resp.headers["Retry-After"] == "60"


def test_queue_limits(tmp_path):
    from tests.unit.conftest import make_unit

    unit = make_unit(tmp_path, max_queued_tasks_per_principal=2, max_queue_depth=3)
    ivan, judy = unit.as_("ivan"), unit.as_("judy")
    assert [ivan.post("/lmsp/v1/tasks", task_body()).status_code for _ in range(2)] == [202, 202]
    resp = ivan.post("/lmsp/v1/tasks", task_body())
    problem(resp, 429, "rate_limited")
    assert int(resp.headers["Retry-After"]) >= 1
    assert judy.post("/lmsp/v1/tasks", task_body()).status_code == 202
    resp = judy.post("/lmsp/v1/tasks", task_body())
    problem(resp, 503, "overloaded")
    assert int(resp.headers["Retry-After"]) >= 1
