"""The events of spec 6.3: their names, one struct per kind (what producers build and what is sent),
their numbering and their SSE and WebSocket wire forms."""

import json
from typing import Annotated, ClassVar, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from common import wire

CREATED = "response.created"
ITEM_ADDED = "response.output_item.added"
# A message's text part opens before its first delta (as OpenAI's API sends it): the OpenAI SDK's stream
# helper appends each delta to the part at the delta's content_index, and fails without one.
PART_ADDED = "response.content_part.added"
TEXT_DELTA = "response.output_text.delta"
REASONING_DELTA = "response.reasoning_summary_text.delta"
# Extensions (6.3 allows extra events), as OpenAI's API sends them around the events 6.3 names: the OpenAI
# SDKs' stream helpers and their listeners (``on("response.output_text.done")``) rely on them. A text or
# summary ends with its ``.done`` and then its part's, before its item's; a reasoning item's summary part
# opens before its first delta (the Node SDK's helper appends a delta to that part and fails without one);
# a function call's arguments come whole, in one delta and their done event, between its item's events.
TEXT_DONE = "response.output_text.done"
PART_DONE = "response.content_part.done"
SUMMARY_PART_ADDED = "response.reasoning_summary_part.added"
REASONING_DONE = "response.reasoning_summary_text.done"
SUMMARY_PART_DONE = "response.reasoning_summary_part.done"
ARGUMENTS_DELTA = "response.function_call_arguments.delta"
ARGUMENTS_DONE = "response.function_call_arguments.done"
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
    """JSON text of what is not an event (chat chunks, WebSocket mode's own messages)."""
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False)


# -- the events: one struct per kind, built by its producer and encoded as it is ---------------------
# msgspec, not pydantic: an event is built and encoded for every few tokens (millions an hour on a
# fleet); measured here (issue 37) a text delta costs 0.2 us as a struct, 1.8 us as a pydantic model
# and 2.1 us as a dict through json.dumps; a final event with its response object 0.8, 7.4 and 6.4 us.
# Nested objects are typed with common/wire.py's models for the OpenAPI document (``schemas``), and
# passed as dicts: a struct does not check its members when built (the producer's types do).
class EventData(msgspec.Struct, kw_only=True):
    """An event's data as logged and published (6.3). ``type`` and ``sequence_number`` are not members:
    ``typed`` splices them in as each frame is sent, so the logged data does not repeat them."""
    name: ClassVar[str]  # the event's name (its SSE ``event:`` line), a class attribute


Index = Annotated[int, Meta(ge=0)]
LIFECYCLE = ("The response object as GET /responses/{id} would return it at that moment (what the OpenAI "
             "SDK builds its picture of the response from)")
Shown = Annotated[wire.ResponseObject, Meta(description=LIFECYCLE)] | UnsetType


class ResponseCreated(EventData, kw_only=True):
    """``response``: only lifecycle events carry it (one or two an event stream), never deltas: every
    frame's bytes cross Postgres, Redis and the api."""
    name = CREATED
    response_id: str
    status: Literal["in_progress"] = "in_progress"
    response: Annotated[wire.ResponseObject, Meta(
        description=LIFECYCLE + "; `queued` for a background response not started yet")] | UnsetType = UNSET


class OutputItemAdded(EventData, kw_only=True):
    name = ITEM_ADDED
    response_id: str
    output_index: Index
    item: wire.AnyOutputItem


class OutputItemDone(OutputItemAdded, kw_only=True):
    name = ITEM_DONE


class PartEvent(EventData, kw_only=True):
    """What every event about a part of an item carries first."""
    response_id: str
    output_index: Index
    item_id: str


def text_part(text: str = "") -> dict:
    """A message's output_text part (wire.OutputText), as the builder of output items makes it."""
    return {"type": "output_text", "text": text, "annotations": []}


class ContentPartAdded(PartEvent, kw_only=True):
    """A message's text part opens (before its first delta), as OpenAI's API sends it."""
    name = PART_ADDED
    content_index: Literal[0] = 0
    part: wire.OutputText = msgspec.field(default_factory=text_part)


class TextDelta(PartEvent, kw_only=True):
    """A message's text (its one part: content_index 0, as the OpenAI SDK reads it). ``logprobs``: a
    member the SDK's event requires; the engine path gives none."""
    name = TEXT_DELTA
    content_index: Literal[0] = 0
    delta: str
    logprobs: list[dict] = msgspec.field(default_factory=list)


class TextDone(PartEvent, kw_only=True):
    """A message's text is complete: all of it (what the deltas made), before its part's done event."""
    name = TEXT_DONE
    content_index: Literal[0] = 0
    text: str
    logprobs: list[dict] = msgspec.field(default_factory=list)


class ContentPartDone(PartEvent, kw_only=True):
    """A message's text part is complete (as its item's done event will carry it)."""
    name = PART_DONE
    content_index: Literal[0] = 0
    part: wire.OutputText


def summary_part(text: str = "") -> dict:
    """A reasoning item's summary_text part (wire.SummaryText), as the builder of output items makes it."""
    return {"type": "summary_text", "text": text}


class SummaryPartAdded(PartEvent, kw_only=True):
    """A reasoning item's summary part opens (before its first delta), as OpenAI's API sends it."""
    name = SUMMARY_PART_ADDED
    summary_index: Literal[0] = 0
    part: wire.SummaryText = msgspec.field(default_factory=summary_part)


class SummaryDelta(PartEvent, kw_only=True):
    """A reasoning item's summary text (its one part)."""
    name = REASONING_DELTA
    summary_index: Literal[0] = 0
    delta: str


class SummaryDone(PartEvent, kw_only=True):
    """A reasoning item's summary text is complete: all of it, before its part's done event."""
    name = REASONING_DONE
    summary_index: Literal[0] = 0
    text: str


class SummaryPartDone(PartEvent, kw_only=True):
    """A reasoning item's summary part is complete. ``status``: ``incomplete`` when the response stopped
    before the model's reasoning did (token limit, cancel), else not sent (as OpenAI's event)."""
    name = SUMMARY_PART_DONE
    summary_index: Literal[0] = 0
    part: wire.SummaryText
    status: Literal["incomplete"] | UnsetType = UNSET


class ArgumentsDelta(PartEvent, kw_only=True):
    """A function call's arguments (JSON text), all of them in one delta: a call is parsed only once the
    model has finished it (6.5), so no earlier piece of it is known."""
    name = ARGUMENTS_DELTA
    delta: str


class ArgumentsDone(PartEvent, kw_only=True):
    """A function call's arguments are complete: all of them, and the function's ``name`` (newer OpenAI
    SDKs' event has it)."""
    name = ARGUMENTS_DONE
    arguments: str
    function_name: str = msgspec.field(name="name")  # sent as ``name``: the struct's ``name`` is the event's


class FinalEvent(EventData, kw_only=True):
    """What every final event (``FINAL``: one a response, its last) carries first; each kind fixes
    ``status``."""
    response_id: str
    status: str
    response: Shown = UNSET


class Completed(FinalEvent, kw_only=True):
    name = COMPLETED
    status: Literal["completed"] = "completed"
    usage: wire.Usage


class Incomplete(FinalEvent, kw_only=True):
    name = INCOMPLETE
    status: Literal["incomplete"] = "incomplete"
    incomplete_details: wire.IncompleteDetails
    usage: wire.Usage


class Failed(FinalEvent, kw_only=True):
    name = FAILED
    status: Literal["failed"] = "failed"
    error: wire.Problem


class Cancelled(FinalEvent, kw_only=True):
    name = CANCELLED
    status: Literal["cancelled"] = "cancelled"


class ErrorEvent(EventData, kw_only=True):
    """A problem after which the stream cannot go on (6.3); not one of the response's events."""
    name = ERROR
    error: wire.Problem


class AttemptStarted(EventData, kw_only=True):
    """Extension event: a new attempt starts from scratch after a restart; a client discards what it
    built from the response's earlier events."""
    name = ATTEMPT_STARTED
    response_id: str
    attempt: Annotated[int, Meta(ge=1)]


KINDS: dict[str, type[EventData]] = {kind.name: kind for kind in (
    ResponseCreated, OutputItemAdded, ContentPartAdded, TextDelta, TextDone, ContentPartDone, SummaryPartAdded,
    SummaryDelta, SummaryDone, SummaryPartDone, ArgumentsDelta, ArgumentsDone, OutputItemDone, Completed,
    Incomplete, Failed, Cancelled, ErrorEvent, AttemptStarted)}
_encode = msgspec.json.Encoder().encode


def encode(event: EventData) -> str:
    """An event's data as JSON text (what the log and the channel carry)."""
    return _encode(event).decode()


def final(rid: str, status: str, *, usage=None, error=None, incomplete_details=None,
          response: dict | None = None) -> FinalEvent:
    """The one final event for a response in ``status``; ``response``: its final object (see
    ``ResponseCreated``)."""
    shown = UNSET if response is None else response
    if status == "completed":
        return Completed(response_id=rid, response=shown, usage=usage)
    if status == "incomplete":
        return Incomplete(response_id=rid, response=shown, incomplete_details=incomplete_details, usage=usage)
    if status == "failed":
        return Failed(response_id=rid, response=shown, error=error)
    return Cancelled(response_id=rid, response=shown)


def started(obj: dict) -> dict:
    """A response object as it was created: in progress, nothing generated yet."""
    return {**obj, "status": "in_progress", "output": [], "usage": None, "error": None, "incomplete_details": None}


def created_before(ending: FinalEvent) -> ResponseCreated:
    """``response.created`` for a stream that got nothing before ``ending`` (its final event, made up by
    the api when the worker died first): its response as it was at the start."""
    return ResponseCreated(response_id=ending.response_id,
                           response=UNSET if ending.response is UNSET else started(ending.response))


Event = tuple[int, str, str]  # (seq, name, data as JSON): a numbered event, as logged and published


class Sequence:
    """The numbering of one response's events (6.4: ids 1, 2, ... with no gap, ``response.created``
    first), the only place a sequence number is made. Each writer of a response's events holds one and
    numbers every event it writes through it: ``lifecycle.create_task`` event #1, a worker's job what it
    generates and (through ``lifecycle.finish``) its final event, a sweep or a cancel the final event
    it writes (after the log's last), a follower the closing events it makes up (after the last it
    sent), a replay the events it sends again. It counts in memory, so numbering costs no round trip."""

    __slots__ = ("last",)

    def __init__(self, last: int = 0):
        self.last = last  # the highest number given (or, for a follower, sent) so far

    def number(self, emitted) -> list[Event]:
        """(seq, name, data as JSON) for each event of ``emitted``, in order."""
        batch = [(self.last + i, event.name, _encode(event).decode()) for i, event in enumerate(emitted, 1)]
        self.last += len(batch)
        return batch

    def closing(self, ending: list[EventData]) -> list[Event]:
        """The events that end a stream no writer numbered for it (a direct response whose worker died:
        its final event), after the last sent; ``response.created`` first when nothing was sent."""
        if self.last == 0 and ending and not isinstance(ending[0], ResponseCreated):
            ending = [created_before(ending[-1]), *ending]
        return self.number(ending)


def opening(response: dict) -> Event:
    """Event #1 of every response: ``response`` is its object (common/resources.py) at its creation."""
    return Sequence().number([ResponseCreated(response_id=response["id"], response=response)])[0]


class _Heads(dict):
    """An event name's frame head, ``{"type":<name>,``, made once."""

    def __missing__(self, name: str) -> str:
        head = self[name] = '{"type":' + json.dumps(name) + ","
        return head


_HEADS = _Heads()


def typed(seq: int | None, name: str, data_json: str) -> str:
    """``data_json`` (an object's JSON text, as logged) with ``type`` (the event name) and
    ``sequence_number`` (its id) first: the OpenAI SDK reads an event's type from its data, and other
    clients ignore members they do not know. Spliced into the text, never parsed: every frame of every
    follower passes here. Every frame the service sends is built through this function, or (a replay's
    pages, ``sse_many``) through its body inlined."""
    head = _HEADS[name]
    if seq is None:  # no id, no sequence number
        return head[:-1] + ("}" if data_json == "{}" else "," + data_json[1:])
    return f'{head}"sequence_number":{seq}' + ("}" if data_json == "{}" else "," + data_json[1:])


def sse(seq: int | None, name: str, data_json: str) -> str:
    head = f"id: {seq}\n" if seq is not None else ""
    return f"{head}event: {name}\ndata: {typed(seq, name, data_json)}\n\n"


def sse_many(batch: list[tuple[int, str, str]]) -> str:
    """``sse`` of every event of ``batch``, in one piece: a replay writes pages of thousands. ``typed``
    is inlined for data that is not ``{}``: its call was a third of a replay's framing."""
    heads = _HEADS
    return "".join([f'id: {seq}\nevent: {name}\ndata: {heads[name]}"sequence_number":{seq},{data[1:]}\n\n'
                    if data != "{}" else sse(seq, name, data) for seq, name, data in batch])


def ws_frame(seq: int, name: str, data_json: str) -> str:
    return f'{{"id":{seq},"event":{json.dumps(name)},"data":{typed(seq, name, data_json)}}}'


# -- one output item's events, in the order OpenAI's API sends them: what a worker's output builder
# (worker/output.py) emits as text arrives and what ``of_response`` makes of a finished item --------
_EMPTIED = {"message": ("content", []), "reasoning": ("summary", []), "function_call": ("arguments", "")}


def begun(item: dict) -> dict:
    """``item`` as its ``output_item.added`` shows it: in progress, nothing in it yet."""
    member, empty = _EMPTIED[item["type"]]
    return {**item, member: empty, "status": "in_progress"}


def item_opened(rid: str, index: int, item: dict) -> list[EventData]:
    """An item's first events: its ``output_item.added`` (``item`` as ``begun`` makes it) and, for a
    message, its text part's opening (the OpenAI SDK's helper needs it before a delta)."""
    out: list[EventData] = [OutputItemAdded(response_id=rid, output_index=index, item=item)]
    if item["type"] == "message":
        out.append(ContentPartAdded(response_id=rid, output_index=index, item_id=item["id"]))
    return out


def text_added(rid: str, index: int, item: dict, text: str, *, first: bool) -> list[EventData]:
    """A message's or reasoning item's text delta (none for no text); a reasoning item's summary part
    opens with its ``first`` text (a message's opened with the item)."""
    at = {"response_id": rid, "output_index": index, "item_id": item["id"]}
    out: list[EventData] = []
    if item["type"] == "reasoning":
        if first:
            out.append(SummaryPartAdded(**at))
        if text:
            out.append(SummaryDelta(**at, delta=text))
    elif text:
        out.append(TextDelta(**at, delta=text))
    return out


def item_closed(rid: str, index: int, item: dict) -> list[EventData]:
    """An item's last events, ``item`` as done (``status`` ``incomplete`` when the response stopped
    first): a text's or summary's ``.done`` and its part's, or a function call's arguments (all of them:
    a call is known only once the model has finished it, 6.5); then ``output_item.done``."""
    at = {"response_id": rid, "output_index": index, "item_id": item["id"]}
    out: list[EventData] = []
    if item["type"] == "function_call":
        out += [ArgumentsDelta(**at, delta=item["arguments"]),
                ArgumentsDone(**at, arguments=item["arguments"], function_name=item["name"])]
    elif item["type"] == "message":
        part = item["content"][0] if item["content"] else text_part()
        out += [TextDone(**at, text=part["text"]), ContentPartDone(**at, part=part)]
    elif item["summary"]:  # a reasoning item with a summary part (none when it had no text)
        part = item["summary"][0]
        cut = {"status": "incomplete"} if item.get("status") == "incomplete" else {}
        out += [SummaryDone(**at, text=part["text"]), SummaryPartDone(**at, part=part, **cut)]
    out.append(OutputItemDone(response_id=rid, output_index=index, item=item))
    return out


def of_response(obj: dict) -> list[Event]:
    """The events a finished response object (6.2) implies, each item's text in one delta, numbered from
    #1: what a replayed Idempotency-Key of a stream sends again (9.2: the original outcome, as it was
    asked for). Each item's events are those a worker's stream makes of it."""
    rid = obj["id"]
    out: list[EventData] = [ResponseCreated(response_id=rid, response=started(obj))]
    for index, item in enumerate(obj.get("output") or []):
        out += item_opened(rid, index, begun(item))
        if item["type"] != "function_call":
            text = "".join(part.get("text", "") for part in item.get("content") or item.get("summary") or [])
            out += text_added(rid, index, item, text, first=bool(text or item.get("summary")))
        out += item_closed(rid, index, item)
    # The event's usage is 6.3's counts, as when it was first sent (the object's has OpenAI's details too).
    usage = obj.get("usage") and {name: obj["usage"][name] for name in wire.Usage.model_fields}
    out.append(final(rid, obj["status"], usage=usage, error=obj.get("error"),
                     incomplete_details=obj.get("incomplete_details"), response=obj))
    return Sequence().number(out)


def schemas(ref_template: str) -> tuple[dict, list]:
    """The OpenAPI schemas of every event's data as it is sent (``type`` and ``sequence_number``
    first), named as ``KINDS``'s structs, and the pydantic models (common/wire.py) they refer to."""
    named: set = set()

    def nested(kind) -> dict:
        named.add(kind)
        return {"$ref": ref_template.format(model=kind.__name__)}

    kinds = list(dict.fromkeys(KINDS.values()))
    _, components = msgspec.json.schema_components(kinds, schema_hook=nested,
                                                   ref_template=ref_template.replace("{model}", "{name}"))
    for kind in kinds:
        schema = components[kind.__name__]
        schema["properties"] = {
            "type": {"type": "string", "const": kind.name, "description": "The event's name, as in its "
                     "`event:` line (for clients such as the OpenAI SDK that read it from the data)"},
            "sequence_number": {"type": "integer", "minimum": 1, "description": "The event's id"},
            **schema["properties"]}
        # Every member is sent, defaults too, but an unset one (UNSET: only lifecycle events show the response).
        schema["required"] = ["type", "sequence_number", *(
            f.encode_name for f in msgspec.structs.fields(kind) if f.default is not UNSET)]
        schema["additionalProperties"] = False
    return components, sorted(named, key=lambda model: model.__name__)
