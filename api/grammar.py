"""The compile budget of structured-output grammars, checked at the door.

A constrained request (``response_format`` json_schema, or ``tool_choice`` required / named, which
constrain to an ``anyOf`` of the tools) is compiled by the worker's grammar backend, xgrammar
(vLLM's default), on threads every tenant shares. So before a request is accepted:

1. static limits: values in the schema, its nesting, and its anyOf/oneOf branches (a nested
   alternation counts once per enclosing branch: that product is what explodes);
2. the backend's own compile, once per (checkpoint, schema), in a helper process with a timeout:
   a schema xgrammar cannot handle, or cannot compile in time, is ``400 invalid_request`` here
   rather than ``generation_failed`` later. Importing xgrammar imports torch, so it never runs
   in the api process itself; the helper starts on the first constrained request.
"""

import hashlib
import json
import logging
import re
import select
import subprocess
import sys
import threading
from collections import OrderedDict
from pathlib import Path

from common.errors import LMSPError
from common.settings import Settings

log = logging.getLogger("lmsp.grammar")
ROOT = Path(__file__).resolve().parent.parent
CACHE_SIZE = 4096
_SOURCE = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")
START_SECONDS = 300  # importing torch and loading a tokenizer on a busy machine


def check_budget(schema, param: str, settings: Settings) -> None:
    nodes = alternatives = 0
    stack = [(schema, 1, 1)]  # value, depth, how many alternatives enclose it
    while stack:
        value, depth, weight = stack.pop()
        nodes += 1
        if nodes > settings.grammar_max_nodes:
            _refuse(param, f"has more than {settings.grammar_max_nodes} JSON values")
        if depth > settings.grammar_max_depth:
            _refuse(param, f"is nested deeper than {settings.grammar_max_depth} levels")
        if isinstance(value, dict):
            for key, member in value.items():
                if key in ("anyOf", "oneOf") and isinstance(member, list):
                    alternatives += weight * len(member)
                    if alternatives > settings.grammar_max_alternatives:
                        _refuse(param, f"has more than {settings.grammar_max_alternatives} anyOf/oneOf "
                                       "branches (nested ones count once per enclosing branch)")
                    stack.extend((m, depth + 1, weight * max(1, len(member))) for m in member)
                else:
                    stack.append((member, depth + 1, weight))
        elif isinstance(value, list):
            stack.extend((m, depth + 1, weight) for m in value)


def _refuse(param: str, why: str) -> None:
    raise LMSPError("invalid_request", f"{param} {why}: too costly to compile into a grammar", param=param)


class GrammarGate:
    def __init__(self, settings: Settings):
        self.settings = settings
        self._results: OrderedDict[str, str | None] = OrderedDict()  # key -> None (compiles) or why not
        self._lock = threading.Lock()   # one compile at a time: the helper answers in order
        self._proc: subprocess.Popen | None = None
        self._checkpoints: set[str] = set()  # the helper has these tokenizers loaded
        self._skipped: set[str] = set()      # ... and cannot load these
        self._unavailable = False  # xgrammar is not installed: only the static limits apply

    def check(self, schema: dict, param: str, checkpoint: str) -> None:
        """Whether the backend compiles ``schema`` (within its size limits: ``check_budget`` first)."""
        if self._unavailable:
            return
        text = json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        key = hashlib.sha256(f"{checkpoint}\n{text}".encode()).hexdigest()
        if key not in self._results:
            self._compile(key, text, checkpoint)
        why = self._results.get(key)
        if why is not None:
            raise LMSPError("invalid_request", f"{param} cannot be used for structured output: {why}",
                            param=param)

    def _compile(self, key: str, text: str, checkpoint: str) -> None:
        timeout = self.settings.grammar_compile_timeout_seconds
        starting = self._proc is None or checkpoint not in self._checkpoints
        if not self._lock.acquire(timeout=START_SECONDS if starting else timeout):
            raise LMSPError("overloaded", "Structured-output schemas are being checked; retry shortly",
                            retry_after=1)
        try:
            if key in self._results or self._unavailable:
                return
            if not self._ready(checkpoint):
                return
            answer = self._ask({"schema": text, "checkpoint": checkpoint}, timeout)
            why = f"the grammar does not compile within {timeout:g} s" if answer is None else answer["error"]
            self._results[key] = why
            while len(self._results) > CACHE_SIZE:
                self._results.popitem(last=False)
        finally:
            self._lock.release()

    def _ready(self, checkpoint: str) -> bool:
        """Start the helper and load ``checkpoint``'s tokenizer in it (not counted in the budget)."""
        if self._proc is None or self._proc.poll() is not None:
            self._checkpoints.clear()
            self._proc = subprocess.Popen([sys.executable, "-m", "api.grammar"], cwd=ROOT, text=True,
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            hello = self._read(START_SECONDS)
            if not hello or not hello.get("ready"):
                log.warning("grammar helper unavailable (%s); only static schema limits apply",
                            (hello or {}).get("error", "no answer"))
                self._unavailable = True
                self._stop()
                return False
        if checkpoint in self._skipped:
            return False
        if checkpoint not in self._checkpoints:
            answer = self._ask({"checkpoint": checkpoint}, START_SECONDS)
            if answer is None or answer["error"]:
                log.warning("grammar helper cannot load the tokenizer of %s (%s); only static schema "
                            "limits apply to it", checkpoint, (answer or {}).get("error", "no answer"))
                self._skipped.add(checkpoint)
                return False
            self._checkpoints.add(checkpoint)
        return True

    def _ask(self, job: dict, timeout: float) -> dict | None:
        try:
            self._proc.stdin.write(json.dumps(job) + "\n")
            self._proc.stdin.flush()
        except OSError:
            self._stop()
            return None
        answer = self._read(timeout)
        if answer is None:
            self._stop()  # stuck in a compile: start afresh for the next one
        return answer

    def _read(self, timeout: float) -> dict | None:
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        line = self._proc.stdout.readline() if ready else ""
        return json.loads(line) if line else None

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None


def _serve() -> None:
    """The helper: one JSON job a line on stdin, one answer a line on stdout."""
    try:
        import xgrammar
        from transformers import AutoTokenizer
    except ImportError as exc:
        print(json.dumps({"ready": False, "error": str(exc)}), flush=True)
        return
    print(json.dumps({"ready": True}), flush=True)
    compilers = {}
    for line in sys.stdin:
        job = json.loads(line)
        checkpoint = job["checkpoint"]
        try:
            if checkpoint not in compilers:
                info = xgrammar.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(checkpoint))
                compilers[checkpoint] = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            if "schema" in job:
                compilers[checkpoint].compile_json_schema(job["schema"], any_whitespace=True)
            answer = {"error": None}
        except Exception as exc:  # noqa: BLE001 - whatever the backend refuses is the client's answer
            # xgrammar's messages start with "[time] file.cc:line: "; the client needs only the rest.
            text = _SOURCE.sub("", " ".join(str(exc).split()))
            answer = {"error": text[:500] or type(exc).__name__}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    _serve()
