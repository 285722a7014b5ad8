"""The service side of every figure: real gunicorn api, real Celery worker, Postgres, Redis."""

import http.client
import io
import json
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import psycopg
import requests
from sqlalchemy import select, update
from urllib3.util import Retry

from common.tables import Event, Response, Task
from tests import factories
from tests.bench.util import HTTPError, RawStream, children, cpu_seconds, percentile, user

TERMINAL = {"succeeded", "failed", "cancelled"}


@dataclass
class Run:
    """Everything the figures share."""
    stack: object            # tests.harness.Stack
    db_url: str
    sessions: object         # sqlalchemy sessionmaker on db_url
    api: str                 # base URL of the production-configured api
    api_proc: object
    token: str               # principal "bench"
    principal: str
    served: str              # model id the worker serves
    parked: str              # model id no worker serves (B3)
    b3_token: str
    b3_principal: str
    worker_proc: object = None
    notes: list = field(default_factory=list)  # more api processes the bench started (M1 reads them)
    redis_url: str = ""


_local = threading.local()


def session_for(token: str) -> requests.Session:
    s = getattr(_local, "sessions", None)
    if s is None:
        s = _local.sessions = {}
    if token not in s:
        s[token] = requests.Session()
        s[token].headers["Authorization"] = f"Bearer {token}"
        # gunicorn closes a connection idle for its keep-alive (2 s); a GET sent as it does is reset:
        # send it again (only GETs: a POST /tasks retried could submit twice).
        s[token].mount("http://", requests.adapters.HTTPAdapter(max_retries=Retry(
            total=2, connect=2, read=2, status=0, allowed_methods={"GET"}, raise_on_status=False)))
    return s[token]


def submit_task(base: str, token: str, model: str, text: str, max_tokens: int) -> dict:
    body = {"type": "response",
            "input": {"model": model, "input": user(text), "max_output_tokens": max_tokens, "temperature": 0}}
    r = session_for(token).post(base + "/lmsp/v1/tasks", json=body, timeout=120)
    if r.status_code != 202:
        raise HTTPError(r.status_code, r.content)
    return r.json()


def get_task(base: str, token: str, task_id: str) -> dict:
    r = session_for(token).get(f"{base}/lmsp/v1/tasks/{task_id}", timeout=120)
    if r.status_code != 200:
        raise HTTPError(r.status_code, r.content)
    return r.json()


def cancel_task(base: str, token: str, task_id: str) -> None:
    session_for(token).post(f"{base}/lmsp/v1/tasks/{task_id}/cancel", timeout=120)


def output_text(response: dict) -> str:
    return "".join(part.get("text", "") for item in response.get("output") or []
                   if item.get("type") == "message" for part in item.get("content") or [])


# -- B1: tasks through the whole service -------------------------------------------------------------
def tasks_round(run: Run, texts: list[str], max_tokens: int) -> dict:
    """64 clients at once (as on vLLM's side), each submitting its task and waiting for it with the
    long poll (GET /tasks/{id}?wait=30, If-None-Match), as the API asks a waiting client to: it
    costs nothing while its task runs and hears of the end when the final event is published."""
    def one(text):
        task = submit_task(run.api, run.token, run.served, text, max_tokens)
        accepted = time.perf_counter()
        tag = None
        while task["status"] not in TERMINAL:
            r = session_for(run.token).get(f"{run.api}/lmsp/v1/tasks/{task['id']}", params={"wait": 30},
                                           headers={"If-None-Match": tag} if tag else {}, timeout=120)
            if r.status_code == 304:
                continue
            if r.status_code != 200:
                raise HTTPError(r.status_code, r.content)
            task, tag = r.json(), r.headers["ETag"]
        return task, accepted

    with ThreadPoolExecutor(len(texts)) as pool:
        start, wall0 = time.perf_counter(), time.time()
        done = list(pool.map(one, texts))
        elapsed = time.perf_counter() - start
    ordered = [task for task, _ in done]
    bad = [t for t in ordered if t["status"] != "succeeded"]
    if bad:
        raise RuntimeError(f"{len(bad)} tasks did not succeed, e.g. {bad[0]}")
    tokens = sum(t["response"]["usage"]["output_tokens"] for t in ordered)
    with run.sessions() as session:
        ended = session.execute(select(Task.ended_at).where(Task.id.in_([t["id"] for t in ordered]))).scalars()
        db_makespan = max(ended) - wall0
    return {"elapsed": elapsed, "tokens": tokens, "tokens_per_s": tokens / elapsed,
            "accepted_s": max(at for _, at in done) - start, "db_makespan_s": db_makespan,
            "texts": [output_text(t["response"]) for t in ordered],
            "timelines": [(t.get("extensions") or {}).get("x-lmsp-timeline") for t in ordered]}


def responses_round(run: Run, texts: list[str], max_tokens: int) -> dict:
    """All at once, non-streaming POST /responses, one connection each (people at screens)."""
    def one(text):
        body = {"model": run.served, "input": user(text), "max_output_tokens": max_tokens, "temperature": 0}
        r = requests.post(run.api + "/lmsp/v1/responses", json=body, timeout=900,
                          headers={"Authorization": f"Bearer {run.token}"})
        if r.status_code != 200:
            raise HTTPError(r.status_code, r.content)
        return r.json()

    with ThreadPoolExecutor(len(texts)) as pool:
        start = time.perf_counter()
        done = list(pool.map(one, texts))
        elapsed = time.perf_counter() - start
    bad = [d for d in done if d["status"] not in ("completed", "incomplete")]
    if bad:
        raise RuntimeError(f"{len(bad)} responses did not complete, e.g. {bad[0]}")
    tokens = sum(d["usage"]["output_tokens"] for d in done)
    return {"elapsed": elapsed, "tokens": tokens, "tokens_per_s": tokens / elapsed,
            "texts": [output_text(d) for d in done]}


# -- B2 / B6: a streaming POST /responses --------------------------------------------------------------
def stream_ttft(run: Run, text: str, max_tokens: int, base: str | None = None) -> dict:
    """Seconds from sending the request to the first response.output_text.delta; reads to the end."""
    body = {"model": run.served, "input": user(text), "max_output_tokens": max_tokens, "temperature": 0,
            "stream": True}
    s = RawStream(base or run.api, "POST", "/lmsp/v1/responses", run.token, body, timeout=600)
    first, final, deltas, created, tokens, end = None, None, "", None, None, None
    for t, _seq, name, data in s.events():
        if name == "response.created" and created is None:
            created = t - s.sent_at
        if name == "response.output_text.delta":
            if first is None:
                first = t - s.sent_at
            deltas += json.loads(data)["delta"]
        elif name.startswith("response.") and name.split(".", 1)[1] in (
                "completed", "incomplete", "failed", "cancelled") or name == "error":
            final, end = name, t - s.sent_at
            tokens = (json.loads(data).get("usage") or {}).get("output_tokens")
    return {"ttft": first, "final": final, "text": deltas, "created": created, "tokens": tokens, "end": end}


# -- B3: acceptance rate ----------------------------------------------------------------------------------
def hammer(base: str, method: str, path: str, token: str, body, seconds: float, threads: int,
           expect: int, api_pids: list[int]) -> dict:
    """``threads`` keep-alive clients send the same request back to back for ``seconds``."""
    u = urlsplit(base)
    payload = json.dumps(body).encode() if body is not None else None
    headers = {"Authorization": f"Bearer {token}"}
    if payload is not None:
        headers["Content-Type"] = "application/json"
    counts = [0] * threads
    errors: Counter = Counter()
    samples: list[bytes] = []
    ends = [0.0] * threads
    barrier = threading.Barrier(threads + 1)
    box = {}

    def client(i):
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
        barrier.wait()
        deadline = box["deadline"]
        n = 0
        while time.perf_counter() < deadline:
            try:
                conn.request(method, path, body=payload, headers=headers)
                r = conn.getresponse()
                data = r.read()
            except (OSError, http.client.HTTPException) as exc:
                errors[type(exc).__name__] += 1
                conn.close()
                conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
                continue
            if r.status == expect:
                n += 1
            else:
                errors[r.status] += 1
                if len(samples) < 3:
                    samples.append(data[:300])
            if r.will_close:
                conn.close()
                conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
        ends[i] = time.perf_counter()
        counts[i] = n
        conn.close()

    pool = [threading.Thread(target=client, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    cpu0 = sum(_cpu(p) for p in api_pids)
    start = time.perf_counter()
    box["deadline"] = start + seconds
    barrier.wait()
    for t in pool:
        t.join()
    elapsed = max(ends) - start
    cpu = sum(_cpu(p) for p in api_pids) - cpu0
    total = sum(counts)
    return {"ok": total, "rate": total / elapsed, "elapsed": elapsed, "start": start, "errors": dict(errors),
            "error_samples": [s.decode(errors="replace") for s in samples],
            "api_cpu_ms_per_req": 1000 * cpu / total if total else None}


def _cpu(pid: int) -> float:
    try:
        return cpu_seconds(pid)
    except OSError:
        return 0.0


def queue_of(model: str) -> str:
    from common.registry import queue_name
    return queue_name(model)


def _broker_keys(queue: str) -> list[str]:
    # kombu's Redis transport: one list per priority step (common.broker: sep ":", steps 0-9).
    return [queue, *(f"{queue}:{i}" for i in range(1, 10))]


def clear_broker(redis_url: str, queue: str) -> None:
    """Drop the messages of a queue no worker consumes (B3's parked model)."""
    import redis
    redis.Redis.from_url(redis_url).delete(*_broker_keys(queue))


def wait_broker(redis_url: str, queue: str, count: int, start: float, timeout: float = 60) -> float:
    """Seconds from ``start`` (perf_counter) until ``count`` messages are in the queue."""
    import redis
    client = redis.Redis.from_url(redis_url)
    keys = _broker_keys(queue)
    deadline = time.perf_counter() + timeout
    while True:
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.llen(k)
        now = time.perf_counter()
        have = sum(pipe.execute())
        if have >= count:
            return now - start
        if now > deadline:
            raise TimeoutError(f"{have} of {count} accepted tasks have a broker message after {timeout:g} s")
        time.sleep(0.002)


def api_workers(run: Run, proc=None) -> list[int]:
    return children((proc or run.api_proc).pid)


# -- B4: fan-out ---------------------------------------------------------------------------------------------
def fan_out(run: Run, base: str, clients: int, max_tokens: int, text: str) -> dict:
    task = submit_task(base, run.token, run.served, text, max_tokens)
    path = task["events_url"]
    received: list[list[tuple[float, int]] | None] = [None] * clients
    meta: list[dict] = [{} for _ in range(clients)]
    errors: list[str] = []

    def follower(i):
        try:
            s = RawStream(base, "GET", path, run.token, timeout=600)
            meta[i] = {"sent": s.sent_at, "headers": s.headers_at}
            got = []
            for t, seq, _name, _data in s.events(arrival=True):
                got.append((t, s.arrived, seq))
            received[i] = got
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{type(exc).__name__}: {exc}"[:300])

    threads = [threading.Thread(target=follower, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    with run.sessions() as session:
        rows = session.execute(select(Event.seq, Event.created_at).where(
            Event.response_id == task["response_id"]).order_by(Event.seq)).all()
    created = dict(rows)
    all_seqs = list(created)
    token_at = token_times(run, task["response_id"])
    lags, insert_lags, arrival, complete, stalled = [], [], [], 0, 0
    heads = [m["headers"] for m in meta if m]
    all_in = max(heads) if heads else float("inf")  # every follower has its response headers
    for i in range(clients):
        got = received[i]
        if got is None:
            continue
        if [seq for _, _, seq in got] == all_seqs:
            complete += 1
        if meta[i]["headers"] - meta[i]["sent"] > 1.0:
            stalled += 1
        connected = meta[i]["sent"]
        for t, arrived, seq in got:
            # Live events only: those whose first token the engine gave after this client asked;
            # older ones are a replay. The lag runs from that token (the delta window counts).
            if seq in token_at and token_at[seq] >= connected:
                lags.append(t - token_at[seq])
                arrival.append(arrived - token_at[seq])
            if seq in created and created[seq] >= connected:
                insert_lags.append(t - created[seq])
    final = get_task(base, run.token, task["id"])
    return {"events": len(all_seqs), "clients": clients, "complete": complete, "stalled_over_1s": stalled,
            "errors": errors[:3], "n_errors": len(errors), "samples": len(lags),
            "traced_deltas": len(token_at),
            "p50_ms": _ms(percentile(lags, 50)), "p99_ms": _ms(percentile(lags, 99)),
            "max_ms": _ms(max(lags) if lags else None), "task_status": final["status"],
            "all_connected_after_s": (all_in - min(m["sent"] for m in meta if m)) if heads else None,
            # The same lags from the event's INSERT (what B4 measured before; info).
            "insert_p50_ms": _ms(percentile(insert_lags, 50)), "insert_p99_ms": _ms(percentile(insert_lags, 99)),
            # To the kernel's arrival time at the reading socket, without the time this process's
            # reader threads wait for the CPU and its GIL (info: how much of a lag is ours).
            "arrival_p50_ms": _ms(percentile(arrival, 50)), "arrival_p99_ms": _ms(percentile(arrival, 99))}


def token_times(run: Run, response_id: str) -> dict[int, float]:
    """seq -> wall time the engine gave the first token of that text delta (the worker's
    LMSP_TRACE_TOKEN_TIMES file)."""
    path = run.stack.env.get("LMSP_TRACE_TOKEN_TIMES")
    out: dict[int, float] = {}
    try:
        with open(path) as f:
            for line in f:
                rid, seq, t, _tokens = line.split()
                if rid == response_id:
                    out[int(seq)] = float(t)
    except (OSError, TypeError):
        pass
    return out


def traced_tokens(run: Run, since: float, until: float) -> int:
    """Output tokens the worker's engine delivered (every request) between two wall times."""
    total = 0
    with open(run.stack.env["LMSP_TRACE_TOKEN_TIMES"]) as f:
        for line in f:
            _rid, _seq, t, tokens = line.split()
            if since <= float(t) < until:
                total += int(tokens)
    return total


def _ms(x):
    return None if x is None else 1000 * x


# -- B5: replay ---------------------------------------------------------------------------------------------
def make_long_log(run: Run, n_events: int) -> dict:
    """A finished task whose log holds ``n_events`` events, written straight into the table."""
    with run.sessions() as session:
        task = factories.task(session, "succeeded", owner=run.principal, model=run.served)
        now = time.time()
        session.execute(update(Task).where(Task.id == task.id).values(ended_at=now))
        session.execute(update(Response).where(Response.id == task.response_id).values(status="completed"))
        session.commit()
        rid, task_id = task.response_id, task.id
    msg_id = "msg_" + uuid.uuid4().hex[:26].upper()
    words = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor".split()
    n_deltas = n_events - 4
    deltas = [" ".join(words[(i + k) % len(words)] for k in range(3)) + " " for i in range(n_deltas)]
    text = "".join(deltas)
    item = {"id": msg_id, "type": "message", "role": "assistant", "content": []}
    done = {**item, "content": [{"type": "output_text", "text": text}]}
    d = lambda obj: json.dumps(obj, separators=(",", ":"))  # noqa: E731
    rows = [(1, "response.created", d({"response_id": rid, "status": "in_progress"})),
            (2, "response.output_item.added", d({"response_id": rid, "output_index": 0, "item": item}))]
    rows += [(3 + i, "response.output_text.delta",
              d({"response_id": rid, "output_index": 0, "item_id": msg_id, "delta": delta}))
             for i, delta in enumerate(deltas)]
    rows += [(n_events - 1, "response.output_item.done", d({"response_id": rid, "output_index": 0, "item": done})),
             (n_events, "response.completed",
              d({"response_id": rid, "status": "completed",
                 "usage": {"input_tokens": 10, "output_tokens": n_deltas, "total_tokens": n_deltas + 10}}))]
    with psycopg.connect(pg_dsn(run.db_url)) as conn:
        with conn.cursor() as cur, cur.copy(
                "COPY events (response_id, seq, name, data, created_at) FROM STDIN") as copy:
            t = now - 3600
            for seq, name, data in rows:
                copy.write_row((rid, seq, name, data, t + seq * 1e-3))
        conn.commit()
        conn.autocommit = True
        conn.execute("VACUUM ANALYZE events")
    return {"task_id": task_id, "response_id": rid, "events": n_events}


def pg_dsn(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def server_pids(run: Run) -> tuple[int, int]:
    """The Postgres server's postmaster (the parent of a connection's backend) and the Redis server's process."""
    import redis
    with psycopg.connect(pg_dsn(run.db_url)) as conn:
        backend = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
        postmaster = int(Path(f"/proc/{backend}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return postmaster, int(redis.Redis.from_url(run.redis_url).info("server")["process_id"])


def replay_once(run: Run, task_id: str) -> dict:
    s = RawStream(run.api, "GET", f"/lmsp/v1/tasks/{task_id}/events", run.token, timeout=600)
    n, last, bytes_ = 0, 0, 0
    for _t, seq, _name, data in s.events():
        n += 1
        if seq != last + 1:
            raise RuntimeError(f"replay out of order: {seq} after {last}")
        last = seq
        bytes_ += len(data)
    elapsed = time.time() - s.sent_at
    return {"events": n, "elapsed": elapsed, "rate": n / elapsed}


def select_once(run: Run, response_id: str) -> dict:
    with psycopg.connect(pg_dsn(run.db_url)) as conn:
        start = time.perf_counter()
        rows = conn.execute("SELECT seq, name, data FROM events WHERE response_id = %s ORDER BY seq",
                            (response_id,)).fetchall()
        elapsed = time.perf_counter() - start
    return {"rows": len(rows), "elapsed": elapsed, "rate": len(rows) / elapsed}


# -- B6 helpers --------------------------------------------------------------------------------------------
def count_status(run: Run, model: str, statuses: tuple[str, ...]) -> int:
    from sqlalchemy import func
    with run.sessions() as session:
        return session.execute(select(func.count()).select_from(Task).where(
            Task.model == model, Task.status.in_(statuses))).scalar()


def batch_state(run: Run, model: str) -> dict:
    """How many of the model's tasks are queued, claimed without a token yet, and running."""
    from sqlalchemy import func
    with run.sessions() as session:
        rows = session.execute(select(Task.status, func.count()).where(
            Task.model == model, Task.status.in_(("queued", "loading", "running"))).group_by(Task.status)).all()
    return {"queued": 0, "loading": 0, "running": 0, **dict(rows)}


def loaded(state: dict, full: int, queued: int) -> bool:
    """A full batch (every engine slot past its first token) with at least ``queued`` waiting behind it."""
    return state["running"] >= full and state["queued"] >= queued


def cancel_unfinished(run: Run, model: str) -> int:
    with run.sessions() as session:
        ids = list(session.execute(select(Task.id).where(
            Task.model == model, Task.status.notin_(tuple(TERMINAL)), Task.principal_id == run.principal)).scalars())
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda tid: cancel_task(run.api, run.token, tid), ids))
    return len(ids)


def wait_idle(run: Run, model: str, timeout: float = 180) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if count_status(run, model, ("queued", "loading", "running", "cancelling")) == 0:
            return True
        time.sleep(0.5)
    return False


def dump(obj) -> str:
    buf = io.StringIO()
    json.dump(obj, buf, indent=1, default=str)
    return buf.getvalue()
