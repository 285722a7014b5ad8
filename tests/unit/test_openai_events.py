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
