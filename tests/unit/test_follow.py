"""Following a response's events (api/live/follower.py, hub.py) on a SQLite log without Redis: replay, then live, each seq
once and in order, closed after the final event; and the same through GET /tasks/{id}/events."""

import threading
import time

from api.live import Hub, follow
from api.live.reads import LogReader
from common import eventlog, events
from tests.harness import parse_sse

ITEM = {"id": "msg_1", "type": "message", "role": "assistant", "content": []}
DONE = {**ITEM, "content": [{"type": "output_text", "text": "Hi!"}]}
USAGE = {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5}


def _script(rid: str) -> list[events.EventData]:
    return [events.ResponseCreated(response_id=rid), events.OutputItemAdded(response_id=rid, output_index=0, item=ITEM),
            events.TextDelta(response_id=rid, output_index=0, item_id="msg_1", delta="Hi"),
            events.TextDelta(response_id=rid, output_index=0, item_id="msg_1", delta="!"),
            events.OutputItemDone(response_id=rid, output_index=0, item=DONE), events.final(rid, "completed", usage=USAGE)]


def _running():
    return None  # the response has not ended by any other means than its log


def _hub(unit) -> Hub:
    hub = Hub(unit.settings, unit.app.extensions["lmsp"].reads)
    assert not hub.connected  # no Redis in the unit layer: the follower polls the log
    return hub


class Follower(threading.Thread):
    """follow() in a thread, as a request thread runs it; records what it yields and when it ends."""

    def __init__(self, hub, rid, after=0, heartbeat=0.1):
        super().__init__(daemon=True)
        self.args = (hub, rid, after)
        self.heartbeat = heartbeat
        self.batches: list = []
        self.done = threading.Event()

    def run(self):
        for batch in follow(*self.args, logged=True, heartbeat=self.heartbeat, ended=_running):
            self.batches.append(batch)
        self.done.set()

    @property
    def seqs(self) -> list[int]:
        return [seq for batch in self.batches if batch for seq, _, _ in batch]

    def wait_for(self, n: int, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while len(self.seqs) < n:
            assert time.monotonic() < deadline, f"saw {self.seqs}, waited for {n}"
            time.sleep(0.01)


def test_replay_of_a_finished_log_ends_with_the_final_event(unit, alice):
    task = alice.task("succeeded")
    alice.log(task, _script(task.response_id))
    batches = list(follow(_hub(unit), task.response_id, 0, logged=True, heartbeat=1, ended=_running))
    got = [event for batch in batches for event in batch]
    assert [seq for seq, _, _ in got] == [1, 2, 3, 4, 5, 6]
    assert [name for _, name, _ in got] == [event.name for event in _script(task.response_id)]
    assert got[-1][1] == events.COMPLETED


def test_replay_after_a_seq(unit, alice):
    task = alice.task("succeeded")
    alice.log(task, _script(task.response_id))
    got = [seq for batch in follow(_hub(unit), task.response_id, 4, logged=True, heartbeat=1, ended=_running) for seq, _, _ in batch]
    assert got == [5, 6]


def test_nothing_after_the_final_event(unit, alice):
    task = alice.task("succeeded")
    script = _script(task.response_id)
    alice.log(task, [script[0], script[-1], script[1]])  # a stray event after the final one
    got = [name for batch in follow(_hub(unit), task.response_id, 0, logged=True, heartbeat=1, ended=_running) for _, name, _ in batch]
    assert got == [events.CREATED, events.COMPLETED]


def test_a_stream_that_ends_before_its_first_event_still_starts_with_created(unit, alice):
    # Chaos seed 4099: a worker took a direct response and was killed before its first event; the
    # stream's only event was response.failed.
    task = alice.task("running")
    failed = events.final(task.response_id, "failed", error={"code": "server_restarted"})
    batches = follow(_hub(unit), task.response_id, 0, logged=True, heartbeat=1,
                     ended=lambda: [failed])
    got = [(seq, name) for batch in batches for seq, name, _ in batch]
    assert got == [(1, events.CREATED), (2, events.FAILED)]


def test_live_events_follow_the_replay_each_once(unit, alice):
    task = alice.task("running")
    script = _script(task.response_id)
    alice.log(task, script[:2])
    follower = Follower(_hub(unit), task.response_id)
    follower.start()
    follower.wait_for(2)
    for seq in range(3, 6):  # one commit per event, as a slow writer would
        alice.log(task, [script[seq - 1]], first=seq)
        time.sleep(0.02)
    follower.wait_for(5)
    assert not follower.done.is_set()  # no final event yet: the stream stays open ...
    time.sleep(0.3)
    assert None in follower.batches    # ... with heartbeats while idle
    alice.log(task, [script[5]], first=6)
    assert follower.done.wait(10)
    assert follower.seqs == [1, 2, 3, 4, 5, 6]
    assert follower.batches[-1][-1][1] == events.COMPLETED


def test_sse_endpoint_replays_then_follows_then_closes(unit, alice):
    task = alice.task("running")
    script = _script(task.response_id)
    alice.log(task, script[:3])
    result: dict = {}

    def read():
        client = unit.app.test_client()
        resp = client.get(f"/lmsp/v1/tasks/{task.id}/events", headers={"Authorization": f"Bearer {alice.secret}"})
        result["status"], result["mimetype"] = resp.status_code, resp.mimetype
        result["text"] = resp.get_data(as_text=True)  # returns only once the server closes the stream

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    time.sleep(0.3)
    alice.log(task, script[3:], first=4)
    reader.join(10)
    assert not reader.is_alive(), "the stream did not close after the final event"
    assert result["status"] == 200 and result["mimetype"] == "text/event-stream"
    received = parse_sse(result["text"].split("\n"))
    assert [seq for seq, _, _ in received] == [1, 2, 3, 4, 5, 6]
    assert received[-1][1] == events.COMPLETED and received[-1][2]["usage"] == USAGE
    # Resuming: `after` wins over Last-Event-ID.
    resp = alice.get(f"/lmsp/v1/tasks/{task.id}/events?after=4", headers={"Last-Event-ID": "1"})
    assert [seq for seq, _, _ in parse_sse(resp.get_data(as_text=True).split("\n"))] == [5, 6]
    resp = alice.get(f"/lmsp/v1/tasks/{task.id}/events", headers={"Last-Event-ID": "5"})
    assert [seq for seq, _, _ in parse_sse(resp.get_data(as_text=True).split("\n"))] == [6]


def test_event_streams_are_exactly_text_event_stream(unit, alice):
    """6.3: `Content-Type: text/event-stream`, with no parameter a strict client would trip on."""
    from tests.unit.conftest import MODEL, request_body
    from tests.unit.fake import FakeWorker

    task = alice.task("succeeded")
    alice.log(task, _script(task.response_id))
    assert alice.get(f"/lmsp/v1/tasks/{task.id}/events").headers["Content-Type"] == "text/event-stream"
    with FakeWorker(unit.sessions, MODEL):
        direct = alice.post("/lmsp/v1/responses", request_body(MODEL, stream=True))
        assert direct.headers["Content-Type"] == "text/event-stream"
        direct.get_data()


def test_a_replay_longer_than_a_page_comes_whole_and_in_order(unit, alice, monkeypatch):
    monkeypatch.setattr("api.live.reads.PAGE", 2)  # 6 events and a stray: four reads
    task = alice.task("succeeded")
    script = _script(task.response_id)
    alice.log(task, [*script, events.TextDelta(response_id=task.response_id, output_index=0, item_id="msg_1",
                                               delta="late")])
    batches = list(follow(_hub(unit), task.response_id, 0, logged=True, heartbeat=1, ended=_running))
    assert [len(batch) for batch in batches] == [2, 2, 2]
    assert [seq for batch in batches for seq, _, _ in batch] == [1, 2, 3, 4, 5, 6]  # nothing after the final


def _paged(unit, alice, monkeypatch, n: int):
    """A finished log of ``n`` events read in pages of 2, and a hub whose page reads (``read``, asked on
    the fan-out thread) and pages given to a follower's sink (``sent``) are recorded in order."""
    from api.live.sinks import QueueSink
    monkeypatch.setattr("api.live.reads.PAGE", 2)
    task = alice.task("succeeded")
    rid = task.response_id
    deltas = [events.TextDelta(response_id=rid, output_index=0, item_id="msg_1", delta=str(i)) for i in range(n - 2)]
    alice.log(task, [events.ResponseCreated(response_id=rid), *deltas, events.final(rid, "completed", usage=USAGE)])
    hub, order = _hub(unit), []
    read, sent = hub.read, QueueSink.events

    def reading(follower, after, *args):
        order.append(("read", after))
        read(follower, after, *args)

    def sending(sink, batch):
        order.append(("sent", batch.events[-1][0]))
        sent(sink, batch)
    hub.read = reading
    monkeypatch.setattr(QueueSink, "events", sending)
    return hub, rid, order


def test_a_replay_reads_its_next_page_while_it_sends_one(unit, alice, monkeypatch):
    """Issue 38 (B5): for a reader that keeps up, the page after a full one is asked for before that one
    goes to the sink, so the database's time overlaps the framing and sending."""
    hub, rid, order = _paged(unit, alice, monkeypatch, 6)
    seqs = [seq for batch in follow(hub, rid, 0, logged=True, heartbeat=1, ended=_running) for seq, _, _ in batch]
    assert seqs == [1, 2, 3, 4, 5, 6]
    assert order == [("read", 0), ("read", 2), ("sent", 2), ("read", 4), ("sent", 4), ("sent", 6)]


def test_a_replay_reads_at_most_one_page_ahead_of_a_reader_that_stops(unit, alice, monkeypatch):
    """A reader that stops taking pages makes the replay stop reading too: one page waits in the sink,
    at most one more is held, however long the log; and when it reads on it gets every event once."""
    hub, rid, order = _paged(unit, alice, monkeypatch, 40)
    stream = follow(hub, rid, 0, logged=True, heartbeat=1, ended=_running)
    first = next(stream)
    time.sleep(0.5)  # time for any number of reads
    reads_, pages = sum(1 for what, _ in order if what == "read"), sum(1 for what, _ in order if what == "sent")
    assert pages == 2 and reads_ == 3  # the page taken, the page waiting, the page held ahead
    seqs = [seq for batch in [first, *stream] for seq, _, _ in batch]
    assert seqs == list(range(1, 41))


def test_sse_frames_are_the_spec_form_byte_for_byte(unit, alice):
    """6.3: each event is ``id``, ``event`` and ``data`` lines and a blank line, the data as logged after
    its ``type`` and ``sequence_number`` (what the OpenAI SDK reads)."""
    task = alice.task("succeeded")
    script = _script(task.response_id)
    alice.log(task, script)
    expected = "".join(f'id: {seq}\nevent: {name}\ndata: {{"type":"{name}","sequence_number":{seq},'
                       f'{events.encode(event)[1:]}\n\n' for seq, (name, event) in
                       enumerate(((event.name, event) for event in script), 1))
    assert events.sse_many([(1, events.CREATED, "{}")]) == events.sse(1, events.CREATED, "{}")
    resp = alice.get(f"/lmsp/v1/tasks/{task.id}/events")
    assert resp.status_code == 200 and resp.get_data(as_text=True) == expected


def test_a_purge_during_a_replay_ends_with_an_error_event(unit, alice, monkeypatch):
    """Issue 21: retention purging the log between two pages of a replay ends the stream with the
    410 problem as an ``error`` event, never silently."""
    from sqlalchemy import update

    from common.tables import Task
    monkeypatch.setattr("api.live.reads.PAGE", 2)
    task = alice.task("succeeded")
    alice.log(task, _script(task.response_id))
    read, calls = LogReader.page, []

    def purge_after_the_first_page(hub, response_id, after):
        calls.append(after)
        if len(calls) == 2:  # what worker/retention.enforce_retention does
            with unit.sessions() as session:
                eventlog.purge(session, [response_id])
                session.execute(update(Task).where(Task.id == task.id).values(events_expired=True))
                session.commit()
        return read(hub, response_id, after)

    monkeypatch.setattr(LogReader, "page", purge_after_the_first_page)
    received = parse_sse(alice.get(f"/lmsp/v1/tasks/{task.id}/events").get_data(as_text=True).split("\n"))
    assert [seq for seq, _, _ in received] == [1, 2, 2]
    assert received[-1][1] == events.ERROR and received[-1][2]["error"]["code"] == "event_history_expired"


def test_a_follower_that_is_not_read_falls_back_to_the_log_and_holds_its_bound(unit, alice):
    """Issue 33: a follower whose reader is slower than the response takes no live batch past its
    bound (memory stays bounded) and is not cut for it: it reads the log at its reader's pace, and
    gets every event once, in order, to the final one."""
    hub = Hub(unit.settings.model_copy(update={"follower_buffer_bytes": 4096}), unit.app.extensions["lmsp"].reads)
    task = alice.task("running")
    script = _script(task.response_id)
    alice.log(task, script[:1])
    stream = follow(hub, task.response_id, 0, logged=True, heartbeat=5, ended=_running)
    assert [seq for seq, _, _ in next(stream)] == [1]
    big = events.TextDelta(response_id=task.response_id, output_index=0, item_id="msg_1", delta="x" * 1000)
    for seq in range(2, 40):  # ~40 KB: ten times the bound, read by nobody
        alice.log(task, [big], first=seq)
        time.sleep(0.01)
    time.sleep(0.5)  # the polls deliver what is left
    (follower,) = hub.topic(task.response_id).followers
    assert follower.sink.queued < 20_000  # the bound and the batch that passed it, not the 40 KB written
    assert follower.state != "ended"
    alice.log(task, [script[-1]], first=40)
    seqs = [seq for batch in stream if batch for seq, _, _ in batch]
    assert [1, *seqs] == list(range(1, 41))


class _Listener:
    """A Redis subscription that is up: the test calls the hub's confirm and delivery, as it would."""
    connected = True

    def subscribe(self, rid):
        pass

    def unsubscribe(self, rid):
        pass


def _attach(hub, rid: str, after: int):
    """A task follower handed over on a socket pair, attached on its own thread as a request's; the
    client's end, read to EOF by ``_ids``."""
    import socket
    server, peer = socket.socketpair()
    peer.settimeout(10)
    attaching = threading.Thread(target=hub.attach, args=(server,), kwargs=dict(
        ws=False, chunked=False, path="/t", response_id=rid, after=after, ended=_running, authorized=None,
        on_close=lambda: None), daemon=True)
    attaching.start()
    return peer, attaching


def _ids(peer) -> list[int]:
    got = b""
    while chunk := peer.recv(65536):
        got += chunk
    peer.close()
    return [int(line[4:]) for line in got.split(b"\n") if line.startswith(b"id: ")]


def _counted(unit, alice, delay: float = 0.0):
    """A hub whose Redis subscription is up (``_Listener``), a running task whose log holds its first 3
    events, and the points its log reads were asked from (each taking ``delay`` seconds)."""
    hub = _hub(unit)
    hub.listener = _Listener()
    task = alice.task("running")
    script = _script(task.response_id)
    alice.log(task, script[:3])
    asked, ask = [], hub.reads.ask

    def counted(rid, after, *rest):
        asked.append(after)
        time.sleep(delay)
        return ask(rid, after, *rest)
    hub.reads.ask = counted
    return hub, task, script, asked


def test_followers_attaching_within_a_live_topics_recent_events_are_served_without_a_read(unit, alice):
    """Issue 38 (F2, B4): the first follower of a task reads its log once its subscription is live; the
    topic keeps that page and what it hears after it, so later followers that resume within it (from 0,
    from the middle, at the head) read nothing, and each still gets every event once, in order, to the
    final one."""
    hub, task, script, asked = _counted(unit, alice)
    rid = task.response_id
    first, attaching = _attach(hub, rid, 0)
    time.sleep(0.2)
    hub.call(hub._confirmed, rid)  # Redis confirms the subscription
    attaching.join(5)
    assert asked == [0]
    numbered = events.Sequence(3).number(script[3:5])
    alice.log(task, script[3:5], first=4)
    hub.call(hub._deliver, rid, list(numbered))  # published after its commit
    time.sleep(0.2)
    later = [_attach(hub, rid, after) for after in (0, 2, 5)]
    for _, thread in later:
        thread.join(5)
    assert asked == [0]  # none of them read the log
    alice.log(task, script[5:], first=6)
    hub.call(hub._deliver, rid, list(events.Sequence(5).number(script[5:])))
    assert _ids(first) == [1, 2, 3, 4, 5, 6]
    assert [_ids(peer) for peer, _ in later] == [[1, 2, 3, 4, 5, 6], [3, 4, 5, 6], [6]]


def test_a_storm_of_followers_on_one_task_reads_its_log_once(unit, alice):
    """Issue 38 (F2, B4): followers that connect together, before the task's subscription is even
    confirmed, make one log read between them: the first to plan reads, the others wait for its page."""
    hub, task, script, asked = _counted(unit, alice, delay=0.3)  # the others come while the read runs
    rid = task.response_id
    storm = [_attach(hub, rid, 0) for _ in range(8)]
    time.sleep(0.2)
    hub.call(hub._confirmed, rid)
    for _, thread in storm:
        thread.join(5)
    assert asked == [0]
    alice.log(task, script[3:], first=4)
    hub.call(hub._deliver, rid, list(events.Sequence(3).number(script[3:])))
    assert [_ids(peer) for peer, _ in storm] == [[1, 2, 3, 4, 5, 6]] * 8


def test_a_followers_socket_has_no_kernel_timeout_and_a_websockets_pong_waits_behind_little():
    """Found behind a throttled link: the kernel reset clients that were reading slowly (Linux counts a
    zero window's probes against TCP_USER_TIMEOUT even while the window opens a little at a time: at
    30 s, then, with the timeout raised, at 90 s), discarding what it held; and a WebSocket client's ping
    timed out behind the ~500 KB the kernel had queued ahead of its pong. On a real TCP connection whose
    client reads nothing: no kernel timeout is set (the sink tells a vanished client, below), and a
    WebSocket follower's socket takes ~64 KiB, an SSE one its buffer."""
    import array
    import fcntl
    import socket

    from api.live.hub import WS_NOTSENT_BYTES, tune
    from common.settings import Settings

    settings = Settings()

    def taken(ws: bool) -> tuple[int, int]:
        with socket.create_server(("127.0.0.1", 0)) as listening, socket.socket() as client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
            client.connect(listening.getsockname())
            sock, _ = listening.accept()
            with sock:
                tune(sock, settings, ws)
                sock.setblocking(False)
                try:
                    while True:
                        sock.send(b"x" * 4096)
                except BlockingIOError:
                    pass
                unsent = array.array("i", [0])
                fcntl.ioctl(sock.fileno(), 0x894B, unsent)  # SIOCOUTQNSD: bytes not yet sent
                return unsent[0], sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)

    ws_unsent, ws_timeout = taken(ws=True)
    sse_unsent, sse_timeout = taken(ws=False)
    assert ws_timeout == sse_timeout == 0  # the kernel's default: no timeout of its own
    assert ws_unsent <= WS_NOTSENT_BYTES + 16384 < settings.follower_buffer_bytes < sse_unsent


def test_a_follower_nothing_waits_for_is_gone_once_its_client_acknowledges_nothing_for_the_stall():
    """What TCP_USER_TIMEOUT was for, without cutting slow readers: bytes the kernel took and the client
    never acknowledges (it vanished, or reads nothing) end the follower after ``follower_stall_seconds``;
    a client that takes a little in each such period is kept."""
    import socket

    from api.live.hub import tune
    from api.live.sinks import SocketSink
    from common.settings import Settings
    from tests.unit.test_live_sinks import Follower, Loop

    settings = Settings(follower_stall_seconds=60)
    for reads in (False, True):
        with socket.create_server(("127.0.0.1", 0)) as listening, socket.socket() as client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.connect(listening.getsockname())
            sock, _ = listening.accept()
            tune(sock, settings, False)
            sock.setblocking(False)
            sink = SocketSink(Loop(), settings, sock, False, "/x", lambda: None, False)
            sink.follower = Follower()
            sink.send(b"x" * 100_000)
            assert not sink.out  # all of it in the kernel: nothing waits here, the stall check cannot see
            start = sink.acked_at
            for period in range(1, 4):
                if reads:  # what its buffer holds (8 KiB), once a period: the window opens, the kernel sends
                    client.recv(65536)  # more, and the client's kernel acknowledges it
                    time.sleep(0.3)
                sink.tick(start + period * 61)
                if sink.follower.ended:
                    break
            # Not reading: the first look (at 61 s) sees what the kernel acknowledged on arrival, the next
            # one nothing more.
            assert (sink.follower.ended, period) == (([], 3) if reads else (["gone"], 2)), reads
            sink.close()
