"""Issue 14 at the protocol layer, fast: the Flask test client on SQLite, no Redis, no engine.

Bad input answers a problem document and changes nothing; streams end; limits hold. The same
behaviours against the real stack are in tests/functional/test_edges.py.
"""

import io
import json
import os
import threading
import time

import pytest
import yaml
from sqlalchemy import func, select

from api.grammar import CompileBudget
from api.grammar_pool import _readable
from api.live import Hub, follow
from api.ratelimit import StreamSlots
from api.services.idempotency import Claims, Key
from common import eventlog, events
from common.db import upgrade
from common.errors import LMSPError
from common.protocol import ResponseRequest, TaskRequest, parse
from common.settings import Settings
from common.tables import IdempotencyRecord, Response, Task
from common.tokens import create_token
from tests import factories
from tests.harness import model_entry, user

MODEL = "smollm2:fast"
PLAIN = "tiny:plain"  # no streaming, no event streams
LIMIT = 64 * 1024  # the request body's


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    from api import create_app

    tmp = tmp_path_factory.mktemp("edges")
    models = tmp / "models.yaml"
    models.write_text(yaml.safe_dump({"models": [
        model_entry(MODEL),
        model_entry(PLAIN, capabilities={"streaming": False, "event_resume": False, "tools": False,
                                         "structured_output": False, "conversations": False,
                                         "resume_snapshots": False}),
    ]}))
    url = f"sqlite:///{tmp / 'lmsp.db'}"
    upgrade(url)
    settings = Settings(home=tmp, database_url=url, models_file=models, redis_url="", max_body_bytes=LIMIT,
                        auth_failures_per_minute=5, rate_limit_per_second=0)
    app = create_app(settings)
    app.testing = True
    return app


@pytest.fixture(scope="module")
def svc(app):
    return app.extensions["lmsp"]


@pytest.fixture(scope="module")
def token(svc):
    with svc.sessions() as session:
        _, secret = create_token(session, "pat", ("models:read", "responses:write", "responses:read",
                                                  "tasks:write", "tasks:read", "tasks:cancel"))
        session.commit()
    return secret


@pytest.fixture
def client(app, token):
    c = app.test_client()
    c.environ_base["HTTP_AUTHORIZATION"] = f"Bearer {token}"
    return c


def rows(svc) -> tuple[int, int, int]:
    with svc.sessions() as session:
        return tuple(session.execute(select(func.count()).select_from(t)).scalar()
                     for t in (Response, Task, IdempotencyRecord))


def problem(resp, status, code, param=...):
    assert resp.status_code == status, resp.get_data(as_text=True)
    assert resp.mimetype == "application/problem+json"
    doc = resp.get_json()
    assert doc["code"] == code and doc["status"] == status and doc["detail"]
    if param is not ...:
        assert doc.get("param") == param, doc
    return doc


def raw(client, path, text: str, **headers):
    return client.post(path, data=text.encode("utf-8", "surrogatepass"), content_type="application/json",
                       headers=headers)


def body(**fields):
    return {"model": MODEL, "input": user("hi"), **fields}


# --- one place that decodes ids and headers ---------------------------------------------------

@pytest.mark.parametrize("after, header, param", [
    ("²", None, "after"), ("-1", None, "after"), ("1e3", None, "after"), ("٣", None, "after"),
    ("9" * 13, None, "after"), (None, "²", "Last-Event-ID"), (None, " 1", "Last-Event-ID"),
])
def test_bad_event_ids_are_400_naming_the_param(client, svc, after, header, param):
    with svc.sessions() as session:
        task = factories.task(session, "succeeded", owner="pat", model=MODEL)
        session.commit()
    path = f"/lmsp/v1/tasks/{task.id}/events" + (f"?after={after}" if after is not None else "")
    headers = {"Last-Event-ID": header} if header is not None else {}
    problem(client.get(path, headers=headers), 400, "invalid_request", param)


# --- bad strings anywhere in the body ----------------------------------------------------------

@pytest.mark.parametrize("path, text, param", [
    ("/lmsp/v1/responses", '{"model": "m", "input": [{"type": "message", "role": "user", "content": "\\ud800"}]}',
     "input[0].content"),
    ("/lmsp/v1/responses", '{"model": "m", "input": [], "extensions": {"x-a": ["ok", "\\udfff!"]}}',
     "extensions.x-a[1]"),
    ("/lmsp/v1/responses", '{"model": "m\\u0000", "input": []}', "model"),
    ("/lmsp/v1/responses", '{"model": "m", "input": [], "extensions": {"x-\\u0000": 1}}', "extensions.x-\x00"),
    ("/lmsp/v1/tasks", '{"type": "response", "input": {"model": "m", "input": [{"type": "message", '
     '"role": "user", "content": [{"type": "input_text", "text": "a\\u0000b"}]}]}}',
     "input.input[0].content[0].text"),
    ("/lmsp/v1/tasks", '{"type": "response", "input": {"model": "m", "input": [], "tools": '
     '[{"type": "function", "name": "f", "description": "\\ud83d"}]}}', "input.tools[0].description"),
])
def test_nul_and_lone_surrogates_are_400_and_change_nothing(client, svc, path, text, param):
    before = rows(svc)
    problem(raw(client, path, text, **{"Idempotency-Key": f"k-{param}"}), 400, "invalid_request", param)
    assert rows(svc) == before


def test_a_pair_of_surrogates_is_just_a_character(client, svc):
    # "\ud83d\ude00" is one emoji: valid, so the request gets as far as the model (unavailable here).
    resp = raw(client, "/lmsp/v1/responses", json.dumps(body(input=user("x")))
               .replace('"x"', '"\\ud83d\\ude00"'))
    problem(resp, 503, "model_unavailable")


def test_body_over_the_limit_is_413_before_authentication(app, svc):
    with app.test_client() as anonymous:
        # Declared length only: the check must not need (or read) the body.
        resp = anonymous.post("/lmsp/v1/responses", data=b"{}", content_type="application/json",
                              environ_overrides={"CONTENT_LENGTH": str(10 * 1024 * 1024)})
    problem(resp, 413, "payload_too_large")


@pytest.mark.parametrize("size, status", [(LIMIT, 503), (LIMIT + 1, 413), (3 * LIMIT, 413)])
def test_a_chunked_body_over_the_limit_is_413_not_cut_at_it(client, svc, size, status):
    """A chunked body has no length to check up front; werkzeug's limited stream ended it at the limit as if
    that were all of it: JSON followed by spaces past the limit was answered, a string was cut."""
    start = json.dumps(body(max_output_tokens=2)).encode()
    data = start + b" " * (size - len(start))
    stream = io.BytesIO(data)  # as gunicorn hands a chunked body over: no Content-Length, a stream that ends
    before = rows(svc)
    resp = client.post("/lmsp/v1/responses", content_type="application/json",
                       headers={"Transfer-Encoding": "chunked", "Idempotency-Key": f"chunked-{size}"},
                       environ_overrides={"wsgi.input": stream, "wsgi.input_terminated": True})
    # Exactly the limit is a body like any other (here no worker serves the model); past it, a 413.
    doc = problem(resp, status, "model_unavailable" if status == 503 else "payload_too_large")
    assert doc["type"] == f"/lmsp/v1/errors#{doc['code']}"
    if status == 413:
        assert rows(svc) == before
        # Up to twice the limit is read to its end, so that the connection can be kept alive; past that,
        # no further (gunicorn then closes the connection).
        assert stream.tell() == min(size, 2 * LIMIT + 1)


def test_bad_tokens_are_rate_limited_per_address_without_lookups(app, svc, token, monkeypatch):
    import api.auth
    lookups = []
    real = api.auth.authenticate
    monkeypatch.setattr(api.auth, "authenticate", lambda session, secret: lookups.append(1) or real(session, secret))
    svc.auth_failures.counts.clear()

    def get(secret, address="203.0.113.9"):
        return app.test_client().get("/lmsp/v1/models", headers={"Authorization": f"Bearer {secret}"},
                                     environ_base={"REMOTE_ADDR": address})

    assert get(token).status_code == 200  # a client of this address that authenticates
    assert [get("not-a-token").status_code for _ in range(8)] == [401] * 8  # never looked up, not counted
    assert len(lookups) == 1
    answers = [get("lmsp_" + "A" * 43) for _ in range(7)]  # well-formed guesses: each a lookup
    assert [r.status_code for r in answers] == [401] * 5 + [429] * 2
    problem(answers[-1], 429, "rate_limited")
    assert int(answers[-1].headers["Retry-After"]) >= 1
    assert len(lookups) == 1 + 5  # the refused ones cost no lookup
    assert get(token).status_code == 200  # a known token from the same address is still served
    assert get("lmsp_" + "A" * 43, "203.0.113.10").status_code == 401  # another address is not punished
    svc.auth_failures.counts.clear()


def test_behind_a_trusted_proxy_bad_tokens_count_against_the_client_not_the_proxy(tmp_path, monkeypatch):
    """Found behind nginx: every client had the proxy's address, so 70 bad tokens from one locked out
    another's new valid token for a minute. With ``LMSP_TRUSTED_PROXIES=1`` the address counted is the
    one the proxy appended to X-Forwarded-For; without it the header is not read (a client cannot name
    a fresh address for each guess)."""
    from tests.unit.conftest import make_unit

    def get(unit, secret, forwarded):
        return unit.app.test_client().get("/lmsp/v1/models", headers={
            "Authorization": f"Bearer {secret}", "X-Forwarded-For": forwarded},
            environ_base={"REMOTE_ADDR": "10.0.0.2"})  # the proxy

    for trusted, carol_answer in ((1, 200), (0, 429)):
        (tmp_path / f"t{trusted}").mkdir()
        unit = make_unit(tmp_path / f"t{trusted}", trusted_proxies=trusted, auth_failures_per_minute=5)
        with unit.sessions() as session:
            _, carol = create_token(session, "carol", ("models:read",))  # new: never seen by this process
            session.commit()
        guesses = [get(unit, "lmsp_" + "A" * 43, f"198.51.100.{i % 2}, 203.0.113.9").status_code for i in range(7)]
        assert guesses == [401] * 5 + [429] * 2
        assert get(unit, carol, "203.0.113.10").status_code == carol_answer


def test_a_locked_out_address_still_has_tokens_known_to_any_process_looked_up(tmp_path):
    """Found by a hostile client's probe: past the bad-token limit, a valid token this process had not
    seen got 429, so one client's guesses locked out the new tokens of everyone at its address, and a
    restarted process locked out every client there. With Redis, a token any api process authenticated
    lately, or that ``lmsp tokens create`` made, is still looked up; an unknown one is still refused."""
    from api import create_app
    from common.bus import mark_known
    from common.tokens import hash_secret
    from tests.harness import REDIS_URL
    from tests.unit.conftest import make_unit

    first = make_unit(tmp_path, redis_url=REDIS_URL, auth_failures_per_minute=5)
    second = create_app(first.settings)  # another api process (or this one restarted)

    def get(app, secret, address="203.0.113.77"):
        return app.test_client().get("/lmsp/v1/models", headers={"Authorization": f"Bearer {secret}"},
                                     environ_base={"REMOTE_ADDR": address})

    with first.sessions() as session:
        _, seen = create_token(session, "dora", ("models:read",))
        _, made = create_token(session, "emil", ("models:read",))
        _, fresh = create_token(session, "finn", ("models:read",))
        session.commit()
    mark_known(REDIS_URL, hash_secret(made))  # what `lmsp tokens create` does
    assert get(first.app, seen, "198.51.100.1").status_code == 200  # seen by the first process only
    guesses = [get(second, f"lmsp_{i:043d}").status_code for i in range(7)]
    assert guesses == [401] * 5 + [429] * 2
    assert get(second, seen).status_code == 200
    assert get(second, made).status_code == 200
    assert get(second, fresh).status_code == 429  # never seen, never announced: a guess like any other


def test_a_token_in_use_stays_known_to_every_process():
    """A process marked a token known in Redis only when it first saw it: used for over an hour there, it
    was no longer known to the others (found by an outside check of the fix above)."""
    import uuid

    import redis

    from api.ratelimit import AuthFailures
    from common.tokens import KNOWN_SECONDS, known_key
    from tests.harness import REDIS_URL

    client, digest = redis.Redis.from_url(REDIS_URL), uuid.uuid4().hex
    failures = AuthFailures(5, REDIS_URL)
    try:
        failures.succeeded(digest)
        assert client.ttl(known_key(digest)) > KNOWN_SECONDS - 5
        client.expire(known_key(digest), 10)  # nearly an hour on
        failures.succeeded(digest)  # used again soon after: not told again
        assert client.ttl(known_key(digest)) <= 10
        failures.told[digest] -= KNOWN_SECONDS / 2  # half an hour on, still in use
        failures.succeeded(digest)
        assert client.ttl(known_key(digest)) > KNOWN_SECONDS - 5
    finally:
        client.delete(known_key(digest))


# --- param names and capabilities ---------------------------------------------------------------

@pytest.mark.parametrize("model, data, param", [
    (ResponseRequest, body(response_format={"type": "json_schema"}), "response_format.json_schema"),
    (TaskRequest, {"type": "response", "input": body(response_format={"type": "json_schema"})},
     "input.response_format.json_schema"),
    (TaskRequest, {"type": "response", "input": body(response_format={"type": "json_schema",
                                                                     "json_schema": {"name": "x"}})},
     "input.response_format.json_schema.schema"),
    (ResponseRequest, body(input=[{"type": "reasoning", "summary": [{"type": "summary_text"}]}]),
     "input[0].summary[0].text"),
    (ResponseRequest, body(input=[{"type": "message", "role": "user", "content": [{"type": "input_text"}]}]),
     "input[0].content[0].text"),
    (ResponseRequest, body(input=[{"type": "function_call", "name": "f", "arguments": "{}"}]), "input[0].call_id"),
    (ResponseRequest, body(tool_choice={"type": "function"}), "tool_choice.name"),
    (ResponseRequest, body(response_format={"type": "text", "text": 1}), "response_format.text"),
])
def test_param_names_the_missing_member(model, data, param):
    with pytest.raises(LMSPError) as err:
        parse(model, data)
    assert err.value.param == param


def test_streaming_capability_is_enforced(client, svc):
    before = rows(svc)
    problem(client.post("/lmsp/v1/responses", json={**body(stream=True), "model": PLAIN}), 400,
            "unsupported_capability", "stream")
    assert rows(svc) == before


def test_event_resume_capability_is_enforced(client, svc, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # kombu's filesystem transport writes its control files in the cwd
    task = client.post("/lmsp/v1/tasks", json={"type": "response", "input": {**body(), "model": PLAIN}}).get_json()
    assert "events_url" not in task
    assert problem(client.get(f"/lmsp/v1/tasks/{task['id']}/events"), 400,
                   "unsupported_capability")["capability"] == "event_resume"
    resumable = client.post("/lmsp/v1/tasks", json={"type": "response", "input": body()}).get_json()
    assert resumable["events_url"] == f"/lmsp/v1/tasks/{resumable['id']}/events"
    for t in (task, resumable):
        client.post(f"/lmsp/v1/tasks/{t['id']}/cancel")
    svc.sender.submit(lambda: None).result()  # the broker messages are sent (here) before the cwd returns


def test_discovery_takes_capabilities_from_the_registry(client, svc):
    caps = client.get("/lmsp/v1").get_json()["capabilities"]
    union = {name: any(s.public_capabilities()[name] for s in svc.registry.models.values()) for name in caps}
    assert caps == union and caps["streaming"] and not caps["reasoning"]  # no model has a reasoning parser


# --- grammar budget at the door -----------------------------------------------------------------

def _nested(depth: int) -> dict:
    if depth == 0:
        return {"type": "string"}
    inner = _nested(depth - 1)
    return {"anyOf": [inner, {"type": "array", "items": inner}, {"type": "object", "properties": {"k": inner}}]}


def test_grammar_bombs_are_refused_at_the_door(client, svc):
    before = rows(svc)
    bomb = body(response_format={"type": "json_schema", "json_schema": {"name": "b", "schema": _nested(6)}})
    problem(client.post("/lmsp/v1/responses", json=bomb), 400, "invalid_request", "response_format.json_schema.schema")
    alternatives = {"type": "object", "properties": {"v": {"oneOf": [{"type": "string"}, {"type": "integer"}]}}}
    tools = [{"type": "function", "name": f"t{i}", "parameters": alternatives} for i in range(128)]
    problem(client.post("/lmsp/v1/tasks", json={"type": "response", "input": body(tools=tools, tool_choice="required")}),
            400, "invalid_request", "input.tools")
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2100)}}
    problem(client.post("/lmsp/v1/responses", json=body(tools=[{"type": "function", "name": "w", "parameters": wide}])),
            400, "invalid_request", "tools[0].parameters")
    assert rows(svc) == before


@pytest.mark.parametrize("schema", [
    {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},  # xgrammar: no first token at all
    {"type": "array", "minItems": 1, "items": {"$ref": "#"}},  # then one more level, for ever
    {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
])
def test_a_schema_with_no_finite_value_is_400(client, svc, schema):
    """Every instance nests without end: xgrammar compiles it, yet no generation held to it can ever end
    valid (the simulated engine failed such a request with generation_failed)."""
    before = rows(svc)
    doc = problem(client.post("/lmsp/v1/responses", json=body(
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})),
        400, "invalid_request", "response_format.json_schema.schema")
    assert "finite" in doc["detail"]
    named = body(tools=[{"type": "function", "name": "f", "parameters": schema}],
                 tool_choice={"type": "function", "name": "f"})
    problem(client.post("/lmsp/v1/tasks", json={"type": "response", "input": named}), 400, "invalid_request",
            "input.tools[0].parameters")
    assert rows(svc) == before
    # The same recursion with a way out (an optional member, an empty array) is a schema like any other.
    for finite in ({"type": "object", "properties": {"next": {"$ref": "#"}}},
                   {"type": "array", "items": {"$ref": "#"}}):
        problem(client.post("/lmsp/v1/responses", json=body(
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": finite}})),
            503, "model_unavailable")  # past the door (no worker in this test)


def test_a_schema_the_backend_cannot_compile_is_400(client, svc):
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}
    doc = problem(client.post("/lmsp/v1/responses", json=body(
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})),
        400, "invalid_request", "response_format.json_schema.schema")
    assert "ookbehind" in doc["detail"]
    fine = {"type": "object", "properties": {"a": {"type": "string"}}}
    resp = client.post("/lmsp/v1/responses", json=body(
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": fine}}))
    problem(resp, 503, "model_unavailable")  # passed the gate (no worker in this test)


def test_a_helper_its_timeout_killed_is_replaced_by_a_fork_not_a_new_import(client, svc):
    """A schema built to overrun kills its helper; the replacement is forked from the spawner that
    imported the backend once, which lives on (a client cannot make the api host import torch again)."""
    pytest.importorskip("xgrammar")
    fine = {"type": "object", "properties": {"b": {"type": "integer"}}}
    problem(client.post("/lmsp/v1/responses", json=body(
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": fine}})), 503, "model_unavailable")
    pool = svc.grammars._pool
    spawner = pool.spawner.proc.pid
    helper = pool.take(5)
    pidfd = os.dup(helper.pidfd)
    try:
        helper.stop()  # what ask does when a compile overruns its timeout (tests/functional/test_edges.py)
        assert not helper.alive and _readable(pidfd, 5)  # its process has ended
        back = threading.Event()
        pool.replace(helper, then=back.set)
        assert back.wait(60)
        fresh = pool.take(5)
        assert fresh.alive and fresh.pidfd is not None and fresh.checkpoints == helper.checkpoints
        assert fresh.ask({"schema": json.dumps({"type": "string"}), "checkpoint": next(iter(fresh.checkpoints))},
                         60) == {"error": None}
        pool.give(fresh)
        assert pool.spawner.proc.pid == spawner and pool.spawner.proc.poll() is None
    finally:
        os.close(pidfd)


@pytest.mark.parametrize("schema, why", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "contains": {"type": "integer"}}, "contains"),
    ({"type": "string", "format": "no-such-format"}, "no-such-format"),
    ({"type": "object", "propertyNames": {"pattern": "^a", "maxLength": 3}}, "propertyNames"),
])
def test_a_schema_xgrammar_compiles_but_the_engine_refuses_is_400(client, svc, schema, why):
    """The engine (vLLM, backend auto) falls back from xgrammar to guidance for these, which refuses them:
    past the door, a synchronous request would answer 500 generation_failed, a task would fail."""
    pytest.importorskip("vllm")
    before = rows(svc)
    doc = problem(client.post("/lmsp/v1/responses", json=body(
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})),
        400, "invalid_request", "response_format.json_schema.schema")
    assert why in doc["detail"]
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {"a": schema}}}]
    named = body(tools=tools, tool_choice={"type": "function", "name": "f"})
    problem(client.post("/lmsp/v1/tasks", json={"type": "response", "input": named}), 400, "invalid_request",
            "input.tools[0].parameters")
    assert rows(svc) == before


def test_the_compile_budget_is_per_principal():
    budget = CompileBudget(seconds_per_minute=2, wait=0.2)
    budget.take("mallory")
    budget.take("nina")  # another principal's turn is its own
    start = time.monotonic()
    with pytest.raises(LMSPError) as err:
        budget.take("mallory")  # one compile at a time: it waits for its own turn, then 429
    assert err.value.code == "rate_limited" and err.value.retry_after >= 1
    assert 0.2 <= time.monotonic() - start < 2
    waiter = threading.Timer(0.05, budget.release, ["mallory"])
    waiter.start()
    budget.take("mallory")  # given back while it waited
    budget.charge("mallory", 1.5)
    budget.charge("mallory", 1.0)
    budget.release("mallory")
    with pytest.raises(LMSPError) as err:
        budget.take("mallory")  # 2.5 s of compiles in the last minute
    assert err.value.code == "rate_limited" and 55 <= err.value.retry_after <= 60
    budget.release("nina")
    budget.take("nina")


# --- streams that end ---------------------------------------------------------------------------

def _finished_task(svc, n_events=3):
    with svc.sessions() as session:
        task = factories.task(session, "succeeded", owner="pat", model=MODEL)
        batch = events.Sequence().number([events.ResponseCreated(response_id=task.response_id)])
        batch += [(i, events.TEXT_DELTA, "{}") for i in range(2, n_events)]
        batch += events.Sequence(n_events - 1).number([events.final(task.response_id, "completed", usage={})])
        eventlog.append(session, task.response_id, batch)
        task.ended_at = time.time()
        session.commit()
    return task


@pytest.mark.parametrize("resume", ["?after=3", "?after=99", "header"])
def test_resume_at_or_past_the_final_event_ends_at_once(client, svc, resume):
    task = _finished_task(svc)
    path = f"/lmsp/v1/tasks/{task.id}/events" + (resume if resume != "header" else "")
    start = time.monotonic()
    resp = client.get(path, headers={"Last-Event-ID": "3"} if resume == "header" else {})
    assert resp.status_code == 200 and resp.get_data(as_text=True) == ""
    assert time.monotonic() - start < 1
    resp.close()
    assert svc.streams.open == 0  # the stream's slot is back


def test_an_open_stream_holds_its_slot_until_the_server_closes_it(client, svc):
    with svc.sessions() as session:
        task = factories.task(session, "running", owner="pat", model=MODEL)
        session.commit()
    resp = client.get(f"/lmsp/v1/tasks/{task.id}/events", buffered=False)
    assert resp.status_code == 200 and svc.streams.open == 1  # the view has returned; the body goes on
    resp.close()  # what the WSGI server does when the client is gone
    assert svc.streams.open == 0


def test_stream_slots_cap_per_principal_and_per_process():
    slots = StreamSlots(total=3, per_principal=2)
    a1, _ = slots.acquire("a"), slots.acquire("a")
    with pytest.raises(LMSPError) as err:
        slots.acquire("a")
    assert err.value.code == "rate_limited" and err.value.retry_after
    slots.acquire("b")
    with pytest.raises(LMSPError):
        slots.acquire("c")  # the process is full
    a1()
    a1()  # giving back twice frees one slot, not two
    slots.acquire("c")
    with pytest.raises(LMSPError):
        slots.acquire("d")


def test_followers_read_the_log_when_redis_is_unreachable(svc):
    task = _finished_task(svc, n_events=5)
    settings = svc.settings.model_copy(update={"redis_url": "redis://127.0.0.1:1/0"})
    hub = Hub(settings, svc.reads)
    start = time.monotonic()
    got = [e for batch in follow(hub, task.response_id, 2, logged=True, heartbeat=0.5, ended=lambda: [])
           if batch for e in batch]
    assert [e[0] for e in got] == [3, 4, 5] and got[-1][1] == events.COMPLETED
    assert time.monotonic() - start < 2 and not hub.connected


def test_a_revoked_token_ends_the_follower(svc):
    with svc.sessions() as session:
        task = factories.task(session, "running", owner="pat", model=MODEL)
        session.commit()
    settings = svc.settings.model_copy(update={"stream_auth_recheck_seconds": 0.2})
    hub = Hub(settings, svc.reads)
    allowed = threading.Event()
    allowed.set()
    threading.Timer(0.5, allowed.clear).start()
    start = time.monotonic()
    with pytest.raises(LMSPError) as err:
        for _ in follow(hub, task.response_id, 0, logged=True, heartbeat=0.1, ended=lambda: None,
                        authorized=allowed.is_set):
            pass
    assert err.value.code == "unauthorized" and time.monotonic() - start < 2


# --- idempotency tied to the request's liveness -------------------------------------------------

def test_an_inflight_key_lives_as_long_as_its_request(svc):
    with svc.sessions() as session:
        factories.principal(session, "pat")
        session.commit()
    claims = Claims(svc.sessions, beat=0.2)
    key = Key("pat", "POST", "/lmsp/v1/responses", f"live-{time.time()}", "h")
    assert claims.begin(key) is None
    time.sleep(1.0)  # five beats: a clock-based stale window would have expired by now
    other = Claims(svc.sessions, beat=0.2)  # another process retrying with the key
    with pytest.raises(LMSPError) as err:
        other.begin(key)
    assert err.value.code == "idempotency_key_in_use"
    claims.live.clear()  # the request's process "dies": no more heartbeats
    time.sleep(0.8)
    assert other.begin(key) is None  # three beats without a heartbeat: taken over
    other.abandon(key)
    assert claims.begin(key) is None  # given back at once
    claims.finish(key, 200, "{}")
    assert claims.begin(key).status_code == 200  # a finished key replays


def test_a_direct_request_whose_message_cannot_be_sent_fails_503_while_its_worker_lives(tmp_path, monkeypatch):
    """The broker away from this api (a worker still heartbeating to Postgres): the message was sent
    again every few seconds for ever and a synchronous request never answered. Once it could not be sent
    for a lease, the response fails ``overloaded`` (503, Retry-After), and nothing is left queued."""
    from api.services import work
    from common import liveness
    from tests.unit.conftest import MODEL as UNIT_MODEL
    from tests.unit.conftest import make_unit

    def unreachable(*_args, **_kw):
        raise ConnectionRefusedError("Connection refused")

    monkeypatch.setattr(work.interactive_wire, "send", unreachable)
    unit = make_unit(tmp_path, lease_seconds=2, direct_requeue_after_seconds=0.2)
    alice = unit.as_("alice")
    stop, beaten = threading.Event(), threading.Event()

    def beat():  # a live worker serving the model, that the broker's messages never reach
        started = time.time()
        while not stop.is_set():
            with unit.sessions() as session:
                liveness.heartbeat(session, "w-alive", [UNIT_MODEL], started, running=0, ready=True,
                                   loaded=[UNIT_MODEL])
                session.commit()
            beaten.set()
            stop.wait(0.3)
    beating = threading.Thread(target=beat, daemon=True)
    beating.start()
    try:
        assert beaten.wait(10)
        started = time.monotonic()
        resp = alice.post("/lmsp/v1/responses", {"model": UNIT_MODEL, "input": user("hi")})
        took = time.monotonic() - started
    finally:
        stop.set()
        beating.join(5)
    doc = problem(resp, 503, "overloaded")
    assert "broker" in doc["detail"] and resp.headers["Retry-After"] == "5"
    assert 2 <= took < 20
    with unit.sessions() as session:
        assert session.execute(select(Response.status)).scalars().all() == ["failed"]
