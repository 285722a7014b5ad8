"""Followers per api process, without an engine: ``python -m tests.bench.followers [N] [--ws]``.

One api process (gunicorn as ``lmsp serve`` starts it) on the local Postgres and Redis; N SSE (or
WebSocket) followers of one running task, all held by this one client thread (a selector, so the
client costs no thread per follower either); a writer appends an event to the task's log and publishes
it every ``--every`` seconds, as a worker would. It prints, for the api worker process:

* how many followers it held (all N, or how many it refused or dropped);
* its RSS per follower (RSS with N followers minus RSS before, over N);
* lag p50/p99 from the writer's commit to the follower's socket, once all are connected;
* api CPU per follower per event (its CPU time over the live phase ÷ followers × events);
* the connect storm: time from N connects at once to each follower's first event (the replay), and the
  api's CPU over it per connect.

The figures are this machine's (2 shared cores: the client and the writer run beside the api).
"""

import argparse
import base64
import json
import os
import re
import selectors
import socket
import sys
import time
import uuid
from pathlib import Path

from common import eventlog, events
from common.bus import Publisher
from common.db import make_engine, session_factory, upgrade
from tests import factories
from tests.bench.util import _TIMESPEC, _TIMESPEC_SPACE, SO_TIMESTAMPNS, children, cpu_seconds
from tests.harness import REDIS_URL, Stack, create_database, drop_database, model_entry

SEQ = re.compile(rb"id: (\d+)\n|\"id\":(\d+),\"event\"")


def percentile(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p / 100))] if values else None


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class Followers:
    """N raw connections on one selector: each sends its GET and records when each event id arrives."""

    def __init__(self, port: int, path: str, token: str, n: int, ws: bool, ramp: int = 0):
        self.sel = selectors.DefaultSelector()
        self.first: dict[int, float] = {}
        self.arrived: dict[int, dict[int, float]] = {i: {} for i in range(n)}
        self.order: dict[int, list[int]] = {i: [] for i in range(n)}  # every id as it came, repeats too
        self.closed: set[int] = set()
        self.status: dict[int, bytes] = {}
        self.started = time.time()
        key = base64.b64encode(os.urandom(16)).decode()
        upgrade = (f"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
                   f"Sec-WebSocket-Key: {key}\r\n") if ws else ""
        self.request = (f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
                        f"Accept: text/event-stream\r\n{upgrade}\r\n").encode()
        self.port, self.n, self.opened, self.ramp = port, n, 0, ramp or n  # ramp: connects per 50 ms
        self._open()

    def _open(self) -> None:
        for i in range(self.opened, min(self.n, self.opened + self.ramp)):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)  # the kernel's arrival time: no client delay
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", self.port))
            self.sel.register(s, selectors.EVENT_WRITE, [i, b"", False])
            self.opened += 1

    def pump(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and len(self.closed) < len(self.arrived):
            if self.opened < self.n:
                self._open()
            for key, mask in self.sel.select(0.05):
                s, state = key.fileobj, key.data
                i = state[0]
                if mask & selectors.EVENT_WRITE:
                    try:
                        s.send(self.request)
                    except OSError:
                        self._close(s, i)
                        continue
                    self.sel.modify(s, selectors.EVENT_READ, state)
                    continue
                now = None
                try:
                    chunk, ancillary, _flags, _addr = s.recvmsg(1 << 16, _TIMESPEC_SPACE)
                    for level, kind, value in ancillary:
                        if (level, kind) == (socket.SOL_SOCKET, SO_TIMESTAMPNS):
                            sec, nsec = _TIMESPEC.unpack(value[:_TIMESPEC.size])
                            now = sec + nsec / 1e9
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    chunk = b""
                if not chunk:
                    self._close(s, i)
                    continue
                now = now or time.time()
                if i not in self.status:
                    self.status[i] = chunk[9:12]  # "HTTP/1.1 200" or 101
                seen = self.arrived[i]
                for a, b in SEQ.findall(chunk):
                    self.first.setdefault(i, now)
                    seen.setdefault(int(a or b), now)
                    self.order[i].append(int(a or b))

    def _close(self, s, i) -> None:
        self.sel.unregister(s)
        s.close()
        self.closed.add(i)

    def close(self) -> None:
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("n", type=int, nargs="?", default=1000)
    ap.add_argument("--ws", action="store_true", help="WebSocket followers instead of SSE")
    ap.add_argument("--events", type=int, default=50)
    ap.add_argument("--every", type=float, default=0.1, help="seconds between events")
    ap.add_argument("--threads", type=int, default=256, help="gunicorn threads (lmsp serve: 256; a thread per follower: N + 64)")
    ap.add_argument("--storm", type=int, default=1000, help="followers of the connect-storm figure")
    args = ap.parse_args()
    url = create_database("lmsp_bench")
    upgrade(url)
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"lmsp-followers-{uuid.uuid4().hex[:6]}"
    tmp.mkdir()
    stack = Stack(tmp, url, models=[model_entry("bench:followers")])
    try:
        run(stack, url, args)
    finally:
        stack.close()
        drop_database(url)


def run(stack: Stack, url: str, args) -> None:
    n = args.n
    token = stack.token("bench")
    threads = args.threads
    base = stack.start_api(workers=1, threads=threads, LMSP_MAX_STREAMS_PER_PRINCIPAL=str(n + 10),
                           LMSP_MAX_FOLLOWERS_PER_PROCESS=str(n + 10),
                           LMSP_MAX_FOLLOWERS_PER_PRINCIPAL=str(n + 10),
                           LMSP_RATE_LIMIT_PER_SECOND="100000", LMSP_RATE_LIMIT_BURST="100000")
    port = int(base.rsplit(":", 1)[1])
    worker = children(stack.procs[-1].pid)[0]
    sessions = session_factory(make_engine(url))
    publisher = Publisher(REDIS_URL)
    with sessions() as session:
        task = factories.task(session, "running", owner="bench", model="bench:followers")
        rid, tid = task.response_id, task.id
        numbering = events.Sequence()
        eventlog.append(session, rid, numbering.number([events.ResponseCreated(response_id=rid)]))
        session.commit()
    path = f"/lmsp/v1/tasks/{tid}/{'ws' if args.ws else 'events'}"
    time.sleep(1.0)
    rss0 = rss_bytes(worker)

    # The connect storm: `storm` followers at once, each until its first event (the replayed #1).
    storm_cpu0 = cpu_seconds(worker)
    storm = Followers(port, path, token, min(args.storm, n), args.ws)
    storm.pump(10)
    firsts = [t - storm.started for t in storm.first.values()]
    storm_cpu = cpu_seconds(worker) - storm_cpu0  # the connects, their first pages, the idle rest of 10 s
    storm.close()
    time.sleep(1.0)

    followers = Followers(port, path, token, n, args.ws, ramp=20)  # ~400 connects/s: what one api process accepts here, under its backlog
    deadline = time.monotonic() + 120
    while len(followers.first) + len(followers.closed) < n and time.monotonic() < deadline:
        followers.pump(0.5)
    connected = time.time() - followers.started
    followers.pump(1.0)
    rss1 = rss_bytes(worker)
    held = len(followers.first) - len(followers.closed & set(followers.first))
    cpu0, committed = cpu_seconds(worker), {}
    item = {"id": "msg_1", "type": "message", "role": "assistant", "content": []}
    added = numbering.number([events.OutputItemAdded(response_id=rid, output_index=0, item=item)])
    with sessions() as session:
        eventlog.append(session, rid, added)
        session.commit()
    publisher.publish(rid, added)
    live_from = time.monotonic()
    for k in range(args.events):
        delta = numbering.number([events.TextDelta(response_id=rid, output_index=0, item_id="msg_1",
                                                   delta=f"word {k} ")])
        with sessions() as session:
            eventlog.append(session, rid, delta)
            session.commit()
        committed[delta[0][0]] = time.time()  # the lag is from the commit (the log's) to the client's socket
        publisher.publish(rid, delta)
        followers.pump(args.every)
    live_seconds = time.monotonic() - live_from
    followers.pump(1.0)
    cpu1 = cpu_seconds(worker)
    rss2 = rss_bytes(worker)
    lags = [arr[s] - t for arr in followers.arrived.values() for s, t in committed.items() if s in arr]
    delivered = sum(1 for arr in followers.arrived.values() for s in committed if s in arr)
    complete = sum(1 for arr in followers.arrived.values() if all(s in arr for s in committed))
    # The final event: every follower's stream must end.
    final = numbering.number([events.final(rid, "completed", usage={"input_tokens": 1, "output_tokens": 1,
                                                                     "total_tokens": 2})])
    with sessions() as session:
        eventlog.append(session, rid, final)
        session.commit()
    publisher.publish(rid, final)
    followers.pump(15)
    ended = len(followers.closed)
    followers.close()
    out = {
        "followers": n, "transport": "ws" if args.ws else "sse", "gunicorn_threads": threads,
        "held": held, "refused": sum(1 for v in followers.status.values() if v not in (b"200", b"101")), "connected_after_s": round(connected, 2),
        "rss_before_mib": round(rss0 / 2**20, 1), "rss_held_mib": round(rss1 / 2**20, 1),
        "rss_live_mib": round(rss2 / 2**20, 1),
        "rss_per_follower_kib": round((max(rss1, rss2) - rss0) / max(1, n) / 1024, 1),
        "events": len(committed), "event_interval_s": args.every, "complete": complete,
        "lag_p50_ms": round(1000 * (percentile(lags, 50) or 0), 1),
        "lag_p99_ms": round(1000 * (percentile(lags, 99) or 0), 1),
        "api_cpu_s_live": round(cpu1 - cpu0, 2), "live_s": round(live_seconds, 1),
        "api_cpu_us_per_follower_event": round(1e6 * (cpu1 - cpu0) / max(1, delivered), 2),
        "storm": len(firsts), "storm_first_event_p50_s": round(percentile(firsts, 50) or 0, 3),
        "storm_first_event_max_s": round(max(firsts) if firsts else 0, 3),
        "storm_without_first_event": min(args.storm, n) - len(firsts),
        "storm_api_cpu_ms_per_connect": round(1000 * storm_cpu / max(1, len(firsts)), 2),
        "ended_after_final": ended,
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    sys.exit(main())
