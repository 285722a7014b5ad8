"""A killed worker's leftovers are found by their markers, also before the engine has renamed itself."""

import os
import subprocess
import sys
import time
import uuid

from worker.procs import ENGINE_TAG_ENV, kill_stale_engines


def _orphan(code: str, tag: str) -> int:
    """A python process carrying ``tag`` whose parent is gone (as after a worker's SIGKILL)."""
    out = subprocess.run(["sh", "-c", f'{sys.executable} -c "{code}" >/dev/null 2>&1 & echo $!'],
                         env={**os.environ, ENGINE_TAG_ENV: tag}, capture_output=True, text=True, check=True)
    return int(out.stdout)


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_an_engine_still_starting_and_a_resource_tracker_are_ended_other_processes_spared():
    tag = f"test-{uuid.uuid4().hex[:8]}"
    starting = _orphan("import multiprocessing, time; time.sleep(60)", tag)  # a spawn child before its title
    bystander = _orphan("import time; time.sleep(60)", tag)  # carries the tag but is no engine
    stranger = _orphan("import multiprocessing, time; time.sleep(60)", "another-worker")
    try:
        time.sleep(0.5)
        killed = kill_stale_engines(tag)
        assert starting in killed
        assert bystander not in killed and stranger not in killed
        assert not _alive(starting) and _alive(bystander) and _alive(stranger)
    finally:
        for pid in (starting, bystander, stranger):
            try:
                os.kill(pid, 9)
            except OSError:
                pass
