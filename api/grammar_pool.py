"""The grammar backend's helper processes, and the pool the api's compiles share.

Importing xgrammar imports torch, so the backend never runs in the api process: each helper is a
process that answers one JSON job a line on a socket. A helper serves one compile at a time; a
compile that overruns its timeout kills its helper, and the replacement starts in the background.
So no lock is held across a restart, and the pool's other helpers go on serving other principals.

Helpers are forked from one spawner process per pool, which imports the backend once (torch,
xgrammar and vLLM's own check: 10-15 CPU-s on a busy host). A replacement is then a fork and a
tokenizer load, so a client that sends schemas built to overrun costs the api's host a fork each,
not an import each.
"""

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from common.errors import LMSPError

ROOT = Path(__file__).resolve().parent.parent
START_SECONDS = 300  # importing torch and loading a tokenizer on a busy machine
FORK_SECONDS = 30
# Compiled once when a helper loads a tokenizer: the first compile and check of a helper pay lazy
# set-up (seconds on a loaded host) that would otherwise count against a client's compile timeout.
WARM_SCHEMA = '{"properties":{"n":{"type":"integer"}},"required":["n"],"type":"object"}'
_SOURCE = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def _readable(fd, timeout: float) -> bool:
    """poll, not select: an api process holding thousands of followers has descriptors past FD_SETSIZE."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout * 1000))


class Unavailable(Exception):
    """The backend does not answer. ``absent``: it cannot run here at all (xgrammar is not installed:
    only the static limits apply); else a moment's failure (the spawner died, or stuck), tried again."""

    def __init__(self, why: str, absent: bool = False):
        super().__init__(why)
        self.absent = absent


class Spawner:
    """The process helpers are forked from: started when the first helper is needed, and again if it
    died. Messages keep their bounds (SOCK_SEQPACKET): the new helper's socket and a pidfd of its
    process come with the reply, so a helper is killed by a handle that cannot name another process."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.control: socket.socket | None = None
        self._lock = threading.Lock()

    def spawn(self) -> tuple[socket.socket, int]:
        """A new helper: its socket and its pidfd (Unavailable: no backend, or no spawner will start)."""
        with self._lock:
            for _ in range(2):  # a spawner that died since the last helper is started again, once
                if self.proc is None or self.proc.poll() is not None:
                    self._start()
                try:
                    self.control.send(b"f")
                    reply, fds, _, _ = socket.recv_fds(self.control, 16, 2)
                except OSError:
                    reply, fds = b"", []
                if len(fds) == 2:
                    return socket.socket(fileno=fds[0]), fds[1]
                for fd in fds:
                    os.close(fd)
                if not reply:  # no answer: the spawner is gone or stuck (b"x": only that helper died)
                    self.stop()
            raise Unavailable("the grammar helpers' spawner does not answer")

    def _start(self) -> None:
        self.stop()
        self.control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self.proc = subprocess.Popen([sys.executable, "-m", "api.grammar_pool", str(theirs.fileno())],
                                         cwd=ROOT, pass_fds=[theirs.fileno()])
        self.control.settimeout(START_SECONDS)
        try:
            hello = json.loads(self.control.recv(4096) or b"null")
        except (OSError, ValueError):
            hello = None
        if not hello or not hello.get("ready"):
            self.stop()
            raise Unavailable((hello or {}).get("error", "no answer"), absent=bool(hello))  # hello: an ImportError
        self.control.settimeout(FORK_SECONDS)

    def stop(self) -> None:
        if self.control is not None:
            self.control.close()  # the spawner exits when it reads the end of its socket; the kill is sure
            self.control = None
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


class Helper:
    """One helper process; ``checkpoints`` are the tokenizers it has loaded."""

    def __init__(self, spawner: Spawner):
        self.spawner = spawner
        self.sock: socket.socket | None = None
        self.reader = self.writer = None  # the socket's two halves, as text files
        self.pidfd: int | None = None
        self.checkpoints: set[str] = set()

    @property
    def alive(self) -> bool:
        # A pidfd is readable once its process has ended.
        return self.pidfd is not None and not _readable(self.pidfd, 0)

    def start(self) -> None:
        self.sock, self.pidfd = self.spawner.spawn()
        self.reader = self.sock.makefile("r", encoding="utf-8")
        self.writer = self.sock.makefile("w", encoding="utf-8")

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
            self.writer.write(json.dumps(job) + "\n")
            self.writer.flush()
            # One answer a job: none is left in the reader's buffer when this polls the socket.
            line = self.reader.readline() if _readable(self.sock, timeout) else ""
            answer = json.loads(line) if line else None
        except (OSError, ValueError):
            answer = None
        if answer is None:
            self.stop()  # stuck in a compile, or dead: it is replaced, never reused
        return answer

    def stop(self) -> None:
        if self.pidfd is not None:
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _readable(self.pidfd, 10)  # gone (its memory free) before a replacement starts
            os.close(self.pidfd)
            self.pidfd = None
        if self.sock is not None:
            for f in (self.reader, self.writer, self.sock):
                try:
                    f.close()
                except OSError:
                    pass  # the unflushed half of a job to a helper that is gone
            self.sock = None


class HelperPool:
    """Up to ``size`` helpers, started when first needed; a helper is idle, in use or being replaced."""

    def __init__(self, size: int):
        self.size = size
        self.spawner = Spawner()
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
            return Helper(self.spawner)

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
            fresh = Helper(self.spawner)
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


def _spawn_helpers(control: socket.socket) -> None:
    """The spawner: imports the backend, says whether it is ready, then forks a helper per request."""
    sys.stdout = sys.stderr  # the libraries' own prints and logs (vLLM's go to stdout)
    try:
        import xgrammar
        from transformers import AutoTokenizer
    except ImportError as exc:
        control.send(json.dumps({"ready": False, "error": str(exc)}).encode())
        return
    backend = SimpleNamespace(xgrammar=xgrammar, tokenizer=AutoTokenizer.from_pretrained, check=_engine_check())
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the api kills helpers; the kernel reaps them
    control.send(json.dumps({"ready": True}).encode())
    while control.recv(16):  # the end of the socket: the api process is gone
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            control.close()
            ours.close()
            _serve(theirs, backend)
            os._exit(0)
        theirs.close()
        with ours:
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                control.send(b"x")  # the helper died at once: the api tries again
                continue
            socket.send_fds(control, [b"h"], [ours.fileno(), pidfd])
            os.close(pidfd)


def _serve(sock: socket.socket, backend) -> None:
    """A helper: one JSON job a line, one answer a line, until the api closes its end."""
    answers = sock.makefile("w", encoding="utf-8")
    compilers = {}  # checkpoint -> (its compiler, its tokenizer)
    for line in sock.makefile("r", encoding="utf-8"):
        job = json.loads(line)
        checkpoint = job["checkpoint"]
        try:
            if checkpoint not in compilers:
                tokenizer = backend.tokenizer(checkpoint)
                info = backend.xgrammar.TokenizerInfo.from_huggingface(tokenizer)
                compilers[checkpoint] = backend.xgrammar.GrammarCompiler(info, max_threads=1,
                                                                         cache_enabled=False), tokenizer
                _compile(compilers[checkpoint], WARM_SCHEMA, backend)  # first-use costs: not a client's budget
            if "schema" in job:
                _compile(compilers[checkpoint], job["schema"], backend)
            answer = {"error": None}
        except Exception as exc:  # noqa: BLE001 - whatever the backend refuses is the client's answer
            # xgrammar's messages start with "[time] file.cc:line: "; the client needs only the rest.
            text = _SOURCE.sub("", " ".join(str(exc).split()))
            answer = {"error": text[:500] or type(exc).__name__}
        print(json.dumps(answer), file=answers, flush=True)


def _compile(compiler_and_tokenizer, schema: str, backend) -> None:
    compiler, tokenizer = compiler_and_tokenizer
    compiler.compile_json_schema(schema, any_whitespace=True)
    backend.check(json.loads(schema), tokenizer)


def _engine_check():
    """vLLM's own check of a structured-output request, as the worker's engine makes it (backend auto:
    xgrammar, else guidance or outlines). A schema xgrammar compiles may still be one the engine refuses
    (uniqueItems, contains, an unknown format): refused here, it is a 400, not a generation that fails
    after its 200 or 202. Without vLLM (an api-only install) only xgrammar's compile applies."""
    try:
        from vllm.config import StructuredOutputsConfig
        from vllm.sampling_params import SamplingParams, StructuredOutputsParams

        # What the check imports on its first call (about a second on a busy host), imported before the
        # spawner says it is ready: a compile budget is for compiling.
        from vllm.v1.structured_output import backend_guidance, backend_outlines, backend_xgrammar  # noqa: F401
    except ImportError:
        return lambda schema, tokenizer: None
    config, model = StructuredOutputsConfig(backend="auto"), SimpleNamespace(is_diffusion=False)

    def check(schema: dict, tokenizer) -> None:
        params = SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(json=schema))
        params._validate_structured_outputs(model, config, tokenizer)  # what verify() runs in the engine
    return check


if __name__ == "__main__":
    _spawn_helpers(socket.socket(fileno=int(sys.argv[1])))
