"""What a hostile client sends: odd numbers in queries and headers, ids that cannot exist, forged
tickets, ambiguous JSON, broken WebSocket handshakes and floods. Each gets a problem document (or,
on an open socket, a close), never a 500, and changes nothing."""

import io
import json
import socket
import threading
import time

import pytest
from gunicorn.http.errors import ChunkMissingTerminator, InvalidChunkExtension, InvalidChunkSize
from sqlalchemy import event, func, select

from common.tables import Response, Task
from tests import factories
from tests.harness import wait_for
from tests.unit.conftest import MODEL, make_unit, problem, task_body

WS_HANDSHAKE = {"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
                "Sec-WebSocket-Version": "13"}


# --- numbers in the query string: ASCII digits, given once ------------------------------------

@pytest.mark.parametrize("query, param", [
    ("limit=%C2%B2", "limit"),           # "²": str.isdigit() says yes, int() says no
    ("limit=%D9%A3", "limit"),           # an Arabic-Indic three
    ("limit=5&limit=50", "limit"),
    ("state=queued&state=failed", "state"),
    ("cursor=task_01J8M8R5X3V7B2N4Q9T1W6Y0ZC&cursor=x", "cursor"),
])
def test_bad_list_queries_are_400_naming_the_param(alice, query, param):
    assert problem(alice.get(f"/lmsp/v1/tasks?{query}"), 400, "invalid_request")["param"] == param


@pytest.mark.parametrize("wait", ["1_0", "%201", "%D9%A3", "0x1", "nan", "inf", "1e999", "-1", "-1e-3", ""])
def test_a_wait_that_is_not_a_json_number_of_seconds_is_400(alice, wait):
    task = alice.task("succeeded")
    assert problem(alice.get(f"/lmsp/v1/tasks/{task.id}?wait={wait}"), 400, "invalid_request")["param"] == "wait"


@pytest.mark.parametrize("wait", ["0", "2.5", "1e-05", "2.5E1", "-0.0", "2433005480437137.0"])
def test_a_wait_written_as_json_writes_numbers_is_taken(alice, wait):
    task = alice.task("succeeded")  # final: answered at once, however long the wait
    assert alice.get(f"/lmsp/v1/tasks/{task.id}?wait={wait}").status_code == 200


def test_a_repeated_wait_or_after_is_400(alice):
    task = alice.task("succeeded")
    assert problem(alice.get(f"/lmsp/v1/tasks/{task.id}?wait=0&wait=abc"), 400,
                   "invalid_request")["param"] == "wait"
    assert problem(alice.get(f"/lmsp/v1/tasks/{task.id}/events?after=1&after=x"), 400,
                   "invalid_request")["param"] == "after"
    assert alice.get(f"/lmsp/v1/tasks/{task.id}?wait=0.5").status_code == 200


# --- ids that cannot exist are never looked up ------------------------------------------------

@pytest.fixture
def no_nul_reaches_the_database(unit):
    """Postgres refuses NUL in text (a DataError, so a 500); SQLite does not care. Fail like Postgres."""
    engine = unit.app.extensions["lmsp"].engine
    sent = []

    def check(_conn, _cursor, _statement, parameters, _context, _many):
        values = parameters.values() if isinstance(parameters, dict) else parameters
        sent.extend(v for v in values if isinstance(v, str) and "\x00" in v)

    event.listen(engine, "before_cursor_execute", check)
    yield sent
    event.remove(engine, "before_cursor_execute", check)


@pytest.mark.parametrize("method, path, code", [
    ("GET", "/lmsp/v1/tasks/%00", "task_not_found"),
    ("GET", "/lmsp/v1/tasks/task_%00/events", "task_not_found"),
    ("POST", "/lmsp/v1/tasks/x%00y/cancel", "task_not_found"),
    ("POST", "/lmsp/v1/tasks/%00/events/ticket", "task_not_found"),
    ("GET", "/lmsp/v1/responses/resp_%00", "response_not_found"),
    ("GET", "/lmsp/v1/tasks/" + "x" * 5000, "task_not_found"),
])
def test_an_id_that_cannot_exist_is_404_without_a_lookup(alice, no_nul_reaches_the_database, method, path, code):
    problem(alice.open(method, path), 404, code)
    assert not no_nul_reaches_the_database


def test_a_previous_response_id_with_a_nul_never_reaches_the_database(alice, no_nul_reaches_the_database):
    # The body gate refuses a NUL in a string before anything is looked up.
    doc = problem(alice.post("/lmsp/v1/tasks", task_body(previous_response_id="resp_\x00")), 400, "invalid_request")
    assert doc["param"] == "input.previous_response_id" and not no_nul_reaches_the_database


# --- forged stream tickets: 401, whatever their shape ---------------------------------------------

def test_forged_tickets_are_401(unit, alice, no_nul_reaches_the_database):
    task = alice.task("succeeded")
    ticket = alice.post(f"/lmsp/v1/tasks/{task.id}/events/ticket").get_json()["ticket"]
    version, token_id, expires, signature = ticket.split(".")
    for forged in (f"{version}.{token_id}.{'9' * 5000}.{signature}",      # past int()'s 4300 digits
                   f"{version}.{token_id}.%C2%B2.{signature}",             # "²"
                   f"{version}.{token_id}.{expires}.%C3%A9{signature}",    # non-ASCII: compare_digest's TypeError
                   f"{version}.%00.{expires}.{signature}",                 # a NUL token id
                   f"{version}.{token_id}.{int(expires) + 1}.{signature}"):
        resp = unit.client.get(f"/lmsp/v1/tasks/{task.id}/events?ticket={forged}")
        problem(resp, 401, "unauthorized")
    assert not no_nul_reaches_the_database
    assert unit.client.get(f"/lmsp/v1/tasks/{task.id}/events?ticket={ticket}").status_code == 200


# --- JSON that means different things to different parsers ----------------------------------------

def _post_raw(caller, text: str):
    return caller.post("/lmsp/v1/tasks", data=text.encode(), content_type="application/json",
                       headers={"Idempotency-Key": f"raw-{time.monotonic_ns()}"})


@pytest.mark.parametrize("edit, param", [
    (lambda t: t.replace('{"type": "response"', '{"type": "batch", "type": "response"', 1), "type"),
    (lambda t: t.replace('"model": ', '"model": "x", "model": ', 1), "input.model"),
    (lambda t: t.replace('"role": "user"', '"role": "user", "role": "system"', 1), "input.input[0].role"),
])
def test_a_member_given_twice_is_400_naming_it(unit, alice, edit, param):
    text = edit(json.dumps(task_body()))
    assert problem(_post_raw(alice, text), 400, "invalid_request")["param"] == param


@pytest.mark.parametrize("number", ["1e400", "-1e400", "9" * 5000])
def test_numbers_no_json_can_hold_are_400(alice, number):
    text = json.dumps(task_body(extensions={"x-n": 0})).replace('"x-n": 0', f'"x-n": {number}')
    doc = problem(_post_raw(alice, text), 400, "invalid_request")
    assert "sys.set_int_max_str_digits" not in doc["detail"]


# --- the WebSocket route -------------------------------------------------------------------------

def _ws(caller, task_id: str, headers: dict, server_socket=None):
    environ = {"werkzeug.socket": server_socket} if server_socket is not None else {}
    return caller.get(f"/lmsp/v1/tasks/{task_id}/ws", headers=headers, environ_overrides=environ)


def _ws_handed_over(caller, task_id: str, headers: dict, server_socket) -> None:
    """A handshake whose socket the fan-out takes: the app ends the request with StopIteration, which
    gunicorn reads as "nothing to write" and the test client passes on."""
    with pytest.raises(StopIteration):
        _ws(caller, task_id, headers, server_socket)


@pytest.mark.parametrize("drop, change, param", [
    ("Sec-WebSocket-Key", {}, "Sec-WebSocket-Key"),
    ("Sec-WebSocket-Version", {}, "Sec-WebSocket-Version"),
    (None, {"Sec-WebSocket-Version": "8"}, "Sec-WebSocket-Version"),
])
def test_a_bad_websocket_handshake_is_400_naming_the_header(alice, drop, change, param):
    task = alice.task("succeeded")
    headers = {k: v for k, v in WS_HANDSHAKE.items() if k != drop} | change
    server, peer = socket.socketpair()
    with server, peer:
        resp = _ws(alice, task.id, headers, server)
        assert problem(resp, 400, "invalid_request")["param"] == param


def test_a_websocket_handshake_in_http_1_0_is_400(alice):
    task = alice.task("succeeded")
    resp = alice.get(f"/lmsp/v1/tasks/{task.id}/ws", headers=WS_HANDSHAKE,
                     environ_overrides={"SERVER_PROTOCOL": "HTTP/1.0"})
    assert "HTTP/1.1" in problem(resp, 400, "invalid_request")["detail"]


def test_plain_get_on_the_websocket_route_says_what_it_takes(alice):
    task = alice.task("succeeded")
    assert "WebSocket upgrade" in problem(_ws(alice, task.id, {}), 400, "invalid_request")["detail"]
    upgrade = {k: WS_HANDSHAKE[k] for k in ("Connection", "Upgrade")}
    doc = problem(alice.get(f"/lmsp/v1/tasks/{task.id}", headers=upgrade), 400, "invalid_request")
    assert "/ws" in doc["detail"]


@pytest.mark.parametrize("method, path", [("GET", "/lmsp/v1/models"), ("GET", "/lmsp/v1/tasks/{id}/events")])
def test_an_upgrade_elsewhere_is_told_every_route_that_takes_one(alice, method, path):
    path = path.format(id=alice.task("succeeded").id)
    doc = problem(alice.open(method, path, headers=WS_HANDSHAKE), 400, "invalid_request")
    assert doc["detail"] == "Only GET /lmsp/v1/responses and GET /lmsp/v1/tasks/{task_id}/ws take a WebSocket upgrade"


def test_a_client_that_floods_the_websocket_is_dropped(alice):
    """The server expects no message: one that grows without end closes the socket (and frees the
    thread) instead of filling the process's memory."""
    task = alice.task("running")
    server, peer = socket.socketpair()
    with server, peer:
        view = threading.Thread(target=_ws_handed_over, args=(alice, task.id, WS_HANDSHAKE, server), daemon=True)
        view.start()
        peer.settimeout(5)
        assert peer.recv(4096).startswith(b"HTTP/1.1 101")
        # One masked binary frame announcing 2**40 bytes, then as much as the server takes.
        peer.sendall(b"\x82\xff" + (1 << 40).to_bytes(8, "big") + b"\x00" * 4)
        with pytest.raises(OSError):
            for _ in range(10_000):  # 640 MiB: never reached
                peer.sendall(b"\x00" * 65536)
        view.join(10)
        assert not view.is_alive()


@pytest.mark.parametrize("frame", [
    b"\x81\x02hi",                              # a text frame that is not masked (RFC 6455 5.1)
    b"\xc1\x80" + b"\x00" * 4,                   # RSV1 set, with no extension agreed
    b"\x83\x80" + b"\x00" * 4,                   # opcode 3: reserved
    b"\x09\x80" + b"\x00" * 4,                   # a ping without FIN: control frames are never fragmented
    b"\x89\xfe\x00\x7e" + b"\x00" * 4 + b"x" * 126,  # a ping of 126 bytes: control frames hold 125
], ids=["unmasked", "rsv1", "opcode3", "fragmented-ping", "long-ping"])
def test_a_websocket_frame_that_breaks_the_protocol_closes_with_1002(alice, frame):
    task = alice.task("running")
    server, peer = socket.socketpair()  # the server's end belongs to the process's fan-out, which closes it
    with peer:
        view = threading.Thread(target=_ws_handed_over, args=(alice, task.id, WS_HANDSHAKE, server), daemon=True)
        view.start()
        peer.settimeout(5)
        got = peer.recv(4096)
        assert got.startswith(b"HTTP/1.1 101") and b"content-type" not in got.partition(b"\r\n\r\n")[0].lower()
        peer.sendall(frame)
        got = got.partition(b"\r\n\r\n")[2]
        while b"\x88" not in got:  # heartbeats may come first; then the close frame
            got += peer.recv(4096)
        close = got[got.index(b"\x88"):]
        assert int.from_bytes(close[2:4], "big") == 1002, close
    wait_for(lambda: server.fileno() == -1, 10, "the fan-out kept the socket")


# --- long polls hold a thread, so they hold a stream slot ------------------------------------------

def test_a_long_poll_holds_a_stream_slot(unit, tmp_path):
    one = make_unit(tmp_path, api_threads=17, stream_reserved_threads=16)  # one slot in this process
    slots = one.app.extensions["lmsp"].streams
    alice, bob = one.as_("alice"), one.as_("bob")
    task = alice.task("queued")
    poll = threading.Thread(target=alice.get, args=(f"/lmsp/v1/tasks/{task.id}?wait=30",), daemon=True)
    poll.start()
    wait_for(lambda: slots.open == 1, 10, "the long poll to take the slot")
    problem(bob.get(f"/lmsp/v1/tasks/{bob.task('succeeded').id}/events"), 429, "rate_limited")
    waiting = bob.task("queued")
    # No slot: told to come back later (an answer at once would make a client poll again at once) ...
    refused = bob.get(f"/lmsp/v1/tasks/{waiting.id}?wait=2")
    problem(refused, 429, "rate_limited")
    assert int(refused.headers["Retry-After"]) >= 1
    assert bob.get(f"/lmsp/v1/tasks/{waiting.id}").status_code == 200  # ... a plain GET needs none,
    # nor a long poll its first read answers (the task differs from the client's ETag), though read
    # here before (it subscribes before that read).
    assert bob.get(f"/lmsp/v1/tasks/{waiting.id}?wait=2", headers={"If-None-Match": '"other"'}).status_code == 200
    assert alice.post(f"/lmsp/v1/tasks/{task.id}/cancel").get_json()["status"] == "cancelled"
    poll.join(10)
    assert not poll.is_alive() and slots.open == 0


@pytest.mark.parametrize("charset, status", [("utf-16", 415), ("latin-1", 415), ("UTF-8", 202), ("utf8", 202)])
def test_a_body_in_another_charset_than_utf8_is_415(alice, charset, status):
    resp = alice.post("/lmsp/v1/tasks", data=json.dumps(task_body()).encode(),
                      content_type=f"application/json; charset={charset}")
    assert resp.status_code == status, resp.get_data(as_text=True)
    if status == 415:
        assert "UTF-8" in problem(resp, 415, "unsupported_media_type")["detail"]


def test_a_compressed_body_is_415_not_a_puzzle(unit, alice):
    import gzip
    resp = alice.post("/lmsp/v1/tasks", data=gzip.compress(json.dumps(task_body()).encode()),
                      content_type="application/json", headers={"Content-Encoding": "gzip"})
    assert "Content-Encoding gzip" in problem(resp, 415, "unsupported_media_type")["detail"]


def test_a_body_in_a_transfer_coding_besides_chunked_is_415(unit, alice):
    import gzip
    before = _rows(unit)
    resp = alice.post("/lmsp/v1/tasks", content_type="application/json",
                      headers={"Transfer-Encoding": "gzip, chunked"},
                      environ_overrides={"wsgi.input": io.BytesIO(gzip.compress(json.dumps(task_body()).encode())),
                                         "wsgi.input_terminated": True})
    assert "Transfer-Encoding gzip, chunked" in problem(resp, 415, "unsupported_media_type")["detail"]
    assert _rows(unit) == before


def test_a_path_with_a_double_slash_is_404_not_a_redirect(alice):
    """Werkzeug redirected it (308, an HTML body, a Location built from the client's Host)."""
    assert problem(alice.get("/lmsp/v1//models"), 404, "not_found")
    assert problem(alice.post("/lmsp/v1//tasks", task_body()), 404, "not_found")


@pytest.mark.parametrize("broken", [InvalidChunkSize(b"zz"), ChunkMissingTerminator(b"xx"),
                                    InvalidChunkExtension("bare CR not allowed")])
@pytest.mark.parametrize("path", ["/lmsp/v1/tasks", "/lmsp/v1/responses"])
def test_a_chunked_body_that_breaks_its_framing_is_400(unit, alice, broken, path):
    """gunicorn reads a chunked body as the app reads it: its framing errors (a size that is not hex, a
    chunk without its CRLF, a bad extension) come out of request.get_data()."""
    class Broken(io.BytesIO):
        def read(self, *_):
            raise broken
        readinto = read

    before = _rows(unit)
    resp = alice.post(path, content_type="application/json", headers={"Transfer-Encoding": "chunked"},
                      environ_overrides={"wsgi.input": Broken(), "wsgi.input_terminated": True})
    assert "cannot be read" in problem(resp, 400, "invalid_request")["detail"]
    assert _rows(unit) == before


def _rows(unit) -> tuple[int, int]:
    with unit.sessions() as session:
        return tuple(session.execute(select(func.count()).select_from(t)).scalar() for t in (Task, Response))


@pytest.mark.parametrize("path, headers, status, code", [
    ("/", {"If-Match": '"not-this"'}, 412, "precondition_failed"),
    ("/static/app.js", {"Range": "bytes=999999999-"}, 416, "range_not_satisfiable"),
])
def test_werkzeugs_own_refusals_are_problem_documents_too(unit, path, headers, status, code):
    assert problem(unit.anonymous.get(path, headers=headers), status, code)["instance"] == path


@pytest.mark.parametrize("status, reason, code", [
    (414, "URI Too Long", "uri_too_long"), (414, "Request URI Too Long", "uri_too_long"),  # gunicorn's, werkzeug's
    (431, "Request Header Fields Too Large", "request_header_fields_too_large"),
    (405, "Method Not Allowed", "method_not_allowed"),
    (418, "I'm a teapot", "i_m_a_teapot"),  # a status nobody named: its reason phrase, in the same form
])
def test_every_http_status_has_a_code_and_a_type_built_from_it(status, reason, code):
    from api.problems import status_problem
    doc = status_problem(status, reason, "x").wire()
    assert (doc["code"], doc["type"], doc["status"]) == (code, f"/lmsp/v1/errors#{code}", status) and doc["title"]


@pytest.fixture
def served(tmp_path):
    """The api under gunicorn, as `lmsp serve` runs it, on SQLite: its settings, and a raw request's answer
    (status, headers, body) read until the server closes the connection."""
    import os
    import subprocess

    from api.serve import gunicorn_argv
    from common.db import upgrade
    from tests.harness import ROOT, free_port
    from tests.unit.conftest import unit_settings

    settings = unit_settings(tmp_path, port=free_port(), api_workers=1, api_threads=4)
    upgrade(settings.db_url)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMSP_")}
    env.update(LMSP_HOME=str(tmp_path), LMSP_MODELS_FILE=str(settings.models_file),
               LMSP_DATABASE_URL=settings.db_url)
    api = subprocess.Popen(gunicorn_argv(settings), env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)

    def ask(raw: bytes) -> tuple[int, dict, bytes]:
        with socket.create_connection(("127.0.0.1", settings.port), timeout=10) as conn:
            conn.sendall(raw)
            answer = b""
            while chunk := conn.recv(65536):
                answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines[1:])
        return int(lines[0].split()[1]), headers, body

    def up() -> bool:
        try:
            socket.create_connection(("127.0.0.1", settings.port), timeout=1).close()
            return True
        except OSError:
            return False

    try:
        wait_for(up, 60, "the api did not start")
        yield settings, ask
    finally:
        api.terminate()
        api.wait(30)


def test_gunicorns_own_refusals_are_problem_documents_too(served):
    """What gunicorn refuses before the app sees it (a request line or headers too large, a request that
    is not HTTP) is answered as the app would: a problem document with LMSP-Version."""
    _, ask = served
    for raw, status, code in [
            (b"GET /lmsp/v1/tasks/" + b"x" * 9000 + b" HTTP/1.1\r\nHost: a\r\n\r\n", 414, "uri_too_long"),
            (b"GET /healthz HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer " + b"x" * 9000 + b"\r\n\r\n", 431,
             "request_header_fields_too_large"),
            (b"\x16\x03\x01 not http\r\n\r\n", 400, "invalid_request"),
            # gunicorn's own answer is 501: a 5xx would say the service failed
            (b"GET /healthz HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: d!\r\n\r\n", 400, "invalid_request")]:
        got, headers, body = ask(raw)
        doc = json.loads(body)
        assert got == status == doc["status"], (got, doc)
        assert headers["Content-Type"] == "application/problem+json" and headers["LMSP-Version"] == "1.0"
        assert doc["title"] and doc["detail"] and doc["code"] == code and doc["type"] == f"/lmsp/v1/errors#{code}"


def test_a_kept_alive_connection_outlives_a_clients_pause(served):
    """A client's next request on its kept-alive connection after a few idle seconds is answered, not
    reset: gunicorn's own keep-alive (2 s) closes the connection under a request sent as it expires (a
    chaos run's POST /responses was reset so), and clients keep idle connections longer (httpx 5 s)."""
    settings, _ = served
    with socket.create_connection(("127.0.0.1", settings.port), timeout=10) as conn:
        reader = conn.makefile("rb")
        for pause in (0, 3):
            time.sleep(pause)
            conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n")
            status = reader.readline()
            assert status.startswith(b"HTTP/1.1 200"), (pause, status)
            length = 0
            while (line := reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                length = int(value) if name.lower() == "content-length" else length
            assert json.loads(reader.read(length))


def test_head_on_an_event_stream_answers_its_headers_and_no_stream(served):
    """HEAD has no body (RFC 9110 9.3.2): on a running task's events gunicorn's api answers the stream's
    headers and closes, instead of a follower writing events into a connection that expects none."""
    from common.db import make_engine, session_factory
    from common.tokens import create_token

    settings, ask = served
    sessions = session_factory(make_engine(settings.db_url))
    with sessions() as session:
        task = factories.task(session, "running", owner="alice", model=MODEL)
        _, secret = create_token(session, "alice", ("tasks:read",))
        session.commit()

    def head(path: str) -> tuple[int, dict, bytes]:
        return ask(f"HEAD {path} HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer {secret}\r\n"
                   "Connection: close\r\n\r\n".encode())

    status, headers, body = head(f"/lmsp/v1/tasks/{task.id}/events")  # read until closed: 10 s at most
    assert status == 200 and headers["Content-Type"] == "text/event-stream" and body == b""
    assert head("/lmsp/v1/tasks/task_01J8M8R5X3V7B2N4Q9T1W6Y0ZC/events")[0] == 404


def test_http_1_0_followers_hold_no_request_thread(served):
    """An HTTP/1.0 client (nginx's default protocol to its upstreams) is followed by the fan-out thread
    like any other: more of them at once than the api has request threads all get their streams, and
    the api still answers short requests."""
    from common import eventlog, events
    from common.db import make_engine, session_factory
    from common.tokens import create_token

    settings, ask = served  # 1 process x 4 threads
    sessions = session_factory(make_engine(settings.db_url))
    with sessions() as session:
        task = factories.task(session, "running", owner="alice", model=MODEL)
        eventlog.append(session, task.response_id, [
            (1, "response.created", events.dumps({"response_id": task.response_id, "status": "in_progress"}))])
        _, secret = create_token(session, "alice", ("tasks:read",))
        session.commit()
    followers = []
    try:
        for _ in range(3 * settings.api_threads):
            conn = socket.create_connection(("127.0.0.1", settings.port), timeout=10)
            conn.sendall(f"GET /lmsp/v1/tasks/{task.id}/events HTTP/1.0\r\n"
                         f"Authorization: Bearer {secret}\r\n\r\n".encode())
            followers.append(conn)
        for conn in followers:
            got = b""
            while b"event: response.created" not in got:
                data = conn.recv(65536)
                assert data, got
                got += data
            assert got.split(b" ", 2)[1] == b"200" and b"Transfer-Encoding" not in got, got
        assert ask(b"GET /healthz HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")[0] == 200
    finally:
        for conn in followers:
            conn.close()


def test_an_http_1_0_client_gets_an_event_stream_it_can_read(served):
    """HTTP/1.0 has no chunked encoding: its stream comes plain and ends when the connection closes."""
    from common import eventlog, events
    from common.db import make_engine, session_factory
    from common.tokens import create_token

    settings, ask = served
    sessions = session_factory(make_engine(settings.db_url))
    with sessions() as session:
        task = factories.task(session, "succeeded", owner="alice", model=MODEL)
        eventlog.append(session, task.response_id, [
            (1, "response.created", events.dumps({"response_id": task.response_id, "status": "in_progress"})),
            (2, "response.completed", events.dumps({"response_id": task.response_id, "status": "completed"}))])
        _, secret = create_token(session, "alice", ("tasks:read",))
        session.commit()
    status, headers, body = ask(f"GET /lmsp/v1/tasks/{task.id}/events HTTP/1.0\r\n"
                                f"Authorization: Bearer {secret}\r\n\r\n".encode())
    assert status == 200 and "Transfer-Encoding" not in headers
    assert body.startswith(b"id: 1\nevent: response.created\n") and b"event: response.completed" in body
