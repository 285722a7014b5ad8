"""The OpenAI SDK with ``_strict_response_validation`` against the api (its WSGI app, the fake worker):
every object and event it reads validates against its models, so user code that relies on a member
OpenAI always sends (``for t in r.tools``, a message's ``status``, a part's ``annotations``) works; and
the request members OpenAI's clients send (``parallel_tool_calls``, ``metadata``) are taken."""

import httpx2
import openai
import pytest

from tests.unit.conftest import MODEL, problem, request_body, task_body
from tests.unit.fake import FakeWorker

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


@pytest.fixture
def sdk(unit, alice):
    client = openai.OpenAI(base_url="http://unit/lmsp/v1", api_key=alice.secret, max_retries=0,
                           _strict_response_validation=True,
                           http_client=httpx2.Client(transport=httpx2.WSGITransport(app=unit.app)))
    yield client
    client.close()


def test_create_and_retrieve_validate_and_echo_the_request(unit, sdk):
    with FakeWorker(unit.sessions, MODEL, text="Hello there"):
        made = sdk.responses.create(model=MODEL, input="hi", store=True, tools=[WEATHER],
                                    parallel_tool_calls=True, metadata={"k": "v"})
        plain = sdk.responses.create(model=MODEL, input="hi")
    assert [t.name for t in made.tools] == ["get_weather"] and made.tool_choice == "auto"
    assert made.parallel_tool_calls is True and made.metadata == {"k": "v"}
    message = made.output[0]
    assert message.status == "completed" and message.content[0].annotations == []
    assert made.output_text == "Hello there" and made.usage.output_tokens_details.reasoning_tokens == 0
    # A request that named none of them: OpenAI's defaults.
    assert plain.tools == [] and plain.tool_choice == "auto" and plain.parallel_tool_calls is True
    assert plain.metadata == {}
    assert sdk.responses.retrieve(made.id).to_dict() == made.to_dict()


def test_the_stream_helper_validates_every_event(unit, sdk):
    with FakeWorker(unit.sessions, MODEL, text="Hello there"):
        with sdk.responses.stream(model=MODEL, input="hi", store=True, metadata={"run": "7"}) as stream:
            seen = list(stream)
            final = stream.get_final_response()
    assert final.output_text == "Hello there" and final.metadata == {"run": "7"} and final.tools == []
    stored = sdk.responses.retrieve(final.id)
    assert stored.metadata == final.metadata and stored.output_text == final.output_text
    assert [e.type for e in seen] == [
        "response.created", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    added, part, _, text_done, part_done, done = seen[1:7]
    # The items and parts the events carry are the final object's, as they were at that moment.
    assert added.item.status == "in_progress" and added.item.content == []
    assert part.part.to_dict() == {"type": "output_text", "text": "", "annotations": []}
    assert done.item.to_dict() == stored.output[0].to_dict()
    assert text_done.text == "Hello there" and text_done.logprobs == []
    assert part_done.part.to_dict() == stored.output[0].content[0].to_dict()


@pytest.mark.parametrize("mode, chunks, cut", [
    ("text", ["<think>hm", "</think>Hello", " there"], False),
    ("text", ["<think>hm"], True),
    ("text", [], True),
    ("tool_auto", ['<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'], False),
    ("tool_forced", ['{"name": "get_weather", "arguments": {}}'], False),
])
def test_every_item_events_validate_as_the_sdks_events(mode, chunks, cut):
    """What strict validation does to each event of a stream (the fake worker above answers plain text):
    the reasoning and function call events too, and those a replayed stream makes (``of_response``)."""
    import json

    from openai._models import validate_type
    from openai.types.responses import ResponseStreamEvent

    from common import events
    from worker.output import OutputBuilder

    builder = OutputBuilder("resp_1", mode, reasoning=True)
    emitted = [event for chunk in chunks for event in builder.feed(chunk)] + builder.finish(cut=cut)
    replayed = events.of_response({"id": "resp_1", "object": "response", "created_at": 1, "model": MODEL,
                                   "status": "completed", "output": builder.items, "usage": None, "error": None})
    frames = [*events.Sequence().number(emitted), *replayed[1:-1]]
    assert {name for _, name, _ in frames} - {events.ITEM_ADDED, events.ITEM_DONE, events.PART_ADDED,
                                              events.TEXT_DELTA, events.REASONING_DELTA}  # the new ones
    for seq, name, data in frames:
        event = validate_type(type_=ResponseStreamEvent, value=json.loads(events.typed(seq, name, data)))
        assert event.type == name and event.sequence_number == seq


def test_the_events_that_end_a_lost_direct_response_are_taken_by_the_sdks_stream_helper(unit):
    """A direct response a database crash lost (its row committed lazily) ends with events the api makes
    up: its final event had no response object, and the SDK's stream helper reads the id of every
    lifecycle event's (``event.response.id``): it raised AttributeError."""
    import json

    from openai import omit
    from openai._models import (
        construct_type,  # as the SDK reads a stream (strict: our codes are not OpenAI's)
    )
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent

    from api.services.work import DirectWatch
    from common import events

    svc = unit.app.extensions["lmsp"]
    ending = DirectWatch(svc, "resp_01LOST", svc.registry.get(MODEL))()
    frames = events.Sequence().closing(ending)
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for seq, name, data in frames:
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=json.loads(events.typed(seq, name, data))))
    assert [name for _, name, _ in frames] == ["response.created", "response.failed"]
    assert json.loads(frames[-1][2])["response"]["error"]["code"] == "server_restarted"


def test_openais_request_members_are_taken_and_the_response_repeats_them(unit, sdk):
    """What an OpenAI client sends that LMSP spells otherwise or does not need: ``developer`` (the system
    role's newer name), ``top_p`` 1, JSON mode, ``user``, ``truncation: disabled``, ``stream_options``;
    the response repeats ``instructions``, ``temperature``, ``top_p`` and ``background`` as OpenAI's does."""
    from api.services import background
    from common.tables import Response

    made = sdk.responses.create(model=MODEL, background=True, store=True, instructions="Be brief.",
                                temperature=0.5, top_p=1, user="u-1", truncation="disabled",
                                text={"format": {"type": "json_object"}},
                                input=[{"role": "developer", "content": "Answer in JSON."},
                                       {"role": "user", "content": "hi"}])
    assert (made.instructions, made.temperature, made.top_p, made.background) == ("Be brief.", 0.5, 1, True)
    assert sdk.responses.retrieve(made.id).instructions == "Be brief."
    with unit.sessions() as session:
        request = session.get(Response, made.id).request
        assert background.task_of(session, made.id) is not None
    assert [m["role"] for m in request["input"]] == ["system", "system", "user"]
    assert request["response_format"]["json_schema"]["schema"] == {"type": "object"}
    plain = sdk.responses.create(model=MODEL, input="hi", background=True, store=True)
    assert (plain.instructions, plain.temperature, plain.top_p, plain.background) == (None, None, None, True)
    with FakeWorker(unit.sessions, MODEL):
        direct = sdk.responses.create(model=MODEL, input="hi", stream_options={"include_obfuscation": False})
        hinted = sdk.responses.create(model=MODEL, input="hi", service_tier="auto", prompt_cache_key="k-1",
                                      safety_identifier="u-1", include=["reasoning.encrypted_content"])
    assert direct.background is False and direct.status == "completed" and hinted.status == "completed"


def test_what_the_sdks_helpers_return_goes_back_as_history(unit, sdk):
    """``parse`` and the stream helpers add ``parsed`` to a text part and ``parsed_arguments`` to a function
    call (the Node SDK too, and ``parsed`` to a chat message): sending such output back as the next
    request's input is how a client keeps a conversation by hand. The input items list shows those items
    with the members OpenAI's items have."""
    from api.chat_completions import response_body

    history = [{"role": "user", "content": "hi"},
               {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": '{"a": 1}', "annotations": [], "logprobs": [],
                             "parsed": {"a": 1}}]},
               {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
                "arguments": '{"city": "Oslo"}', "parsed_arguments": {"city": "Oslo"}, "status": "completed"},
               {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
               {"role": "assistant", "content": "Sunny."},
               {"role": "user", "content": "thanks"}]
    made = sdk.responses.create(model=MODEL, input=history, tools=[WEATHER], background=True, store=True)
    listed = sdk.responses.input_items.list(made.id, order="asc").data  # each item strictly validated
    assert [item.type for item in listed] == ["message", "message", "function_call", "function_call_output",
                                              "message", "message"]
    assert listed[4].status == "completed" and listed[4].content[0].annotations == []  # sent as a string
    assert listed[3].status == "completed"
    chat, _ = response_body({"model": MODEL, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": '{"a": 1}', "refusal": None, "parsed": {"a": 1}, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{}", "parsed_arguments": {}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]})
    assert chat.messages[1].parsed == {"a": 1}


def test_models_validate(sdk):
    listed = sdk.models.list().data
    assert MODEL in [m.id for m in listed]
    assert all(isinstance(m.created, int) and m.owned_by for m in listed)


@pytest.mark.parametrize("metadata, param", [
    ({f"k{i}": "v" for i in range(17)}, "metadata"),
    ({"k" * 65: "v"}, "metadata"),
    ({"k": "v" * 513}, "metadata.k"),
    ({"k": 1}, "metadata.k"),
    (["k"], "metadata"),
])
def test_metadata_beyond_openais_limits_is_refused(alice, metadata, param):
    doc = problem(alice.post("/lmsp/v1/responses", request_body(metadata=metadata)), 400, "invalid_request")
    assert doc["param"] == param or doc["param"].startswith(param + "."), doc


def test_metadata_at_openais_limits_is_taken(alice):
    metadata = {f"{i:02}" + "k" * 62: "v" * 512 for i in range(16)}
    made = alice.post("/lmsp/v1/tasks", task_body(store=True, metadata=metadata))
    assert made.status_code == 202, made.get_json()
    assert alice.get(f"/lmsp/v1/responses/{made.get_json()['response_id']}").get_json()["metadata"] == metadata


def test_parallel_tool_calls_false_is_refused_as_chat_completions_does(alice):
    for path, body in (("/lmsp/v1/responses", request_body(parallel_tool_calls=False)),
                       ("/lmsp/v1/chat/completions", {"model": MODEL, "parallel_tool_calls": False,
                                                      "messages": [{"role": "user", "content": "hi"}]})):
        assert problem(alice.post(path, body), 400, "invalid_request")["param"] == "parallel_tool_calls"


def test_a_tasks_response_keeps_its_metadata(alice):
    made = alice.post("/lmsp/v1/tasks", task_body(store=True, parallel_tool_calls=True,
                                                  metadata={"ticket": "T-1"}))
    assert made.status_code == 202, made.get_json()
    shown = alice.get(f"/lmsp/v1/responses/{made.get_json()['response_id']}").get_json()
    assert shown["metadata"] == {"ticket": "T-1"} and shown["parallel_tool_calls"] is True


def test_rows_stored_before_the_echo_show_the_tools_their_request_named(tmp_path):
    """Migration 0011 fills the echo of earlier rows from their requests (SQLite here; Postgres in
    tests/functional/test_migrations.py's upgrade of filled databases)."""
    import json

    from sqlalchemy import text

    from common.db import make_engine, upgrade
    from common.resources import response_model
    from common.tables import Response

    url = f"sqlite:///{tmp_path / 'old.db'}"
    upgrade(url, "0010")
    engine = make_engine(url)
    choice = {"type": "function", "name": "get_weather"}
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO principals (id, created_at) VALUES ('p', 0)"))
        for rid, request in (("resp_tools", {"model": MODEL, "tools": [WEATHER], "tool_choice": choice}),
                             ("resp_plain", {"model": MODEL})):
            conn.execute(text("INSERT INTO responses (id, principal_id, model, request, status, stored, created_at, "
                              "updated_at) VALUES (:id, 'p', :model, :request, 'completed', 1, 0, 0)"),
                         {"id": rid, "model": MODEL, "request": json.dumps(request)})
    upgrade(url)
    with engine.connect() as conn:
        echo = dict(conn.execute(text("SELECT id, echo FROM responses")).all())
    assert json.loads(echo["resp_tools"]) == {"tools": [WEATHER], "tool_choice": choice}
    assert echo["resp_plain"] is None
    shown = response_model(Response(id="resp_tools", created_at=0, model=MODEL, status="completed", output=[],
                                    echo=json.loads(echo["resp_tools"]))).wire()
    assert shown["tools"] == [WEATHER] and shown["tool_choice"] == choice and shown["metadata"] == {}
