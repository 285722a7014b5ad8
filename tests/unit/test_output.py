"""The protocol layer without an engine: text -> items and events, tool calls, reasoning, resume."""

import itertools
import json

import pytest

from common import events
from common.prompt import tool_call_schema, tool_mode
from common.protocol import ResponseRequest
from worker.output import OutputBuilder


def sent(emitted) -> list[tuple[str, dict]]:
    """(name, data) of each event as it is sent."""
    return [(event.name, json.loads(events.encode(event))) for event in emitted]


def run(builder, chunks, cut=False):
    emitted = []
    for chunk in chunks:
        emitted += builder.feed(chunk)
    return sent(emitted + builder.finish(cut=cut))


def names(emitted) -> list[str]:
    return [name for name, _ in emitted]


def of(emitted, name) -> list[dict]:
    return [data for n, data in emitted if n == name]


# An item's events in the order OpenAI's API sends them (common/events.py; the spec's own among them as
# before): what the OpenAI SDKs' stream helpers accumulate, and their listeners wait for.
MESSAGE_OPENS = [events.ITEM_ADDED, events.PART_ADDED]
MESSAGE_ENDS = [events.TEXT_DONE, events.PART_DONE, events.ITEM_DONE]
SUMMARY_ENDS = [events.REASONING_DONE, events.SUMMARY_PART_DONE, events.ITEM_DONE]
CALL = [events.ITEM_ADDED, events.ARGUMENTS_DELTA, events.ARGUMENTS_DONE, events.ITEM_DONE]


def test_a_message_streams_as_openais_does():
    emitted = run(OutputBuilder("resp_1", "text"), ["Hello", " there"])
    assert names(emitted) == [*MESSAGE_OPENS, events.TEXT_DELTA, events.TEXT_DELTA, *MESSAGE_ENDS]
    item = of(emitted, events.ITEM_DONE)[0]["item"]
    at = {"response_id": "resp_1", "output_index": 0, "item_id": item["id"], "content_index": 0}
    assert of(emitted, events.TEXT_DONE) == [{**at, "text": "Hello there", "logprobs": []}]
    assert of(emitted, events.PART_DONE) == [{**at, "part": item["content"][0]}]
    assert item["content"] == [{"type": "output_text", "text": "Hello there", "annotations": []}]


def test_reasoning_becomes_a_reasoning_item_with_summary_text():
    emitted = run(OutputBuilder("resp_1", "text", reasoning=True),
                  ["<thi", "nk>\nFirst, add", " the numbers.</th", "ink>\n", "The answer", " is 5."])
    names = [n for n, _ in emitted]
    assert names[0] == events.ITEM_ADDED and emitted[0][1]["item"]["type"] == "reasoning"
    done = [d["item"] for n, d in emitted if n == events.ITEM_DONE]
    assert done[0] == {"id": done[0]["id"], "type": "reasoning", "status": "completed",
                       "summary": [{"type": "summary_text", "text": "First, add the numbers."}]}
    assert done[1]["type"] == "message" and done[1]["content"][0]["text"] == "The answer is 5."
    assert [d["output_index"] for n, d in emitted if n == events.ITEM_DONE] == [0, 1]
    reasoning = "".join(d["delta"] for n, d in emitted if n == events.REASONING_DELTA)
    assert reasoning == "First, add the numbers."
    # Its summary part opens before its first delta (the Node SDK's helper appends the delta to it).
    assert names == [events.ITEM_ADDED, events.SUMMARY_PART_ADDED, *[events.REASONING_DELTA] * 2, *SUMMARY_ENDS,
                     *MESSAGE_OPENS, events.TEXT_DELTA, events.TEXT_DELTA, *MESSAGE_ENDS]
    at = {"response_id": "resp_1", "output_index": 0, "item_id": done[0]["id"], "summary_index": 0}
    assert of(emitted, events.SUMMARY_PART_ADDED) == [{**at, "part": {"type": "summary_text", "text": ""}}]
    assert of(emitted, events.REASONING_DONE) == [{**at, "text": "First, add the numbers."}]
    assert of(emitted, events.SUMMARY_PART_DONE) == [{**at, "part": done[0]["summary"][0]}]  # no status: completed
    assert of(emitted, events.TEXT_DONE)[0]["text"] == "The answer is 5."


def test_a_reasoning_item_without_text_has_no_summary_part():
    emitted = run(OutputBuilder("resp_1", "text", reasoning=True), ["<think>\n</think>\n", "Hi"])
    assert names(emitted) == [events.ITEM_ADDED, events.ITEM_DONE, *MESSAGE_OPENS, events.TEXT_DELTA,
                              *MESSAGE_ENDS]
    assert emitted[1][1]["item"]["summary"] == []


def test_without_a_reasoning_parser_think_tags_are_plain_text():
    emitted = run(OutputBuilder("resp_1", "text"), ["<think>x</think>", "y"])
    done = [d["item"] for n, d in emitted if n == events.ITEM_DONE]
    assert len(done) == 1 and done[0]["content"][0]["text"] == "<think>x</think>y"


def test_auto_tool_call_is_held_back_and_parsed():
    emitted = run(OutputBuilder("resp_1", "tool_auto"),
                  [" <tool_", 'call>{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}</tool_call>'])
    assert names(emitted) == CALL  # no text deltas leaked
    item = emitted[3][1]["item"]
    assert item["type"] == "function_call" and item["name"] == "get_weather"
    assert json.loads(item["arguments"]) == {"city": "Oslo"}
    assert emitted[0][1]["item"]["arguments"] == ""
    # The arguments are known only once the call is: all of them in one delta, then its done event.
    at = {"response_id": "resp_1", "output_index": 0, "item_id": item["id"]}
    assert emitted[1][1] == {**at, "delta": item["arguments"]}
    assert emitted[2][1] == {**at, "arguments": item["arguments"], "name": "get_weather"}


def test_each_call_of_a_turn_has_its_argument_events_in_order():
    emitted = run(OutputBuilder("resp_1", "tool_auto"), [
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n<tool_call>{"name": "b", "arguments": {}}'
        '</tool_call>'])
    assert names(emitted) == CALL * 2
    assert [d["output_index"] for _, d in emitted] == [0] * 4 + [1] * 4
    assert [(d["name"], d["arguments"]) for d in of(emitted, events.ARGUMENTS_DONE)] == [("a", '{"x": 1}'), ("b", "{}")]


def test_a_forced_call_has_its_argument_events():
    emitted = run(OutputBuilder("resp_1", "tool_forced"), ['{"name": "b", ', '"arguments": {"q": "é"}}'])
    assert names(emitted) == CALL
    item = emitted[3][1]["item"]
    assert item["name"] == "b" and item["arguments"] == '{"q": "é"}' == emitted[1][1]["delta"]
    assert emitted[2][1] == {"response_id": "resp_1", "output_index": 0, "item_id": item["id"],
                             "arguments": '{"q": "é"}', "name": "b"}


def test_auto_mode_plain_answer_streams_and_malformed_call_stays_text():
    emitted = run(OutputBuilder("resp_1", "tool_auto"), ["Hello", " there"])
    assert [d["delta"] for n, d in emitted if n == events.TEXT_DELTA] == ["Hello", " there"]
    emitted = run(OutputBuilder("resp_1", "tool_auto"), ["<tool_call>{not json</tool_call>"])
    done = [d["item"] for n, d in emitted if n == events.ITEM_DONE]
    assert done[0]["type"] == "message" and done[0]["content"][0]["text"] == "<tool_call>{not json</tool_call>"


def test_empty_generation_still_answers_one_message():
    emitted = run(OutputBuilder("resp_1", "text"), [])
    assert names(emitted) == [*MESSAGE_OPENS, *MESSAGE_ENDS]
    empty = {"type": "output_text", "text": "", "annotations": []}
    assert emitted[4][1]["item"]["content"] == [empty]
    # before any delta: the OpenAI SDK's helper
    assert emitted[1][1]["part"] == empty
    assert emitted[2][1]["text"] == "" and emitted[3][1]["part"] == empty  # its done events all the same


def test_items_are_in_progress_until_done_and_incomplete_when_cut():
    builder = OutputBuilder("resp_1", "text", reasoning=True)
    emitted = sent(builder.feed("<think>hm</think>Once upon") + builder.finish(cut=True))
    assert [d["item"]["status"] for n, d in emitted if n == events.ITEM_ADDED] == ["in_progress"] * 2
    # The reasoning ended before the token limit; the message did not.
    assert [d["item"]["status"] for n, d in emitted if n == events.ITEM_DONE] == ["completed", "incomplete"]
    assert [item["status"] for item in builder.items] == ["completed", "incomplete"]
    calls = run(OutputBuilder("resp_1", "tool_auto"), ['<tool_call>{"name": "f", "arguments": {}}</tool_call>'])
    assert [d["item"]["status"] for n, d in calls if "item" in d] == ["in_progress", "completed"]


def test_a_cut_item_gets_its_done_events_with_the_text_it_has():
    emitted = sent((builder := OutputBuilder("resp_1", "text", reasoning=True)).feed("<think>hm</think>Once upon")
                   + builder.finish(cut=True))
    assert names(emitted) == [events.ITEM_ADDED, events.SUMMARY_PART_ADDED, events.REASONING_DELTA, *SUMMARY_ENDS,
                              *MESSAGE_OPENS, events.TEXT_DELTA, *MESSAGE_ENDS]
    assert "status" not in of(emitted, events.SUMMARY_PART_DONE)[0]  # the reasoning ended before the cut
    assert of(emitted, events.TEXT_DONE)[0]["text"] == "Once upon"
    assert of(emitted, events.PART_DONE)[0]["part"] == builder.items[1]["content"][0]
    # Cut while reasoning: its part is done, incomplete (as OpenAI's event says it), and no message follows.
    emitted = run(OutputBuilder("resp_1", "text", reasoning=True), ["<think>Let me", " thi"], cut=True)
    assert names(emitted) == [events.ITEM_ADDED, events.SUMMARY_PART_ADDED, events.REASONING_DELTA,
                              events.REASONING_DELTA, *SUMMARY_ENDS]
    assert of(emitted, events.REASONING_DONE)[0]["text"] == "Let me thi"
    assert of(emitted, events.SUMMARY_PART_DONE)[0]["part"] == {"type": "summary_text", "text": "Let me thi"}
    assert of(emitted, events.SUMMARY_PART_DONE)[0]["status"] == "incomplete"
    assert of(emitted, events.ITEM_DONE)[0]["item"]["status"] == "incomplete"
    # Cut before any text: an empty message, incomplete, with its done events.
    emitted = run(OutputBuilder("resp_1", "text"), [], cut=True)
    assert names(emitted) == [*MESSAGE_OPENS, *MESSAGE_ENDS] and emitted[2][1]["text"] == ""
    assert emitted[4][1]["item"]["status"] == "incomplete"


def test_replay_rebuilds_state_and_continues_the_same_item():
    first = OutputBuilder("resp_1", "text")
    logged = sent(first.feed("Once upon"))
    resumed = OutputBuilder("resp_1", "text")
    for name, data in logged:
        resumed.replay(name, json.loads(json.dumps(data)))
    assert resumed.raw == "Once upon"
    emitted = sent(resumed.feed(" a time") + resumed.finish())
    assert emitted[0] == (events.TEXT_DELTA, {"response_id": "resp_1", "output_index": 0,
                                              "item_id": logged[0][1]["item"]["id"], "content_index": 0,
                                              "delta": " a time", "logprobs": []})
    assert resumed.items[0]["content"][0]["text"] == "Once upon a time"


NEW_KINDS = {events.TEXT_DONE, events.PART_DONE, events.SUMMARY_PART_ADDED, events.REASONING_DONE,
             events.SUMMARY_PART_DONE, events.ARGUMENTS_DELTA, events.ARGUMENTS_DONE}
REASONED = ["<think>\nFirst, add", " the numbers.", "</think>\n", "The answer", " is 5."]


def state(builder) -> dict:
    return {name: json.loads(json.dumps(getattr(builder, name)))
            for name in ("items", "open", "held", "buffer", "raw", "thinking")}


@pytest.mark.parametrize("mode, chunks, at, logged_kinds, goes_on", [
    # mid-reasoning: its summary part was opened (and logged) with its first delta
    ("text", REASONED, 1, [events.ITEM_ADDED, events.SUMMARY_PART_ADDED, events.REASONING_DELTA],
     [events.REASONING_DELTA, *SUMMARY_ENDS, *MESSAGE_OPENS, events.TEXT_DELTA, events.TEXT_DELTA, *MESSAGE_ENDS]),
    # between the items: the reasoning's done events are in the log
    ("text", REASONED, 3, [events.ITEM_ADDED, events.SUMMARY_PART_ADDED, events.REASONING_DELTA,
                           events.REASONING_DELTA, *SUMMARY_ENDS],
     [*MESSAGE_OPENS, events.TEXT_DELTA, events.TEXT_DELTA, *MESSAGE_ENDS]),
    # mid-message
    ("text", REASONED, 4, [events.ITEM_ADDED, events.SUMMARY_PART_ADDED, events.REASONING_DELTA,
                           events.REASONING_DELTA, *SUMMARY_ENDS, *MESSAGE_OPENS, events.TEXT_DELTA],
     [events.TEXT_DELTA, *MESSAGE_ENDS]),
])
def test_replay_of_the_new_events_resumes_identically(monkeypatch, mode, chunks, at, logged_kinds, goes_on):
    """A job resumed from the log (``on_restart: resume``) goes on as the first would have: the same
    state as a replay of the spec's events alone (the log before these events were sent), and the same
    events after it."""
    ids = itertools.count()
    monkeypatch.setattr("worker.output.new_id", lambda kind: f"{kind}_{next(ids)}")
    first = OutputBuilder("resp_1", mode, reasoning=True)
    logged = sent([event for chunk in chunks[:at] for event in first.feed(chunk)])
    assert names(logged) == logged_kinds
    resumed, before = OutputBuilder("resp_1", mode, reasoning=True), OutputBuilder("resp_1", mode, reasoning=True)
    for name, data in logged:
        resumed.replay(name, json.loads(json.dumps(data)))
        if name not in NEW_KINDS:
            before.replay(name, json.loads(json.dumps(data)))
    assert state(resumed) == state(before)
    assert state(resumed)["items"] == state(first)["items"] and resumed.open == first.open
    mark = next(ids)

    def rest(builder):
        nonlocal ids
        ids = itertools.count(mark)  # the same ids for the items made from here on
        return sent([event for chunk in chunks[at:] for event in builder.feed(chunk)] + builder.finish())

    went_on = rest(first)
    assert names(went_on) == goes_on and rest(resumed) == went_on
    assert resumed.items == first.items


def test_replay_of_a_finished_call_rebuilds_it():
    first = OutputBuilder("resp_1", "tool_auto")
    logged = run(first, ['<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'])
    resumed = OutputBuilder("resp_1", "tool_auto")
    for name, data in logged:
        resumed.replay(name, data)
    assert names(logged) == CALL and resumed.items == first.items and resumed.open is None
    assert resumed.raw == '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'


def test_forced_tool_schemas():
    tools = [{"type": "function", "name": "a", "parameters": {"type": "object"}},
             {"type": "function", "name": "b", "parameters": {"type": "object"}}]
    base = {"model": "m", "input": [{"type": "message", "role": "user", "content": "x"}], "tools": tools}
    named = ResponseRequest.model_validate({**base, "tool_choice": {"type": "function", "name": "b"}})
    assert tool_mode(named) == "b"
    assert [s["properties"]["name"]["const"] for s in tool_call_schema(named)["anyOf"]] == ["b"]
    required = ResponseRequest.model_validate({**base, "tool_choice": "required"})
    assert len(tool_call_schema(required)["anyOf"]) == 2
    assert tool_call_schema(ResponseRequest.model_validate(base)) is None


def test_a_nul_from_the_model_cannot_fail_the_response():
    emitted = run(OutputBuilder("resp_1", "text"), ["a\x00", "b"])
    text = [d["item"] for n, d in emitted if n == events.ITEM_DONE][0]["content"][0]["text"]
    assert text == "a\ufffdb" and "\\u0000" not in json.dumps(emitted)
