"""Small tools for the benchmark: progress, statistics, a lean HTTP/SSE client, /proc memory."""

import json
import os
import re
import signal
import socket
import statistics
import struct
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

T0 = time.monotonic()


def log(message: str) -> None:
    print(f"[bench {time.monotonic() - T0:7.1f}s] {message}", file=sys.stderr, flush=True)


# -- statistics ------------------------------------------------------------------------------
def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def percentile(values, q: float):
    """Linear interpolation between closest ranks (q in 0..100)."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    pos = (len(values) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


# -- prompts ------------------------------------------------------------------------------------
TOPICS = [
    "the history of tea", "how bridges are built", "the water cycle", "volcanoes", "the printing press",
    "honey bees", "the moon landing", "coral reefs", "the invention of paper", "glaciers",
    "the Silk Road", "photosynthesis", "lighthouses", "the human heart", "desert plants",
    "the Roman aqueducts", "thunderstorms", "the piano", "migratory birds", "the first computers",
    "rainforests", "the Great Wall of China", "octopuses", "wind energy", "ancient Egypt",
    "the Olympic Games", "chess", "the telescope", "salt", "the Amazon river",
    "penguins", "the railway", "coffee", "earthquakes", "the alphabet",
    "solar panels", "the Renaissance", "whales", "bread baking", "the compass",
    "mountains", "the internet", "bicycles", "the ocean tides", "maps and mapmaking",
    "the violin", "clouds", "the steam engine", "elephants", "recycling",
    "the Moon", "gardening", "the postal service", "snowflakes", "libraries",
    "the microscope", "wolves", "architecture of cathedrals", "rivers", "the calendar",
    "clocks", "butterflies", "the Vikings", "wool and weaving",
]


def essay_prompt(i: int) -> str:
    return f"Write a long, detailed essay about {TOPICS[i % len(TOPICS)]}."


def user(text: str) -> list[dict]:
    return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}]


# -- lean HTTP -------------------------------------------------------------------------------------
class HTTPError(RuntimeError):
    def __init__(self, status: int, body: bytes):
        super().__init__(f"HTTP {status}: {body[:500]!r}")
        self.status = status
        self.body = body


# One whole block in the service's own form (common.events.sse), matched in C: a long replay is
# 100,000 of them, and the line-by-line loop of ``_blocks`` costs more per event than the SELECT
# B5 compares the replay with. A block in any other form goes through ``_blocks``.
_FRAME = re.compile(rb"(?:^|(?<=\n\n))id: (\d+)\nevent: ([^\n]*)\ndata: ([^\n]*)\n\n")


SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux; also the control message's type
_TIMESPEC = struct.Struct("@ll")
_TIMESPEC_SPACE = socket.CMSG_SPACE(_TIMESPEC.size)


def _blocks(text: bytes, t: float):
    """SSE blocks, line by line: (t, seq, name, data) of each event; comments and empty blocks yield nothing."""
    for block in text.split(b"\n\n"):
        seq, name, data = None, None, None
        for line in block.split(b"\n"):
            if line.startswith(b"id: "):
                seq = int(line[4:])
            elif line.startswith(b"event: "):
                name = line[7:].decode()
            elif line.startswith(b"data: "):
                data = line[6:]
        if name is not None:
            yield t, seq, name, data


class RawStream:
    """One HTTP/1.0 request on a raw socket (no chunked framing: the server closes at the end),
    for reading SSE with as little client CPU (and GIL) as possible."""

    def __init__(self, base: str, method: str, path: str, token: str, body=None, timeout: float = 600,
                 headers: dict | None = None):
        u = urlsplit(base)
        self.sent_at = time.time()
        self.sock = socket.create_connection((u.hostname, u.port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        data = json.dumps(body).encode() if body is not None else b""
        lines = [f"{method} {path} HTTP/1.0", f"Host: {u.hostname}:{u.port}",
                 f"Authorization: Bearer {token}", "Accept: text/event-stream"]
        if body is not None:
            lines += ["Content-Type: application/json", f"Content-Length: {len(data)}"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        self.sent_at = time.time()
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + data)
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"connection closed before headers: {buf[:300]!r}")
            buf += chunk
        self.headers_at = time.time()
        head, _, self.rest = buf.partition(b"\r\n\r\n")
        self.status = int(head.split(b" ", 2)[1])
        if self.status != 200:
            self.close_after_reading_error()

    def close_after_reading_error(self):
        body = self.rest
        try:
            while chunk := self.sock.recv(65536):
                body += chunk
        finally:
            self.sock.close()
        raise HTTPError(self.status, body)

    def events(self, arrival: bool = False):
        """Yield (receive time, seq, event name, data bytes); comments (heartbeats) are skipped.
        Events that arrive in one recv() share its receive time. With ``arrival``, ``self.arrived``
        is meanwhile the kernel's time of that recv's last bytes reaching the socket: this process's
        own scheduling (a thousand reader threads on one GIL) is in the receive time, not in it."""
        buf, t = self.rest, self.headers_at
        self.arrived = t
        if arrival:
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
            except OSError:
                arrival = False  # not Linux: the arrival time stays the receive time
        try:
            while True:
                end = buf.rfind(b"\n\n") + 2  # the complete blocks; the rest waits for more bytes
                if end > 1:
                    pos = 0
                    for m in _FRAME.finditer(buf, 0, end):
                        if m.start() > pos:
                            yield from _blocks(buf[pos:m.start()], t)
                        yield t, int(m[1]), m[2].decode(), m[3]
                        pos = m.end()
                    if pos < end:
                        yield from _blocks(buf[pos:end], t)
                    buf = buf[end:]
                if arrival:
                    chunk, ancillary, _flags, _addr = self.sock.recvmsg(1 << 18, _TIMESPEC_SPACE)
                    for level, kind, value in ancillary:
                        if (level, kind) == (socket.SOL_SOCKET, SO_TIMESTAMPNS):
                            sec, nsec = _TIMESPEC.unpack(value[:_TIMESPEC.size])
                            self.arrived = sec + nsec / 1e9
                else:
                    chunk = self.sock.recv(1 << 18)
                t = time.time()
                if not arrival:
                    self.arrived = t
                if not chunk:
                    return
                buf += chunk
        finally:
            self.sock.close()

    def close(self):
        self.sock.close()


# -- /proc --------------------------------------------------------------------------------------------
def proc_status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def vm_hwm_mib(pid: int) -> float | None:
    try:
        return int(proc_status(pid)["VmHWM"].split()[0]) / 1024
    except (OSError, KeyError, ValueError):
        return None


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry.name))
    return out


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for child in children(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def proc_name(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        return " ".join(c.decode(errors="replace") for c in cmd if c)[:80]
    except OSError:
        return "?"


class Freezer:
    """SIGSTOP / SIGCONT a set of processes, so an idle engine cannot take any CPU from the measured side.
    Each pid is signalled only while it is the same process (same start time) as when it was listed,
    so a pid reused after its process died is never stopped."""

    def __init__(self, name: str, pids_fn):
        self.name = name
        self.pids_fn = pids_fn
        self.frozen: list[tuple[int, int]] = []
        self.since = None

    def freeze(self) -> None:
        if self.frozen:
            return
        for pid in self.pids_fn():
            born = start_time(pid)
            if born is None:
                continue
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                continue
            if start_time(pid) != born:  # it died and its pid was taken between the two reads: undo
                os.kill(pid, signal.SIGCONT)
                continue
            self.frozen.append((pid, born))
        self.since = time.monotonic()

    def thaw(self) -> float:
        """Resume; returns how long it was frozen."""
        for pid, born in reversed(self.frozen):
            if start_time(pid) != born:
                continue
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        was = time.monotonic() - self.since if self.frozen else 0.0
        self.frozen = []
        return was


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User + system CPU of one process (or of its thread ``tid``) so far."""
    stat = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(stat).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ThreadMeter:
    """CPU seconds of one process's threads between start() and stop(), by Python thread name: which part
    of the process the CPU went to. py-spy's dump at stop names the threads; a pool's numbered threads
    (ThreadPoolExecutor-5_12, lmsp-interactive_7) count as one; a thread that ended meanwhile is lost
    (the process's own figure has it)."""

    def __init__(self, pid: int):
        self.pid = pid

    def _read(self) -> dict[int, float]:
        out = {}
        for tid in os.listdir(f"/proc/{self.pid}/task"):
            try:
                out[int(tid)] = cpu_seconds(self.pid, int(tid))
            except OSError:
                pass
        return out

    def start(self) -> "ThreadMeter":
        self.before = self._read()
        return self

    def stop(self) -> dict[str, float]:
        after, names = self._read(), self._names()
        used: dict[str, float] = {}
        for tid, cpu in after.items():
            name = names.get(tid, "unnamed")
            used[name] = used.get(name, 0.0) + cpu - self.before.get(tid, 0.0)
        return dict(sorted(used.items(), key=lambda kv: -kv[1]))

    def _names(self) -> dict[int, str]:
        import subprocess
        spy = Path(sys.executable).with_name("py-spy")
        try:
            dump = subprocess.run([str(spy), "dump", "--json", "--nonblocking", "-p", str(self.pid)],
                                  capture_output=True, text=True, timeout=60).stdout
            threads = json.loads(dump or "[]")
        except (OSError, subprocess.TimeoutExpired, ValueError):
            return {}
        return {t["os_thread_id"]: re.sub(r"(-\d+)?(_\d+)?$", "", t.get("thread_name") or "unnamed")
                for t in threads if t.get("os_thread_id")}


# -- identity and CPU pinning of processes ------------------------------------------------------------
def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot: with its pid, an identity no reuse can fake."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def tree(proc) -> list[int]:
    """A running Popen's pid and its descendants; nothing once it has exited (its pid may be reused)."""
    if proc is None or proc.poll() is not None:
        return []
    return [proc.pid] + descendants(proc.pid)


def affinity(pid: int) -> list[int] | None:
    try:
        return sorted(os.sched_getaffinity(pid))
    except OSError:
        return None


def engine_compute_cpus(root: int) -> list[int]:
    """The CPUs the vLLM compute processes (``VLLM::Worker...``) under ``root`` are bound to."""
    prefix = os.environ.get("VLLM_PROCESS_NAME_PREFIX", "VLLM") + "::Worker"
    bound: set[int] = set()
    for pid in descendants(root):
        if proc_name(pid).startswith(prefix):
            bound |= set(affinity(pid) or ())
    return sorted(bound)


def pin_off_engine(pid: int) -> list[int] | None:
    """Pin every thread of ``pid`` to the CPUs its engine's compute threads are not bound to, as the
    service's worker pins itself (worker.engine.EngineHost(pin=True)); done from outside, for a
    process that does not do it itself (vLLM's own server). Returns the CPUs, or None when nothing is
    left over (then the kernel decides, as it does for the worker)."""
    bound = set(engine_compute_cpus(pid))
    free = set(affinity(pid) or ()) - bound
    if not bound or not free:
        return None
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), free)
        except OSError:
            pass  # the thread ended meanwhile
    return sorted(free)
