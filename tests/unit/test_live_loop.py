"""The fan-out thread (api/live/loop.py): calls from other threads run on it, in order; one that
raises is reported for its own follower and the thread goes on; the clock runs polls and ticks."""

import threading
import time

from api.live.loop import Loop


class Owner:
    sink = None  # what marks a follower (a call's owner) to the loop

    def boom(self):
        raise RuntimeError("boom")


def test_calls_run_in_order_on_the_loop_thread_and_a_failure_is_the_owners_only():
    failed, ticks, ran = [], [], []
    loop = Loop(lambda now: None, ticks.append, lambda: 0.05, lambda f, exc: failed.append((f, str(exc))))
    owner = Owner()
    done = threading.Event()
    loop.call(ran.append, (1, threading.current_thread().name))
    loop.call(owner.boom)
    loop.call(lambda: ran.append((2, threading.current_thread().name)))
    loop.call(done.set)
    assert done.wait(5)
    assert ran == [(1, "MainThread"), (2, "lmsp-fanout")]  # the first's argument was made here
    assert failed == [(owner, "boom")]
    time.sleep(0.6)
    assert ticks  # the clock ran meanwhile


def test_a_draining_sink_is_ticked_until_it_leaves():
    class Sink:
        ticks = 0

        def tick(self, now):
            self.ticks += 1
            loop.draining.discard(self)
    loop = Loop(lambda now: None, lambda now: None, lambda: 1.0, lambda f, exc: None)
    sink = Sink()
    loop.draining.add(sink)
    time.sleep(1.2)
    assert sink.ticks == 1 and not loop.draining


def test_calls_from_many_threads_all_run_in_each_threads_order_and_share_wake_ups(monkeypatch):
    """A call that lands while the thread is taking calls is taken with them or wakes it again: a
    lost wake-up would leave a ping below waiting. Calls that pile up share one wake-up byte."""
    from api.live import loop as module
    writes = []
    real_write = module.os.write
    monkeypatch.setattr(module.os, "write", lambda fd, data: writes.append(1) or real_write(fd, data))
    loop = Loop(lambda now: None, lambda now: None, lambda: 1.0, lambda f, exc: None)
    ran = {i: [] for i in range(3)}

    def flood(i):
        for k in range(20_000):
            loop.call(ran[i].append, k)
    flooders = [threading.Thread(target=flood, args=(i,)) for i in range(3)]
    for t in flooders:
        t.start()
    pings = after = 0
    while after < 100:  # pings while the others flood, and after
        after += not any(t.is_alive() for t in flooders)
        pong = threading.Event()
        loop.call(pong.set)
        assert pong.wait(5), f"a call waited for a wake-up that never came (ping {pings})"
        pings += 1
    assert all(seen == list(range(20_000)) for seen in ran.values())
    assert len(writes) < (60_000 + pings) / 2, (len(writes), pings)
