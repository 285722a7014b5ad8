"""A fleet of simulated GPUs on this machine, and clients that follow it from outside over HTTP.

Shared by ``make fleet`` (tests/bench/fleet.py) and its functional test at modest scale
(tests/functional/test_fleet.py): N workers of a model whose engine is ``sim`` (worker/sim.py),
K api processes, and asyncio clients (one event loop, thousands of connections) that follow task
events over SSE and WebSocket, resume with ``after`` when a connection drops, and are checked
against the log in Postgres afterwards: every event once, in order, exactly one final event.
Only HTTP and the log are looked at, so it measures whatever follower design the api has.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psycopg

from common.events import ERROR, FINAL
from tests.bench.util import descendants
from tests.harness import Stack, api_argv, free_port, model_entry


# Postgres connections of one process: dozens of processes share a max_connections that, on a shared
# test machine, other people's databases use too. All of them pooled, none overflow: an overflow
# connection is closed when it is returned, so a busy process would connect again (a backend forked,
# TLS and auth on a real network) for every transaction past its pool.
def pool_env(connections: int) -> dict[str, str]:
    return {"LMSP_DB_POOL_SIZE": str(max(1, connections)), "LMSP_DB_MAX_OVERFLOW": "0"}


# A GPU as the issue describes one: 64 streams a batch at 40 tokens/s each, handed to the worker every
# 200 ms (the task delta window, so the worker's cost per event is not the simulation's wake-ups).
SIM_ENGINE = {"kind": "sim", "max_num_seqs": 64, "ttft_ms": 150, "tokens_per_s": 40, "tick_ms": 200}
FINAL_EVENTS = set(FINAL)
OPEN = {"followers": 0}  # follower connections open now (the loop thread's count)


# -- processes -------------------------------------------------------------------------------------
class Fleet:
    """One database, one sim model, its workers and api processes."""

    def __init__(self, tmp: Path, database_url: str, model_id: str, engine: dict | None = None,
                 env: dict | None = None, extra_models: list[dict] | None = None):
        self.model = model_id
        self.stack = Stack(tmp, database_url, redis=True, models=[
            model_entry(model_id, engine=engine or SIM_ENGINE, max_output_tokens=100_000,
                        context_window=200_000, queue_depth=10**7), *(extra_models or [])])
        self.stack.env.update(env or {})
        self.stack.env["LMSP_WORKER_METRICS_PORT"] = "0"  # dozens of workers: no port each
        self.worker_env: dict[str, str] = {}  # e.g. a smaller Postgres pool than the api's
        self.workers: dict[str, subprocess.Popen] = {}
        self.apis: list[tuple[str, subprocess.Popen]] = []

    def start_workers(self, ids: list[str], timeout: float = 300) -> float:
        """Start workers at once (their boots overlap); return when all are ready, the seconds it took."""
        t0 = time.monotonic()
        self.spawn_workers(ids)
        self.wait_workers(ids, timeout)
        return time.monotonic() - t0

    def spawn_workers(self, ids: list[str]) -> None:
        for wid in ids:
            self.workers[wid] = self.stack.spawn([sys.executable, "-m", "worker", "--model", self.model],
                                                 f"worker-{wid}.log", LMSP_WORKER_ID=wid, **self.worker_env)

    def wait_workers(self, ids: list[str], timeout: float = 300) -> None:
        pending = {wid: self.workers[wid] for wid in ids}
        deadline = time.monotonic() + timeout
        while pending:
            for wid, proc in list(pending.items()):
                text = (self.stack.tmp / f"worker-{wid}.log").read_text(errors="replace")
                if proc.poll() is not None:
                    raise RuntimeError(f"worker {wid} exited:\n{text[-3000:]}")
                if " ready." in text:
                    del pending[wid]
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers not ready after {timeout}s: {sorted(pending)}")
            time.sleep(0.3)

    def start_apis(self, count: int, threads: int, **env) -> list[str]:
        """``count`` api processes, each its own gunicorn with one worker, so a client can spread its
        connections exactly (one gunicorn with several workers hands them out by accept race)."""
        started = []
        for _ in range(count):
            port = free_port()
            proc = self.stack.spawn(api_argv(port, 1, threads), f"api-{port}.log",
                                    LMSP_API_THREADS=str(threads), **env)
            started.append((f"http://127.0.0.1:{port}", proc))
        for base, _ in started:
            wait_http(base + "/healthz", 120)
        self.apis += started
        return [base for base, _ in started]

    def kill_worker(self, wid: str) -> None:
        os.killpg(self.workers[wid].pid, signal.SIGKILL)
        self.workers[wid].wait(10)

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.workers.values() if p.poll() is None]

    def api_pids(self) -> list[int]:
        """The gunicorn workers (not their masters): where requests and followers are served."""
        return [pid for _, proc in self.apis for pid in descendants(proc.pid)]

    def close(self, timeout: float = 30, graceful: bool = True) -> None:
        """SIGTERM every process at once (dozens stopping one after another would take minutes);
        not ``graceful``: SIGKILL (a test's database whose tasks have all ended)."""
        procs = [p for p in self.stack.procs if p.poll() is None]
        for proc in procs:
            _signal(proc, signal.SIGTERM if graceful else signal.SIGKILL)
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(proc, signal.SIGKILL)
                proc.wait(10)


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def wait_http(url: str, timeout: float) -> None:
    import requests
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if requests.get(url, timeout=2).ok:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


def rss_kib(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


# -- clients -----------------------------------------------------------------------------------------
class Loop:
    """An asyncio loop on its own thread: the load generator's clients all live on it."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fleet-clients", daemon=True)
        self.thread.start()
        self.http: aiohttp.ClientSession = self.run(self._session())

    @staticmethod
    async def _session() -> aiohttp.ClientSession:
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=False),
                                     timeout=aiohttp.ClientTimeout(total=None, sock_connect=30))

    def run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def spawn(self, coro) -> asyncio.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        async def shut():
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:  # clients still running (a run cut short): close their connections
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)
            await self.http.close()
        self.run(shut())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def auth(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def task_body(model: str, text: str, max_tokens: int, on_restart: str = "resume") -> dict:
    return {"type": "response", "on_restart": on_restart,
            "input": {"model": model, "max_output_tokens": max_tokens,
                      "input": [{"type": "message", "role": "user", "content": text}]}}


async def post_task(http, base: str, token: str, body: dict) -> tuple[dict, float]:
    """POST /tasks; the task and the request's seconds. Retries 429/503 after Retry-After."""
    while True:
        t = time.perf_counter()
        async with http.post(base + "/lmsp/v1/tasks", json=body, headers=auth(token)) as r:
            doc = await r.json(content_type=None)
            took = time.perf_counter() - t
            if r.status == 202:
                return doc, took
            if r.status in (429, 503):
                await asyncio.sleep(float(r.headers.get("Retry-After", "1")))
                continue
            raise RuntimeError(f"POST /tasks -> {r.status}: {doc}")


@dataclass
class Followed:
    """What one follower received: (seq, name, receive time) in arrival order, and its connections."""
    task_id: str
    mode: str  # "sse" or "ws"
    events: list[tuple[int, str, float]] = field(default_factory=list)
    connects: int = 0
    refused: int = 0  # connections answered 429 (stream caps), then tried again
    errors: int = 0   # streams the server ended with an `error` event (its id is the resume point), resumed
    first_at: float | None = None  # receive time of its first event
    started_at: float = 0.0
    error: str | None = None

    @property
    def last(self) -> int:
        return self.events[-1][0] if self.events else 0

    @property
    def ended(self) -> bool:
        return bool(self.events) and self.events[-1][1] in FINAL_EVENTS


async def follow(http, base: str, token: str, task_id: str, mode: str, drop_after: float | None = None,
                 rec: Followed | None = None, deadline: float = 600) -> Followed:
    """Follow a task to its final event, resuming with ``after`` whenever a connection ends early
    (a restarting api, a cut slow follower, or ``drop_after`` seconds: a reconnect storm's client)."""
    rec = rec or Followed(task_id, mode)
    rec.started_at = time.time()
    end = time.monotonic() + deadline
    while not rec.ended and time.monotonic() < end:
        rec.connects += 1
        try:
            read = _sse if mode == "sse" else _ws
            await asyncio.wait_for(read(http, base, token, task_id, rec), drop_after)
        except TimeoutError:
            drop_after = None  # dropped once on purpose; the resumed connection runs to the end
        except (aiohttp.ClientError, ConnectionError, OSError) as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(0.2)
    if not rec.ended and rec.error is None:
        rec.error = "no final event before the deadline"
    return rec


def _record(rec: Followed, seq: int, name: str, t: float) -> None:
    if name == ERROR:  # not an event of the log: the stream ended, its id says where to resume
        rec.errors += 1
        return
    if rec.first_at is None:
        rec.first_at = t
    rec.events.append((seq, name, t))


async def _sse(http, base, token, task_id, rec: Followed) -> None:
    async with http.get(f"{base}/lmsp/v1/tasks/{task_id}/events", params={"after": str(rec.last)},
                        headers=auth(token)) as r:
        if r.status == 429:
            rec.refused += 1
            await asyncio.sleep(float(r.headers.get("Retry-After", "1")))
            return
        if r.status != 200:
            raise aiohttp.ClientResponseError(r.request_info, (), status=r.status, message=await r.text())
        OPEN["followers"] += 1
        try:
            await _read_sse(r, lambda seq, name, t: _record(rec, seq, name, t))
        finally:
            OPEN["followers"] -= 1


async def _read_sse(r, on_event) -> None:
    buf = b""
    async for chunk in r.content.iter_any():
        t = time.time()
        buf += chunk
        *blocks, buf = buf.split(b"\n\n")
        for block in blocks:
            seq = name = None
            for line in block.split(b"\n"):
                if line.startswith(b"id: "):
                    seq = int(line[4:])
                elif line.startswith(b"event: "):
                    name = line[7:].decode()
            if name is not None:
                on_event(seq, name, t)


async def _ws(http, base, token, task_id, rec: Followed) -> None:
    url = base.replace("http", "ws", 1) + f"/lmsp/v1/tasks/{task_id}/ws?after={rec.last}"
    try:
        ws = await http.ws_connect(url, headers=auth(token), autoping=True)
    except aiohttp.WSServerHandshakeError as exc:
        if exc.status == 429:
            rec.refused += 1
            await asyncio.sleep(1)
            return
        raise
    OPEN["followers"] += 1
    try:
        async with ws:
            async for msg in ws:
                if msg.type == aiohttp.WSMsgType.TEXT:
                    frame = json.loads(msg.data)
                    _record(rec, frame["id"], frame["event"], time.time())
                elif msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                    break
    finally:
        OPEN["followers"] -= 1


async def direct_stream(http, base: str, token: str, model: str, max_tokens: int) -> str | None:
    """A streaming POST /responses read to its end; the final event's name (None: no final event)."""
    body = {"model": model, "input": [{"type": "message", "role": "user", "content": "a direct question"}],
            "max_output_tokens": max_tokens, "stream": True}
    names: list[str] = []
    async with http.post(base + "/lmsp/v1/responses", json=body, headers=auth(token)) as r:
        if r.status != 200:
            return f"HTTP {r.status}"
        await _read_sse(r, lambda seq, name, t: names.append(name))
    return next((n for n in reversed(names) if n in FINAL_EVENTS), None)


async def long_poll(http, base: str, token: str, task_id: str, deadline: float = 600) -> str:
    """Wait for a task's end as the API asks a waiting client to: GET ?wait=30 with If-None-Match."""
    tag, status, end = None, "queued", time.monotonic() + deadline
    while status not in ("succeeded", "failed", "cancelled") and time.monotonic() < end:
        async with http.get(f"{base}/lmsp/v1/tasks/{task_id}", params={"wait": "30"},
                            headers={**auth(token), **({"If-None-Match": tag} if tag else {})}) as r:
            if r.status == 304:
                continue
            if r.status != 200:
                await asyncio.sleep(1)
                continue
            status, tag = (await r.json())["status"], r.headers.get("ETag")
    return status


# -- the check against the log ---------------------------------------------------------------------------
@dataclass
class Check:
    followers: int = 0
    events: int = 0       # events received
    lost: int = 0         # in the log, never received
    duplicated: int = 0   # received more than once
    out_of_order: int = 0  # received after a later one
    finals_wrong: int = 0  # followers without exactly one final event, or with events after it
    unfinished: int = 0   # followers that never got to the end
    stream_errors: int = 0  # streams ended by an `error` event, then resumed
    lags: list[float] = field(default_factory=list)  # receive time - the event's created_at

    @property
    def bad(self) -> int:
        return self.lost + self.duplicated + self.out_of_order + self.finals_wrong + self.unfinished


def dsn(url: str) -> str:
    return url.replace("postgresql+psycopg", "postgresql")


def read_log(database_url: str, task_ids: list[str]) -> dict[str, list[tuple[int, str, float]]]:
    """task id -> its logged events (seq, name, created_at), in seq order."""
    out: dict[str, list] = {t: [] for t in task_ids}
    with psycopg.connect(dsn(database_url)) as conn:
        rows = conn.execute(
            "SELECT t.id, e.seq, e.name, e.created_at FROM tasks t JOIN events e ON e.response_id = t.response_id "
            "WHERE t.id = ANY(%s) ORDER BY t.id, e.seq", (task_ids,)).fetchall()
    for task_id, seq, name, created in rows:
        out[task_id].append((seq, name, created))
    return out


def check(followed: list[Followed], log: dict[str, list[tuple[int, str, float]]], since: float = 0.0) -> Check:
    """Every follower against its task's log. Lags count only events received after ``since`` by
    followers connected by then (a replay of old events is not lag)."""
    c = Check(followers=len(followed))
    for rec in followed:
        logged = log[rec.task_id]
        created = {seq: t for seq, _, t in logged}
        got = [seq for seq, _, _ in rec.events]
        c.events += len(got)
        c.stream_errors += rec.errors
        c.duplicated += len(got) - len(set(got))
        c.out_of_order += sum(1 for a, b in zip(got, got[1:], strict=False) if b <= a)
        c.lost += len(set(created) - set(got))
        finals = [i for i, (_, name, _) in enumerate(rec.events) if name in FINAL_EVENTS]
        if not rec.ended:
            c.unfinished += 1
        elif len(finals) != 1 or finals[0] != len(rec.events) - 1:
            c.finals_wrong += 1
        for seq, _, t in rec.events:
            if seq in created and t >= since and created[seq] >= rec.started_at:
                c.lags.append(t - created[seq])
    return c
