"""lmsp.client and the CLI against the real Flask app (SQLite, no engine), through httpx's WSGI
transport; retry and reconnection policy against scripted transports. Also the task list, stream
tickets and the dashboard's public page."""

import asyncio
import functools
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import jsonschema
import pytest
import yaml
from click.testing import CliRunner

from common import eventlog, events
from common.db import make_engine, session_factory, upgrade
from common.ids import new_id
from common.settings import Settings
from common.tables import Response, Task
from common.tokens import create_token, revoke_token
from lmsp import cli
from lmsp import client as lc
from tests.harness import CHECKPOINT, ROOT

MODEL = "tiny:client"
BASE = "http://lmsp.test"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from api import create_app

    home = tmp_path_factory.mktemp("client")
    models = home / "models.yaml"
    models.write_text(yaml.safe_dump({"models": [
        {"id": MODEL, "checkpoint": str(CHECKPOINT), "context_window": 512, "max_output_tokens": 64}]}))
    settings = Settings(home=home, models_file=models, database_url=f"sqlite:///{home / 'lmsp.db'}",
                        broker_url="", redis_url="", poll_interval_seconds=0.01)
    upgrade(settings.db_url)
    app = create_app(settings)
    sessions = session_factory(make_engine(settings.db_url))
    with sessions() as session:
        alice_id, alice = create_token(session, "alice", ("models:read", "tasks:read", "tasks:write",
                                                          "tasks:cancel", "responses:write"))
        _, bob = create_token(session, "bob", ("tasks:read", "tasks:write"))
        _, blind = create_token(session, "alice", ("models:read",))
        session.commit()
    return {"app": app, "sessions": sessions, "alice": alice, "alice_id": alice_id, "bob": bob, "blind": blind}


class Recorder(httpx.BaseTransport):
    """The app behind a WSGI transport; records requests; cuts the first ``drops`` event streams
    after ``cut_after`` bytes, and refuses the first ``refusals`` connections."""

    def __init__(self, app, *, drops=0, cut_after=300, refusals=0):
        self.inner = httpx.WSGITransport(app=app)
        self.requests: list[httpx.Request] = []
        self.drops, self.cut_after, self.refusals = drops, cut_after, refusals

    def handle_request(self, request):
        self.requests.append(request)
        if self.refusals:
            self.refusals -= 1
            raise httpx.ConnectError("connection refused", request=request)
        resp = self.inner.handle_request(request)
        if request.url.path.endswith("/events") and self.drops:
            self.drops -= 1
            body = resp.read()[:self.cut_after]

            class Cut(httpx.SyncByteStream):
                def __iter__(self):
                    yield body
                    raise httpx.ReadError("connection reset by peer")

            return httpx.Response(resp.status_code, headers=resp.headers, stream=Cut())
        return resp


def client(env, token="alice", **kw) -> tuple[lc.Client, Recorder]:
    transport = Recorder(env["app"], **kw)
    return lc.Client(BASE, env[token], transport=transport, reconnect_timeout=30), transport


def _task(env, principal="alice", status="succeeded", log=None, text="Hello there"):
    now = time.time()
    time.sleep(0.002)  # ids sort by their millisecond: one task per millisecond keeps the order exact
    rid, tid = new_id("response"), new_id("task")
    done = status in ("succeeded", "failed", "cancelled")
    output = [{"id": "msg_1", "type": "message", "role": "assistant",
               "content": [{"type": "output_text", "text": text}]}]
    with env["sessions"]() as session:
        session.add(Response(id=rid, principal_id=principal, model=MODEL, request={"model": MODEL, "input": []},
                             status="completed" if status == "succeeded" else "in_progress", stored=True,
                             output=output if status == "succeeded" else None,
                             usage={"input_tokens": 3, "output_tokens": 7, "total_tokens": 10}
                             if status == "succeeded" else None, created_at=now, updated_at=now))
        session.flush()
        session.add(Task(id=tid, principal_id=principal, response_id=rid, type="response", model=MODEL,
                         status=status, on_restart="fail", attempt=1, created_at=now, updated_at=now,
                         ended_at=now if done else None, events_expired=False))
        if log:
            eventlog.append(session, rid, [(i + 1, n, events.dumps({"response_id": rid, **d}))
                                           for i, (n, d) in enumerate(log)])
        session.commit()
    return tid


def _log(words: list[str], *, attempt_at: int | None = None) -> list[tuple[str, dict]]:
    log = [(events.CREATED, {"status": "in_progress"}),
           (events.ITEM_ADDED, {"output_index": 0, "item": {"id": "msg_1", "type": "message",
                                                            "role": "assistant", "content": []}})]
    for i, word in enumerate(words):
        if i == attempt_at:
            log.append((lc.ATTEMPT_STARTED, {"attempt": 2}))
        log.append((events.TEXT_DELTA, {"output_index": 0, "item_id": "msg_1", "delta": word}))
    log.append((events.COMPLETED, {"status": "completed",
                                   "usage": {"input_tokens": 3, "output_tokens": len(words), "total_tokens": 9}}))
    return log


# -- the task list ----------------------------------------------------------------------------------
def test_list_tasks_is_scoped_filtered_and_paged(env):
    mine = [_task(env, status=s) for s in ("queued", "running", "succeeded", "failed", "cancelled")]
    theirs = _task(env, principal="bob")
    http, _ = client(env)
    first = http.list_tasks(limit=2)
    assert [t["id"] for t in first["data"]] == mine[::-1][:2] and first["has_more"]
    listed = [t["id"] for t in http.iter_tasks()]
    assert listed[:5] == mine[::-1] and theirs not in listed
    assert len(listed) == len(set(listed))
    done = http.list_tasks(state="succeeded")["data"]
    assert {t["status"] for t in done} == {"succeeded"} and done[0]["response"]["usage"]["output_tokens"] == 7
    assert {t["status"] for t in http.list_tasks(state="queued,running")["data"]} == {"queued", "running"}
    for params, param in (({"state": "finished"}, "state"), ({"limit": 0}, "limit"), ({"cursor": "x"}, "cursor")):
        with pytest.raises(lc.InvalidRequest) as info:
            http.list_tasks(**params)
        assert info.value.param == param and info.value.status == 400
    with pytest.raises(lc.InvalidRequest) as info:
        http._json("GET", "/lmsp/v1/tasks", params={"status": "running"})  # a typo is not ignored
    assert info.value.param == "status"
    doc = env["app"].test_client().get("/lmsp/v1/openapi.json",
                                       headers={"Authorization": f"Bearer {env['alice']}"}).get_json()
    declared = doc["paths"]["/lmsp/v1/tasks"]["get"]["responses"]["200"]["content"]["application/json"]
    jsonschema.Draft202012Validator({**declared["schema"], "components": doc["components"]}).validate(first)
    blind, _ = client(env, "blind")
    with pytest.raises(lc.Forbidden) as info:
        blind.list_tasks()
    assert info.value.code == "insufficient_scope"


def test_problems_are_typed_exceptions(env):
    http, _ = client(env)
    with pytest.raises(lc.NotFound) as info:
        http.get_task("task_nope")
    assert (info.value.code, info.value.status) == ("task_not_found", 404)
    bob, _ = client(env, "bob")
    with pytest.raises(lc.NotFound):  # another principal's task answers like an unknown one
        bob.get_task(_task(env))
    stranger = lc.Client(BASE, "lmsp_wrong", transport=Recorder(env["app"]))
    with pytest.raises(lc.Unauthorized) as info:
        stranger.models()
    assert info.value.code == "unauthorized"
    with pytest.raises(lc.Conflict) as info:
        http.cancel_task(_task(env, status="succeeded"))
    assert info.value.code == "task_not_cancelable"


def test_create_task_sends_an_idempotency_key_and_replays_it(env):
    http, transport = client(env)
    first = http.create_task("Say hi.", max_output_tokens=8)
    second = http.create_task("Say hi.", max_output_tokens=8)
    keys = [r.headers.get("Idempotency-Key") for r in transport.requests if r.method == "POST"]
    assert first["id"] != second["id"] and len(set(keys)) == 2 and all(keys)
    assert http.create_task("Say hi.", idempotency_key="same-1")["id"] == \
        http.create_task("Say hi.", idempotency_key="same-1")["id"]
    body = json.loads(transport.requests[-1].content)
    assert body["input"]["model"] == MODEL  # the first ready-or-listed model by default
    assert body["input"]["input"][0]["content"][0] == {"type": "input_text", "text": "Say hi."}
    with pytest.raises(lc.InvalidRequest) as info:
        http.create_task("Say hi.", max_output_tokens=10_000)
    assert info.value.param == "input.max_output_tokens"


# -- following ----------------------------------------------------------------------------------------
def test_follow_resumes_by_last_event_id_across_drops_and_refusals(env):
    words = [f"w{i} " for i in range(40)]
    tid = _task(env, log=_log(words))
    http, transport = client(env, drops=3, cut_after=700, refusals=0)
    lost = []
    received = list(http.follow(tid, on_disconnect=lambda why, delay: lost.append(why)))
    assert [e.id for e in received] == list(range(1, len(words) + 4))  # each event once, in order
    assert "".join(e.data["delta"] for e in received if e.name == lc.TEXT_DELTA) == "".join(words)
    assert received[-1].final and received[-1].name == "response.completed"
    sent = [r.headers.get("Last-Event-ID") for r in transport.requests if r.url.path.endswith("/events")]
    assert len(sent) == 4 and sent[0] is None and [int(s) for s in sent[1:]] == sorted(int(s) for s in sent[1:])
    assert len(lost) == 3 and all("connection lost" in why for why in lost)


def test_follow_waits_through_an_unreachable_api(env, monkeypatch):
    monkeypatch.setattr(lc.time, "sleep", lambda s: None)
    tid = _task(env, log=_log(["a", "b"]))
    http, transport = client(env, refusals=4)
    received = list(http.follow(tid))
    assert [e.id for e in received] == [1, 2, 3, 4, 5]
    http.reconnect_timeout = 0
    http._http._transport.refusals = 1000
    with pytest.raises(lc.ServiceUnreachable):
        list(http.follow(tid))


def test_follow_yields_attempt_started_and_stops_at_the_final_event(env):
    tid = _task(env, log=_log(["old ", "text ", "new ", "text"], attempt_at=2))
    http, _ = client(env)
    names = [e.name for e in http.follow(tid)]
    assert lc.ATTEMPT_STARTED in names and names[-1] == "response.completed"
    assert names.index(lc.ATTEMPT_STARTED) == 4


def test_follow_raises_on_a_refusal_that_retrying_cannot_fix(env):
    http, _ = client(env, "bob")
    with pytest.raises(lc.NotFound):
        list(http.follow(_task(env, log=_log(["x"]))))


# -- retry policy -------------------------------------------------------------------------------------
def _scripted(answers):
    """A transport answering ``answers`` in turn; returns it and the requests it saw."""
    seen = []

    def handle(request):
        seen.append(request)
        return answers[min(len(seen), len(answers)) - 1]

    return httpx.MockTransport(handle), seen


def _problem(status, code, retry_after=None):
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else {}
    return httpx.Response(status, headers=headers, json={"type": f"/lmsp/v1/errors#{code}", "title": code,
                                                         "status": status, "code": code, "detail": "busy"})


def test_429_and_503_are_retried_honouring_retry_after_with_the_same_key(monkeypatch):
    slept = []
    monkeypatch.setattr(lc.time, "sleep", slept.append)
    task = {"id": "task_1", "status": "queued"}
    transport, seen = _scripted([_problem(429, "rate_limited", 2), _problem(503, "overloaded", 3),
                                 httpx.Response(202, json=task)])
    http = lc.Client(BASE, "t", transport=transport)
    assert http.create_task("hi", model="m") == task
    assert slept == [2.0, 3.0]
    assert len({r.headers["Idempotency-Key"] for r in seen}) == 1  # a retry is the same request


def test_retries_end_with_the_typed_problem(monkeypatch):
    monkeypatch.setattr(lc.time, "sleep", lambda s: None)
    transport, seen = _scripted([_problem(503, "model_unavailable", 10)])
    http = lc.Client(BASE, "t", transport=transport, max_retries=2)
    with pytest.raises(lc.Unavailable) as info:
        http.create_response("hi", model="m")
    assert (info.value.code, info.value.retry_after, len(seen)) == ("model_unavailable", 10.0, 3)
    transport, seen = _scripted([_problem(400, "invalid_request")])
    with pytest.raises(lc.InvalidRequest):
        lc.Client(BASE, "t", transport=transport).get_task("x")
    assert len(seen) == 1  # a client error is not retried


def test_async_client_follows_across_a_drop():
    body = "".join(f"id: {i}\nevent: response.output_text.delta\ndata: {{\"delta\": \"{i} \"}}\n\n"
                   for i in range(1, 6)) + 'id: 6\nevent: response.completed\ndata: {"status": "completed"}\n\n'
    seen = []

    class Cut(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield body[:body.index("id: 3")].encode()
            raise httpx.ReadError("reset")

    def handle(request):
        seen.append(request.headers.get("Last-Event-ID"))
        if len(seen) == 1:
            return httpx.Response(200, headers={"Content-Type": "text/event-stream"}, stream=Cut())
        after = int(request.headers["Last-Event-ID"])
        return httpx.Response(200, text=body[body.index(f"id: {after + 1}"):],
                              headers={"Content-Type": "text/event-stream"})

    async def run():
        async with lc.AsyncClient(BASE, "t", transport=httpx.MockTransport(handle)) as http:
            return [e async for e in http.follow("task_1")]

    received = asyncio.run(run())
    assert [e.id for e in received] == [1, 2, 3, 4, 5, 6] and seen == [None, "2"]


# -- stream tickets and the dashboard ----------------------------------------------------------------
def test_stream_tickets(env, monkeypatch):
    tid = _task(env, log=_log(["a"]))
    other = _task(env, log=_log(["b"]))
    web = env["app"].test_client()
    bearer = {"Authorization": f"Bearer {env['alice']}"}
    assert web.post(f"/lmsp/v1/tasks/{tid}/events/ticket").status_code == 401
    assert web.post(f"/lmsp/v1/tasks/{tid}/events/ticket",
                    headers={"Authorization": f"Bearer {env['bob']}"}).status_code == 404
    ticket = web.post(f"/lmsp/v1/tasks/{tid}/events/ticket", headers=bearer).get_json()
    stream = web.get(ticket["events_url"])
    assert stream.status_code == 200 and "event: response.completed" in stream.get_data(as_text=True)
    forged = ticket["ticket"][:-2] + ("AA" if not ticket["ticket"].endswith("AA") else "BB")
    for url in (f"/lmsp/v1/tasks/{other}/events?ticket={ticket['ticket']}",  # another task
                f"/lmsp/v1/tasks/{tid}/events?ticket={forged}",
                f"/lmsp/v1/tasks/{tid}?ticket={ticket['ticket']}"):          # only the events stream takes one
        resp = web.get(url)
        assert resp.status_code == 401 and ticket["ticket"] not in resp.get_data(as_text=True), url
    monkeypatch.setattr(time, "time", lambda real=time.time: real() + 61)
    assert web.get(ticket["events_url"]).status_code == 401  # expired
    monkeypatch.undo()
    fresh = web.post(f"/lmsp/v1/tasks/{tid}/events/ticket", headers=bearer).get_json()
    with env["sessions"]() as session:
        revoke_token(session, env["alice_id"])
        session.commit()
    assert web.get(fresh["events_url"]).status_code == 401  # dies with its token


def test_dashboard_is_public_and_locked_down(env):
    web = env["app"].test_client()
    page = web.get("/")
    assert page.status_code == 200 and page.mimetype == "text/html"
    assert "default-src 'self'" in page.headers["Content-Security-Policy"]
    assert page.headers["Referrer-Policy"] == "no-referrer"
    for path in ("/static/app.js", "/static/style.css"):
        assert web.get(path).status_code == 200, path
    assert web.get("/lmsp/v1/models").status_code == 401  # the API still needs a token


# -- the CLI ------------------------------------------------------------------------------------------
@pytest.fixture
def run_cli(env, monkeypatch):
    monkeypatch.setattr(lc, "Client", functools.partial(lc.Client, transport=Recorder(env["app"])))

    def run(*args, token=None):
        return CliRunner().invoke(cli.cli, [*args, "--url", BASE, "--token", token or env["bob"]])

    return run


def test_cli_tail_prints_text_marks_a_retry_and_exits_by_outcome(env, run_cli):
    tid = _task(env, principal="bob", log=_log(["old ", "line\n", "new ", "text"], attempt_at=2))
    done = run_cli("tail", tid)
    assert done.exit_code == 0, done.output
    out = done.output
    assert "old line" in out and "↻ attempt 2 started" in out and out.index("↻") < out.index("new text")
    assert "succeeded · 4 tokens" in out
    failed = _task(env, principal="bob", status="failed",
                   log=[(events.CREATED, {"status": "in_progress"}),
                        (events.FAILED, {"status": "failed", "error": {"code": "server_restarted"}})])
    assert run_cli("tail", failed).exit_code == 1
    cancelled = _task(env, principal="bob", status="cancelled",
                      log=[(events.CREATED, {"status": "in_progress"}), (events.TEXT_DELTA, {"delta": "a b c"}),
                           (events.CANCELLED, {"status": "cancelled", "response": {"usage": {"output_tokens": 36}}})])
    assert "cancelled · 36 tokens" in run_cli("tail", cancelled).output  # the exact count, not ~ from the text
    lines = run_cli("tail", tid, "--json").output.splitlines()
    assert json.loads(lines[0])["event"] == "response.created" and json.loads(lines[-1])["data"]["id"] == tid


def test_cli_errors_say_what_to_do(env, run_cli):
    missing = run_cli("tasks", "show", "task_nope")
    assert missing.exit_code == 1 and "lmsp tasks list" in missing.output
    refused = run_cli("tasks", "list", token="lmsp_wrong")
    assert refused.exit_code == 1 and "LMSP_TOKEN" in refused.output
    listed = run_cli("tasks", "list", "--json")
    assert listed.exit_code == 0 and all(t["object"] == "task" for t in json.loads(listed.output))


def test_cli_lists_ids_and_states_whole_at_80_columns_and_in_a_pipe(env, run_cli, monkeypatch):
    """An id is what `lmsp tail`, `tasks show` and `tasks cancel` are given: a table never cuts it, nor
    a state ("succeed…")."""
    monkeypatch.setenv("COLUMNS", "80")
    _task(env, principal="bob", log=_log(["x"]))
    listed = json.loads(run_cli("tasks", "list", "--json").output)
    table = run_cli("tasks", "list").output
    assert listed and all(t["id"] in table and f" {t['status']} " in table for t in listed), table


def test_dev_and_serve_refuse_a_port_in_use_and_say_how_to_pick_another(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        for command in ("dev", "serve"):
            done = subprocess.run([sys.executable, "-m", "lmsp", command, "--port", str(port)], cwd=ROOT,
                                  env={**os.environ, "LMSP_HOME": str(tmp_path)}, capture_output=True,
                                  text=True, timeout=60)
            assert done.returncode == 1, done.stderr
            assert f"port {port} on 127.0.0.1 is in use" in done.stderr and "LMSP_PORT" in done.stderr
    assert not (tmp_path / "lmsp.db").exists()  # refused before touching anything
