"""A Python client for an LMSP 1.0 service: ``Client`` (sync) and ``AsyncClient``, both on httpx.

    from lmsp.client import Client

    with Client() as lmsp:                       # LMSP_URL / LMSP_TOKEN, or the dev token of `make run`
        task = lmsp.create_task("Write a short report on tea.")
        for event in lmsp.follow(task["id"]):    # reconnects by Last-Event-ID until the final event
            if event.name == ATTEMPT_STARTED:
                ...                              # a new attempt: drop the text received so far
            elif event.name == TEXT_DELTA:
                print(event.data["delta"], end="", flush=True)

Every create sends a fresh ``Idempotency-Key`` (kept across its retries, so a retry never runs
twice); ``429``/``502``/``503``/``504`` are retried with backoff honouring ``Retry-After``; every
other problem document is raised as a :class:`ProblemError` subclass carrying ``code``, ``param``,
``status`` and ``retry_after``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

API = "/lmsp/v1"
CREATED = "response.created"
TEXT_DELTA = "response.output_text.delta"
# Extension event: the task's response starts again from nothing (a `retry` after a restart).
ATTEMPT_STARTED = "response.attempt.started"
FINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed", "response.cancelled"})
ERROR_EVENT = "error"
TERMINAL_STATES = frozenset({"succeeded", "failed", "cancelled"})
RETRY_STATUSES = frozenset({429, 502, 503, 504})

Json = dict[str, Any]
Input = str | list[Json]
OnDisconnect = Callable[[str, float], None]  # (why, seconds until the next try)


# -- configuration --------------------------------------------------------------------------------
def default_url() -> str:
    if url := os.environ.get("LMSP_URL"):
        return url
    from common.settings import load_settings  # where `lmsp dev` serves
    settings = load_settings()
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    return f"http://{host}:{settings.port}"


def base_url(url: str | None) -> str:
    """``url`` (default: ``default_url()``) without a trailing slash; a ``ClientError`` for one without its
    scheme, which httpx would take for a path and fail to reach as "is the service running?"."""
    url = (url or default_url()).rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ClientError(f"{url!r} is not a URL: give http://host:port (--url or LMSP_URL)")
    return url


def dev_token_path() -> Path:
    from common.settings import load_settings
    return load_settings().home / "dev-token"


def default_token() -> str | None:
    if token := os.environ.get("LMSP_TOKEN"):
        return token
    try:
        return dev_token_path().read_text().strip() or None
    except OSError:
        return None


# -- errors ---------------------------------------------------------------------------------------
class ClientError(Exception):
    """Anything this client raises."""


class ServiceUnreachable(ClientError):
    """The service could not be reached (connection refused, DNS, timeouts) within the retries."""


class UnexpectedAnswer(ClientError):
    """The URL answered, but not as an LMSP service does (another server on that port, a proxy's page)."""


class ProblemError(ClientError):
    """An RFC 9457 problem document answered by the service (spec 9.3)."""

    def __init__(self, problem: Json, retry_after: float | None = None):
        self.problem = problem
        self.status: int = _status(problem)
        self.code: str = str(problem.get("code") or "unknown")
        self.title: str = problem.get("title") or ""
        self.detail: str = problem.get("detail") or self.title
        self.param: str | None = problem.get("param")
        self.retry_after = retry_after
        super().__init__(f"{self.detail} ({self.code})")


class InvalidRequest(ProblemError): ...       # 400
class Unauthorized(ProblemError): ...         # 401
class Forbidden(ProblemError): ...            # 403
class NotFound(ProblemError): ...             # 404
class Conflict(ProblemError): ...             # 409
class Gone(ProblemError): ...                 # 410: the events are past their retention
class RateLimited(ProblemError): ...          # 429
class ServerError(ProblemError): ...          # 5xx but 503
class Unavailable(ProblemError): ...          # 503


_BY_STATUS: dict[int, type[ProblemError]] = {400: InvalidRequest, 401: Unauthorized, 403: Forbidden,
                                              404: NotFound, 409: Conflict, 410: Gone, 429: RateLimited,
                                              503: Unavailable}


def _status(problem: Json) -> int:
    status = problem.get("status")
    return status if isinstance(status, int) else 0  # a document that is not ours may carry anything


def problem_error(problem: Json, retry_after: float | None = None) -> ProblemError:
    status = _status(problem)
    cls = _BY_STATUS.get(status) or (ServerError if status >= 500 else ProblemError)
    return cls(problem, retry_after)


def _retry_after(resp: httpx.Response) -> float | None:
    raw = resp.headers.get("Retry-After", "")
    try:
        return max(0.0, float(raw))
    except ValueError:
        return None  # an HTTP date: rare enough to fall back on the backoff


def _error_from(resp: httpx.Response) -> ProblemError:
    try:
        doc = json.loads(resp.content)
        if not isinstance(doc, dict):
            raise ValueError
    except ValueError:  # not a problem document (a proxy's error page)
        doc = {"status": resp.status_code, "code": "http_error",
               "detail": f"{resp.status_code} {resp.reason_phrase} from {resp.request.url}"}
    if not isinstance(doc.get("status"), int):
        doc["status"] = resp.status_code
    return problem_error(doc, _retry_after(resp))


def _expect_events(resp: httpx.Response) -> None:
    """A stream's answer: every LMSP stream is text/event-stream."""
    if not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
        raise UnexpectedAnswer(f"{resp.request.url} answered {resp.status_code} {resp.reason_phrase} without an "
                               "event stream: is that the LMSP service?")


def _document(resp: httpx.Response) -> Json:
    """A success's body: every LMSP answer is a JSON object."""
    return _json_object(resp.json, f"{resp.request.url} answered {resp.status_code} {resp.reason_phrase} "
                        "without a JSON object")


def _json_object(load: Callable[[], object], instead: str) -> Json:
    """What ``load()`` parses, if it is a JSON object; else an UnexpectedAnswer saying what came ``instead``."""
    try:
        doc = load()
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise UnexpectedAnswer(f"{instead}: is that the LMSP service?")
    return doc


# -- events ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Event:
    """One server-sent event (spec 6.3); ``id`` is None for a final event sent without one."""

    id: int | None
    name: str
    data: Json = field(default_factory=dict)

    @property
    def final(self) -> bool:
        return self.name in FINAL_EVENTS


class SSEDecoder:
    """Lines of a text/event-stream in, events out (comments and keep-alives are skipped)."""

    def __init__(self) -> None:
        self._id: int | None = None
        self._name: str | None = None
        self._data: list[str] = []

    def line(self, line: str) -> Event | None:
        if line == "":
            event = None
            if self._name is not None or self._data:
                data = _event_data("\n".join(self._data)) if self._data else {}
                event = Event(self._id, self._name or "message", data)
            self._id, self._name, self._data = None, None, []
            return event
        if line.startswith(":"):
            return None
        key, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if key == "id" and value.isdigit():
            self._id = int(value)
        elif key == "event":
            self._name = value
        elif key == "data":
            self._data.append(value)
        return None


def _event_data(text: str) -> Json:
    return _json_object(lambda: json.loads(text), f"the event stream sent data that is not a JSON object "
                        f"({text[:60]!r})")


# -- request bodies and results -------------------------------------------------------------------
def user_input(prompt: Input) -> list[Json]:
    """A prompt as input items: a string becomes one user message."""
    if isinstance(prompt, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": prompt}]}]
    return prompt


def output_text(response: Json | None) -> str:
    """The text of a response object's message items."""
    parts = []
    for item in (response or {}).get("output") or []:
        if item.get("type") == "message":
            parts += [p.get("text", "") for p in item.get("content") or [] if p.get("type") == "output_text"]
    return "".join(parts)


def json_schema_format(schema: Json, name: str = "answer") -> Json:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


def _response_body(prompt: Input, model: str, fields: Json) -> Json:
    return {"model": model, "input": user_input(prompt), **{k: v for k, v in fields.items() if v is not None}}


def _task_body(prompt: Input, model: str, on_restart: str | None, fields: Json) -> Json:
    body: Json = {"type": "response", "input": _response_body(prompt, model, fields)}
    if on_restart is not None:
        body["on_restart"] = on_restart
    return body


def _pick_model(models: list[Json]) -> str:
    if not models:
        raise ClientError("The service serves no models; `lmsp models import-gguf` registers one")
    ready = [m for m in models if m.get("status") == "ready"]
    return (ready or models)[0]["id"]


def _task_params(state: str | None, limit: int | None, cursor: str | None) -> Json:
    return {k: v for k, v in {"state": state, "limit": limit, "cursor": cursor}.items() if v is not None}


def _headers(token: str | None) -> dict[str, str]:
    headers = {"LMSP-Version": "1.0", "User-Agent": "lmsp-client/1.0"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return headers


# -- retry policy (shared by both clients) --------------------------------------------------------
class Backoff:
    """Delays between tries: ``Retry-After`` when the server gives one, else exponential with jitter."""

    def __init__(self, base: float = 0.5, cap: float = 10.0):
        self.base, self.cap, self.tries = base, cap, 0

    def next(self, retry_after: float | None = None) -> float:
        self.tries += 1
        if retry_after is not None:
            return min(retry_after, 60.0)
        return min(self.cap, self.base * 2 ** (self.tries - 1)) * random.uniform(0.8, 1.2)

    def reset(self) -> None:
        self.tries = 0


class _Retry:
    """When to try a request again: transport errors and 429/502/503/504, ``max_retries`` times."""

    def __init__(self, url: str, max_retries: int):
        self.url, self.max_retries, self.backoff = url, max_retries, Backoff()

    def after_error(self, exc: httpx.TransportError) -> float:
        if self.backoff.tries >= self.max_retries:
            raise ServiceUnreachable(f"Cannot reach {self.url}: {exc!r}") from exc
        return self.backoff.next()

    def after_answer(self, resp: httpx.Response) -> float:
        if resp.status_code in RETRY_STATUSES and self.backoff.tries < self.max_retries:
            return self.backoff.next(_retry_after(resp))
        raise _error_from(resp)


class _Follow:
    """The state of a reconnecting follower: the last id seen, the decoder of the current connection,
    and how long the service has been failing."""

    def __init__(self, task_id: str, after: int, reconnect_timeout: float, on_disconnect: OnDisconnect | None):
        self.path = f"{API}/tasks/{quote(task_id, safe='')}/events"
        self.last = after
        self.timeout = reconnect_timeout
        self.on_disconnect = on_disconnect
        self.backoff = Backoff(cap=5.0)
        self.failing_since: float | None = None
        self.decoder = SSEDecoder()
        self.why = ""
        self.gave_up = False  # the server sent an `error` event: reconnect
        self.retry_after: float | None = None

    def headers(self) -> dict[str, str]:
        return {"Accept": "text/event-stream", **({"Last-Event-ID": str(self.last)} if self.last else {})}

    def opened(self, resp: httpx.Response) -> bool:
        """Whether the stream answered; raise a refusal that retrying cannot fix."""
        self.retry_after = None
        if resp.status_code >= 400:
            error = _error_from(resp)
            if resp.status_code not in RETRY_STATUSES:
                raise error
            self.why, self.retry_after = str(error), error.retry_after
            return False
        _expect_events(resp)
        self.failing_since = None
        self.backoff.reset()
        self.decoder = SSEDecoder()
        self.why, self.gave_up = "the stream ended before the final event", False
        return True

    def feed(self, line: str) -> Event | None:
        """The event a line completes, unless it repeats one already seen. An ``error`` event (the
        server cannot go on) sets ``why``: the caller then reconnects."""
        event = self.decoder.line(line)
        if event is None or (event.id is not None and event.id <= self.last):
            return None
        if event.name == ERROR_EVENT:
            self.why, self.gave_up = str(_stream_problem(event)), True
            return None
        if event.id is not None:
            self.last = event.id
        return event

    def lost(self, exc: Exception | None = None) -> float:
        """The delay before the next try; raise once the service has been unreachable too long."""
        if exc is not None:
            self.why = f"connection lost ({type(exc).__name__})"
        now = time.monotonic()
        self.failing_since = self.failing_since or now
        if now - self.failing_since > self.timeout:
            raise ServiceUnreachable(f"Lost the event stream of {self.path} for {self.timeout:.0f} s: {self.why}")
        delay, self.retry_after = self.backoff.next(self.retry_after), None
        if self.on_disconnect:
            self.on_disconnect(self.why, delay)
        return delay


def _direct(decoder: SSEDecoder, line: str) -> Event | None:
    """One line of a direct response stream: its ``error`` event is raised."""
    event = decoder.line(line)
    if event is not None and event.name == ERROR_EVENT:
        raise _stream_problem(event)
    return event


def _stream_problem(event: Event) -> ProblemError:
    return problem_error(event.data.get("error") or {"status": 500, "code": "server_error",
                                                     "detail": "The stream failed"})


# -- the sync client ------------------------------------------------------------------------------
class Client:
    """A synchronous LMSP client. ``url`` and ``token`` default to LMSP_URL / LMSP_TOKEN / the dev token."""

    def __init__(self, url: str | None = None, token: str | None = None, *, timeout: float = 30.0,
                 max_retries: int = 5, reconnect_timeout: float = 300.0,
                 transport: httpx.BaseTransport | None = None):
        self.url = base_url(url)
        self.max_retries = max_retries
        self.reconnect_timeout = reconnect_timeout
        self._http = httpx.Client(base_url=self.url, headers=_headers(token or default_token()),
                                  timeout=httpx.Timeout(timeout, connect=5.0), transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # plumbing
    def _send(self, method: str, path: str, *, stream: bool = False, **kw) -> httpx.Response:
        """One request, retried on 429/5xx-unavailable and on transport errors (every request this
        client makes is safe to repeat: reads, idempotent cancels, creates with an Idempotency-Key)."""
        retry = _Retry(self.url, self.max_retries)
        while True:
            try:
                resp = self._http.send(self._http.build_request(method, path, **kw), stream=stream)
            except httpx.TransportError as exc:
                time.sleep(retry.after_error(exc))
                continue
            if resp.status_code < 400:
                return resp
            if stream:
                resp.read()
                resp.close()
            time.sleep(retry.after_answer(resp))

    def _json(self, method: str, path: str, **kw) -> Json:
        return _document(self._send(method, path, **kw))

    # models
    def models(self) -> list[Json]:
        return self._json("GET", f"{API}/models")["data"]

    def model(self, model_id: str) -> Json:
        return self._json("GET", f"{API}/models/{quote(model_id, safe='')}")

    def default_model(self) -> str:
        """The first model that is ready (else the first one)."""
        return _pick_model(self.models())

    # tasks
    def create_task(self, prompt: Input, *, model: str | None = None, on_restart: str | None = None,
                    idempotency_key: str | None = None, **fields: Any) -> Json:
        """Create a durable task; ``fields`` are response request fields (max_output_tokens, ...)."""
        body = _task_body(prompt, model or self.default_model(), on_restart, fields)
        return self._json("POST", f"{API}/tasks", json=body,
                          headers={"Idempotency-Key": idempotency_key or str(uuid.uuid4())})

    def get_task(self, task_id: str) -> Json:
        return self._json("GET", f"{API}/tasks/{quote(task_id, safe='')}")

    def cancel_task(self, task_id: str) -> Json:
        return self._json("POST", f"{API}/tasks/{quote(task_id, safe='')}/cancel")

    def list_tasks(self, *, state: str | None = None, limit: int | None = None, cursor: str | None = None
                   ) -> Json:
        """One page, newest first: ``{"data": [...], "has_more": bool, "next_cursor": str | None}``."""
        return self._json("GET", f"{API}/tasks", params=_task_params(state, limit, cursor))

    def iter_tasks(self, *, state: str | None = None) -> Iterator[Json]:
        cursor = None
        while True:
            page = self.list_tasks(state=state, cursor=cursor, limit=100)
            yield from page["data"]
            if not page["has_more"]:
                return
            cursor = page["next_cursor"]

    def follow(self, task_id: str, *, after: int = 0, on_disconnect: OnDisconnect | None = None
               ) -> Iterator[Event]:
        """A task's events from ``after`` on, through drops and api restarts, until the final event.
        ``on_disconnect(why, delay)`` hears of each lost connection."""
        state = _Follow(task_id, after, self.reconnect_timeout, on_disconnect)
        while True:
            try:
                with self._http.stream("GET", state.path, headers=state.headers()) as resp:
                    if resp.status_code >= 400:
                        resp.read()
                    if state.opened(resp):
                        for line in resp.iter_lines():
                            if (event := state.feed(line)) is not None:
                                yield event
                                if event.final:
                                    return
                            elif state.gave_up:
                                break
            except httpx.TransportError as exc:
                time.sleep(state.lost(exc))
                continue
            time.sleep(state.lost())

    # responses
    def create_response(self, prompt: Input, *, model: str | None = None, idempotency_key: str | None = None,
                        **fields: Any) -> Json:
        """A synchronous response: returns the finished response object."""
        body = {**_response_body(prompt, model or self.default_model(), fields), "stream": False}
        return self._json("POST", f"{API}/responses", json=body,
                          headers={"Idempotency-Key": idempotency_key or str(uuid.uuid4())},
                          timeout=httpx.Timeout(None, connect=5.0))

    def stream_response(self, prompt: Input, *, model: str | None = None, **fields: Any) -> Iterator[Event]:
        """A streamed response's events up to the final one. A direct stream cannot be resumed
        (spec 6.4): a dropped connection raises; use a task for output that must survive."""
        body = {**_response_body(prompt, model or self.default_model(), fields), "stream": True}
        resp = self._send("POST", f"{API}/responses", json=body, stream=True,
                          headers={"Idempotency-Key": str(uuid.uuid4())}, timeout=httpx.Timeout(60.0, connect=5.0))
        try:
            _expect_events(resp)
            decoder = SSEDecoder()
            for line in resp.iter_lines():
                if (event := _direct(decoder, line)) is not None:
                    yield event
                    if event.final:
                        return
            raise ServiceUnreachable("The response stream ended before its final event")
        except httpx.TransportError as exc:
            raise ServiceUnreachable(f"The response stream broke: {exc!r}") from exc
        finally:
            resp.close()


# -- the async client -----------------------------------------------------------------------------
class AsyncClient:
    """The same operations as :class:`Client`, awaitable; ``follow`` and ``stream_response`` are async
    iterators."""

    def __init__(self, url: str | None = None, token: str | None = None, *, timeout: float = 30.0,
                 max_retries: int = 5, reconnect_timeout: float = 300.0,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.url = base_url(url)
        self.max_retries = max_retries
        self.reconnect_timeout = reconnect_timeout
        self._http = httpx.AsyncClient(base_url=self.url, headers=_headers(token or default_token()),
                                       timeout=httpx.Timeout(timeout, connect=5.0), transport=transport)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _send(self, method: str, path: str, *, stream: bool = False, **kw) -> httpx.Response:
        retry = _Retry(self.url, self.max_retries)
        while True:
            try:
                resp = await self._http.send(self._http.build_request(method, path, **kw), stream=stream)
            except httpx.TransportError as exc:
                await asyncio.sleep(retry.after_error(exc))
                continue
            if resp.status_code < 400:
                return resp
            if stream:
                await resp.aread()
                await resp.aclose()
            await asyncio.sleep(retry.after_answer(resp))

    async def _json(self, method: str, path: str, **kw) -> Json:
        return _document(await self._send(method, path, **kw))

    async def models(self) -> list[Json]:
        return (await self._json("GET", f"{API}/models"))["data"]

    async def model(self, model_id: str) -> Json:
        return await self._json("GET", f"{API}/models/{quote(model_id, safe='')}")

    async def default_model(self) -> str:
        return _pick_model(await self.models())

    async def create_task(self, prompt: Input, *, model: str | None = None, on_restart: str | None = None,
                          idempotency_key: str | None = None, **fields: Any) -> Json:
        body = _task_body(prompt, model or await self.default_model(), on_restart, fields)
        return await self._json("POST", f"{API}/tasks", json=body,
                                headers={"Idempotency-Key": idempotency_key or str(uuid.uuid4())})

    async def get_task(self, task_id: str) -> Json:
        return await self._json("GET", f"{API}/tasks/{quote(task_id, safe='')}")

    async def cancel_task(self, task_id: str) -> Json:
        return await self._json("POST", f"{API}/tasks/{quote(task_id, safe='')}/cancel")

    async def list_tasks(self, *, state: str | None = None, limit: int | None = None,
                         cursor: str | None = None) -> Json:
        return await self._json("GET", f"{API}/tasks", params=_task_params(state, limit, cursor))

    async def follow(self, task_id: str, *, after: int = 0, on_disconnect: OnDisconnect | None = None
                     ) -> AsyncIterator[Event]:
        state = _Follow(task_id, after, self.reconnect_timeout, on_disconnect)
        while True:
            try:
                async with self._http.stream("GET", state.path, headers=state.headers()) as resp:
                    if resp.status_code >= 400:
                        await resp.aread()
                    if state.opened(resp):
                        async for line in resp.aiter_lines():
                            if (event := state.feed(line)) is not None:
                                yield event
                                if event.final:
                                    return
                            elif state.gave_up:
                                break
            except httpx.TransportError as exc:
                await asyncio.sleep(state.lost(exc))
                continue
            await asyncio.sleep(state.lost())

    async def create_response(self, prompt: Input, *, model: str | None = None,
                              idempotency_key: str | None = None, **fields: Any) -> Json:
        body = {**_response_body(prompt, model or await self.default_model(), fields), "stream": False}
        return await self._json("POST", f"{API}/responses", json=body,
                                headers={"Idempotency-Key": idempotency_key or str(uuid.uuid4())},
                                timeout=httpx.Timeout(None, connect=5.0))

    async def stream_response(self, prompt: Input, *, model: str | None = None, **fields: Any
                              ) -> AsyncIterator[Event]:
        body = {**_response_body(prompt, model or await self.default_model(), fields), "stream": True}
        resp = await self._send("POST", f"{API}/responses", json=body, stream=True,
                                headers={"Idempotency-Key": str(uuid.uuid4())},
                                timeout=httpx.Timeout(60.0, connect=5.0))
        try:
            _expect_events(resp)
            decoder = SSEDecoder()
            async for line in resp.aiter_lines():
                if (event := _direct(decoder, line)) is not None:
                    yield event
                    if event.final:
                        return
            raise ServiceUnreachable("The response stream ended before its final event")
        except httpx.TransportError as exc:
            raise ServiceUnreachable(f"The response stream broke: {exc!r}") from exc
        finally:
            await resp.aclose()
