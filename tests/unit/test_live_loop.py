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
