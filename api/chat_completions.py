"""OpenAI's Chat Completions, worded as LMSP's direct responses and back (api/views/chat.py).

A chat request becomes a ``ResponseRequest`` body (messages -> input items, ``tools`` flattened,
``response_format`` json_object -> a schema of any object), so it is validated, limited, shared and
generated exactly as ``POST /responses`` is; the response object and its events become
``chat.completion`` and ``chat.completion.chunk`` objects. What the service cannot do is a 400
``invalid_request`` naming the field, never silently ignored.
"""

import json
import time
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, Field, StrictBool, StrictStr, field_validator

from common import events
from common.errors import LMSPError
from common.protocol import (
    ClientHints,
    JsonSchema,
    Name,
    ParallelToolCalls,
    SdkParsed,
    Strict,
    TokenCount,
    parse,
)

DONE = "data: [DONE]\n\n"


# -- the request --------------------------------------------------------------------------------
class TextPart(Strict):
    type: Literal["text"]
    text: StrictStr


Content = StrictStr | list[TextPart]


def text_of(content: Content | None) -> str:
    return "" if content is None else content if isinstance(content, str) else "".join(p.text for p in content)


class SystemMessage(Strict):
    role: Literal["system", "developer"]
    content: Content


class UserMessage(Strict):
    role: Literal["user"]
    content: Content


class CalledFunction(Strict):
    name: Name
    arguments: StrictStr
    parsed_arguments: SdkParsed = None


class ToolCall(Strict):
    id: str = Field(min_length=1)
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(Strict):
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[ToolCall] | None = None
    # What a completion's message carries besides, sent back with it in a history (an OpenAI server's
    # too): output metadata the model does not read; an audio reply or a refusal cannot be rendered.
    refusal: None = None
    annotations: list | None = None
    audio: None = None
    function_call: None = None
    parsed: SdkParsed = None


class ToolMessage(Strict):
    role: Literal["tool"]
    content: Content
    tool_call_id: str = Field(min_length=1)


Message = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


class FunctionSpec(Strict):
    name: Name
    description: str | None = None
    parameters: JsonSchema | None = None
    strict: StrictBool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(Strict):
    name: Name


class NamedTool(Strict):
    type: Literal["function"]
    function: NamedFunction


class TextFormat(Strict):
    type: Literal["text"]


class JsonObjectFormat(Strict):
    type: Literal["json_object"]


class SchemaSpec(Strict):
    name: Name
    schema_: JsonSchema = Field(alias="schema", default_factory=lambda: {"type": "object"})
    description: str | None = None
    strict: StrictBool | None = None


class JsonSchemaFormat(Strict):
    type: Literal["json_schema"]
    json_schema: SchemaSpec


class StreamOptions(Strict):
    include_usage: StrictBool = False
    include_obfuscation: StrictBool | None = None  # padding against length side channels: none is sent


def _one(value):
    if value != 1:
        raise ValueError("only n: 1 is supported (one choice per request)")
    return value


def _stops(value):
    return [value] if isinstance(value, str) else value


class ChatRequest(ClientHints):
    """``POST /chat/completions`` as OpenAI's SDK sends it. Sampling knobs the engine path does not
    carry are accepted only at their neutral values."""
    model: str = Field(min_length=1, max_length=200)
    messages: list[Message] = Field(min_length=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None
    temperature: float | None = Field(default=None, ge=0, le=2, strict=True)
    top_p: float | None = Field(default=None, ge=1, le=1, description="Only 1 (no nucleus cut)")
    frequency_penalty: float | None = Field(default=None, ge=0, le=0, description="Only 0")
    presence_penalty: float | None = Field(default=None, ge=0, le=0, description="Only 0")
    n: Annotated[int, BeforeValidator(_one)] | None = None
    stop: Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(max_length=4),
                    BeforeValidator(_stops)] | None = None
    seed: int | None = Field(default=None, strict=True)
    logprobs: Literal[False] | None = Field(default=None, description="The engine path gives no log probabilities")
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedTool | None = None
    parallel_tool_calls: ParallelToolCalls | None = None
    response_format: Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat,
                               Field(discriminator="type")] | None = None

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_limit(cls, value, info):
        if value is not None and info.data.get("max_tokens") is not None:
            raise ValueError("max_tokens and max_completion_tokens are two spellings of one limit; give one")
        return value

    @field_validator("stream_options")
    @classmethod
    def _streamed(cls, value, info):
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only for stream: true")
        return value


# -- the request as LMSP's ----------------------------------------------------------------------
def _items(messages: list) -> list[dict]:
    out: list[dict] = []
    for m in messages:
        if isinstance(m, ToolMessage):
            out.append({"type": "function_call_output", "call_id": m.tool_call_id, "output": text_of(m.content)})
            continue
        role = "system" if m.role == "developer" else m.role
        text = text_of(m.content)
        calls = getattr(m, "tool_calls", None) or []
        if text or not calls:
            out.append({"type": "message", "role": role, "content": text})
        out += [{"type": "function_call", "call_id": c.id, "name": c.function.name,
                 "arguments": c.function.arguments} for c in calls]
    return out


def _format(fmt) -> dict | None:
    if fmt is None or isinstance(fmt, TextFormat):
        return None if fmt is None else {"type": "text"}
    spec = fmt.json_schema if isinstance(fmt, JsonSchemaFormat) else SchemaSpec(name="json_object")
    return {"type": "json_schema", "json_schema": spec.model_dump(by_alias=True, exclude_none=True)}


def response_body(body) -> tuple[ChatRequest, dict]:
    """The chat request parsed, and the ``ResponseRequest`` body it stands for."""
    chat = parse(ChatRequest, body)
    out = {"model": chat.model, "input": _items(chat.messages), "stream": chat.stream,
           "max_output_tokens": chat.max_completion_tokens or chat.max_tokens, "temperature": chat.temperature,
           "response_format": _format(chat.response_format), "stop": chat.stop, "seed": chat.seed,
           "tools": None if chat.tools is None else [
               {"type": "function", **t.function.model_dump(exclude_none=True)} for t in chat.tools],
           "tool_choice": chat.tool_choice if isinstance(chat.tool_choice, str | None) else {
               "type": "function", "name": chat.tool_choice.function.name}}
    return chat, {k: v for k, v in out.items() if v is not None}


def chat_param(param: str | None, chat: ChatRequest) -> str | None:
    """A ``ResponseRequest`` field named by a problem -> the chat request's field it came from."""
    if param is None:
        return None
    limit = "max_completion_tokens" if chat.max_completion_tokens is not None else "max_tokens"
    head, _, rest = param.partition(".")
    root = head.split("[")[0]
    if root == "input":
        return "messages"  # items do not map one to one (an assistant message with calls is several)
    if root == "max_output_tokens":
        return limit
    if root == "tools" and rest:
        return f"{head}.function.{rest}"
    if param == "tool_choice.name":
        return "tool_choice.function.name"
    return param


def translated(exc: LMSPError, chat: ChatRequest) -> LMSPError:
    exc.param = chat_param(exc.param, chat)
    return exc


# -- the outcome as chat's ----------------------------------------------------------------------
def _finish_reason(status: str, calls: list) -> str:
    if status == "incomplete":
        return "length"
    return "tool_calls" if calls else "stop"


def _usage(usage: dict | None) -> dict | None:
    if usage is None:
        return None
    return {"prompt_tokens": usage["input_tokens"], "completion_tokens": usage["output_tokens"],
            "total_tokens": usage["total_tokens"]}


def _call(index: int, item: dict) -> dict:
    return {"index": index, "id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def completion(response: dict) -> dict:
    """The ``chat.completion`` of a finished response object (6.2)."""
    output = response.get("output") or []
    text = "".join(p.get("text", "") for item in output if item["type"] == "message" for p in item["content"])
    calls = [item for item in output if item["type"] == "function_call"]
    message = {"role": "assistant", "content": text if text or not calls else None, "refusal": None}
    if calls:
        message["tool_calls"] = [{k: v for k, v in _call(i, c).items() if k != "index"} for i, c in enumerate(calls)]
    return {"id": response["id"], "object": "chat.completion", "created": response["created_at"],
            "model": response["model"], "system_fingerprint": None, "usage": _usage(response.get("usage")),
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": _finish_reason(response["status"], calls)}]}


def finish(status: int, body: str) -> tuple[int, str]:
    """``api.direct.wait``'s outcome (a response object, or a problem) as chat's."""
    return (status, json.dumps(completion(json.loads(body)))) if status < 400 else (status, body)


class Chunks:
    """A response's events (6.3) as ``chat.completion.chunk`` SSE frames, one event at a time."""

    def __init__(self, model: str, include_usage: bool, calls_only: bool = False):
        """``calls_only``: tool_choice required or named, so the message has tool calls and no content
        (null, as in the completion, not the "" of a message that may yet get text)."""
        self.model, self.include_usage, self.calls_only = model, include_usage, calls_only
        self.created = int(time.time())
        self.calls = 0
        self.id = ""

    def _chunk(self, delta: dict | None, finish_reason=None, usage=None) -> str:
        doc = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
               "system_fingerprint": None,
               "choices": [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                                     "finish_reason": finish_reason}]}
        if self.include_usage:
            doc["usage"] = usage
        return f"data: {events.dumps(doc)}\n\n"

    def __call__(self, event) -> str:
        _seq, name, data_json = event
        data = json.loads(data_json)
        self.id = data.get("response_id", self.id)
        if name == events.CREATED:
            return self._chunk({"role": "assistant", "content": None if self.calls_only else ""})
        if name == events.TEXT_DELTA:
            return self._chunk({"content": data["delta"]})
        if name == events.ITEM_DONE and data["item"]["type"] == "function_call":
            self.calls += 1
            return self._chunk({"tool_calls": [_call(self.calls - 1, data["item"])]})
        if name == events.FAILED:
            return error_frame(data["error"])
        if name in events.FINAL:
            out = self._chunk({}, _finish_reason(data["status"], [None] * self.calls))
            usage = _usage(data.get("usage"))
            return out + (self._chunk(None, usage=usage) if self.include_usage and usage else "")
        return ""  # item boundaries, reasoning and attempts have no chat form

    def failed(self, _seq: int, doc: dict) -> str:
        """The stream cannot go on (``api.direct.stream``): an error chunk, as OpenAI's streams end."""
        return error_frame(doc)


def error_frame(doc: dict) -> str:
    """An ``error`` data line: the OpenAI SDK raises it as an APIError."""
    return f"data: {events.dumps({'error': {**doc, 'message': doc.get('detail', '')}})}\n\n"


# -- documents (OpenAPI) --------------------------------------------------------------------------
class ChatMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCall] | None = None


class Choice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(BaseModel):
    """The answer of a synchronous chat completion; its id is the response's (``GET /responses/{id}``
    when it was stored)."""
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: None = None
    choices: list[Choice]
    usage: ChatUsage | None
