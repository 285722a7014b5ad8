"""The protocol layer without an engine: text -> items and events, tool calls, reasoning, resume."""

import json

from common import events
from common.prompt import tool_call_schema, tool_mode
from common.protocol import ResponseRequest
from worker.output import OutputBuilder


def sent(emitted) -> list[tuple[str, dict]]:
    """(name, data) of each event as it is sent."""
    return [(event.name, json.loads(events.encode(event))) for event in emitted]


def run(builder, chunks):
    emitted = []
    for chunk in chunks:
        emitted += builder.feed(chunk)
    return sent(emitted + builder.finish())


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


def test_without_a_reasoning_parser_think_tags_are_plain_text():
    emitted = run(OutputBuilder("resp_1", "text"), ["<think>x</think>", "y"])
    done = [d["item"] for n, d in emitted if n == events.ITEM_DONE]
    assert len(done) == 1 and done[0]["content"][0]["text"] == "<think>x</think>y"


def test_auto_tool_call_is_held_back_and_parsed():
    emitted = run(OutputBuilder("resp_1", "tool_auto"),
                  [" <tool_", 'call>{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}</tool_call>'])
    assert [n for n, _ in emitted] == [events.ITEM_ADDED, events.ITEM_DONE]  # no text deltas leaked
    item = emitted[1][1]["item"]
    assert item["type"] == "function_call" and item["name"] == "get_weather"
    assert json.loads(item["arguments"]) == {"city": "Oslo"}
    assert emitted[0][1]["item"]["arguments"] == ""


def test_auto_mode_plain_answer_streams_and_malformed_call_stays_text():
    emitted = run(OutputBuilder("resp_1", "tool_auto"), ["Hello", " there"])
    assert [d["delta"] for n, d in emitted if n == events.TEXT_DELTA] == ["Hello", " there"]
    emitted = run(OutputBuilder("resp_1", "tool_auto"), ["<tool_call>{not json</tool_call>"])
    done = [d["item"] for n, d in emitted if n == events.ITEM_DONE]
    assert done[0]["type"] == "message" and done[0]["content"][0]["text"] == "<tool_call>{not json</tool_call>"


def test_empty_generation_still_answers_one_message():
    emitted = run(OutputBuilder("resp_1", "text"), [])
    assert [n for n, _ in emitted] == [events.ITEM_ADDED, events.PART_ADDED, events.ITEM_DONE]
    assert emitted[2][1]["item"]["content"] == [{"type": "output_text", "text": "", "annotations": []}]
    # before any delta: the OpenAI SDK's helper
    assert emitted[1][1]["part"] == {"type": "output_text", "text": "", "annotations": []}


def test_items_are_in_progress_until_done_and_incomplete_when_cut():
    builder = OutputBuilder("resp_1", "text", reasoning=True)
    emitted = sent(builder.feed("<think>hm</think>Once upon") + builder.finish(cut=True))
    assert [d["item"]["status"] for n, d in emitted if n == events.ITEM_ADDED] == ["in_progress"] * 2
    # The reasoning ended before the token limit; the message did not.
    assert [d["item"]["status"] for n, d in emitted if n == events.ITEM_DONE] == ["completed", "incomplete"]
    assert [item["status"] for item in builder.items] == ["completed", "incomplete"]
    calls = run(OutputBuilder("resp_1", "tool_auto"), ['<tool_call>{"name": "f", "arguments": {}}</tool_call>'])
    assert [d["item"]["status"] for _, d in calls] == ["in_progress", "completed"]


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
