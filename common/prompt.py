"""Input items -> the model's chat prompt, and the tool-call conventions around it.

The api renders the prompt to count tokens against the context window; the worker
renders the same prompt to generate. Both use this module so they always agree.
"""

import json
from functools import lru_cache

from common.protocol import FunctionCallItem, FunctionCallOutputItem, MessageItem, ResponseRequest

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@lru_cache(maxsize=64)
def load_tokenizer(checkpoint: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(checkpoint)


def _supports_tools(tokenizer) -> bool:
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


def render(tokenizer, req: ResponseRequest, continuation: str = "") -> str:
    """The prompt text; ``continuation`` is output already generated (resume)."""
    native = _supports_tools(tokenizer)
    msgs = messages(req, native)
    kwargs = {}
    if tool_mode(req) != "none":
        if native and tool_mode(req) == "auto":
            kwargs["tools"] = [{"type": "function", "function": {
                "name": t.name, "description": t.description or "", "parameters": t.parameters}}
                for t in req.tools]
        else:
            system = {"role": "system", "content": _tool_instructions(req)}
            if msgs and msgs[0]["role"] == "system":
                msgs[0] = {"role": "system", "content": msgs[0]["content"] + "\n\n" + system["content"]}
            else:
                msgs.insert(0, system)
    prompt = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kwargs)
    return prompt + continuation


def count_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])
