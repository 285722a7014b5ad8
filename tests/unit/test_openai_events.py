"""Our events as the OpenAI SDK's stream helper accumulates them (its ResponseStreamState, without a
server), and the input items page of a stored response (issue 34, items 1 and 3)."""

import json

import pytest
from openai._models import construct_type_unchecked
from openai._types import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from api.services.stored import input_page
from common import events
from common.errors import LMSPError
from common.tables import Response
from tests.unit.conftest import MODEL, problem
from worker.output import OutputBuilder

RID = "resp_01J8M6Q4W2T7N5R3V9X1Z8B0DF"


def response(output, status="completed") -> dict:
    return {"id": RID, "object": "response", "created_at": 1, "status": status, "model": "m", "output": output,
            "usage": {"input_tokens": 3, "output_tokens": 4, "total_tokens": 7}, "error": None,
            "incomplete_details": None, "previous_response_id": None}


def helper(emitted):
    """What the SDK's helper makes of events, numbered and framed as the service sends them."""
    state = ResponseStreamState(text_format=omit, input_tools=omit)
    fired = []
    for seq, name, data in emitted if isinstance(emitted[0], tuple) else events.Sequence().number(emitted):
        fired += state.handle_event(construct_type_unchecked(type_=ResponseStreamEvent,
                                                             value=json.loads(events.typed(seq, name, data))))
    return state, fired


def test_a_generated_stream_gives_the_helper_its_final_response():
    builder = OutputBuilder(RID, "tool_auto", reasoning=True)
    body = [*builder.feed("<think>hm</think>Hello"), *builder.feed(" there"), *builder.finish()]
    final = response(builder.items)
    state, fired = helper([events.ResponseCreated(response_id=RID, response=events.started(final)), *body,
                           events.final(RID, "completed", usage=final["usage"], response=final)])
    deltas = [e for e in fired if e.type == "response.output_text.delta"]
    assert [d.snapshot for d in deltas] == ["Hello", "Hello there"]  # the part the delta's content_index names
    done = state._completed_response
    assert done.output_text == "Hello there" and [i.type for i in done.output] == ["reasoning", "message"]


def test_a_replayed_stream_of_every_item_kind_satisfies_the_helper():
    final = response([{"id": "msg_1", "type": "message", "role": "assistant",
                       "content": [{"type": "output_text", "text": "hi"}]},
                      {"id": "fc_1", "type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}])
    state, fired = helper(events.of_response(final))
    assert fired[0].response.id == RID and fired[-1].type == "response.completed"
    assert state._completed_response.output[1].call_id == "call_1"


def stream(builder, chunks, status="completed"):
    """A response's whole stream as the service sends it: created, the builder's events, its final event."""
    body = [event for chunk in chunks for event in builder.feed(chunk)] + builder.finish(cut=status != "completed")
    final = response(builder.items, status)
    details = {"incomplete_details": {"reason": "max_output_tokens"}} if status == "incomplete" else {}
    return final, [events.ResponseCreated(response_id=RID, response=events.started(final)), *body,
                   events.final(RID, status, usage=final["usage"], response={**final, **details}, **details)]


def test_the_helpers_listeners_get_the_done_and_argument_events():
    """``responses.stream()``'s events (what ``for event in stream`` and a listener see) include each
    text's done event with all of it, and a call's arguments as a delta and a done event."""
    _, sent = stream(OutputBuilder(RID, "text"), ["Hello", " there"])
    state, fired = helper(sent)
    assert [e.type for e in fired] == [
        "response.created", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    text_done, part_done = fired[5], fired[6]
    assert text_done.text == "Hello there" and text_done.content_index == 0 and text_done.item_id == fired[1].item.id
    assert part_done.part.text == "Hello there" and state._completed_response.output_text == "Hello there"

    final, sent = stream(OutputBuilder(RID, "tool_auto"),
                         ['<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'])
    state, fired = helper(sent)
    assert [e.type for e in fired] == [
        "response.created", "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    arguments = final["output"][0]["arguments"]
    assert fired[2].delta == fired[2].snapshot == arguments  # the helper's snapshot: the arguments so far
    assert fired[3].arguments == arguments and fired[3].model_extra["name"] == "get_weather"
    assert state._completed_response.output[0].arguments == arguments


def test_a_reasoning_stream_accumulates_its_summary():
    reasoning = "First, add the numbers."
    _, sent = stream(OutputBuilder(RID, "text", reasoning=True),
                     ["<think>\nFirst, add", " the numbers.</th", "ink>\n", "The answer is 5."])
    state, fired = helper(sent)
    kinds = [e.type for e in fired]
    assert kinds[1:8] == [
        "response.output_item.added", "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.delta", "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.done", "response.reasoning_summary_part.done", "response.output_item.done"]
    opened, text_done, part_done = fired[2], fired[5], fired[6]
    assert (opened.summary_index, opened.part.text) == (0, "")  # opened before the first delta
    assert "".join(e.delta for e in fired[3:5]) == text_done.text == part_done.part.text == reasoning
    done = state._completed_response
    assert done.output[0].summary[0].text == reasoning and done.output_text == "The answer is 5."


@pytest.mark.parametrize("mode, chunks, status", [
    ("text", ["<think>hm</think>Hello there"], "completed"),
    ("tool_auto", ['<tool_call>{"name": "f", "arguments": {"a": [1]}}</tool_call>'], "completed"),
    ("text", ["<think>Let me thi"], "incomplete"),
    ("text", [], "completed"),
])
def test_a_replayed_stream_is_the_live_streams_events(mode, chunks, status):
    """What an Idempotency-Key's replay sends of a finished response (``of_response``) is what its stream
    sent, event for event (each text in one delta: here the live one had one too)."""
    _, live = stream(OutputBuilder(RID, mode, reasoning=True), chunks, status)
    replayed = events.of_response(live[-1].response)  # the final object, as stored
    assert [(name, json.loads(data)) for _, name, data in replayed][1:-1] == [
        (event.name, json.loads(events.encode(event))) for event in live[1:-1]]
    assert helper(replayed)[1][-1].type == f"response.{status}"


def test_without_a_response_on_response_created_the_helper_fails():
    """What the SDK did with the old events (the issue's AttributeError): the test above can fail."""
    with pytest.raises(AttributeError):
        helper([events.ResponseCreated(response_id=RID)])


def _row(items) -> Response:
    return Response(id=RID, request={"input": items})


def test_input_items_pages_in_both_orders_with_stable_ids():
    items = [{"type": "message", "role": "user", "content": f"turn {i}"} for i in range(5)]
    items[2] = {"type": "function_call_output", "call_id": "c", "output": "{}", "id": "fco_given"}
    row = _row(items)
    first = input_page(row, after=None, limit=2, order="asc").wire()
    assert first["has_more"] and [i["id"] for i in first["data"]] == [first["first_id"], first["last_id"]]
    assert first["data"][0]["content"] == [{"type": "input_text", "text": "turn 0"}]
    second = input_page(row, after=first["last_id"], limit=2, order="asc").wire()
    assert second["first_id"] == "fco_given" and second["has_more"]
    last = input_page(row, after=second["last_id"], limit=2, order="asc").wire()
    assert len(last["data"]) == 1 and not last["has_more"]
    newest = input_page(row, after=None, limit=20, order="desc").wire()
    assert [i["id"] for i in newest["data"]] == [i["id"] for i in reversed(
        first["data"] + second["data"] + last["data"])]
    assert input_page(row, after=None, limit=20, order="desc").wire() == newest  # ids made the same way each time
    empty = input_page(row, after=newest["last_id"], limit=20, order="desc").wire()
    assert empty == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}
    with pytest.raises(LMSPError) as caught:
        input_page(row, after="msg_nope", limit=20, order="desc")
    assert caught.value.code == "invalid_request" and caught.value.param == "after"


def test_the_sdks_errors_say_what_the_problem_says(unit, alice):
    """The SDK puts an error body's ``message`` in the exception's text (else only "Error code: 404"),
    and its ``code``, ``param`` and ``type`` in the exception, from the body's ``error`` member when it has
    one (the only place the Node SDK looks): every problem document carries its ``detail`` there too."""
    import httpx2
    import openai

    sdk = openai.OpenAI(base_url="http://unit/lmsp/v1", api_key=alice.secret, max_retries=0,
                        http_client=httpx2.Client(transport=httpx2.WSGITransport(app=unit.app)))
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.responses.retrieve("resp_" + "0" * 26)
    assert missing.value.code == "response_not_found" and missing.value.type == "not_found_error"
    detail = missing.value.response.json()["detail"]
    assert detail.startswith("No stored response") and str(missing.value) == f"Error code: 404 - {detail}"
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.responses.create(model=MODEL, input="hi", max_output_tokens=-1)
    assert bad.value.param == "max_output_tokens" and bad.value.type == "invalid_request_error"
    assert bad.value.response.json()["detail"] in str(bad.value)
    with pytest.raises(openai.AuthenticationError) as unknown:
        sdk.with_options(api_key="not-a-token").models.list()
    assert unknown.value.code == "unauthorized" and unknown.value.response.json()["detail"] in str(unknown.value)


def test_a_background_responses_stream_resumes_from_last_event_id(unit, alice):
    """An SSE client reconnects by sending Last-Event-ID by itself (6.4): GET /responses/{id}?stream=true
    resumes after it, as the task's events do; ``starting_after`` wins over it."""
    from api.services import background
    from common.tables import Task
    from tests.harness import parse_sse

    made = alice.post("/lmsp/v1/responses", {"model": MODEL, "input": "hi", "background": True,
                                               "store": True}).get_json()
    with unit.sessions() as session:
        task = session.get(Task, background.task_of(session, made["id"]).id)
    rid = made["id"]
    alice.log(task, [events.TextDelta(response_id=rid, output_index=0, item_id="msg_1", delta="a"),
                     events.TextDelta(response_id=rid, output_index=0, item_id="msg_1", delta="b"),
                     events.final(rid, "completed", usage={})], first=2)  # #1: its creation logged it

    def ids(query: str, **headers) -> list[int]:
        resp = alice.get(f"/lmsp/v1/responses/{rid}?stream=true{query}", headers=headers)
        assert resp.status_code == 200, resp.get_data(as_text=True)
        return [seq for seq, _, _ in parse_sse(resp.get_data(as_text=True).splitlines())]

    assert ids("") == [1, 2, 3, 4]
    assert ids("", **{"Last-Event-ID": "2"}) == [3, 4]
    assert ids("&starting_after=3", **{"Last-Event-ID": "1"}) == [4]
    problem(alice.get(f"/lmsp/v1/responses/{rid}?stream=true", headers={"Last-Event-ID": "x"}), 400,
            "invalid_request")
