"""The OpenAI Python SDK, unchanged, against the real stack (issue 34, items 1-3): api under gunicorn,
Postgres, Redis, Celery and a worker on the simulated engine (what is tested is the api's events and
resources, not the engine's text), in a stack of this module's own so that its worker can be killed."""

import asyncio
import json
import signal
import time
import uuid
from types import SimpleNamespace

import openai
import pytest
from pydantic import BaseModel

from tests.harness import CHECKPOINT, Stack, model_entry, user, wait_for

pytestmark = pytest.mark.skipif(not (CHECKPOINT / "config.json").exists(), reason="default model not imported")

# 80 tokens/s a stream. The model's answers end by themselves after 8-24 tokens (completed, as the stream
# helper's get_final_response needs); the long model's run to max_output_tokens: 1,000 of them take long
# enough to cancel or kill.
LONG = {"kind": "sim", "max_num_seqs": 8, "ttft_ms": 20, "tokens_per_s": 80, "tick_ms": 20}
ENGINE = {**LONG, "stop_after": [8, 24]}
ENDED = ("completed", "incomplete", "failed", "cancelled")
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def sim(tmp_path_factory, pg_url):
    run = uuid.uuid4().hex[:6]
    model, long = f"sim:o{run}", f"sim:l{run}"
    stack = Stack(tmp_path_factory.mktemp("sdk"), pg_url, models=[model_entry(model, engine=ENGINE),
                                                                  model_entry(long, engine=LONG)])
    try:
        stack.start_worker(model, f"sdk-{model}")
        worker_id = f"sdk-{long}"
        proc = stack.start_worker(long, worker_id)
        base = stack.start_api()
        yield SimpleNamespace(stack=stack, model=model, long=long, worker_id=worker_id, worker=proc, base=base,
                              olga=stack.token("sdk-olga"), pete=stack.token("sdk-pete"))
    finally:
        stack.close()


def client(sim, who: str = "olga", cls=openai.OpenAI):
    return cls(base_url=f"{sim.base}/lmsp/v1", api_key=getattr(sim, who), max_retries=0, timeout=120)


@pytest.fixture
def sdk(sim):
    return client(sim)


def plain(obj) -> dict:
    """An SDK object as a dict, without the members the SDK's parsing adds (``parsed``)."""
    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in ("parsed", "parsed_arguments")}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value
    return strip(obj.to_dict())


def settle(sdk, response_id: str, timeout: float = 120):
    deadline = time.time() + timeout
    while (got := sdk.responses.retrieve(response_id)).status not in ENDED:
        assert time.time() < deadline, got
        time.sleep(0.2)
    return got


def test_create_with_string_and_array_input(sdk, sim):
    first = sdk.responses.create(model=sim.model, input="Name three colors.", max_output_tokens=20, store=True)
    assert first.id.startswith("resp_") and first.status == "completed" and first.output_text
    assert plain(sdk.responses.retrieve(first.id)) == plain(first)
    for items in ([{"role": "user", "content": "Name three colors."}], user("Name three colors.")):
        again = sdk.responses.create(model=sim.model, input=items, max_output_tokens=20)
        assert again.output_text == first.output_text  # the same prompt, whichever spelling


def test_stream_helper_final_response_is_the_stored_one(sdk, sim):
    with sdk.responses.stream(model=sim.model, input="Write about the sea.", max_output_tokens=40,
                              store=True) as stream:
        seen = list(stream)
        final = stream.get_final_response()
    deltas = [e for e in seen if e.type == "response.output_text.delta"]
    assert deltas and deltas[-1].snapshot == final.output_text  # the helper built the text from our deltas
    assert seen[0].type == "response.created" and seen[0].response.id == final.id
    assert plain(final) == plain(sdk.responses.retrieve(final.id))


def test_a_plain_stream_ends_with_the_response_on_its_final_event(sdk, sim):
    with sdk.responses.create(model=sim.model, input="Write about rivers.", max_output_tokens=30,
                              stream=True) as stream:
        seen = list(stream)
    assert [e.sequence_number for e in seen] == list(range(1, len(seen) + 1))
    assert seen[0].response.status == "in_progress" and seen[0].response.output == []
    last = seen[-1]
    assert last.type == "response.completed" and last.response.status == "completed"
    text = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
    assert text and last.response.output_text == text
    # The event's usage is 6.3's counts; the response object's has OpenAI's details besides.
    assert {name: getattr(last.response.usage, name) for name in last.usage} == last.usage


def test_strict_validation_of_what_the_sdk_reads(sim):
    """With ``_strict_response_validation`` every object and event is validated against the SDK's
    models: the members OpenAI always sends (a response's tools, tool_choice, parallel_tool_calls, an
    item's status, a part's annotations, a model's created and owned_by) are all there."""
    strict = openai.OpenAI(base_url=f"{sim.base}/lmsp/v1", api_key=sim.olga, max_retries=0, timeout=120,
                           _strict_response_validation=True)
    made = strict.responses.create(model=sim.model, input="Name three colors.", max_output_tokens=20, store=True,
                                   tools=[WEATHER], parallel_tool_calls=True, metadata={"ticket": "T-1"})
    assert [t.name for t in made.tools] == ["get_weather"] and made.tool_choice == "auto"
    assert made.parallel_tool_calls is True and made.metadata == {"ticket": "T-1"}
    assert made.output[0].status in ("completed", "incomplete") and made.output[0].content[0].annotations == []
    assert plain(strict.responses.retrieve(made.id)) == plain(made)
    with strict.responses.stream(model=sim.model, input="Write about the sea.", max_output_tokens=40,
                                 store=True, metadata={"run": "1"}) as stream:
        seen = list(stream)
        final = stream.get_final_response()
    done = [e.item for e in seen if e.type == "response.output_item.done"]
    assert final.metadata == {"run": "1"} and plain(final) == plain(strict.responses.retrieve(final.id))
    assert [item.to_dict() for item in done] == [plain(item) for item in final.output]
    assert all(isinstance(m.created, int) and m.owned_by for m in strict.models.list().data)
    strict.close()


def test_background_create_poll_stream_and_resume_the_stream(sdk, sim):
    made = sdk.responses.create(model=sim.model, input="Tell a story.", max_output_tokens=60, background=True,
                                store=True)
    assert made.status == "queued" and made.output == []
    done = settle(sdk, made.id)
    assert done.status == "completed" and done.output_text
    whole = list(sdk.responses.retrieve(made.id, stream=True))  # from response.created, after the end
    assert [e.sequence_number for e in whole] == list(range(1, len(whole) + 1))
    assert whole[0].type == "response.created" and whole[0].response.status == "queued"
    assert whole[-1].type == "response.completed" and plain(whole[-1].response) == plain(done)
    rest = list(sdk.responses.retrieve(made.id, stream=True, starting_after=3))
    assert [e.sequence_number for e in rest] == [e.sequence_number for e in whole[3:]]
    with sdk.responses.stream(response_id=made.id) as stream:  # the helper replays it and filters itself
        assert plain(stream.get_final_response()) == plain(done)
    with sdk.responses.stream(response_id=made.id, starting_after=3) as stream:
        assert [e.sequence_number for e in stream][0] == 4
    again = sdk.responses.create(model=sim.model, input="Tell a story.", max_output_tokens=60, background=True,
                                 store=True, extra_headers={"Idempotency-Key": made.id})
    assert sdk.responses.create(model=sim.model, input="Tell a story.", max_output_tokens=60, background=True,
                                store=True, extra_headers={"Idempotency-Key": made.id}).id == again.id
    with sdk.responses.create(model=sim.model, input="Tell a story.", max_output_tokens=60, background=True,
                              store=True, stream=True) as stream:  # created and followed at once
        streamed = list(stream)
    assert streamed[0].response.status == "queued" and streamed[-1].type == "response.completed"
    assert streamed[-1].response.output_text == done.output_text  # the same prompt, the same text


def test_background_cancel_is_idempotent(sdk, sim):
    made = sdk.responses.create(model=sim.long, input="Write a long essay.", max_output_tokens=1000,
                                background=True, store=True)
    wait_for(lambda: sdk.responses.retrieve(made.id).status == "in_progress", 60, "never started")
    cancelled = sdk.responses.cancel(made.id)
    assert cancelled.status == "cancelled" and cancelled.id == made.id
    assert plain(sdk.responses.cancel(made.id)) == plain(cancelled) == plain(sdk.responses.retrieve(made.id))
    events = list(sdk.responses.retrieve(made.id, stream=True))
    assert events[-1].type == "response.cancelled" and events[-1].response["status"] == "cancelled"  # not an SDK type
    direct = sdk.responses.create(model=sim.model, input="hi", max_output_tokens=5, store=True)
    with pytest.raises(openai.BadRequestError):  # only background responses can be cancelled
        sdk.responses.cancel(direct.id)


def test_a_background_response_survives_its_worker_killed(sdk, sim):
    """on_restart resume (the default here): the text goes on where the log ends, the items and numbers
    continue, and it is the same text an uninterrupted run gives (the simulator's text is a function of
    its prompt and what came before)."""
    ask = dict(model=sim.long, input="Tell me everything about lighthouses.", max_output_tokens=200,
               store=True, background=True)
    whole = settle(sdk, sdk.responses.create(**ask).id)
    made = sdk.responses.create(**ask, extra_body={"extensions": {"x-lmsp-on-restart": "resume"}})
    with sdk.responses.retrieve(made.id, stream=True) as stream:
        for event in stream:
            if event.type == "response.output_text.delta" and event.sequence_number >= 20:
                break
    sim.stack.stop(sim.worker, signal.SIGKILL)
    assert sdk.responses.retrieve(made.id).status == "in_progress"  # nobody runs it now
    sim.worker = sim.stack.start_worker(sim.long, sim.worker_id)  # its boot hands the task on: resume
    done = settle(sdk, made.id)
    assert done.status == "incomplete" and done.output_text == whole.output_text
    events = list(sdk.responses.retrieve(made.id, stream=True))
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    assert [e.type for e in events].count("response.output_item.added") == 1
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert plain(events[-1].response) == plain(done)


def test_input_items_pages(sdk, sim):
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(5)]
    made = sdk.responses.create(model=sim.model, input=turns, max_output_tokens=5, store=True)
    page = sdk.responses.input_items.list(made.id, order="asc", limit=2)
    assert [item.content[0].text for item in page.data] == ["turn 0", "turn 1"]
    assert page.has_more and page.first_id == page.data[0].id and page.last_id == page.data[1].id
    every = [item.content[0].text for item in sdk.responses.input_items.list(made.id, order="asc", limit=2)]
    assert every == [f"turn {i}" for i in range(5)]  # the SDK's auto-paging follows after=last_id
    newest = sdk.responses.input_items.list(made.id)  # desc, 20
    assert [item.content[0].text for item in newest.data] == [f"turn {i}" for i in reversed(range(5))]
    assert not newest.has_more and newest.data[0].id == newest.first_id
    assert [i.id for i in sdk.responses.input_items.list(made.id).data] == [i.id for i in newest.data]  # stable
    for bad in ({"limit": 0}, {"limit": 101}, {"order": "sideways"}, {"after": "msg_nope"}):
        with pytest.raises(openai.BadRequestError) as caught:
            sdk.responses.input_items.list(made.id, **bad)
        assert caught.value.body["code"] == "invalid_request" and caught.value.body["param"] == next(iter(bad))


def test_delete_and_tenancy(sdk, sim):
    made = sdk.responses.create(model=sim.model, input="Hello.", max_output_tokens=5, store=True)
    other = client(sim, "pete")
    for call in (other.responses.retrieve, other.responses.delete, other.responses.input_items.list,
                 other.responses.cancel):
        with pytest.raises(openai.NotFoundError):
            call(made.id)
    assert sdk.responses.delete(made.id) is None
    for call in (sdk.responses.retrieve, sdk.responses.delete, sdk.responses.input_items.list):
        with pytest.raises(openai.NotFoundError):
            call(made.id)
    with pytest.raises(openai.NotFoundError):  # previous_response_id cannot read it either
        sdk.responses.create(model=sim.model, input="Again.", previous_response_id=made.id, max_output_tokens=5)


def test_deleting_a_running_background_response_cancels_it(sdk, sim):
    made = sdk.responses.create(model=sim.long, input="Write a long essay.", max_output_tokens=1000,
                                background=True, store=True)
    wait_for(lambda: sdk.responses.retrieve(made.id).status == "in_progress", 60, "never started")
    raw = sdk.with_raw_response.responses.delete(made.id)
    assert json.loads(raw.text) == {"id": made.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(made.id)
    import psycopg
    with psycopg.connect(sim.stack.database_url.replace("postgresql+psycopg", "postgresql")) as conn:
        wait_for(lambda: conn.execute("SELECT status FROM tasks WHERE response_id = %s", (made.id,)).fetchone()[0]
                 == "cancelled", 30, "the deleted response's task was not cancelled")


class City(BaseModel):
    name: str
    population: int


def test_parse_with_a_pydantic_model(sdk, sim):
    parsed = sdk.responses.parse(model=sim.model, input="Describe Tokyo.", text_format=City, max_output_tokens=200)
    assert isinstance(parsed.output_parsed, City)
    with sdk.responses.stream(model=sim.model, input="Describe Oslo.", text_format=City, max_output_tokens=200,
                              store=True) as stream:
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, City)
    assert plain(final) == plain(sdk.responses.retrieve(final.id))


def test_a_tool_round_trip(sdk, sim):
    question = [{"role": "user", "content": "What is the weather in Hangzhou?"}]
    called = sdk.responses.create(model=sim.model, input=question, tools=[WEATHER], tool_choice="required",
                                  max_output_tokens=80)
    call = called.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and "city" in json.loads(call.arguments)
    answered = sdk.responses.create(model=sim.model, max_output_tokens=20, tools=[WEATHER], input=[
        *question, call, {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 17}'}])
    assert answered.output[0].type == "message" and answered.output_text


def test_async_streaming(sim):
    async def run():
        sdk = client(sim, cls=openai.AsyncOpenAI)
        async with sdk.responses.stream(model=sim.model, input="Say hi.", max_output_tokens=20,
                                        store=True) as stream:
            kinds = [event.type async for event in stream]
            final = await stream.get_final_response()
        stored = await sdk.responses.retrieve(final.id)
        await sdk.close()
        return kinds, final, stored

    kinds, final, stored = asyncio.run(run())
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert plain(final) == plain(stored)
