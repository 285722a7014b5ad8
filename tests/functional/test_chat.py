"""POST /chat/completions (issue 34, item 5) driven by the OpenAI Python SDK unchanged, on the real engine:
the same direct path as /responses, worded as chat.completion objects and chunks."""

import json
import uuid

import jsonschema
import openai
import pytest

from tests.harness import Client

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
CHAT = "/lmsp/v1/chat/completions"


def sdk(client: Client) -> openai.OpenAI:
    return openai.OpenAI(base_url=client.url("/lmsp/v1"), api_key=client.http.headers["Authorization"][7:],
                         max_retries=0)


def test_chat_sync_same_as_responses_with_stop_and_seed(alice, model_id):
    chat = sdk(alice)
    messages = [{"role": "developer", "content": "You answer briefly."},
                {"role": "user", "content": [{"type": "text", "text": "Name three colors."}]}]
    done = chat.chat.completions.create(model=model_id, messages=messages, max_tokens=24, temperature=0, seed=7)
    assert done.object == "chat.completion" and done.model == model_id and len(done.choices) == 1
    choice = done.choices[0]
    assert choice.message.role == "assistant" and choice.message.content and choice.message.tool_calls is None
    assert choice.finish_reason in ("stop", "length")
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens
    assert 0 < done.usage.completion_tokens <= 24
    # The same request on /responses (developer = system) gives the same text: one path, one engine.
    same = chat.responses.create(model=model_id, instructions="You answer briefly.", input="Name three colors.",
                                 max_output_tokens=24, temperature=0)
    assert same.output_text == choice.message.content
    # stop: generation ends before the stop string, which is left out
    text = choice.message.content
    word = text.split()[len(text.split()) // 2]
    stopped = chat.chat.completions.create(model=model_id, messages=messages, max_completion_tokens=24,
                                           temperature=0, stop=[word])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == text[:text.index(word)]


def test_chat_stream_with_usage(alice, model_id):
    chat = sdk(alice)
    messages = [{"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": "Write one sentence about the sea."}]
    chunks = list(chat.chat.completions.create(model=model_id, messages=messages, max_tokens=30, temperature=0,
                                               stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens > 0  # usage comes last, alone
    assert all(c.usage is None for c in body)
    assert body[-1].choices[0].finish_reason in ("stop", "length")
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in body)
    sync = chat.chat.completions.create(model=model_id, messages=messages, max_tokens=30, temperature=0)
    assert text and text == sync.choices[0].message.content
    assert last.usage.completion_tokens == sync.usage.completion_tokens
    # without include_usage there is no usage chunk; the stream ends with [DONE] (the SDK stops there)
    with alice.stream_post(CHAT, {"model": model_id, "messages": messages, "max_tokens": 5, "stream": True}) as resp:
        raw = resp.raw.read().decode()
    assert raw.endswith("data: [DONE]\n\n") and '"usage"' not in raw


def test_chat_tool_round_trip(alice, model_id):
    chat = sdk(alice)
    question = [{"role": "user", "content": "What is the weather in Hangzhou?"}]
    called = chat.chat.completions.create(model=model_id, messages=question, tools=[WEATHER], tool_choice="required",
                                          max_tokens=60, temperature=0)
    choice = called.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # streamed, through the SDK's own stream helper: the call arrives whole
    with chat.chat.completions.stream(model=model_id, messages=question, tools=[WEATHER], max_tokens=60,
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                      temperature=0) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.arguments == call.function.arguments
    # the round trip: the assistant's call and the tool's answer, read by the model
    answered = chat.chat.completions.create(
        model=model_id, tools=[WEATHER], tool_choice="none", max_tokens=30, temperature=0,
        messages=[*question, choice.message,  # the SDK's own message object, sent back as it is
                  {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 17})}])
    assert answered.choices[0].message.content and answered.choices[0].finish_reason in ("stop", "length")
    alone = chat.chat.completions.create(model=model_id, messages=question, tools=[WEATHER], tool_choice="none",
                                         max_tokens=1)
    assert answered.usage.prompt_tokens > alone.usage.prompt_tokens + 10  # the call and its result were read


def test_chat_response_format(alice, model_id):
    chat = sdk(alice)
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    messages = [{"role": "user", "content": "Describe Tokyo as JSON with its population."}]
    shaped = chat.chat.completions.create(model=model_id, messages=messages, max_tokens=120, temperature=0,
                                          response_format={"type": "json_schema", "json_schema": {
                                              "name": "city", "schema": schema, "strict": True}})
    assert shaped.choices[0].finish_reason == "stop", shaped
    jsonschema.validate(json.loads(shaped.choices[0].message.content), schema)
    loose = chat.chat.completions.create(model=model_id, max_tokens=120, temperature=0,
                                         messages=[{"role": "user", "content": "Tokyo's population as JSON."},
                                                   {"role": "assistant", "content": '{"population": 14000000}'},
                                                   {"role": "user", "content": "Paris's population as JSON."}],
                                         response_format={"type": "json_object"})
    assert loose.choices[0].finish_reason == "stop", loose
    assert isinstance(json.loads(loose.choices[0].message.content), dict)


@pytest.mark.parametrize("fields, param", [
    ({"n": 2}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"top_p": 0.5}, "top_p"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"max_tokens": 5, "max_completion_tokens": 5}, "max_completion_tokens"),
    ({"max_tokens": 10_000_000}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, "messages[0].name"),
    ({"messages": [{"role": "user", "content": "hi " * 5000}]}, "messages"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"frequency_penalty": 1}, "frequency_penalty"),
])
def test_chat_unsupported_or_bad_input_is_a_problem(alice, model_id, fields, param):
    body = {"model": model_id, "messages": [{"role": "user", "content": "hi"}], **fields}
    resp = alice.post(CHAT, body)
    assert resp.status_code == 400, resp.text
    assert resp.headers["Content-Type"] == "application/problem+json"
    doc = resp.json()
    assert doc["param"] == param and doc["code"] in ("invalid_request", "context_length_exceeded"), doc


def test_chat_through_the_sdk_errors_auth_and_idempotency(stack, alice, model_id):
    chat = sdk(alice)
    with pytest.raises(openai.BadRequestError) as bad:
        chat.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}], n=3)
    assert bad.value.body["param"] == "n" and bad.value.body["code"] == "invalid_request"
    with pytest.raises(openai.NotFoundError):
        chat.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    reader = Client(alice.base, stack.token("chat-reader", scopes="responses:read"))
    denied = reader.post(CHAT, {"model": model_id, "messages": [{"role": "user", "content": "hi"}]})
    assert denied.status_code == 403 and denied.json()["scope"] == "responses:write"
    # Idempotency-Key: the same body again is the same completion, not a second generation
    body = {"model": model_id, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8}
    key = {"Idempotency-Key": uuid.uuid4().hex}
    first, again = alice.post(CHAT, body, headers=key), alice.post(CHAT, body, headers=key)
    assert first.status_code == again.status_code == 200 and first.json() == again.json()
    assert first.json()["object"] == "chat.completion"
    # the key is bound to the chat body as sent, not to its translation (`user` is not translated)
    other = alice.post(CHAT, {**body, "user": "someone-else"}, headers=key)
    assert other.status_code == 422 and other.json()["code"] == "idempotency_key_reused"
    streamed = {**body, "stream": True}
    key = {"Idempotency-Key": uuid.uuid4().hex}
    first, again = alice.post(CHAT, streamed, headers=key), alice.post(CHAT, streamed, headers=key)
    texts = ["".join(json.loads(line[6:])["choices"][0]["delta"].get("content", "")
                     for line in r.text.split("\n") if line.startswith("data: {")) for r in (first, again)]
    assert texts[0] == texts[1] and again.text.endswith("data: [DONE]\n\n")
