"""``lmsp worker --model ID --gpus 0,1,2,3|all [--tensor-parallel N]``: one worker process per GPU of this
host, or per group of N GPUs for a model bigger than one GPU (one engine spread over the group).

Each child sees only its GPUs (``CUDA_VISIBLE_DEVICES``, numbered in PCI bus order like ``nvidia-smi``)
and has a stable id, ``host:gpuN`` (``host:gpuN-M`` for a group), (``LMSP_WORKER_ID``), so a child started again finishes the bookkeeping of its own tasks; the Nth
child's metrics port is ``LMSP_WORKER_METRICS_PORT`` + N. A child that exits is started again after
a backoff that doubles while it keeps dying young. SIGTERM or SIGINT is passed on to every child as
SIGTERM (each drains its tasks) and the supervisor waits for all of them; a second signal kills them.
"""

import argparse
import ctypes
import logging
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from common import logs
from common.errors import LMSPError
from common.registry import Registry
from common.settings import ConfigError, get_settings
from worker.identity import DuplicateWorker

log = logging.getLogger("lmsp.supervisor")
_PR_SET_PDEATHSIG = 1


def parse_gpus(text: str) -> list[int]:
    if text.strip() == "all":
        return visible_gpus()
    try:
        gpus = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--gpus takes 'all' or GPU indices like 0,1,2, not {text!r}") from None
    if min(gpus) < 0 or len(set(gpus)) != len(gpus):
        raise ValueError(f"--gpus takes distinct GPU indices from 0, not {text!r}")
    return gpus


def group_gpus(gpus: list[int], tensor_parallel: int) -> list[tuple[int, ...]]:
    """``0,1,2,3`` with 2 -> ``(0, 1), (2, 3)``: each group is one worker, one engine."""
    if tensor_parallel < 1 or len(gpus) % tensor_parallel:
        raise ValueError(f"--tensor-parallel {tensor_parallel} does not divide the {len(gpus)} GPUs of --gpus "
                         f"{','.join(map(str, gpus))}: give a multiple of it")
    return [tuple(gpus[i:i + tensor_parallel]) for i in range(0, len(gpus), tensor_parallel)]


def visible_gpus() -> list[int]:
    """The GPUs ``nvidia-smi -L`` lists (``GPU 0: NVIDIA A100 ... (UUID: ...)``)."""
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True,
                                 timeout=60).stdout
    except FileNotFoundError:
        raise ValueError("--gpus all needs nvidia-smi on PATH; name the GPUs instead, e.g. --gpus 0,1") from None
    except subprocess.CalledProcessError as exc:
        raise ValueError(f"nvidia-smi -L failed: {exc.stderr.strip() or exc.returncode}") from None
    gpus = [int(n) for n in re.findall(r"^GPU (\d+):", listing, re.MULTILINE)]
    if not gpus:
        raise ValueError("nvidia-smi -L lists no GPU")
    return gpus


def die_with_parent() -> None:
    """A ``preexec_fn``: if the parent (this supervisor, `lmsp dev`) is SIGKILLed, the child gets SIGTERM
    (a worker drains and ends its engine) instead of running on as an orphan."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Child:
    gpus: tuple[int, ...]
    env: dict
    proc: subprocess.Popen | None = None
    started: float = 0.0
    backoff: float = 0.0
    restart_at: float = 0.0

    @property
    def worker_id(self) -> str:
        return self.env["LMSP_WORKER_ID"]


class Supervisor:
    def __init__(self, argv: list[str], gpus: list[int | tuple[int, ...]], *, host: str | None = None, metrics_port: int = 0,
                 min_backoff: float = 1.0, max_backoff: float = 60.0, stable_after: float = 60.0):
        self.argv = argv
        self.min_backoff, self.max_backoff, self.stable_after = min_backoff, max_backoff, stable_after
        host = host or socket.gethostname()
        self.children = []
        for n, group in enumerate(gpus):
            group = tuple(group) if isinstance(group, (tuple, list)) else (group,)
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(map(str, group)),
                   "LMSP_WORKER_ID": f"{host}:gpu" + "-".join(map(str, group))}
            # CUDA's default order (fastest first) can differ from nvidia-smi's on mixed hosts.
            env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
            env["LMSP_WORKER_METRICS_PORT"] = str(metrics_port + n if metrics_port else 0)
            self.children.append(Child(group, env))
        self.signals = 0

    def _on_signal(self, signum, _frame) -> None:
        self.signals += 1
        log.info("%s: stopping %d workers%s", signal.Signals(signum).name, len(self.children),
                 "" if self.signals == 1 else " now (second signal: killing them)")

    def _start(self, child: Child) -> None:
        # A group of its own: Ctrl-C reaches the supervisor only, which passes SIGTERM on once.
        child.proc = subprocess.Popen(self.argv, env=child.env, process_group=0, preexec_fn=die_with_parent)
        child.started = time.monotonic()
        log.info("started %s (pid %d) on GPU %s", child.worker_id, child.proc.pid, ",".join(map(str, child.gpus)))

    def _reap(self, child: Child, now: float) -> None:
        code, lived = child.proc.returncode, now - child.started
        child.proc = None
        if code == DuplicateWorker.exit_code:   # its id is live elsewhere: refused once, not again
            child.restart_at = math.inf
            log.error("%s was refused: another process holds its id (its log says where); not starting it "
                      "again: give this host its own hostname, then restart this service", child.worker_id)
            return
        young = lived < self.stable_after
        child.backoff = min(self.max_backoff, max(self.min_backoff, child.backoff * 2)) if young else self.min_backoff
        child.restart_at = now + child.backoff
        log.error("%s exited with %s after %.1f s; starting it again in %.1f s",
                  child.worker_id, code, lived, child.backoff)

    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        for child in self.children:
            self._start(child)
        while not self.signals:
            now = time.monotonic()
            for child in self.children:
                if child.proc is not None and child.proc.poll() is not None:
                    self._reap(child, now)
                if child.proc is None and now >= child.restart_at:
                    self._start(child)
            time.sleep(0.2)
        return self._stop()

    def _stop(self) -> int:
        running = [c.proc for c in self.children if c.proc is not None and c.proc.poll() is None]
        for proc in running:
            proc.send_signal(signal.SIGTERM)
        killed = False
        while any(proc.poll() is None for proc in running):
            if self.signals > 1 and not killed:
                for proc in running:
                    if proc.poll() is None:
                        proc.kill()
                killed = True
            time.sleep(0.2)
        log.info("every worker has stopped")
        return 0


def worker_argv(models: str, tensor_parallel: int = 1) -> list[str]:
    """``models``: one id, or several: ``a,b``."""
    return [sys.executable, "-m", "worker", "--model", models, "--tensor-parallel", str(tensor_parallel)]


def main(model: str | None, gpus: str, tensor_parallel: int = 1) -> int:
    from worker.main import model_list

    logs.setup()
    settings = get_settings()
    try:
        models = model_list(model)
        registry = Registry.load(settings.models_path)
        for model_id in models:
            registry.get(model_id)
        groups = group_gpus(parse_gpus(gpus), tensor_parallel)
    except LMSPError as exc:
        sys.exit(f"lmsp worker: {exc.detail} (registry: {settings.models_path})")
    except (ValueError, ConfigError) as exc:
        sys.exit(f"lmsp worker: {exc}")
    return Supervisor(worker_argv(",".join(models), tensor_parallel), groups, metrics_port=settings.worker_metrics_port).run()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m worker.supervisor",
                                     description="one worker per GPU of this host for one model")
    parser.add_argument("--model", help="a model id, or several: a,b (default: LMSP_WORKER_MODELS)")
    parser.add_argument("--gpus", required=True, help="'all' (what nvidia-smi -L lists) or indices: 0,1,2,3")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="GPUs per worker (one engine over them)")
    args = parser.parse_args()
    sys.exit(main(args.model, args.gpus, args.tensor_parallel))
