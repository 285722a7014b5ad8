"""The other baseline: vLLM's own OpenAI server on the same checkpoint with the same engine settings.

Started as ``python -m vllm.entrypoints.openai.api_server`` with the engine arguments and
environment the worker resolves (``common.registry.resolve_engine``), plus what EngineHost adds
(priority scheduling, prefix caching), so the two servers differ only in what sits around the engine.
"""

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from tests.bench.util import RawStream, descendants

# EngineHost sets these on every engine it starts (worker/engine.py).
HOST_ARGS = {"scheduling_policy": "priority", "enable_prefix_caching": True}


def argv(checkpoint: str, engine_args: dict, port: int) -> list[str]:
    out = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", checkpoint,
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "bench",
           "--disable-uvicorn-access-log"]
    for key, value in {"enforce_eager": True, **engine_args, **HOST_ARGS}.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is not False and value is not None:
            out += [flag, str(value)]
    return out


class VllmServer:
    def __init__(self, stack, checkpoint: str, settings, port: int):
        self.base = f"http://127.0.0.1:{port}"
        self.proc = stack.spawn(argv(checkpoint, settings.args, port), "vllm-server.log", **settings.env)
        self.log = stack.tmp / "vllm-server.log"

    def wait_ready(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("vLLM's server exited:\n" + self.log.read_text(errors="replace")[-3000:])
            try:
                if requests.get(self.base + "/health", timeout=2).ok:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        raise TimeoutError("vLLM's server not ready:\n" + self.log.read_text(errors="replace")[-3000:])

    def pids(self) -> list[int]:
        return [self.proc.pid] + descendants(self.proc.pid)

    def _body(self, text: str, max_tokens: int, stream: bool) -> dict:
        body = {"model": "bench", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                "temperature": 0, "stream": stream}
        if stream:  # the final chunk carries the usage: token totals are compared with the service's
            body["stream_options"] = {"include_usage": True}
        return body

    def complete(self, text: str, max_tokens: int) -> dict:
        r = requests.post(self.base + "/v1/chat/completions", json=self._body(text, max_tokens, False), timeout=900)
        r.raise_for_status()
        doc = r.json()
        return {"text": doc["choices"][0]["message"]["content"], "tokens": doc["usage"]["completion_tokens"]}

    def batch(self, texts: list[str], max_tokens: int) -> dict:
        """All at once, one connection each, as 64 clients would."""
        with ThreadPoolExecutor(len(texts)) as pool:
            start = time.perf_counter()
            done = list(pool.map(lambda t: self.complete(t, max_tokens), texts))
            elapsed = time.perf_counter() - start
        tokens = sum(d["tokens"] for d in done)
        return {"elapsed": elapsed, "tokens": tokens, "tokens_per_s": tokens / elapsed,
                "texts": [d["text"] for d in done]}

    def stream_ttft(self, text: str, max_tokens: int) -> dict:
        """Seconds from sending to the first non-empty content delta (as service.stream_ttft)."""
        s = RawStream(self.base, "POST", "/v1/chat/completions", "none", self._body(text, max_tokens, True))
        first, content, tokens = None, "", None
        buf = s.rest
        try:
            while True:
                # Line by line: uvicorn frames the stream in chunks, whose size lines sit between events.
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    line = line.rstrip(b"\r")
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    doc = json.loads(line[6:])
                    if doc.get("usage"):
                        tokens = doc["usage"]["completion_tokens"]
                    choices = doc["choices"]
                    delta = (choices[0]["delta"].get("content") or "") if choices else ""
                    if delta and first is None:
                        first = time.time() - s.sent_at
                    content += delta
                chunk = s.sock.recv(1 << 16)
                if not chunk:
                    break
                buf += chunk
        finally:
            s.close()
        return {"ttft": first, "text": content, "tokens": tokens}
