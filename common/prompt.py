"""Input items -> the model's chat prompt, and the tool-call conventions around it.

The api renders the prompt to count tokens against the context window; the worker
renders the same prompt to generate. Both use this module so they always agree. It
reads the checkpoint's tokenizer.json with ``tokenizers`` and renders its chat template
with jinja2 exactly as transformers' ``apply_chat_template`` does, so the api never
imports transformers or torch (hundreds of MiB per api process).
"""

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from common.protocol import FunctionCallItem, FunctionCallOutputItem, MessageItem, ResponseRequest

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTokenizer:
    """A checkpoint's tokenizer and chat template, without transformers."""

    def __init__(self, checkpoint: str):
        folder = Path(checkpoint)
        if not (folder / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{checkpoint} has no tokenizer.json")
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        template = config.get("chat_template")
        if (folder / "chat_template.jinja").exists():  # where transformers >= 4.43 saves it
            template = (folder / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: the default one
            template = {t["name"]: t["template"] for t in template}.get("default")
        if not template:
            raise ValueError(f"{checkpoint} has no chat template")
        self.chat_template = template
        self._template = _jinja().from_string(template)
        # What transformers passes to every template as its special_tokens_map.
        self._special = {k: _token_text(config[k]) for k in SPECIAL_TOKENS if config.get(k) is not None}
        extra = config.get("additional_special_tokens") or config.get("extra_special_tokens")
        if isinstance(extra, list) and extra:
            self._special["additional_special_tokens"] = [_token_text(t) for t in extra]

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        return self._template.render(messages=messages, tools=tools, documents=None, add_generation_prompt=True,
                                     **self._special)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids


def _token_text(token) -> str:
    return token["content"] if isinstance(token, dict) else str(token)


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask tag) renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # As transformers overrides it: jinja's own tojson escapes HTML characters.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=1)
def _jinja() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@lru_cache(maxsize=64)
def load_tokenizer(checkpoint: str) -> ChatTokenizer:
    return ChatTokenizer(checkpoint)


def _supports_tools(tokenizer: ChatTokenizer) -> bool:
    template = tokenizer.chat_template or ""
    return "tools" in template and "tool_calls" in template


def tool_mode(req: ResponseRequest) -> str:
    """none | auto | required | the name of the one tool to call."""
    if not req.tools:
        return "none"
    choice = req.tool_choice or "auto"
    return choice if isinstance(choice, str) else choice.name


def tool_call_schema(req: ResponseRequest) -> dict | None:
    """The JSON schema that constrains generation so a call is guaranteed (required / named)."""
    mode = tool_mode(req)
    if mode in ("none", "auto"):
        return None
    tools = [t for t in req.tools if mode == "required" or t.name == mode]
    return {"anyOf": [{"type": "object",
                       "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                       "required": ["name", "arguments"], "additionalProperties": False}
                      for t in tools]}


def _tool_instructions(req: ResponseRequest) -> str:
    mode = tool_mode(req)
    specs = [{"name": t.name, "description": t.description or "", "parameters": t.parameters}
             for t in req.tools if mode in ("auto", "required") or t.name == mode]
    lines = ["You can call these functions:", json.dumps(specs, ensure_ascii=False)]
    if mode == "auto":
        lines.append(f'To call one, answer only {TOOL_OPEN}{{"name": ..., "arguments": {{...}}}}{TOOL_CLOSE}.')
    else:
        lines.append('Call a function now: answer only {"name": ..., "arguments": {...}} as JSON.')
    return "\n".join(lines)


def messages(req: ResponseRequest, native_tools: bool) -> list[dict]:
    out: list[dict] = []
    names = {}
    for item in req.input:
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            names[item.call_id] = item.name
            if native_tools:
                out.append({"role": "assistant", "content": "", "tool_calls": [{
                    "id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": _json_or_text(item.arguments)}}]})
            else:
                call = json.dumps({"name": item.name, "arguments": _json_or_text(item.arguments)})
                out.append({"role": "assistant", "content": f"{TOOL_OPEN}{call}{TOOL_CLOSE}"})
        elif isinstance(item, FunctionCallOutputItem):
            if native_tools:
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
            else:
                name = names.get(item.call_id, "the function")
                out.append({"role": "user", "content": f"Result of {name}: {item.output}"})
    return out


def _json_or_text(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def render(tokenizer: ChatTokenizer, req: ResponseRequest, continuation: str = "") -> str:
    """The prompt text; ``continuation`` is output already generated (resume)."""
    native = _supports_tools(tokenizer)
    msgs = messages(req, native)
    tools = None
    if tool_mode(req) != "none":
        if native and tool_mode(req) == "auto":
            tools = [{"type": "function", "function": {
                "name": t.name, "description": t.description or "", "parameters": t.parameters}}
                for t in req.tools]
        else:
            system = {"role": "system", "content": _tool_instructions(req)}
            if msgs and msgs[0]["role"] == "system":
                msgs[0] = {"role": "system", "content": msgs[0]["content"] + "\n\n" + system["content"]}
            else:
                msgs.insert(0, system)
    try:
        return tokenizer.apply_chat_template(msgs, tools) + continuation
    except Exception as exc:  # noqa: BLE001 - raise_exception(), a type error, a recursion: it refuses this input
        raise PromptError(f"the model's chat template refuses this input: {_reason(exc)}") from exc


class PromptError(ValueError):
    """The chat template cannot render these messages (roles out of order, say)."""


def _reason(exc: Exception) -> str:
    return (str(exc).strip() or type(exc).__name__)[:300] if isinstance(exc, jinja2.TemplateError) \
        else type(exc).__name__


def count_tokens(tokenizer: ChatTokenizer, text: str) -> int:
    return len(tokenizer.encode(text))
