"""The event format of spec 6.3: names, payload builders, sequence numbers and the SSE wire form."""

import json

CREATED = "response.created"
ITEM_ADDED = "response.output_item.added"
# A message's text part opens before its first delta (as OpenAI's API sends it): the OpenAI SDK's stream
# helper appends each delta to the part at the delta's content_index, and fails without one.
PART_ADDED = "response.content_part.added"
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


def created(rid: str, response: dict | None = None) -> dict:
    """``response``: the response object as GET would return it now (6.2), for clients such as the
    OpenAI SDK that build their picture of the response from it. Only lifecycle events carry it (one
    or two an event stream), never deltas: every frame's bytes cross Postgres, Redis and the api."""
    data = {"response_id": rid, "status": "in_progress"}
    if response is not None:
        data["response"] = response
    return data


def started(obj: dict) -> dict:
    """A response object as it was created: in progress, nothing generated yet."""
    return {**obj, "status": "in_progress", "output": [], "usage": None, "error": None, "incomplete_details": None}


def created_before(rid: str, closing: list[tuple[str, str]]) -> tuple[str, str]:
    """``response.created`` for a stream that got nothing before ``closing`` (its final event, made
    up by the api when the worker died first): its response as it was at the start."""
    final = json.loads(closing[-1][1]).get("response")
    return CREATED, dumps(created(rid, None if final is None else started(final)))


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


def opening(response: dict) -> tuple[int, str, str]:
    """Event #1 of every response: ``response`` is its object (common/resources.py) at its creation."""
    return Sequence().number([(CREATED, created(response["id"], response))])[0]


def item_added(rid: str, index: int, item: dict) -> dict:
    return {"response_id": rid, "output_index": index, "item": item}


def part_added(rid: str, index: int, item_id: str) -> dict:
    """The (only) text part of message ``index`` opens: the OpenAI SDK's helper needs it before a delta."""
    return {"response_id": rid, "output_index": index, "item_id": item_id, "content_index": 0,
            "part": {"type": "output_text", "text": ""}}


def text_delta(rid: str, index: int, item_id: str, delta: str) -> dict:
    """A message's text (its one part: content_index 0, as the OpenAI SDK reads it)."""
    return {"response_id": rid, "output_index": index, "item_id": item_id, "content_index": 0, "delta": delta}


def summary_delta(rid: str, index: int, item_id: str, delta: str) -> dict:
    """A reasoning item's summary text (its one part)."""
    return {"response_id": rid, "output_index": index, "item_id": item_id, "summary_index": 0, "delta": delta}


item_done = item_added


def attempt_started(rid: str, attempt: int) -> dict:
    return {"response_id": rid, "attempt": attempt}


def final(rid: str, status: str, *, usage=None, error=None, incomplete_details=None,
          response: dict | None = None) -> tuple[str, dict]:
    """The one final event for a response in ``status``; ``response``: its final object (see ``created``)."""
    data: dict = {"response_id": rid, "status": status}
    if response is not None:
        data["response"] = response
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
    out = [(CREATED, created(rid, started(obj)))]
    for index, item in enumerate(obj.get("output") or []):
        parts = {"message": ("content", TEXT_DELTA, text_delta),
                 "reasoning": ("summary", REASONING_DELTA, summary_delta)}.get(item["type"])
        if parts is None:  # a function call arrives complete in its done event (6.5)
            out.append((ITEM_ADDED, item_added(rid, index, {**item, "arguments": ""})))
        else:
            field, delta, payload = parts
            out.append((ITEM_ADDED, item_added(rid, index, {**item, field: []})))
            if item["type"] == "message":
                out.append((PART_ADDED, part_added(rid, index, item["id"])))
            if text := "".join(part.get("text", "") for part in item.get(field) or []):
                out.append((delta, payload(rid, index, item["id"], text)))
        out.append((ITEM_DONE, item_done(rid, index, item)))
    out.append(final(rid, obj["status"], usage=obj.get("usage"), error=obj.get("error"),
                     incomplete_details=obj.get("incomplete_details"), response=obj))
    return out
