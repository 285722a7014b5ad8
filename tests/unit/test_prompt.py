"""common/prompt.py renders and counts exactly as transformers does, without importing it.

The api and the worker both render with common.prompt, so they agree by construction;
these tests pin that the lean renderer agrees with transformers' apply_chat_template
(what vLLM's own server uses) on the default model's checkpoint and on a tool-aware template.
"""

import shutil
import subprocess
import sys

import pytest

from common.prompt import ChatTokenizer, _supports_tools, load_tokenizer, messages, render, tool_mode
from common.protocol import ResponseRequest
from tests.harness import CHECKPOINT, ROOT

pytestmark = pytest.mark.skipif(not (CHECKPOINT / "tokenizer.json").exists(), reason="default model not imported")

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def msg(role, text):
    kind = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}


REQUESTS = {
    "one user turn": {"input": [msg("user", "Say hello.")]},
    "system and multi-turn": {"input": [msg("system", "Be brief."), msg("user", "Hi"), msg("assistant", "Hello!"),
                                        msg("user", "What is 2+2? Ünïcode ✓")]},
    "tools auto": {"input": [msg("user", "Weather in Paris?")], "tools": TOOLS},
    "tools required": {"input": [msg("user", "Weather in Paris?")], "tools": TOOLS, "tool_choice": "required"},
    "tool call and result": {"tools": TOOLS, "input": [
        msg("user", "Weather in Paris?"),
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": '{"temp_c": 21}'},
        msg("user", "And tomorrow?")]},
}

# A Hermes/Qwen-style template that takes tools and tool_calls natively (SmolLM2's does not).
TOOL_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call: {% for tool in tools %}{{ tool | tojson }}{% endfor %}<|im_end|>
{% endif %}{%- for message in messages %}<|im_start|>{{ message.role }}
{% if message.tool_calls %}{% for call in message.tool_calls %}<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}
{%- else %}{{ message.content }}{% endif %}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def hf_render(hf, tokenizer: ChatTokenizer, req: ResponseRequest) -> str:
    """(common.prompt.render, the same messages through transformers' apply_chat_template)."""
    native = _supports_tools(tokenizer)
    ours = render(tokenizer, req)
    msgs = messages(req, native)
    tools = None
    if tool_mode(req) == "auto" and native:
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                   "parameters": t.parameters}} for t in req.tools]
        return ours, hf.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    if tool_mode(req) != "none":  # the instructions go into the system message: compare the whole prompt text
        system_text = ours.split("<|im_start|>system\n", 1)[1].split("<|im_end|>", 1)[0]
        if msgs and msgs[0]["role"] == "system":
            msgs[0] = {"role": "system", "content": system_text}
        else:
            msgs.insert(0, {"role": "system", "content": system_text})
    return ours, hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


@pytest.fixture(scope="module", params=["smollm2", "tool-template"])
def pair(request, tmp_path_factory):
    from transformers import AutoTokenizer
    folder = CHECKPOINT
    if request.param == "tool-template":
        folder = tmp_path_factory.mktemp("tooltpl")
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(CHECKPOINT / name, folder / name)
        (folder / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    return ChatTokenizer(str(folder)), AutoTokenizer.from_pretrained(str(folder))


@pytest.mark.parametrize("name", list(REQUESTS))
def test_prompt_and_tokens_match_transformers(pair, name):
    ours_tok, hf = pair
    req = ResponseRequest.model_validate({"model": "m", **REQUESTS[name]})
    ours, theirs = hf_render(hf, ours_tok, req)
    assert ours == theirs
    assert ours_tok.encode(ours) == hf(ours, add_special_tokens=False)["input_ids"]


def test_native_tools_reach_the_template(pair):
    ours_tok, _ = pair
    req = ResponseRequest.model_validate({"model": "m", **REQUESTS["tools auto"]})
    if _supports_tools(ours_tok):
        assert '"name": "get_weather"' in render(ours_tok, req)


def test_no_chat_template_or_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_tokenizer(str(tmp_path))
    shutil.copy(CHECKPOINT / "tokenizer.json", tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match="no chat template"):
        ChatTokenizer(str(tmp_path))


def test_api_app_imports_neither_torch_nor_transformers():
    code = ("import sys, api, api.views.responses, api.services.validation, common.prompt; "
            "print(sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
