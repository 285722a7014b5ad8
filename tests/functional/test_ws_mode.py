"""WebSocket mode of the Responses API, driven by the OpenAI SDK unchanged (``client.responses.connect()``)
against the real stack: api under gunicorn, Postgres, Redis, the session's vLLM worker."""

import os
import signal
import threading
import time

import openai
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tests.harness import Client, wait_for

FINAL = {"response.completed", "response.incomplete", "response.failed", "response.cancelled"}
WAIT = 120  # seconds any one event may take on a loaded 2-core host


def sdk(client: Client) -> openai.OpenAI:
    return openai.OpenAI(base_url=client.url("/lmsp/v1"), api_key=client.http.headers["Authorization"][7:],
                         max_retries=0)


def recv(conn, timeout: float = WAIT):
    """The next event; the socket is closed (and the test fails) if none comes in ``timeout``."""
    watchdog = threading.Timer(timeout, conn.close)
    watchdog.start()
    try:
        return conn.recv()
    finally:
        watchdog.cancel()


def until_final(conn) -> list:
    """Events up to one response's final event (one lane at a time on the socket)."""
    got = [recv(conn)]
    while got[-1].type not in FINAL and got[-1].type != "error":
        got.append(recv(conn))
    return got


def text_of(events) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def test_two_turns_chained_by_previous_response_id(alice, model_id):
    common = {"model": model_id, "temperature": 0, "max_output_tokens": 8}
    with sdk(alice).responses.connect() as conn:
        conn.response.create(input="Say hello.", **common)  # store false: only the connection remembers it
        first = until_final(conn)
        assert [e.sequence_number for e in first] == list(range(1, len(first) + 1))
        assert first[0].type == "response.created" and first[-1].type in ("response.completed",
                                                                           "response.incomplete")
        done = first[-1].response
        assert done.id == first[0].response.id and done.output_text == text_of(first) and done.output_text
        conn.response.create(input="Again, in French.", previous_response_id=done.id, **common)
        second = until_final(conn)
        assert second[-1].type in ("response.completed", "response.incomplete"), second[-1]
        # The second turn's prompt is the first's input, its output and the new input.
        assert second[-1].response.previous_response_id == done.id
        assert second[-1].response.usage.input_tokens > done.usage.input_tokens + done.usage.output_tokens

        # generate: false warms a conversation: a completed response without output, to continue from.
        conn.response.create(input="My name is Ada.", generate=False, **common)
        warm = until_final(conn)
        assert [e.type for e in warm] == ["response.created", "response.completed"]
        assert warm[-1].response.output == [] and warm[-1].response.usage.output_tokens == 0
        conn.response.create(input="What is my name?", previous_response_id=warm[-1].response.id, **common)
        assert until_final(conn)[-1].response.usage.input_tokens > warm[-1].response.usage.input_tokens
    # A response created over POST with store: true is continued from storage on a new connection.
    stored = sdk(alice).responses.create(input="Say hello.", store=True, **common)
    with sdk(alice).responses.connect() as conn:
        conn.response.create(input="Again.", previous_response_id=stored.id, **common)
        assert until_final(conn)[-1].response.previous_response_id == stored.id
        conn.response.create(input="Again.", previous_response_id=done.id, **common)  # another connection's
        refused = recv(conn)
        assert refused.type == "error" and refused.error.code == "response_not_found"


def test_lanes_run_beside_each_other_and_one_lane_in_order(alice, model_id):
    common = {"model": model_id, "temperature": 0, "max_output_tokens": 24}
    with sdk(alice).responses.connect() as conn:
        conn.response.create(input="Count to ten.", stream_id="a", **common)
        conn.response.create(input="Name some birds.", stream_id="b", **common)
        seen = []
        while sum(e.type in FINAL for e in seen) < 2:
            seen.append(recv(conn))
        lanes = {lane: [e for e in seen if e.stream_id == lane] for lane in ("a", "b")}
        assert len(lanes["a"]) + len(lanes["b"]) == len(seen)  # every event names its lane
        for events in lanes.values():
            assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
        # At once: each lane's response started before the other's ended.
        first_final = min(i for i, e in enumerate(seen) if e.type in FINAL)
        assert all(any(e.type == "response.created" for e in seen[:first_final] if e.stream_id == lane)
                   for lane in ("a", "b")), [(e.stream_id, e.type) for e in seen]

        conn.response.create(input="Count to ten.", **common)  # the default lane: first in, first out
        conn.response.create(input="Name some birds.", **common)
        seen = []
        while sum(e.type in FINAL for e in seen) < 2:
            seen.append(recv(conn))
        created = [i for i, e in enumerate(seen) if e.type == "response.created"]
        finals = [i for i, e in enumerate(seen) if e.type in FINAL]
        assert finals[0] < created[1], [e.type for e in seen]
        assert all(e.stream_id is None for e in seen)


def test_bad_input_is_an_error_event_and_the_socket_goes_on(alice, model_id):
    with sdk(alice).responses.connect() as conn:
        conn.response.create(model=model_id, input=[], stream_id="x")
        event = recv(conn)
        assert event.type == "error" and event.status == 400 and event.stream_id == "x"
        assert event.error.code == "invalid_request" and event.error.param == "input" and event.error.message
        conn.send_raw('{"type": "response.create", "model": "nope:1", "input": "hi"}')
        event = recv(conn)
        assert event.type == "error" and event.error.code == "model_not_found" and event.status == 404
        conn.response.create(model=model_id, input="Hi.", max_output_tokens=4)
        assert until_final(conn)[-1].type in ("response.completed", "response.incomplete")


def test_a_revoked_token_ends_the_socket(stack, api, worker, model_id):
    secret = stack.token("wanda")
    client = Client(api, secret)
    token_id = next(line.split()[0] for line in stack.lmsp("tokens", "list").stdout.splitlines()
                    if " wanda " in line)
    with sdk(client).responses.connect() as conn:
        conn.response.create(model=model_id, input="Hi.", max_output_tokens=4)
        assert until_final(conn)[-1].type in ("response.completed", "response.incomplete")
        stack.lmsp("tokens", "revoke", token_id)
        revoked = time.monotonic()
        event = recv(conn, 30)
        assert event.type == "error" and event.error.code == "unauthorized"
        with pytest.raises(ConnectionClosed) as closed:
            recv(conn, 30)
        assert closed.value.rcvd.code == 1008
        assert time.monotonic() - revoked < 15  # the recheck interval (5 s) and some
    with pytest.raises(InvalidStatus) as refused:
        sdk(client).responses.connect().enter()
    assert refused.value.response.status_code == 401


def test_closing_the_socket_stops_its_generation(alice, model_id):
    with sdk(alice).responses.connect() as conn:
        conn.response.create(model=model_id, input="Write a long story about the sea.", max_output_tokens=400,
                             temperature=0, store=True)
        created = recv(conn)
        assert created.type == "response.created"
        while recv(conn).type != "response.output_text.delta":
            pass
    rid = created.response.id
    closed = time.monotonic()
    wait_for(lambda: alice.get(f"/lmsp/v1/responses/{rid}").json()["status"] == "cancelled", 10,
             "the closed socket's response to be cancelled")
    stopped = alice.get(f"/lmsp/v1/responses/{rid}").json()
    assert time.monotonic() - closed < 10 and stopped["status"] == "cancelled"


def test_connection_limits(stack, worker, model_id):
    """The settings that bound a connection, on an api of their own: its lifetime, the connections of a
    principal, the lanes of a connection."""
    api = stack.start_api(threads=16, LMSP_WS_MAX_CONNECTION_SECONDS="4", LMSP_WS_MAX_CONNECTIONS_PER_PRINCIPAL="1",
                          LMSP_WS_MAX_LANES="1", LMSP_STREAM_AUTH_RECHECK_SECONDS="1")
    proc = stack.procs[-1]
    client = sdk(Client(api, stack.token("lena")))
    with client.responses.connect() as conn:
        opened = time.monotonic()
        with pytest.raises(InvalidStatus) as refused:
            client.responses.connect().enter()
        assert refused.value.response.status_code == 429
        conn.response.create(model=model_id, input="Count to ten.", max_output_tokens=16, stream_id="a")
        conn.response.create(model=model_id, input="Hi.", max_output_tokens=4, stream_id="b")
        seen = [recv(conn)]
        while seen[-1].type != "error":
            seen.append(recv(conn))
        assert seen[-1].stream_id == "b" and seen[-1].error.code == "rate_limited" and seen[-1].status == 429
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                recv(conn, 30)
        assert closed.value.rcvd.code == 1001 and 3.5 < time.monotonic() - opened < 15
    deadline = time.monotonic() + 15  # its slot is given back once its lanes have let go
    while True:
        try:
            conn = client.responses.connect().enter()
            break
        except InvalidStatus as exc:
            assert exc.response.status_code == 429 and time.monotonic() < deadline
            time.sleep(0.2)
    try:
        conn.response.create(model=model_id, input="Hi.", max_output_tokens=4)
        assert until_final(conn)[-1].type in ("response.completed", "response.incomplete")
        os.killpg(proc.pid, signal.SIGTERM)  # a restart: the idle connection is told to reconnect elsewhere
        with pytest.raises(ConnectionClosed) as closed:
            recv(conn, 30)
        assert closed.value.rcvd.code == 1012
    finally:
        conn.close()
        stack.stop(proc)


def test_a_ping_flood_is_closed_with_1008(stack, api):
    """simple_websocket answers every ping on the connection's thread: a client pinging without pause
    cost a core and slowed every other request. Past PING_FLOOD pings in a second it is closed, as a task
    follower is (api/live/websocket.py)."""
    from websockets.sync.client import connect

    from api.live.websocket import PING_FLOOD

    url = api.replace("http", "ws", 1) + "/lmsp/v1/responses"
    with connect(url, additional_headers={"Authorization": f"Bearer {stack.token('pinger')}"}) as conn:
        conn.ping(b"first").wait(10)  # answered: a client that pings now and then is served
        with pytest.raises(ConnectionClosed) as closed:
            for i in range(PING_FLOOD + 5):  # in well under a second (and all read: no reset loses the close)
                conn.ping(b"%d" % i)
            recv(conn, 30)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
