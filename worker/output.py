"""Generated text -> the output items and events of spec 6.2/6.3.

Each item's events are common/events.py's (``item_opened``, ``text_added``, ``item_closed``): the order
OpenAI's API sends them in, the same as a replayed response's (``events.of_response``).

The builder is fed text as the engine produces it and returns the events to
emit. It can also be rebuilt from logged events, which is what makes
``on_restart: resume`` continue the same items (docs/architecture.md, invariant 6).
"""

import json

from common import events
from common.events import EventData
from common.ids import new_id
from common.prompt import THINK_CLOSE, THINK_OPEN, TOOL_CLOSE, TOOL_OPEN

Emitted = list[EventData]


class OutputBuilder:
    """Modes: ``text`` streams a message; ``tool_auto`` streams a message unless the model
    opens a tool call; ``tool_forced`` buffers a constrained ``{"name","arguments"}`` JSON."""

    def __init__(self, response_id: str, mode: str, *, reasoning: bool = False, in_reasoning: bool = False):
        self.rid = response_id
        self.mode = mode
        self.reasoning = reasoning
        self.items: list[dict] = []
        self.open: int | None = None     # index of the item receiving text
        self.held = ""                   # text that may still turn out to be a tag
        self.buffer: str | None = "" if mode == "tool_forced" else None  # a tool call being collected
        self.raw = ""                    # everything generated, for resuming
        self.thinking = in_reasoning

    # -- feeding -------------------------------------------------------------------
    def feed(self, text: str) -> Emitted:
        text = text.replace("\x00", "\ufffd")  # a model may emit NUL; Postgres JSONB cannot store it
        self.raw += text
        if self.buffer is not None:
            self.buffer += text
            return []
        out: Emitted = []
        self.held += text
        while self.held:
            if self.thinking:
                head, sep, tail = self.held.partition(THINK_CLOSE)
                if sep:
                    out += self._append("reasoning", head)
                    out += self._close()
                    self.thinking = False
                    self.held = tail.lstrip("\n")
                    continue
                keep = _partial_suffix(self.held, THINK_CLOSE)
                out += self._append("reasoning", self.held[:len(self.held) - keep])
                self.held = self.held[len(self.held) - keep:]
                return out
            if self.open is None:  # at the start of an item: could this be a tag?
                stripped = self.held.lstrip()
                if self.reasoning and THINK_OPEN.startswith(stripped[:len(THINK_OPEN)]):
                    if len(stripped) < len(THINK_OPEN):
                        return out
                    self.thinking = True
                    self.held = stripped[len(THINK_OPEN):].lstrip("\n")
                    continue
                if self.mode == "tool_auto" and TOOL_OPEN.startswith(stripped[:len(TOOL_OPEN)]):
                    if len(stripped) < len(TOOL_OPEN):
                        return out
                    self.buffer = self.held
                    self.held = ""
                    return out
                if not stripped:
                    return out
            out += self._append("message", self.held)
            self.held = ""
        return out

    def finish(self, cut: bool = False) -> Emitted:
        """Close every open item; turn a collected tool call into function_call items. ``cut``: the
        response stopped before the model did (token limit, cancel): the item open then is incomplete."""
        out: Emitted = []
        if self.buffer is not None:
            calls = _parse_calls(self.buffer, forced=self.mode == "tool_forced")
            if calls is None:  # not a tool call after all: keep the text
                out += self._append("message", self.buffer)
            for name, arguments in calls or []:
                item = {"id": new_id("function_call"), "type": "function_call", "call_id": new_id("call"),
                        "name": name, "arguments": arguments, "status": "completed"}
                self.items.append(item)
                index = len(self.items) - 1
                out += events.item_opened(self.rid, index, events.begun(item))
                out += events.item_closed(self.rid, index, item)
            self.buffer = None
        elif self.held:
            out += self._append("reasoning" if self.thinking else "message", self.held)
            self.held = ""
        status = "incomplete" if cut else "completed"
        out += self._close(status)
        if not self.items:  # the model stopped at once: still answer with an (empty) message
            out += self._append("message", "")
            out += self._close(status)
        return out

    # -- items -----------------------------------------------------------------------
    def _append(self, kind: str, text: str) -> Emitted:
        out: Emitted = []
        if self.open is not None and self.items[self.open]["type"] != kind:
            out += self._close()
        if self.open is None:
            item = ({"id": new_id("message"), "type": "message", "role": "assistant", "content": []}
                    if kind == "message" else {"id": new_id("reasoning"), "type": "reasoning", "summary": []})
            item["status"] = "in_progress"  # as OpenAI's items: until its done event (``_close``)
            self.items.append(item)
            self.open = len(self.items) - 1
            out += events.item_opened(self.rid, self.open, _copy(item))
        if text:
            out += self._add_text(self.items[self.open], text)
        return out

    def _add_text(self, item: dict, text: str) -> Emitted:
        parts = item["content"] if item["type"] == "message" else item["summary"]
        first = not parts
        if first:
            parts.append(_empty_part(item))
        parts[0]["text"] += text
        return events.text_added(self.rid, self.open, item, text, first=first)

    def _close(self, status: str = "completed") -> Emitted:
        if self.open is None:
            return []
        item = self.items[self.open]
        if item["type"] == "message" and not item["content"]:
            item["content"].append(events.text_part())
        item["status"] = status
        index, self.open = self.open, None
        return events.item_closed(self.rid, index, _copy(item))

    # -- resume ----------------------------------------------------------------------
    def replay(self, name: str, data: dict) -> None:
        """Rebuild state from a logged event (the snapshot of a running task). The events that end a part
        or a function call's arguments change nothing an item's done event does not set; a message's text
        part opening neither (its first text makes it, as in ``_add_text``)."""
        if name == events.ITEM_ADDED:
            self.items.append(_copy(data["item"]))
            self.open = data["output_index"]
            if data["item"]["type"] == "reasoning":
                self.raw += THINK_OPEN
                self.thinking = True
        elif name == events.SUMMARY_PART_ADDED:  # logged with its first delta: the delta then finds it
            summary = self.items[data["output_index"]]["summary"]
            if not summary:
                summary.append(_empty_part(self.items[data["output_index"]]))
        elif name in (events.TEXT_DELTA, events.REASONING_DELTA):
            item = self.items[data["output_index"]]
            parts = item["content"] if item["type"] == "message" else item["summary"]
            if not parts:
                parts.append(_empty_part(item))
            parts[0]["text"] += data["delta"]
            self.raw += data["delta"]
        elif name == events.ITEM_DONE:
            self.items[data["output_index"]] = _copy(data["item"])
            if data["item"]["type"] == "reasoning":
                self.raw += THINK_CLOSE + "\n"
                self.thinking = False
            elif data["item"]["type"] == "function_call":
                call = json.dumps({"name": data["item"]["name"], "arguments": json.loads(data["item"]["arguments"])})
                self.raw += f"{TOOL_OPEN}{call}{TOOL_CLOSE}"
            self.open = None


def _empty_part(item: dict) -> dict:
    return events.text_part() if item["type"] == "message" else events.summary_part()


def _copy(item: dict) -> dict:
    return json.loads(json.dumps(item))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _parse_calls(text: str, forced: bool) -> list[tuple[str, str]] | None:
    """[(name, arguments JSON)] or None when the text holds no well-formed call."""
    bodies = [text] if forced else [chunk.split(TOOL_CLOSE, 1)[0] for chunk in text.split(TOOL_OPEN)[1:]]
    calls = []
    for body in bodies:
        try:
            obj = json.loads(body.strip())
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        arguments = obj.get("arguments", obj.get("parameters", {}))
        calls.append((obj["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls or None
