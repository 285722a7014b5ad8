"""Request shapes of spec 6.1 and 7.1, validated with pydantic.

Validation errors become ``400 invalid_request`` with ``param`` naming the field.
"""

import json
from types import UnionType
from typing import Annotated, Literal, Union, get_args, get_origin

import jsonschema
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictStr,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)

from common.errors import LMSPError
from common.wire import OnRestart

Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


def _json_number(value):
    # JSON Schema's integer admits 5.0 but never "5" or true.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("must be an integer")
    return value


def _check_schema(schema: dict) -> dict:
    dialect = schema.get("$schema")
    if dialect is not None and not isinstance(dialect, str):  # jsonschema looks it up as a URI: a TypeError
        raise ValueError("not a valid JSON Schema: $schema must be a string (the URI of a dialect)")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ValueError(f"not a valid JSON Schema: {exc.message}") from None
    except Exception as exc:  # noqa: BLE001 - whatever else the checker chokes on is the client's schema
        raise ValueError(f"not a valid JSON Schema ({type(exc).__name__})") from None
    return schema


def _arguments(text: str) -> str:
    """Arguments are rendered into the prompt as JSON when they parse as JSON (common.prompt)."""
    try:
        json.loads(text)
    except RecursionError:
        raise ValueError("is JSON nested too deeply to be rendered") from None
    except ValueError:
        pass  # not JSON: rendered as text
    return text


JsonSchema = Annotated[dict, AfterValidator(_check_schema)]
TokenCount = Annotated[int, Field(ge=1, le=10_000_000), BeforeValidator(_json_number)]
# A turn may call several tools (worker/output.py parses every call the model writes), and nothing can hold
# the model to one: only true, OpenAI's default, is accepted (here and by Chat Completions).
ParallelToolCalls = Annotated[Literal[True], Field(
    description="Only true: a turn may call several tools; it cannot be held to one")]
# OpenAI's limits: up to 16 pairs, keys up to 64 characters, values up to 512.
Metadata = Annotated[dict[Annotated[StrictStr, Field(max_length=64)], Annotated[StrictStr, Field(max_length=512)]],
                     Field(max_length=16)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# What the OpenAI SDKs' helpers add to an output they return (``responses.parse``, ``stream``'s final
# response, a chat completion's ``parse``): sent back with it as the conversation's history, not read.
SdkParsed = object | None


class TextPart(Strict):
    type: Literal["input_text", "output_text"]
    text: StrictStr
    annotations: list | None = None  # an output part sent back as it was received; not read
    logprobs: list | None = None
    parsed: SdkParsed = None


def _developer(role: str) -> str:
    # OpenAI's newer name for the system role (its models give it the system role's place)
    return "system" if role == "developer" else role


class MessageItem(Strict):
    type: Literal["message"]
    id: str | None = None
    role: Annotated[Literal["system", "user", "assistant"], BeforeValidator(_developer)]
    content: StrictStr | list[TextPart]
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    id: str | None = None
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: Annotated[StrictStr, AfterValidator(_arguments)]
    status: str | None = None
    parsed_arguments: SdkParsed = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    id: str | None = None
    call_id: str = Field(min_length=1)
    output: StrictStr
    status: str | None = None


class SummaryPart(Strict):
    type: Literal["summary_text"]
    text: str


class ReasoningItem(Strict):
    """Sent back from an earlier output; the model does not see earlier reasoning."""
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryPart] = []
    status: str | None = None


def _easy_message(value):
    # The OpenAI SDK's shorthand {"role": ..., "content": ...} is a message item without its type.
    if isinstance(value, dict) and "type" not in value and "role" in value:
        return {"type": "message", **value}
    return value


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
                      Field(discriminator="type"), BeforeValidator(_easy_message)]


class FunctionTool(Strict):
    type: Literal["function"]
    name: Name
    description: str | None = None
    parameters: JsonSchema = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: StrictBool | None = None


class NamedToolChoice(Strict):
    type: Literal["function"]
    name: Name


class JsonSchemaSpec(Strict):
    name: Name
    schema_: JsonSchema = Field(alias="schema")
    description: str | None = None
    strict: StrictBool | None = None


class TextFormat(Strict):
    type: Literal["text"]


class JsonSchemaFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class FlatJsonSchemaFormat(Strict):
    """``text.format`` json_schema as the OpenAI Responses API spells it: name and schema at its top."""
    type: Literal["json_schema"]
    name: Name
    schema_: JsonSchema = Field(alias="schema")
    description: str | None = None
    strict: StrictBool | None = None


class JsonObjectFormat(Strict):
    """Any JSON object (OpenAI's JSON mode): held to the schema of any object."""
    type: Literal["json_object"]


class TextConfig(Strict):
    format: Annotated[TextFormat | FlatJsonSchemaFormat | JsonObjectFormat, Field(discriminator="type")] | None = None


class ResponseStreamOptions(Strict):
    include_obfuscation: StrictBool | None = None  # padding against length side channels: none is sent


class ClientHints(Strict):
    """What OpenAI's clients send for the service's own records or tuning, taken and not read, on
    /responses and /chat/completions: an end user's id, a service tier (there is one), a prompt cache key
    (prefix caching needs none), a safety identifier."""
    user: StrictStr | None = None
    service_tier: Literal["auto", "default"] | None = None
    prompt_cache_key: Annotated[StrictStr, Field(max_length=1024)] | None = None
    safety_identifier: Annotated[StrictStr, Field(max_length=1024)] | None = None


class ResponseRequest(ClientHints):
    """Other spellings (the OpenAI SDK's) are folded into LMSP's when parsed, so what is stored, and
    what a worker reads, is LMSP's only: a string ``input`` (one user message), ``instructions`` (a
    system message first), ``text.format`` (``response_format``)."""
    model: str = Field(min_length=1, max_length=200)
    input: Annotated[StrictStr, Field(min_length=1)] | Annotated[list[InputItem], Field(min_length=1)]
    instructions: StrictStr | None = None
    stream: StrictBool = False
    max_output_tokens: TokenCount | None = None
    temperature: float | None = Field(default=None, ge=0, le=2, strict=True)
    top_p: float | None = Field(default=None, ge=1, le=1, strict=True, description="Only 1 (no nucleus cut)")
    # Extensions of 6.1 that Chat Completions needs (api/chat_completions.py): generation ends before
    # any of these strings (left out of the text), and a seed makes sampling repeatable.
    stop: Annotated[list[Annotated[StrictStr, Field(min_length=1, max_length=200)]],
                    Field(min_length=1, max_length=4)] | None = None
    seed: int | None = Field(default=None, ge=-(2 ** 63), lt=2 ** 63, strict=True)
    response_format: Annotated[TextFormat | JsonSchemaFormat, Field(discriminator="type")] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: ParallelToolCalls | None = None
    store: StrictBool = False
    previous_response_id: StrictStr | None = None
    metadata: Metadata | None = None  # kept on the response and shown with it (OpenAI's metadata)
    extensions: dict | None = None
    text: TextConfig | None = None
    background: StrictBool | None = None
    # OpenAI's members with nothing to do here: the default truncation (``auto`` would drop input items
    # unasked: refused), stream options, and the one ``include`` that asks for nothing this service has
    # (reasoning items are never encrypted here; the Agents SDK sends it); other includes (logprobs, tool
    # results) would be promises not kept: refused.
    truncation: Literal["disabled"] | None = None
    stream_options: ResponseStreamOptions | None = None
    include: list[Literal["reasoning.encrypted_content"]] | None = None
    _format_param: str = PrivateAttr("response_format")  # how the client spelled it: errors name that
    _instructions: str | None = PrivateAttr(None)  # as given, for the response object (``given_instructions``)

    @field_validator("background")
    @classmethod
    def _background(cls, value: bool | None, info) -> bool | None:
        # A background response is a durable task behind the OpenAI surface (api/services/background.py):
        # it is kept, so that it can be polled, streamed again and cancelled.
        if value and not info.data.get("store"):
            raise ValueError("background: true needs store: true (a background response is kept to be polled)")
        return value

    @field_validator("text")
    @classmethod
    def _one_format(cls, value: TextConfig | None, info) -> TextConfig | None:
        if value is not None and value.format is not None and info.data.get("response_format") is not None:
            # two answers to one question: neither silently wins
            raise ValueError("text.format and response_format are two spellings of the same field; give one")
        return value

    @model_validator(mode="after")
    def _lmsp_spelling(self) -> "ResponseRequest":
        if isinstance(self.input, str):
            self.input = [MessageItem(type="message", role="user", content=self.input)]
        if self.instructions is not None:
            self.input = [MessageItem(type="message", role="system", content=self.instructions), *self.input]
            self._instructions, self.instructions = self.instructions, None
        fmt = self.text.format if self.text is not None else None
        if isinstance(fmt, JsonObjectFormat):
            self.response_format = JsonSchemaFormat(type="json_schema", json_schema=JsonSchemaSpec(
                name="json_object", schema={"type": "object"}))
        elif fmt is not None:
            self.response_format = fmt if isinstance(fmt, TextFormat) else JsonSchemaFormat(
                type="json_schema", json_schema=JsonSchemaSpec(
                    name=fmt.name, schema=fmt.schema_, description=fmt.description, strict=fmt.strict))
        if fmt is not None:
            self._format_param = "text.format"
        self.text = None
        return self

    @property
    def given_instructions(self) -> str | None:
        """``instructions`` as the client gave them (folded into ``input`` as a system message)."""
        return self._instructions

    @property
    def format_param(self) -> str:
        """The field the client named the output format with."""
        return self._format_param

    @property
    def schema_param(self) -> str:
        return "text.format.schema" if self._format_param == "text.format" else "response_format.json_schema.schema"

    @field_validator("extensions")
    @classmethod
    def _extensions(cls, value: dict | None) -> dict | None:
        return value  # unknown extensions are ignored, never an error (9.1)

    @property
    def json_schema(self) -> dict | None:
        fmt = self.response_format
        return fmt.json_schema.schema_ if isinstance(fmt, JsonSchemaFormat) else None


class TaskRequest(Strict):
    type: Literal["response"]
    input: ResponseRequest
    on_restart: OnRestart = OnRestart.FAIL
    extensions: dict | None = None  # the envelope's own, if a client sends any: ignored (9.1)




def _unwrap(tp):
    """Annotated[X, ...] -> X and X | None -> X, repeatedly."""
    while True:
        if get_origin(tp) is Annotated:
            tp = get_args(tp)[0]
            continue
        if get_origin(tp) in (Union, UnionType):
            members = [a for a in get_args(tp) if a is not type(None)]
            if len(members) == 1:
                tp = members[0]
                continue
        return tp


def _branch(members: list, label) -> object:
    """The union member pydantic's ``label`` (a discriminator value or a type name) stands for."""
    for member in map(_unwrap, members):
        if isinstance(member, type) and issubclass(member, BaseModel):
            tag = member.model_fields.get("type") or member.model_fields.get("role")  # chat's messages: by role
            if label == member.__name__ or (tag is not None and label in get_args(tag.annotation)):
                return member
        elif str(label).startswith(f"{getattr(get_origin(member) or member, '__name__', '')}".lower()):
            return member  # "str", "list[TextPart]", "literal[...]"
    return None


def _param(model: type[BaseModel], loc: tuple) -> str:
    """pydantic's error location -> ``param``, walking the model's types so union-branch labels
    (which are not fields) are left out at any depth, and fields are named by their alias."""
    out, tp = "", model
    for part in loc:
        tp = _unwrap(tp)
        if get_origin(tp) in (Union, UnionType):
            tp = _branch(list(get_args(tp)), part)
            continue
        if isinstance(part, int):
            out += f"[{part}]"
            tp = get_args(tp)[0] if get_origin(tp) is list else None
            continue
        name = str(part)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            field = next((f for key, f in tp.model_fields.items() if name in (key, f.alias)), None)
            tp = field.annotation if field is not None else None
        else:
            tp = None
        out += ("." if out else "") + name
    return out


def parse(model: type[BaseModel], body) -> BaseModel:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        # The deepest error names the field the client got wrong, not a union branch.
        err = max(exc.errors(), key=lambda e: len(e["loc"]))
        param = _param(model, err["loc"])
        raise LMSPError("invalid_request", f"{param or 'body'}: {err['msg']}", param=param or None) from None
