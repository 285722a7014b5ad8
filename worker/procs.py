"""Engine processes on this host, found without importing an engine: a killed worker's leftover
vLLM processes (ended at boot), and CPU pinning of this process's threads."""

import hashlib
import os
import signal
import time
from pathlib import Path

# Inherited by the spawned EngineCore process, so a restarted worker can find
# the engine its SIGKILLed predecessor left behind (see kill_stale_engines).
ENGINE_TAG_ENV = "LMSP_ENGINE_TAG"
# The same for the database a worker serves: two deployments on one host (two `lmsp dev`, say) may
# reuse a worker id, and must never end each other's engines.


def vllm_process_prefix() -> str:
    # What vllm.envs.VLLM_PROCESS_NAME_PREFIX reads, without importing vLLM (seconds, hundreds of MiB).
    return os.environ.get("VLLM_PROCESS_NAME_PREFIX", "VLLM")


_deployment: str | None = None  # this process's deployment (mark_deployment)


def mark_deployment(database_url: str) -> None:
    global _deployment
    _deployment = hashlib.sha256(database_url.encode()).hexdigest()[:16]


def engine_markers(tag: str) -> dict[str, str]:
    """The environment an engine this process starts carries, for kill_stale_engines to find it after a
    SIGKILL: one variable, ``tag@deployment``. vLLM renames its processes (setproctitle), which
    overwrites all but the end of what /proc/PID/environ shows: set it last, just before the load
    (EngineHost._load), and it is what survives."""
    return {ENGINE_TAG_ENV: f"{tag}@{_deployment}" if _deployment else tag}


def kill_stale_engines(tag: str, timeout: float = 10.0) -> list[int]:
    """SIGKILL the vLLM processes (EngineCore and its Worker, also while starting, and the killed
    worker's multiprocessing resource tracker) carrying ``tag`` (and this process's deployment, once
    ``mark_deployment`` ran).

    A SIGKILLed worker leaves its engine running (on a GPU, holding the card's
    memory); call this at boot, before start(), with the worker's stable id as
    the tag. Our own descendants are spared. Returns the pids killed.
    """
    markers = {f"{name}={value}".encode() for name, value in engine_markers(tag).items()}
    title = f"{vllm_process_prefix()}::".encode()
    killed = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        pid = int(proc.name)
        try:
            cmdline = (proc / "cmdline").read_bytes()
            # An engine still starting has not renamed itself yet (it is a multiprocessing spawn child),
            # and a killed worker's resource tracker outlives it too: both carry the markers as well.
            if not (cmdline.startswith(title) or b"multiprocessing" in cmdline):
                continue
            if not markers <= set((proc / "environ").read_bytes().split(b"\0")):
                continue
            if _descends_from_us(pid):
                continue
            os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError):
            continue  # exited meanwhile, or not ours to read or kill
        killed.append(pid)
    wait_gone(killed, timeout)
    return killed


def engine_processes(pids) -> set[int]:
    """Those of ``pids`` an engine owns: not multiprocessing's resource tracker, which the whole process
    shares (started by the first engine, used by the next)."""
    owned = set()
    for pid in pids:
        try:
            if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                owned.add(pid)
        except OSError:
            continue  # gone already
    return owned


def wait_gone(pids, timeout: float = 10.0) -> None:
    """Until every one of ``pids`` has exited (a zombie counts as gone); TimeoutError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while any(_alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"engine processes did not exit: {sorted(pids)}")
        time.sleep(0.1)


def kill(pids) -> None:
    """SIGKILL ``pids``, those already gone aside."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue


def _stat(pid: int) -> list[str]:
    # Fields after "(comm)", which may itself contain spaces: [state, ppid, ...].
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _pin_process(cpus: set[int]) -> None:
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass  # the thread ended meanwhile


def _descendants(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                parents[int(proc.name)] = int(_stat(int(proc.name))[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = [], [root]
    while frontier:
        kids = [pid for pid, ppid in parents.items() if ppid in frontier]
        found += kids
        frontier = kids
    return found


def _descends_from_us(pid: int) -> bool:
    me = os.getpid()
    while pid > 1:
        if pid == me:
            return True
        pid = int(_stat(pid)[1])
    return False


def _alive(pid: int) -> bool:
    # A killed orphan may stay a zombie until its new parent reaps it; a
    # zombie holds no memory, so it counts as gone.
    try:
        return _stat(pid)[0] != "Z"
    except OSError:
        return False
