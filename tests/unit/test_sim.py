"""The simulated engine's own contract (what vLLM does too is in tests/functional/test_engine.py):
timing, batch capacity, a text a resume continues, valid structured output and tool calls, and a
worker that never imports vLLM for it."""

import json
import subprocess
import sys
import threading
import time

import jsonschema
import pytest

from common.prompt import tool_call_schema
from common.protocol import ResponseRequest
from common.registry import ModelSpec, detect_machine, resolve_engine
from tests.harness import CHECKPOINT, ROOT, model_entry
from worker.gate import GenParams
from worker.output import OutputBuilder

pytestmark = pytest.mark.skipif(not (CHECKPOINT / "config.json").exists(), reason="default model not imported")
PROMPT = "<|im_start|>user\nWrite about tea.<|im_end|>\n<|im_start|>assistant\n"


def make(**engine):
    from worker.sim import SimEngine
    spec = ModelSpec(**model_entry("sim", engine={"kind": "sim", **engine}))
    host = SimEngine(spec.checkpoint, resolve_engine(spec, detect_machine()))
    host.start()
    return host


@pytest.fixture(scope="module")
def fast():
    host = make(max_num_seqs=4, ttft_ms=0, tokens_per_s=2000, tick_ms=5)
    yield host
    host.shutdown()


def collect(host, rid, prompt=PROMPT, **params):
    deltas = list(host.generate(rid, prompt, GenParams(**{"max_tokens": 64, **params})))
    return "".join(d.text for d in deltas), deltas


def test_engine_sim_in_models_yaml():
    spec = ModelSpec(**model_entry("s", engine="sim"))
    assert spec.engine_kind == "sim" and spec.max_num_seqs == 64
    assert resolve_engine(spec, detect_machine()).resolved["device"] == "sim"
    with pytest.raises(ValueError, match="engine kind"):
        ModelSpec(**model_entry("s", engine={"kind": "tpu"}))
    # A misspelt key would leave its default in force unseen: the simulator would run at 40 tokens/s
    with pytest.raises(ValueError, match="simulated engine takes ttft_ms, tokens_per_s.*not tokens_per_sec"):
        ModelSpec(**model_entry("s", engine={"kind": "sim", "tokens_per_sec": 5}))


def test_time_to_first_token_decode_rate_and_batch_capacity():
    host = make(max_num_seqs=2, ttft_ms=200, tokens_per_s=50, tick_ms=10)
    try:
        stamps: dict = {}

        def one(rid):
            start = time.monotonic()
            stamps[rid] = [start] + [time.monotonic() for d in host.generate(rid, PROMPT, GenParams(max_tokens=25))
                                     for _ in range(d.token_ids)]

        threads = [threading.Thread(target=one, args=(f"r{i}",)) for i in range(3)]
        for t in threads:
            t.start()
            time.sleep(0.02)  # arrival order: r0, r1 take the batch, r2 waits
        for t in threads:
            t.join()
        # Lower bounds are exact, from the request's start: token k is due k/rate after the first one was
        # due, so nothing is early (a first token seen late, on a busy machine, shortens the span from it to
        # the last). Upper bounds leave room for a busy machine (CI's three lanes on two cores have held a
        # thread back for a second) and still catch a wait per token.
        for rid in ("r0", "r1"):
            start, first, last = stamps[rid][0], stamps[rid][1], stamps[rid][-1]
            assert 0.2 <= first - start < 2.0
            assert 0.2 + 24 / 50 <= last - start  # 50 tokens/s per stream, after the first
            assert last - first < 24 / 50 + 0.5
        # The third had no slot until one of the first two ended (at the earliest, 0.2 + 24/50 after its
        # start), then its own time to first token; with a slot at once it would have had it at 0.26 s.
        assert stamps["r2"][1] >= min(stamps["r0"][0], stamps["r1"][0]) + 0.2 + 24 / 50 + 0.2
    finally:
        host.shutdown()


def test_text_is_deterministic_and_a_resume_continues_it(fast):
    whole, deltas = collect(fast, "a", max_tokens=40)
    assert deltas[-1].finish_reason == "length" and sum(d.token_ids for d in deltas) == 40
    assert collect(fast, "b", max_tokens=40)[0] == whole
    # On another worker: prompt + output so far (what a resume sends) goes on with the same text.
    head = collect(fast, "c", max_tokens=15)[0]
    tail = collect(fast, "d", PROMPT + head, max_tokens=25)[0]
    assert head + tail == whole
    # The tokenizer counts exactly what was generated (the snapshot's token count on resume).
    assert len(fast.tokenizer().encode(head)) == 15
    assert collect(fast, "e", PROMPT.replace("tea", "coffee"), max_tokens=40)[0] != whole


def test_stop_after_ends_by_itself_unless_eos_is_ignored():
    host = make(ttft_ms=0, tokens_per_s=2000, tick_ms=5, stop_after=[5, 9])
    try:
        _, deltas = collect(host, "s", max_tokens=100)
        assert deltas[-1].finish_reason == "stop" and 5 <= sum(d.token_ids for d in deltas) <= 9
        _, deltas = collect(host, "i", max_tokens=30, ignore_eos=True)
        assert deltas[-1].finish_reason == "length" and sum(d.token_ids for d in deltas) == 30
    finally:
        host.shutdown()


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 3, "maxLength": 20},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "budget": {"type": ["number", "null"], "exclusiveMinimum": 0, "multipleOf": 0.5},
        "kind": {"enum": ["trip", "stay"]},
        "when": {"type": "string", "format": "date"},
        "stops": {"type": "array", "minItems": 3, "items": {"$ref": "#/$defs/stop"}},
        "ok": {"type": "boolean"},
    },
    "required": ["city", "days", "budget", "kind", "when", "stops", "ok"],
    "additionalProperties": False,
    "$defs": {"stop": {"allOf": [{"type": "object", "properties": {"name": {"type": "string"}},
                                  "required": ["name"]},
                                 {"properties": {"nights": {"type": "integer"}}, "required": ["nights"]}]}},
}


def test_structured_output_is_a_valid_document(fast):
    text, deltas = collect(fast, "j", max_tokens=500, json_schema=SCHEMA)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert deltas[-1].finish_reason == "stop"  # ended by itself
    # Streamed in pieces: at 2,000 tokens/s the document takes 25 ms, and a consumer held off the
    # GIL that long on a loaded machine gets it merged into one Delta. At 100 tokens/s it takes 0.5 s.
    slow = make(max_num_seqs=1, ttft_ms=0, tokens_per_s=100, tick_ms=10)
    try:
        slow_text, slow_deltas = collect(slow, "s", max_tokens=500, json_schema=SCHEMA)
        assert slow_text == text and len(slow_deltas) > 1
    finally:
        slow.shutdown()
    text, deltas = collect(fast, "k", max_tokens=5, json_schema=SCHEMA)
    assert deltas[-1].finish_reason == "length"  # cut short, as a real engine would be


def test_recursive_and_huge_schemas_end():
    """A tree whose children are optional is a finite, valid document; a schema whose every instance nests
    without end, or a minLength of a gigabyte, fails at once instead of exhausting the stack or memory."""
    from worker.sim import MAX_STRING, document

    tree = {"$defs": {"node": {"type": "object", "properties": {
        "name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node"}
    jsonschema.validate(document(tree, ["a ", "b "]), tree)
    with pytest.raises(ValueError, match="nests deeper"):
        document({"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}, ["a "])
    cut = document({"type": "string", "minLength": 10**9, "maxLength": 10**9}, ["word "])
    assert MAX_STRING <= len(cut) < MAX_STRING + len("word ")


def test_a_forced_tool_call_comes_out_as_a_function_call(fast):
    req = ResponseRequest.model_validate({
        "model": "sim", "input": [{"type": "message", "role": "user", "content": "Weather in Oslo?"}],
        "tools": [{"type": "function", "name": "get_weather",
                   "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                  "required": ["city"]}}],
        "tool_choice": "required"})
    text, _ = collect(fast, "t", max_tokens=200, json_schema=tool_call_schema(req))
    builder = OutputBuilder("resp_x", "tool_forced")
    builder.feed(text)
    builder.finish()
    (call,) = builder.items
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert isinstance(json.loads(call["arguments"])["city"], str)


def test_a_sim_worker_never_imports_vllm():
    # Dozens of sim workers share one machine only if none pays vLLM's (and torch's) import.
    code = ("import sys; import worker.main, worker.runner, worker.recovery, worker.sim; "
            "print('vllm' in sys.modules or 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
