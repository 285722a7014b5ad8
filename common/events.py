"""The event format of spec 6.3: names, payload builders, sequence numbers and the SSE wire form."""

import json

CREATED = "response.created"
ITEM_ADDED = "response.output_item.added"
TEXT_DELTA = "response.output_text.delta"
REASONING_DELTA = "response.reasoning_summary_text.delta"
ITEM_DONE = "response.output_item.done"
COMPLETED = "response.completed"
INCOMPLETE = "response.incomplete"
FAILED = "response.failed"
CANCELLED = "response.cancelled"
ERROR = "error"
# Extension (6.3 allows extra events): a new attempt starts from scratch after a restart; a client
# discards what it built from this response's earlier events.
ATTEMPT_STARTED = "response.attempt.started"

FINAL = frozenset({COMPLETED, INCOMPLETE, FAILED, CANCELLED})
# Exactly the type 6.3 names: Flask would append "; charset=utf-8" to a text/* mimetype (SSE is UTF-8 anyway).
SSE_TYPE = "text/event-stream"
# A comment line between events, without a blank line of its own: the OpenAI SDK keeps the last id
# across a blank line (as the SSE spec says) and then dispatches the blank line as an event with no
# data, which it cannot parse. A lone comment line joins the next event's block, where it is ignored.
HEARTBEAT = ": keep-alive\n"


def dumps(data: dict) -> str:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False)


def created(rid: str) -> dict:
    return {"response_id": rid, "status": "in_progress"}


class Sequence:
    """The numbering of one response's events (6.3: ids 1, 2, ... with no gap, ``response.created``
    first), the only place a sequence number is made. Every writer of events numbers through one:
    ``lifecycle.create_task`` event #1, the worker's job what it generates, ``lifecycle`` a final
    event, a follower the closing events it makes up. It counts in memory, so numbering costs no
    round trip; a writer that holds none starts one after the log's last event."""

    __slots__ = ("last",)

    def __init__(self, last: int = 0):
        self.last = last  # the highest number given so far

    @classmethod
    def opened(cls) -> "Sequence":
        """After a task's ``response.created``, which ``lifecycle.create_task`` logged as #1."""
        return cls(1)

    @property
    def next(self) -> int:
        return self.last + 1

    def number(self, emitted) -> list[tuple[int, str, str]]:
        """(seq, name, data as JSON) for each (name, data) of ``emitted``, in order; ``data`` is a
        payload, or its JSON already encoded (shared by many followers)."""
        batch = [(self.last + i, name, data if isinstance(data, str) else dumps(data))
                 for i, (name, data) in enumerate(emitted, 1)]
        self.last += len(batch)
        return batch


def opening(rid: str) -> tuple[int, str, str]:
    """Event #1 of every response."""
    return Sequence().number([(CREATED, created(rid))])[0]


def item_added(rid: str, index: int, item: dict) -> dict:
    return {"response_id": rid, "output_index": index, "item": item}


def text_delta(rid: str, index: int, item_id: str, delta: str) -> dict:
    return {"response_id": rid, "output_index": index, "item_id": item_id, "delta": delta}


item_done = item_added


def attempt_started(rid: str, attempt: int) -> dict:
    return {"response_id": rid, "attempt": attempt}


def final(rid: str, status: str, *, usage=None, error=None, incomplete_details=None) -> tuple[str, dict]:
    """The one final event for a response in ``status``."""
    data: dict = {"response_id": rid, "status": status}
    if status == "completed":
        return COMPLETED, {**data, "usage": usage}
    if status == "incomplete":
        return INCOMPLETE, {**data, "incomplete_details": incomplete_details, "usage": usage}
    if status == "failed":
        return FAILED, {**data, "error": error}
    return CANCELLED, data


_HEADS: dict[str, str] = {}


def typed(seq: int | None, name: str, data_json: str) -> str:
    """``data_json`` (an object's JSON text, as logged) with ``type`` (the event name) and
    ``sequence_number`` (its id) first: the OpenAI SDK reads an event's type from its data, and other
    clients ignore members they do not know. Spliced into the text, never parsed: every frame of every
    follower passes here. Every frame the service sends is built through this function."""
    head = _HEADS.get(name)
    if head is None:
        head = _HEADS[name] = '{"type":' + json.dumps(name) + ","
    if seq is None:  # no id, no sequence number
        return head[:-1] + ("}" if data_json == "{}" else "," + data_json[1:])
    return f'{head}"sequence_number":{seq}' + ("}" if data_json == "{}" else "," + data_json[1:])


def sse(seq: int | None, name: str, data_json: str) -> str:
    head = f"id: {seq}\n" if seq is not None else ""
    return f"{head}event: {name}\ndata: {typed(seq, name, data_json)}\n\n"


def sse_many(batch: list[tuple[int, str, str]]) -> str:
    """``sse`` of every event of ``batch``, in one piece: a replay writes pages of thousands."""
    return "".join([f"id: {seq}\nevent: {name}\ndata: {typed(seq, name, data)}\n\n" for seq, name, data in batch])


def ws_frame(seq: int, name: str, data_json: str) -> str:
    return f'{{"id":{seq},"event":{json.dumps(name)},"data":{typed(seq, name, data_json)}}}'


def of_response(obj: dict) -> list[tuple[str, dict]]:
    """The events a finished response object (6.2) implies, each item's text in one delta: what a
    replayed Idempotency-Key of a stream sends again (9.2: the original outcome, as it was asked for)."""
    rid = obj["id"]
    out = [(CREATED, created(rid))]
    for index, item in enumerate(obj.get("output") or []):
        parts = {"message": ("content", TEXT_DELTA), "reasoning": ("summary", REASONING_DELTA)}.get(item["type"])
        if parts is None:  # a function call arrives complete in its done event (6.5)
            out.append((ITEM_ADDED, item_added(rid, index, {**item, "arguments": ""})))
        else:
            field, delta = parts
            out.append((ITEM_ADDED, item_added(rid, index, {**item, field: []})))
            if text := "".join(part.get("text", "") for part in item.get(field) or []):
                out.append((delta, text_delta(rid, index, item["id"], text)))
        out.append((ITEM_DONE, item_done(rid, index, item)))
    out.append(final(rid, obj["status"], usage=obj.get("usage"), error=obj.get("error"),
                     incomplete_details=obj.get("incomplete_details")))
    return out
