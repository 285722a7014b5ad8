"""The engine contract, run against vLLM and the simulated engine alike (worker/gate.py's admission
gate in front of each): a person's request never waits for a batch slot held by background work, the
background request it pauses loses nothing, an abort ends a request at once, and max tokens is exact.
The vLLM engine is loaded once for the module (~40 s); the simulated one costs ~1 s."""

import threading
import time

import pytest

from common.registry import ModelSpec, detect_machine, resolve_engine
from tests.harness import CHECKPOINT, model_entry

pytestmark = pytest.mark.skipif(not (CHECKPOINT / "config.json").exists(), reason="default model not imported")

BACKGROUND, INTERACTIVE = 6, 0
TOKENS = 48
ENGINES = {
    # vLLM's stats on (the worker turns them off): a test reads each output's engine step from them.
    "vllm": {"dtype": "float32", "max_model_len": 512, "max_num_seqs": 2, "disable_log_stats": False},
    # Slow enough that a background request of TOKENS is still running when a person arrives.
    "sim": {"kind": "sim", "max_num_seqs": 2, "ttft_ms": 40, "tokens_per_s": 60, "tick_ms": 10},
}


@pytest.fixture(scope="module", params=list(ENGINES))
def host(request):
    spec = ModelSpec(**model_entry("gate", engine=ENGINES[request.param]))
    if spec.engine_kind == "sim":
        from worker.sim import SimEngine as Host
    else:
        from worker.engine import EngineHost as Host
    h = Host(spec.checkpoint, resolve_engine(spec, detect_machine()))
    h.start()
    yield h
    h.shutdown()


def run(host, rid, prompt, priority, out, tokens=TOKENS, on_delta=None):
    from worker.gate import GenParams
    text, first, tokens_seen = "", None, 0
    start = time.monotonic()
    for delta in host.generate(rid, prompt, GenParams(max_tokens=tokens, temperature=0, priority=priority,
                                                       ignore_eos=True)):
        if delta.token_ids and first is None:
            first = time.monotonic() - start
        tokens_seen += delta.token_ids
        text += delta.text
        final = delta
        if on_delta is not None:
            on_delta(delta)
    out[rid] = {"text": text, "tokens": tokens_seen, "first": first, "end": time.monotonic(),
                "ended_at": time.time(), "admitted_at": final.admitted_at, "finish": final.finish_reason,
                "prompt_tokens": final.prompt_tokens}


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
    # Admitted at once (by the gate's clock), not after a background request ended ...
    assert got["person"]["admitted_at"] < min(got["bg-a"]["ended_at"], got["bg-b"]["ended_at"])
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


def test_first_token_step_carries_no_background_prefill(host, monkeypatch):
    person = "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    background = "<|im_start|>user\nTell me about lakes.<|im_end|>\n<|im_start|>assistant\n"
    alone: dict = {}
    run(host, "lakes-alone", background, BACKGROUND, alone)
    # When the engine's first output of each request reached the host (its loop thread): the consumer
    # threads' clocks would also count how late a loaded machine schedules them.
    first_output: dict = {}
    started = host._started
    monkeypatch.setattr(host, "_started", lambda req: (first_output.setdefault(req.request_id, time.monotonic()),
                                                       started(req)))
    got: dict = {}
    p = threading.Thread(target=run, args=(host, "first", person, INTERACTIVE, got, 8))
    p.start()
    while "first" not in host._active:
        time.sleep(0.001)
    # A free slot, but the person's first token is still being computed: the background request waits
    # for it (or, admitted before it, is paused: it had no output yet) ...
    run(host, "lakes", background, BACKGROUND, got)
    p.join()
    assert first_output["lakes"] > first_output["first"]
    # ... and loses nothing by it.
    assert got["lakes"]["finish"] == "length"
    assert got["lakes"]["prompt_tokens"] == alone["lakes-alone"]["prompt_tokens"]


def test_a_persons_prompt_has_a_step_of_its_own_and_the_background_beside_it_loses_nothing(host, monkeypatch):
    """On a CPU, vLLM's scheduler computes a person's prompt in a step no running background decode
    shares (worker/vllm_scheduler.py): the background sits that one step out and goes on."""
    if not hasattr(host, "_llm"):
        pytest.skip("the simulated engine has no vLLM scheduler")
    # Each output's engine step, by the timestamp the engine core gave that step (vLLM's request stats).
    steps: dict = {}
    generate = host._llm.generate

    async def recorded(prompt, params, request_id, **kwargs):
        async for res in generate(prompt, params, request_id, **kwargs):
            steps.setdefault(request_id.split("~")[0], []).append(res.metrics.last_token_ts)
            yield res

    got: dict = {}
    run(host, "alone", PROMPT, BACKGROUND, got, 160)
    monkeypatch.setattr(host._llm, "generate", recorded)
    decoding = threading.Event()
    bg = threading.Thread(target=run, args=(host, "decoding", PROMPT, BACKGROUND, got, 160),
                          kwargs={"on_delta": lambda d: d.token_ids and decoding.set()})
    bg.start()
    assert decoding.wait(60)
    run(host, "person", "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n", INTERACTIVE, got, 4)
    bg.join()
    first = steps["person"][0]
    background = steps["decoding"]
    assert min(background) < first < max(background)  # it was decoding before and after ...
    assert first not in background  # ... but not in the person's step
    assert got["decoding"]["finish"] == "length" and got["decoding"]["tokens"] == 160
    assert got["decoding"]["text"] == got["alone"]["text"]  # greedy: the step it sat out changed nothing


PROMPT = "<|im_start|>user\nWrite about the sea.<|im_end|>\n<|im_start|>assistant\n"


def test_max_tokens_is_exact(host):
    got: dict = {}
    for n in (1, 7):
        run(host, f"max-{n}", PROMPT, BACKGROUND, got, tokens=n)
        assert got[f"max-{n}"]["tokens"] == n and got[f"max-{n}"]["finish"] == "length"
    # The text is what the tokenizer counts as that many tokens (a resume counts its snapshot so).
    assert len(host.tokenizer().encode(got["max-7"]["text"])) == 7


def test_abort_while_generating_ends_it_at_once(host):
    got: dict = {}
    started = threading.Event()
    t = threading.Thread(target=run, args=(host, "long", PROMPT, BACKGROUND, got, 400),
                         kwargs={"on_delta": lambda d: d.token_ids and started.set()})
    t.start()
    assert started.wait(60)
    aborted_at = time.monotonic()
    host.abort("long")
    t.join(timeout=30)
    assert not t.is_alive()
    assert got["long"]["finish"] == "abort"
    assert 0 < got["long"]["tokens"] < 400
    assert got["long"]["end"] - aborted_at < 2
    while host.running():  # its slot is free again
        time.sleep(0.01)


def test_the_scheduler_does_not_spin_through_a_cpu_forward_pass(host):
    """worker/vllm_plugin.py: vLLM's EngineCore waits for each step's result on a socket, not in a
    sched_yield loop; without it the EngineCore burns as much CPU as the process that computes."""
    if not hasattr(host, "_engine_procs"):
        pytest.skip("the simulated engine has no engine processes")
    import psutil

    procs = {psutil.Process(p.pid).name(): psutil.Process(p.pid) for p in host._engine_procs}
    core, = (p for name, p in procs.items() if "EngineCore" in name)
    computing, = (p for p in core.children() if "Worker" in p.name())

    def cpu(p):
        times = p.cpu_times()
        return times.user + times.system

    before = cpu(core), cpu(computing)
    run(host, "spin", PROMPT, BACKGROUND, {}, tokens=64)
    spent = cpu(core) - before[0], cpu(computing) - before[1]
    assert spent[0] < 0.3 * spent[1], f"EngineCore {spent[0]:.2f} CPU-s beside {spent[1]:.2f} computing"
