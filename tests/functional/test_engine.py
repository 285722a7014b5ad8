"""worker/engine.py's admission gate on the real engine: a person's request never waits for a
batch slot held by background work, and the background request it pauses loses nothing."""

import threading
import time

import pytest

from common.registry import ModelSpec, detect_machine, resolve_engine
from tests.harness import CHECKPOINT, model_entry

pytestmark = pytest.mark.skipif(not (CHECKPOINT / "config.json").exists(), reason="default model not imported")

BACKGROUND, INTERACTIVE = 6, 0
TOKENS = 48


@pytest.fixture(scope="module")
def host():
    from worker.engine import EngineHost
    spec = ModelSpec(**model_entry("gate", engine={"dtype": "float32", "max_model_len": 512, "max_num_seqs": 2}))
    h = EngineHost(spec.checkpoint, resolve_engine(spec, detect_machine()))
    h.start()
    yield h
    h.shutdown()


def run(host, rid, prompt, priority, out, tokens=TOKENS):
    from worker.engine import GenParams
    text, first = "", None
    start = time.monotonic()
    for delta in host.generate(rid, prompt, GenParams(max_tokens=tokens, temperature=0, priority=priority,
                                                       ignore_eos=True)):
        if delta.token_ids and first is None:
            first = time.monotonic() - start
        text += delta.text
        final = delta
    out[rid] = {"text": text, "first": first, "first_at": start + first if first is not None else None,
                "end": time.monotonic(), "finish": final.finish_reason, "prompt_tokens": final.prompt_tokens}


def test_interactive_pauses_background_and_background_resumes_intact(host):
    prompts = {"bg-a": "<|im_start|>user\nTell me about rivers.<|im_end|>\n<|im_start|>assistant\n",
               "bg-b": "<|im_start|>user\nTell me about mountains.<|im_end|>\n<|im_start|>assistant\n"}
    alone: dict = {}
    for rid, prompt in prompts.items():
        run(host, rid + "-alone", prompt, BACKGROUND, alone)

    got: dict = {}
    threads = [threading.Thread(target=run, args=(host, rid, p, BACKGROUND, got)) for rid, p in prompts.items()]
    for t in threads:
        t.start()
    while host.running() < 2 or len(host._active) < 2:  # both slots taken by background work
        time.sleep(0.01)
    time.sleep(0.3)
    run(host, "person", "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n", INTERACTIVE, got, tokens=8)
    for t in threads:
        t.join()
    # Admitted at once, not after a background request ended ...
    assert got["person"]["end"] < min(got["bg-a"]["end"], got["bg-b"]["end"])
    # ... and the paused one resumed where it was: same text, same length, same prompt count.
    for rid in prompts:
        assert got[rid]["text"] == alone[rid + "-alone"]["text"]
        assert got[rid]["finish"] == "length"
        assert got[rid]["prompt_tokens"] == alone[rid + "-alone"]["prompt_tokens"]


def test_abort_while_waiting_for_a_slot(host):
    got: dict = {}
    prompt = "<|im_start|>user\nCount to one hundred.<|im_end|>\n<|im_start|>assistant\n"
    threads = [threading.Thread(target=run, args=(host, f"hold-{i}", prompt, INTERACTIVE, got, 64)) for i in range(2)]
    for t in threads:
        t.start()
    while len(host._active) < 2:
        time.sleep(0.01)
    waiter = threading.Thread(target=run, args=(host, "waiter", prompt, BACKGROUND, got))
    waiter.start()
    while "waiter" not in host._requests:
        time.sleep(0.01)
    host.abort("waiter")
    waiter.join(timeout=30)
    assert not waiter.is_alive()
    assert got["waiter"]["finish"] == "abort" and got["waiter"]["text"] == ""
    assert "hold-0" not in got  # it ended while the batch was still busy
    for t in threads:
        t.join()


def test_first_token_step_carries_no_background_prefill(host):
    person = "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    background = "<|im_start|>user\nTell me about lakes.<|im_end|>\n<|im_start|>assistant\n"
    alone: dict = {}
    run(host, "lakes-alone", background, BACKGROUND, alone)
    got: dict = {}
    p = threading.Thread(target=run, args=(host, "first", person, INTERACTIVE, got, 8))
    p.start()
    while "first" not in host._active:
        time.sleep(0.001)
    # A free slot, but the person's first token is still being computed: the background request waits
    # for it (or, admitted before it, is paused: it had no output yet) ...
    run(host, "lakes", background, BACKGROUND, got)
    p.join()
    assert got["lakes"]["first_at"] > got["first"]["first_at"]
    # ... and loses nothing by it.
    assert got["lakes"]["finish"] == "length"
    assert got["lakes"]["prompt_tokens"] == alone["lakes-alone"]["prompt_tokens"]
