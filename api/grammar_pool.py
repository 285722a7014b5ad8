"""The grammar backend's helper processes, and the pool the api's compiles share.

Importing xgrammar imports torch, so the backend never runs in the api process: each helper is a
child process that answers one JSON job a line. A helper serves one compile at a time; a compile
that overruns its timeout kills its helper, and the replacement starts in the background. So no
lock is held across a restart, and the pool's other helpers go on serving other principals.
"""

import json
import re
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from common.errors import LMSPError

ROOT = Path(__file__).resolve().parent.parent
START_SECONDS = 300  # importing torch and loading a tokenizer on a busy machine
_SOURCE = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


class Unavailable(Exception):
    """The backend cannot run here (xgrammar is not installed): only the static limits apply."""


class Helper:
    """One helper process; ``checkpoints`` are the tokenizers it has loaded."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.checkpoints: set[str] = set()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "api.grammar_pool"], cwd=ROOT, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        hello = self._read(START_SECONDS)
        if not hello or not hello.get("ready"):
            self.stop()
            raise Unavailable((hello or {}).get("error", "no answer"))

    def load(self, checkpoint: str) -> str | None:
        """Load ``checkpoint``'s tokenizer (once): None when loaded, else why not."""
        if checkpoint not in self.checkpoints:
            answer = self.ask({"checkpoint": checkpoint}, START_SECONDS)
            if answer is None or answer["error"]:
                return (answer or {}).get("error") or "no answer"
            self.checkpoints.add(checkpoint)
        return None

    def ask(self, job: dict, timeout: float) -> dict | None:
        """The answer to ``job``, or None when there is none within ``timeout`` (the helper is then gone)."""
        try:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            answer = self._read(timeout)
        except (OSError, ValueError):
            answer = None
        if answer is None:
            self.stop()  # stuck in a compile, or dead: it is replaced, never reused
        return answer

    def _read(self, timeout: float) -> dict | None:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        return json.loads(line) if line else None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


class HelperPool:
    """Up to ``size`` helpers, started when first needed; a helper is idle, in use or being replaced."""

    def __init__(self, size: int):
        self.size = size
        self._idle: list[Helper] = []
        self._live = 0  # helpers idle, in use or starting
        self._cond = threading.Condition()

    def take(self, wait: float) -> Helper:
        """An idle helper, else a new (unstarted) one while fewer than ``size`` are live, else the
        first one given back within ``wait`` seconds: ``503 overloaded`` when none is."""
        deadline = time.monotonic() + wait
        with self._cond:
            while not self._idle and self._live >= self.size:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LMSPError("overloaded", "Every structured-output schema checker of this api process "
                                    "is busy; retry shortly", retry_after=1)
                self._cond.wait(left)
            if self._idle:
                return self._idle.pop()
            self._live += 1
            return Helper()

    def give(self, helper: Helper) -> None:
        """Back into the pool; a dead one leaves it (the next ``take`` may start another)."""
        with self._cond:
            if helper.alive:
                self._idle.append(helper)
            else:
                self._live -= 1
            self._cond.notify()

    def replace(self, helper: Helper, then) -> None:
        """Start a helper with ``helper``'s tokenizers in its place, in the background; call ``then``
        once it is in the pool (or failed to start)."""
        def run():
            fresh = Helper()
            try:
                fresh.start()
                for checkpoint in helper.checkpoints:
                    fresh.load(checkpoint)
            except Unavailable:
                pass  # given back dead: it leaves the pool
            finally:
                self.give(fresh)
                then()
        helper.stop()
        threading.Thread(target=run, name="grammar-helper-restart", daemon=True).start()


def _serve() -> None:
    """The helper: one JSON job a line on stdin, one answer a line on stdout."""
    answers, sys.stdout = sys.stdout, sys.stderr  # the libraries' own prints and logs (vLLM's go to stdout)
    try:
        import xgrammar
        from transformers import AutoTokenizer
    except ImportError as exc:
        print(json.dumps({"ready": False, "error": str(exc)}), file=answers, flush=True)
        return
    engine_check = _engine_check()
    print(json.dumps({"ready": True}), file=answers, flush=True)
    compilers = {}  # checkpoint -> (its compiler, its tokenizer)
    for line in sys.stdin:
        job = json.loads(line)
        checkpoint = job["checkpoint"]
        try:
            if checkpoint not in compilers:
                tokenizer = AutoTokenizer.from_pretrained(checkpoint)
                info = xgrammar.TokenizerInfo.from_huggingface(tokenizer)
                compilers[checkpoint] = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False), tokenizer
            if "schema" in job:
                compiler, tokenizer = compilers[checkpoint]
                compiler.compile_json_schema(job["schema"], any_whitespace=True)
                engine_check(json.loads(job["schema"]), tokenizer)
            answer = {"error": None}
        except Exception as exc:  # noqa: BLE001 - whatever the backend refuses is the client's answer
            # xgrammar's messages start with "[time] file.cc:line: "; the client needs only the rest.
            text = _SOURCE.sub("", " ".join(str(exc).split()))
            answer = {"error": text[:500] or type(exc).__name__}
        print(json.dumps(answer), file=answers, flush=True)


def _engine_check():
    """vLLM's own check of a structured-output request, as the worker's engine makes it (backend auto:
    xgrammar, else guidance or outlines). A schema xgrammar compiles may still be one the engine refuses
    (uniqueItems, contains, an unknown format): refused here, it is a 400, not a generation that fails
    after its 200 or 202. Without vLLM (an api-only install) only xgrammar's compile applies."""
    try:
        from vllm.config import StructuredOutputsConfig
        from vllm.sampling_params import SamplingParams, StructuredOutputsParams

        # What the check imports on its first call (about a second on a busy host), imported before the
        # helper says it is ready: a compile budget is for compiling.
        from vllm.v1.structured_output import backend_guidance, backend_outlines, backend_xgrammar  # noqa: F401
    except ImportError:
        return lambda schema, tokenizer: None
    config, model = StructuredOutputsConfig(backend="auto"), SimpleNamespace(is_diffusion=False)

    def check(schema: dict, tokenizer) -> None:
        params = SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(json=schema))
        params._validate_structured_outputs(model, config, tokenizer)  # what verify() runs in the engine
    return check


if __name__ == "__main__":
    _serve()
