"""One live process per worker id: a second process with a live worker's id refuses to start, and a
worker whose id another process took over stops heartbeating (worker/identity.py, liveness.heartbeat)."""

import threading
import time
from types import SimpleNamespace

import pytest

from common import liveness
from common.db import make_engine, session_factory, transaction, upgrade
from common.settings import ConfigError
from worker import identity
from worker.identity import ensure_sole

LEASE, BEAT = 6.0, 0.2


@pytest.fixture
def sessions(tmp_path):
    url = f"sqlite:///{tmp_path / 'identity.db'}"
    upgrade(url)
    return session_factory(make_engine(url))


def beat(sessions, worker_id, started_at, **kw):
    with transaction(sessions) as session:
        liveness.heartbeat(session, worker_id, ["m"], started_at, running=0, ready=True, loaded=["m"], **kw)


def test_a_second_process_with_a_live_workers_id_refuses_to_start(sessions):
    beat(sessions, "gpu0", 1.0, boot=True)
    stop = threading.Event()

    def live():  # the first process goes on heartbeating
        while not stop.wait(BEAT):
            beat(sessions, "gpu0", 1.0)

    threading.Thread(target=live, daemon=True).start()
    try:
        with pytest.raises(ConfigError, match="another worker is running with id gpu0.*LMSP_WORKER_ID"):
            ensure_sole(sessions, "gpu0", LEASE, BEAT)
    finally:
        stop.set()


def test_a_worker_restarted_after_a_kill_keeps_its_id(sessions):
    """Its row is fresh but nobody heartbeats any more: after two heartbeats it starts."""
    beat(sessions, "gpu0", 1.0, boot=True)
    started = time.monotonic()
    ensure_sole(sessions, "gpu0", LEASE, BEAT)
    assert 2 * BEAT <= time.monotonic() - started < LEASE


def test_no_wait_for_an_id_that_stopped_or_never_ran(sessions, monkeypatch):
    # The watch is sleeps between reads: none is the proof (a wall-clock bound failed a loaded CI).
    slept = []  # (this module's time only: other tests' threads sleep too)
    monkeypatch.setattr(identity, "time", SimpleNamespace(monotonic=time.monotonic, sleep=slept.append))
    ensure_sole(sessions, "new", LEASE, BEAT)
    beat(sessions, "gpu0", 1.0, boot=True)
    beat(sessions, "gpu0", 1.0, stopped=True)
    ensure_sole(sessions, "gpu0", LEASE, BEAT)
    assert slept == []


def test_a_worker_whose_id_was_taken_over_is_told_at_its_next_heartbeat(sessions):
    beat(sessions, "gpu0", 1.0, boot=True)   # paused past its lease...
    beat(sessions, "gpu0", 2.0, boot=True)   # ...while another process booted with its id
    with pytest.raises(liveness.Replaced):
        beat(sessions, "gpu0", 1.0)
    beat(sessions, "gpu0", 2.0)              # the new holder heartbeats on
    with sessions() as session:
        assert liveness.lease_of(session, "gpu0", LEASE) is not None
