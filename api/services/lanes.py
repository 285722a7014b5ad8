"""WebSocket mode of the Responses API (the OpenAI SDK's ``responses.connect()``): what one connection
holds; api/views/realtime.py is its route.

The client sends ``response.create`` events: the create body's fields, flat, with ``stream_id`` (its
lane) and ``generate``. A lane runs its responses one at a time, first in first out, beside the other
lanes; the default lane is the one without ``stream_id``. A lane with work has a thread of its own,
which generates on the direct path (api/direct.py, as POST /responses does) and sends the response's
events, the same as its SSE stream's data, one text message each, with the lane's ``stream_id``.
Finished responses are remembered for ``previous_response_id`` (stored ones are read from the
database too). Closing the connection aborts its generations.
"""

import json
import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from simple_websocket import ConnectionClosed

from api import direct
from api.body import json_object
from api.services.validation import prepare
from api.services.work import drop_direct, warm_direct
from common import events
from common.errors import LMSPError, problem
from common.tables import Response

log = logging.getLogger("lmsp.api")
CREATE = "response.create"
MAX_STREAM_ID = 128
JOIN_SECONDS = 5.0  # how long a closing connection waits for its lanes to abort and let go


@dataclass(frozen=True)
class Remembered:
    """A finished response as previous_response_id reads it (api/services/validation.py)."""
    id: str
    status: str
    request: dict
    output: list


@dataclass(frozen=True)
class Create:
    """One response.create, waiting for its lane."""
    body: dict  # the create body (ResponseRequest's fields)
    stream_id: str | None
    generate: bool


def error_event(doc: dict, stream_id: str | None = None) -> str:
    """An ``error`` event in WebSocket mode's shape, ``{"type": "error", "error": {...}}``: the error is
    the problem document (9.3), with ``message`` (what the OpenAI SDK reads) beside its ``detail``."""
    data = {"type": events.ERROR, "error": {**doc, "message": doc.get("detail", "")},
            "status": doc.get("status", 500)}
    if stream_id is not None:
        data["stream_id"] = stream_id
    return events.dumps(data)


def frame(event: tuple[int, str, str], stream_id: str | None) -> str:
    """A response's event as a text message: its SSE data (``type`` and ``sequence_number`` first),
    with the lane's ``stream_id`` last when it has one."""
    text = events.typed(*event)
    return text if stream_id is None else f'{text[:-1]},"stream_id":{json.dumps(stream_id)}}}'


def parse(message: str | bytes, settings) -> Create:
    """A client message as a ``Create``, or the ``LMSPError`` its error event carries."""
    if isinstance(message, bytes):
        try:
            message = message.decode("utf-8")
        except UnicodeDecodeError:
            raise LMSPError("invalid_request", "A message must be UTF-8 JSON text") from None
    body = json_object(message, settings)
    kind = body.pop("type", None)
    if kind != CREATE:
        raise LMSPError("invalid_request", f"A client event's type must be {CREATE}, not {kind!r}", param="type")
    stream_id = body.pop("stream_id", None)
    if stream_id is not None and not (isinstance(stream_id, str) and 0 < len(stream_id) <= MAX_STREAM_ID):
        raise LMSPError("invalid_request", f"stream_id must be a string of 1 to {MAX_STREAM_ID} characters",
                        param="stream_id")
    generate = body.pop("generate", True)
    if not isinstance(generate, bool):
        raise LMSPError("invalid_request", "generate must be true or false", param="generate")
    if body.pop("background", None) is not None:
        raise LMSPError("invalid_request", "background is not taken over a WebSocket; create the response "
                        "with POST /lmsp/v1/responses (background: true) or as a task", param="background")
    if body.pop("stream", None) is not None:
        raise LMSPError("invalid_request", "stream is implicit over a WebSocket: leave it out", param="stream")
    return Create({**body, "stream": generate}, stream_id, generate)


class Connection:
    """One WebSocket's lanes and memory. ``send(text)`` writes one text message (any thread; they
    are serialized here); ``receive`` is called on the connection's own thread, ``close`` once at
    its end."""

    def __init__(self, svc, principal: str, send: Callable[[str], None]):
        self.svc, self.principal, self._send = svc, principal, send
        self.settings = svc.settings
        self.lock = threading.Lock()       # lanes, queued, running, memory
        self.send_lock = threading.Lock()  # one message at a time on the socket
        self.lanes: dict[str | None, deque[Create]] = {}  # a lane with work: its creates still waiting
        self.threads: list[threading.Thread] = []
        self.queued = 0
        self.running: set[str] = set()     # ids of the responses generating now
        self.memory: OrderedDict[str, Remembered] = OrderedDict()
        self.closed = threading.Event()

    def send(self, text: str) -> bool:
        """False once the socket is gone."""
        if self.closed.is_set():
            return False
        try:
            with self.send_lock:
                self._send(text)
            return True
        except (ConnectionClosed, OSError):
            self.closed.set()
            return False

    # -- the connection's thread ------------------------------------------------------------------

    def receive(self, message: str | bytes) -> None:
        """A client message: a response.create joins its lane; anything wrong is an error event."""
        stream_id = None
        try:
            create = parse(message, self.settings)
            stream_id = create.stream_id
            self._enqueue(create)
        except LMSPError as exc:
            self.send(error_event(exc.to_problem(), stream_id))

    def _enqueue(self, create: Create) -> None:
        lane, thread = create.stream_id, None
        with self.lock:
            if self.queued >= self.settings.ws_max_queued:
                raise LMSPError("rate_limited", f"{self.queued} responses wait on this connection, its limit; "
                                "wait for some to finish", retry_after=1)
            waiting = self.lanes.get(lane)
            if waiting is None:
                if len(self.lanes) >= self.settings.ws_max_lanes:
                    raise LMSPError("rate_limited", f"This connection has {len(self.lanes)} lanes at work, its "
                                    "limit; send to one of them (its stream_id) or wait", retry_after=1)
                waiting = self.lanes[lane] = deque()
                thread = threading.Thread(target=self._lane, args=(lane,), name="lmsp-ws-lane", daemon=True)
                self.threads = [t for t in self.threads if t.is_alive()] + [thread]
            waiting.append(create)
            self.queued += 1
        if thread is not None:
            thread.start()

    def idle(self) -> bool:
        """No lane at work."""
        with self.lock:
            return not self.lanes

    def close(self) -> None:
        """The socket is closed (or closing): abort what generates, drop what waits, let the lanes end."""
        self.closed.set()
        with self.lock:
            running = list(self.running)
            for waiting in self.lanes.values():
                self.queued -= len(waiting)
                waiting.clear()
            threads = list(self.threads)
        for response_id in running:  # at once; each lane's stream would abort it within a heartbeat too
            try:
                drop_direct(self.svc, response_id)
            except Exception:  # noqa: BLE001 - the database is away: the lane's own abort tries again
                log.warning("WebSocket closed: abort of %s failed", response_id, exc_info=True)
        for thread in threads:
            thread.join(JOIN_SECONDS)

    # -- a lane's thread --------------------------------------------------------------------------

    def _lane(self, lane: str | None) -> None:
        while True:
            with self.lock:
                waiting = self.lanes[lane]
                if not waiting or self.closed.is_set():
                    del self.lanes[lane]
                    return
                create = waiting.popleft()
                self.queued -= 1
            try:
                self._respond(create)
            except LMSPError as exc:
                self.send(error_event(exc.to_problem(), lane))
            except Exception:  # noqa: BLE001 - the lane goes on; the client hears of it
                log.exception("WebSocket response failed")
                self.send(error_event(problem("server_error", "The response failed"), lane))

    def _respond(self, create: Create) -> None:
        svc = self.svc
        svc.limiter.check(self.principal)  # each response as one POST /responses
        with self.lock:
            remembered = dict(self.memory)
        with svc.sessions() as session:
            prepared = prepare(session, svc, self.principal, create.body, remembered)
        if not create.generate:
            obj = warm_direct(svc, self.principal, prepared).wire()
            request = prepared.request.model_dump(mode="json", by_alias=True, exclude_none=True)
            self._remember(Remembered(obj["id"], obj["status"], request, []))
            for event in events.of_response(obj):
                self.send(frame(event, create.stream_id))
            return
        run = direct.launch(svc, self.principal, prepared)
        with self.lock:
            self.running.add(run.response_id)
        try:
            if self._relay(run, create.stream_id):
                self._remember_row(run.response_id)
        finally:
            with self.lock:
                self.running.discard(run.response_id)

    def _relay(self, run: direct.Direct, stream_id: str | None) -> bool:
        """Send the response's events until its final one (True), or until the socket goes (False:
        closing the stream aborts the generation)."""
        texts = direct.stream(run, frames=lambda event: frame(event, stream_id),
                              failed=lambda _seq, doc: error_event(doc, stream_id))
        try:
            for text in texts:
                if text == events.HEARTBEAT:
                    if self.closed.is_set():
                        return False
                elif not self.send(text):
                    return False
            return True
        finally:
            texts.close()

    def _remember_row(self, response_id: str) -> None:
        with self.svc.sessions() as session:
            row = session.get(Response, response_id)
            if row is None or row.status not in ("completed", "incomplete"):
                return
            self._remember(Remembered(row.id, row.status, row.request, row.output or []))

    def _remember(self, item: Remembered) -> None:
        with self.lock:
            self.memory[item.id] = item
            while len(self.memory) > self.settings.ws_memory_responses:
                self.memory.popitem(last=False)
