"""The chaos run's clients: tasks of every policy submitted with Idempotency-Keys (and retried with them),
followers over SSE and WebSocket that drop their connection every few events and resume, cancels, and
direct streams. Each records what it saw in the shared history the checker reads."""

import json
import random
import re
import threading
import time
import uuid

import requests
import websocket

from tests.chaos.checker import FINALS
from tests.harness import iter_sse, user

TOPICS = ["tea", "bridges", "rain", "volcanoes", "paper", "bees", "the moon", "reefs", "glaciers", "salt",
          "maps", "bells", "ink", "kites", "clocks", "wolves", "rivers", "bread", "owls", "sand"]
RETRY_ANSWERS = {409, 429, 500, 502, 503, 504}  # answered, but worth the same request again (9.2)


class History:
    """Everything the clients saw; one lock, appended from many threads."""

    def __init__(self, t0: float):
        self.t0 = t0
        self.lock = threading.Lock()
        self.tasks: dict[str, dict] = {}
        self.followers: list[dict] = []
        self.directs: list[dict] = []
        self.keys: dict[str, set] = {}
        self.http: list[dict] = []
        self.counts: dict[str, int] = {}

    def now(self) -> float:
        return time.monotonic() - self.t0

    def count(self, what: str, n: int = 1) -> None:
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + n

    def answered(self, method: str, path: str, resp: requests.Response) -> None:
        self.count(f"http {resp.status_code}")
        if resp.status_code < 500:
            return
        try:
            doc = resp.json() if not resp.headers.get("Content-Type", "").startswith("text/event-stream") else {}
        except ValueError:
            doc = {}
        with self.lock:
            self.http.append({"method": method, "path": path.split("?")[0], "status": resp.status_code,
                              "code": doc.get("code"), "retry_after": resp.headers.get("Retry-After"),
                              "content_type": resp.headers.get("Content-Type"), "body": resp.text[:300] if not doc
                              else json.dumps(doc)[:300], "t": round(self.now(), 1)})


class Load:
    def __init__(self, base: str, token: str, model: str, history: History, rng: random.Random, *,
                 task_clients: int = 3, direct_clients: int = 1, label: str = ""):
        self.base, self.token, self.model, self.h = base, token, model, history
        self.label = label  # what its followers' transports are called after (" slow": the throttled link)
        self.rng = rng
        self.stop = threading.Event()      # no new work
        self.give_up = threading.Event()   # followers stop waiting (the settle period is over)
        self.threads = [threading.Thread(target=self._task_client, args=(random.Random(rng.random()),),
                                         daemon=True, name=f"tasks-{i}") for i in range(task_clients)]
        self.threads += [threading.Thread(target=self._direct_client, args=(random.Random(rng.random()),),
                                          daemon=True, name=f"direct-{i}") for i in range(direct_clients)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self.threads)

    def session(self) -> requests.Session:
        s = requests.Session()
        s.headers["Authorization"] = f"Bearer {self.token}"
        return s

    def _request(self, http: requests.Session, method: str, path: str, **kw) -> requests.Response:
        resp = http.request(method, self.base + path, timeout=kw.pop("timeout", (5, 60)), **kw)
        self.h.answered(method, path, resp)
        return resp

    # -- tasks ---------------------------------------------------------------------------------------
    def _task_client(self, rng: random.Random) -> None:
        http = self.session()
        while not self.stop.is_set():
            try:
                self._one_task(http, rng)
            except Exception as exc:  # noqa: BLE001 - a client bug must show, not end the load silently
                self.h.count(f"client error {type(exc).__name__}: {exc}"[:120])
                time.sleep(1)

    def _one_task(self, http: requests.Session, rng: random.Random) -> None:
        policy = rng.choice(["fail", "retry", "resume"])
        body = {"type": "response", "on_restart": policy, "input": {
            "model": self.model, "input": user(f"Write a short story about {rng.choice(TOPICS)}."),
            "temperature": round(rng.uniform(0, 1), 2), "max_output_tokens": rng.randint(16, 64)}}
        if rng.random() < 0.1:  # structured output: the api's grammar gate checks it (the grammar_kill fault)
            policy = body["on_restart"] = rng.choice(["fail", "retry"])  # a resume of JSON starts again
            body["input"]["text"] = {"format": {"type": "json_schema", "name": "story", "schema": {
                "type": "object", "properties": {"title": {"type": "string"}, "n": {"type": "integer"}},
                "required": ["title"], "additionalProperties": False,
                "description": f"story {rng.randint(0, 10**6)}"}}}  # a schema of its own: compiled, not cached
        key = f"chaos-{uuid.uuid4().hex}"
        task = self._submit(http, body, key, first=True)
        if task is None:
            return
        with self.h.lock:
            self.h.tasks[task["id"]] = {"policy": policy, "cancel": None, "key": key}
        if rng.random() < 0.3:  # the client's retry after its answer: the same task, nothing runs twice
            self._submit(http, body, key, tries=3)
        if rng.random() < 0.2:
            threading.Timer(rng.uniform(0.2, 6), self._cancel, args=(task["id"],)).start()
        transport = rng.choice(["sse", "ws"])
        self._follow(task, transport, rng)

    def _submit(self, http, body, key, tries: int = 60, first: bool = False) -> dict | None:
        """POST with one Idempotency-Key until an answer says the task exists (or the key is refused)."""
        for _ in range(tries):
            if self.give_up.is_set():
                return None
            try:
                resp = self._request(http, "POST", "/lmsp/v1/tasks", json=body, headers={"Idempotency-Key": key})
            except requests.RequestException:
                self.h.count("submit: no answer")
                time.sleep(1)
                continue
            if resp.status_code in (200, 202):
                task = resp.json()
                with self.h.lock:
                    self.h.keys.setdefault(key, set()).add(task["id"])
                self.h.count("tasks accepted" if first else "idempotent replays")
                return task
            if resp.status_code in RETRY_ANSWERS:
                time.sleep(float(resp.headers.get("Retry-After", 1)) if resp.status_code != 409 else 0.5)
                continue
            self.h.count(f"submit refused {resp.status_code} {resp.text[:80]}")
            return None
        return None

    def _cancel(self, task_id: str) -> None:
        http = self.session()
        answer = "unknown"  # asked, but no answer: it may have happened
        for _ in range(20):
            try:
                resp = self._request(http, "POST", f"/lmsp/v1/tasks/{task_id}/cancel")
            except requests.RequestException:
                time.sleep(1)
                continue
            if resp.status_code == 200:
                answer = resp.json()["status"]
                break
            if resp.status_code == 409:
                answer = "not_cancelable"
                break
            time.sleep(1)
        self.h.count(f"cancel -> {answer}")
        with self.h.lock:
            self.h.tasks[task_id]["cancel"] = answer

    def _follow(self, task: dict, transport: str, rng: random.Random, every: tuple[int, int] = (2, 8)) -> None:
        """Follow the task to its final event, leaving after every few events (``every``) to resume."""
        rec = {"task_id": task["id"], "transport": transport + self.label, "events": [], "finished": False, "reconnects": 0}
        with self.h.lock:
            self.h.followers.append(rec)
        read = self._sse if transport == "sse" else self._ws
        http = self.session()
        while not self.give_up.is_set():
            last = rec["events"][-1][0] if rec["events"] else 0
            try:
                if read(http, task, last, rng.randint(*every), rec["events"]):
                    rec["finished"] = True
                    return
            except (requests.RequestException, websocket.WebSocketException, OSError):
                time.sleep(0.5)
            rec["reconnects"] += 1

    def _sse(self, http, task, last, every, events) -> bool:
        """One connection: True once the final event arrived; False to reconnect."""
        with http.get(self.base + task["events_url"], stream=True, headers={"Last-Event-ID": str(last)},
                      timeout=(5, 60)) as resp:
            self.h.answered("GET", task["events_url"], resp)
            if resp.status_code != 200:
                time.sleep(1)
                return False
            resp.encoding = "utf-8"  # SSE is UTF-8; requests would guess ISO-8859-1 for a text/* type
            for n, (seq, name, data) in enumerate(iter_sse(sse_lines(resp)), 1):
                if name == "error":  # the server cannot go on (6.3): resume from the last id
                    self.h.count("follower: error event")
                    return False
                events.append([seq, name, data])
                if name in FINALS:
                    return True
                if n >= every:
                    return False
        return False

    def _ws(self, http, task, last, every, events) -> bool:
        url = self.base.replace("http", "ws", 1) + f"/lmsp/v1/tasks/{task['id']}/ws?after={last}"
        ws = websocket.create_connection(url, timeout=60, header=[f"Authorization: Bearer {self.token}"])
        try:
            for _ in range(every):
                frame = ws.recv()
                if not frame:
                    return False
                event = json.loads(frame)
                if event["event"] == "error":  # as on SSE (6.3): the server cannot go on; resume from the last id
                    self.h.count("follower: error event")
                    return False
                events.append([event["id"], event["event"], event["data"]])
                if event["event"] in FINALS:
                    return True
            return False
        finally:
            ws.close()

    # -- direct responses ----------------------------------------------------------------------------
    def _direct_client(self, rng: random.Random) -> None:
        http = self.session()
        while not self.stop.is_set():
            body = {"model": self.model, "input": user(f"Describe {rng.choice(TOPICS)} in one sentence."),
                    "max_output_tokens": rng.randint(8, 32), "temperature": 0}
            try:
                if rng.random() < 0.7:
                    self._direct_stream(http, {**body, "stream": True})
                else:
                    self._direct_sync(http, body)
            except Exception as exc:  # noqa: BLE001
                self.h.count(f"client error {type(exc).__name__}: {exc}"[:120])
            time.sleep(rng.uniform(0.5, 3))

    def _direct_stream(self, http, body) -> None:
        # Recorded from the start: a stream still open when the run ends is one that hangs.
        rec = {"started": self.h.now(), "ended": None, "events": [], "outcome": "open", "detail": None}
        with self.h.lock:
            self.h.directs.append(rec)
        deadline = time.monotonic() + 300  # a stream open this long hangs (invariant 9: every stream ends)
        try:
            with http.post(self.base + "/lmsp/v1/responses", json=body, stream=True, timeout=(5, 120)) as resp:
                self.h.answered("POST", "/lmsp/v1/responses", resp)
                if resp.status_code != 200:
                    rec["outcome"] = f"http {resp.status_code}"  # a refusal (503 while no worker is up)
                    return
                rec["outcome"] = "eof"
                resp.encoding = "utf-8"
                for seq, name, data in iter_sse(_until(sse_lines(resp), deadline)):
                    rec["events"].append([seq, name, data])
                    if name in FINALS or name == "error":
                        rec["outcome"] = "final" if name in FINALS else "error"
                        break
        except Hung:
            rec["outcome"] = "hung"
        except requests.RequestException as exc:
            rec["outcome"], rec["detail"] = "broken", f"{type(exc).__name__}: {exc}"[:300]
        rec["ended"] = self.h.now()
        self.h.count(f"direct stream: {rec['outcome']}")

    def _direct_sync(self, http, body) -> None:
        try:
            resp = self._request(http, "POST", "/lmsp/v1/responses", json=body, timeout=(5, 300))
            self.h.count(f"direct sync: {resp.status_code}")
        except requests.ReadTimeout:
            with self.h.lock:
                self.h.directs.append({"started": self.h.now() - 300, "ended": self.h.now(), "events": [],
                                       "outcome": "hung", "detail": "a synchronous response unanswered for 300 s"})
        except requests.RequestException:
            self.h.count("direct sync: no answer")


def sse_lines(resp):
    """The lines of an SSE stream, ended by CRLF, LF or CR only (the spec's): requests' iter_lines splits
    on every line boundary str.splitlines knows, U+2028 among them, which generated text may hold (seen
    in a delta: the data line cut in two, its JSON unterminated). A CR at a chunk's end waits for the next
    chunk, which may begin with its LF."""
    pending = ""
    for chunk in resp.iter_content(chunk_size=None, decode_unicode=True):
        pending += chunk
        cut = len(pending) - 1 if pending.endswith("\r") else len(pending)
        *lines, rest = re.split(r"\r\n|\r|\n", pending[:cut])
        pending = rest + pending[cut:]
        yield from lines
    if pending:
        yield pending


class Hung(Exception):
    pass


def _until(lines, deadline: float):
    """The lines of a stream, keep-alive comments included, until ``deadline``: a stream that only
    sends keep-alives never ends otherwise."""
    for line in lines:
        if time.monotonic() > deadline:
            raise Hung
        yield line
