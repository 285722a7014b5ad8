"""A simulated GPU engine (``engine: sim`` in models.yaml): the worker's engine interface, behind the
same admission gate as vLLM (``worker.gate``), at next to no CPU per token and without importing
vLLM, so one machine can host dozens of "GPUs" for load and scale tests. The real engine stays the
proof of behaviour; this one is for measuring everything around it.

What it simulates, per model entry (``engine: {kind: sim, ...}``):

* ``ttft_ms`` (150): from admission to the first token (also after a pause: a new prefill);
* ``tokens_per_s`` (40): decode rate of each stream, whatever the batch size (a GPU's batch);
* ``max_num_seqs`` (64): batch capacity; the gate pauses background work for a person's request;
* ``tick_ms`` (50): how often the batch advances; each stream gets every token due by then in one
  Delta (a GPU step per token would cost a Python wake-up per token, the very cost to avoid). The
  first token of a stream is not held back to a tick;
* ``stop_after`` (none): ``[lo, hi]``: a request ends by itself ("stop") after a number of tokens in
  that range, fixed by its prompt; otherwise it runs to its ``max_tokens`` ("length").

Text comes from a deterministic chain of words that are one token each in the model's tokenizer:
the next word depends only on the previous one, so a prompt that ends with generated text (a
``resume`` on another worker) continues the same text, and the tokenizer counts what was generated
exactly. A ``json_schema`` (structured output, or a forced tool call) gets a valid document for it.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import time
import zlib

from common.prompt import load_tokenizer
from common.registry import EngineSettings
from worker.gate import Delta, Deltas, GatedHost, Request

CORPUS_WORDS = 2048
CHARS_PER_JSON_TOKEN = 4  # a structured document is streamed in pieces of about a token
# A fault hook (the chaos run's poison request, tests/chaos): a prompt that carries CRASH_MARK kills the
# engine once it has streamed CRASH_AFTER tokens in an admission, as a request that crashes a real engine
# in decode does: every request in the engine fails with it, and the engine is dead.
CRASH_MARK, CRASH_AFTER = "[sim: crash the engine in decode]", 4


class _Stream:
    """One admitted request as the ticker advances it (loop thread only)."""

    __slots__ = ("req", "out", "prompt_tokens", "pos", "doc", "limit", "t0", "base", "done", "crash")

    def __init__(self, req: Request, out: Deltas, prompt_tokens: int, pos: int, doc: str | None, limit: int):
        self.req = req
        self.out = out
        self.prompt_tokens = prompt_tokens
        self.pos = pos            # the chain's position of the next word (text)
        self.doc = doc            # the whole document (structured output), streamed in pieces
        self.limit = limit        # tokens after which it ends
        self.t0 = 0.0             # when the first token of this admission is due
        self.base = 0             # tokens delivered before this admission
        self.done: asyncio.Future | None = None  # resolved with the finish reason that ends the admission
        self.crash = False        # the fault hook's poison (CRASH_MARK)


class SimEngineDied(RuntimeError):
    """The fault hook's crash (CRASH_MARK)."""


class SimEngine(GatedHost):
    dead_errors = (SimEngineDied,)

    def __init__(self, checkpoint: str, settings: EngineSettings, tag: str | None = None, pin: bool = False):
        args = settings.args
        super().__init__(int(args.get("max_num_seqs", 64)), "sim-engine-loop")
        self._checkpoint = checkpoint
        self.ttft = float(args.get("ttft_ms", 150)) / 1000
        self.rate = float(args.get("tokens_per_s", 40))
        self.tick = float(args.get("tick_ms", 50)) / 1000
        self.stop_after = args.get("stop_after")
        self._streams: dict[str, _Stream] = {}  # engine id -> admitted stream (loop thread)
        self._wake: asyncio.Event | None = None
        self._ticker: asyncio.Task | None = None
        self._closed = False

    # -- load ------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._load(), self._loop).result()
        except BaseException:
            self._stop_loop()
            raise

    async def _load(self) -> None:
        self._tok = load_tokenizer(self._checkpoint)
        self._chain = _chain(self._tok)
        self._at = {w.strip(): i for i, w in enumerate(self._chain)}
        self._wake = asyncio.Event()
        self._ticker = asyncio.create_task(self._tick_forever())

    # -- one request -------------------------------------------------------------------------------
    async def _pump(self, req: Request, prompt: str | list[int], out: Deltas) -> None:
        params = req.params
        text = prompt if isinstance(prompt, str) else self._tok.tokenizer.decode(prompt)
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(self._tok.encode(prompt))
        doc = None
        limit = params.max_tokens
        if params.json_schema is not None:
            doc = json.dumps(document(params.json_schema, self._chain), ensure_ascii=False)
            limit = min(limit, -(-len(doc) // CHARS_PER_JSON_TOKEN))
        elif self.stop_after and not params.ignore_eos:
            lo, hi = self.stop_after
            limit = min(limit, lo + zlib.crc32(text.encode()) % (hi - lo + 1))
        stream = _Stream(req, out, prompt_tokens, self._continue_at(text), doc, limit)
        stream.crash = CRASH_MARK in text
        await self._admitted(req, out, prompt_tokens, lambda: self._run_admitted(stream))

    async def _run_admitted(self, stream: _Stream) -> bool:
        """One admission: the ticker streams it until it ends (True) or the gate pauses it (False)."""
        req = stream.req
        stream.done = self._loop.create_future()
        stream.base = len(req.output_ids)
        stream.t0 = time.monotonic() + self.ttft
        self._streams[req.engine_id] = stream
        self._wake.set()
        try:
            finish = await stream.done
        finally:
            self._streams.pop(req.engine_id, None)
        if finish == "abort" and req.paused and not req.cancelled:
            return False  # paused by the gate, not ended: the consumer sees nothing
        if finish == "abort":
            stream.out.put(Delta(text="", token_ids=0, finish_reason="abort", prompt_tokens=stream.prompt_tokens))
        return True

    def _continue_at(self, prompt: str) -> int:
        """Where the chain goes on: after the prompt's last word when that is one of the chain's
        (a prompt ending in generated text), else at a place fixed by the prompt."""
        tail = prompt[-64:].split()
        if tail and tail[-1] in self._at:
            return (self._at[tail[-1]] + 1) % len(self._chain)
        return zlib.crc32(prompt.encode()) % len(self._chain)

    async def _engine_abort(self, engine_id: str) -> None:
        stream = self._streams.pop(engine_id, None)
        if stream is not None and not stream.done.done():
            stream.done.set_result("abort")

    # -- the batch ----------------------------------------------------------------------------------
    async def _tick_forever(self) -> None:
        next_tick = 0.0
        while True:
            if not self._streams:
                self._wake.clear()
                await self._wake.wait()
                next_tick = time.monotonic() + self.tick
            # The batch advances every tick, and a first token is never late by a tick (time to first
            # token is what a person notices); a stream admitted meanwhile wakes this to look again.
            now = time.monotonic()
            due = min([next_tick, *(s.t0 for s in self._streams.values() if len(s.req.output_ids) == s.base)])
            if due > now:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), due - now)
                    continue
                except TimeoutError:
                    pass
            now = time.monotonic()
            self._step(now)
            if now >= next_tick:
                next_tick = max(next_tick + self.tick, now)

    def _step(self, now: float) -> None:
        for engine_id, s in list(self._streams.items()):
            if now < s.t0:
                continue
            done = len(s.req.output_ids)
            if s.crash and done - s.base >= CRASH_AFTER:
                self._crash(s.req.request_id)
                return
            due = min(s.base + int((now - s.t0) * self.rate) + 1, s.limit)
            k = due - done
            if k <= 0:
                continue
            if s.doc is not None:
                text = s.doc[done * CHARS_PER_JSON_TOKEN:due * CHARS_PER_JSON_TOKEN]
            else:
                text = self._words(s.pos, k)
                s.pos = (s.pos + k) % len(self._chain)
            s.req.output_ids.extend(range(done, due))
            self._started(s.req)
            finish = None
            if due >= s.limit:
                finish = "stop" if s.limit < s.req.params.max_tokens or (
                    s.doc is not None and due * CHARS_PER_JSON_TOKEN >= len(s.doc)) else "length"
            s.out.put(Delta(text=text, token_ids=k, finish_reason=finish, prompt_tokens=s.prompt_tokens,
                             admitted_at=s.req.admitted_at))
            if finish is not None:
                del self._streams[engine_id]
                s.done.set_result(finish)

    def _crash(self, request_id: str) -> None:
        """The fault hook: the engine dies. The requests in it fail with the error (those prefilling are
        marked so: worker/gate.py), then, once they have, those waiting for a slot are cancelled."""
        self._closed = True
        error = SimEngineDied(f"the simulated engine crashed in the decode of {request_id} (fault hook)")
        for s in self._streams.values():
            if not s.done.done():
                s.done.set_exception(error)
        self._streams.clear()
        self._loop.call_soon(lambda: [pump.cancel() for pump in list(self._pumps)])

    def _words(self, pos: int, k: int) -> str:
        chain, n = self._chain, len(self._chain)
        if pos + k <= n:
            return "".join(chain[pos:pos + k])
        parts = []
        while k > 0:
            take = min(k, n - pos)
            parts.append("".join(chain[pos:pos + take]))
            k -= take
            pos = 0
        return "".join(parts)

    # -- the rest of the interface --------------------------------------------------------------------
    @property
    def dead(self) -> bool:
        return self._closed

    def tokenizer(self):
        return load_tokenizer(self._checkpoint)

    async def _close(self) -> None:
        self._closed = True
        await self._cancel_pumps()
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)


def _chain(tok) -> list[str]:
    """The chain's words (" word"), each one token, in the deterministic order the text follows."""
    vocab = tok.tokenizer.get_vocab()
    words = sorted({t[1:] for t in vocab if t.startswith("Ġ") and re.fullmatch(r"[a-z]{3,9}", t[1:])}
                   - {"assistant", "user", "system"})  # never the last word of a fresh chat prompt
    single = [w for w, enc in zip(words, tok.tokenizer.encode_batch([" " + w for w in words],
                                                                    add_special_tokens=False), strict=True)
              if len(enc.ids) == 1]
    rng = random.Random(0)
    chosen = rng.sample(single, min(CORPUS_WORDS, len(single)))
    if len(chosen) < 16:
        raise ValueError("the tokenizer has too few plain words for the simulated engine's text")
    return [" " + w for w in chosen]


# -- a valid document for a JSON schema ------------------------------------------------------------
# Past this depth only what the schema requires is built (a recursive schema's optional children end);
# past the hard limit the schema has no instance the simulator can build (its recursion is required).
OPTIONAL_DEPTH, MAX_DEPTH = 6, 64
MAX_STRING = 65536  # a longer minLength is cut, as max_output_tokens cuts a real engine's output


def document(schema: dict, words: list[str]):
    """A deterministic instance of ``schema`` (the subset structured output uses: types, enum, const,
    anyOf/oneOf/allOf, $ref to $defs, objects, arrays, string/number bounds)."""
    return _instance(schema, schema, words, [0], 0)


def _instance(schema, root, words, n, depth):
    if schema is True or not isinstance(schema, dict) or not schema:
        return None
    if depth > MAX_DEPTH:
        raise ValueError(f"the schema nests deeper than {MAX_DEPTH} levels in every instance")
    if "$ref" in schema:
        target = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            if part:
                target = target[part]
        return _instance(target, root, words, n, depth + 1)
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    for key in ("anyOf", "oneOf"):
        if schema.get(key):
            return _instance(schema[key][0], root, words, n, depth + 1)
    if schema.get("allOf"):
        merged = {k: v for k, v in schema.items() if k != "allOf"}
        for part in schema["allOf"]:
            merged = _merge(merged, part)
        return _instance(merged, root, words, n, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None:
        kind = "object" if "properties" in schema else "array" if "items" in schema else "string"
    deep = depth >= OPTIONAL_DEPTH
    if kind == "object":
        props = schema.get("properties", {})
        names = schema.get("required") or ([] if deep else list(props))
        return {name: _instance(props.get(name, {"type": "string"}), root, words, n, depth + 1) for name in names}
    if kind == "array":
        count = int(schema.get("minItems", 0))
        if not deep:
            count = max(count, min(2, int(schema.get("maxItems", 2))))
        prefix = schema.get("prefixItems", [])
        return [_instance(prefix[i] if i < len(prefix) else schema.get("items", {"type": "string"}), root, words, n,
                          depth + 1) for i in range(count)]
    if kind in ("integer", "number"):
        return _number(schema, kind)
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    return _string(schema, words, n)


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        if k == "properties":
            out[k] = {**out.get(k, {}), **v}
        elif k == "required":
            out[k] = list(dict.fromkeys(out.get(k, []) + v))
        else:
            out[k] = v
    return out


def _number(schema: dict, kind: str):
    lo = schema.get("minimum", schema.get("exclusiveMinimum", 0))
    hi = schema.get("maximum", schema.get("exclusiveMaximum", lo + 100))
    value = lo + 1 if "minimum" not in schema and "exclusiveMinimum" in schema else lo
    if value > hi or ("exclusiveMaximum" in schema and value >= hi):
        value = (lo + hi) / 2
    if step := schema.get("multipleOf"):
        value = math.ceil(value / step) * step
    return math.ceil(value) if kind == "integer" else value


FORMATS = {"date-time": "2026-11-08T12:00:00Z", "date": "2026-11-08", "time": "12:00:00",
           "email": "sim@example.com", "uri": "https://example.com/sim",
           "uuid": "00000000-0000-4000-8000-000000000000", "ipv4": "192.0.2.1"}


def _string(schema: dict, words, n) -> str:
    if schema.get("format") in FORMATS:
        return FORMATS[schema["format"]]
    lo, hi = min(int(schema.get("minLength", 0)), MAX_STRING), int(schema.get("maxLength", 40))
    text = ""
    while len(text) < max(lo, 1):
        text += words[n[0] % len(words)]
        n[0] += 1
    text = text.strip()
    text = (text + "x" * lo)[:max(lo, len(text))]
    return text[:hi]
