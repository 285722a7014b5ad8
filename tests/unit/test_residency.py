"""worker/residency.py with engines that only record whether they run: which models are loaded, in what
order, under a memory budget and a keep-alive (the real engines' loads are in tests/functional/test_models.py)."""

import threading
import time

import pytest

from common.registry import ModelSpec
from worker.residency import Closed, Residency, Slot


class Engine:
    dead = False

    def __init__(self, model, alive):
        self.model, self.alive = model, alive
        alive.add(model)

    def running(self):
        return 0

    def shutdown(self):
        self.alive.discard(self.model)


def hosts(*models, gib=1.0, budget=1.0, keep_alive=-1.0):
    alive: set[str] = set()
    slots = [Slot(ModelSpec(id=m, checkpoint="/x", context_window=8, max_output_tokens=8), gib,
                  lambda m=m: Engine(m, alive)) for m in models]
    return Residency(slots, budget_gib=budget, keep_alive=keep_alive), alive


def until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def in_thread(fn):
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def test_the_least_recently_used_model_makes_room():
    res, alive = hosts("a", "b", "c", budget=2.0)
    stop = threading.Event()
    for model in ("a", "b", "a", "c"):
        res.load(model, stop)
    assert res.loaded() == ["a", "c"] and alive == {"a", "c"}  # b was used least recently
    assert [s.loads for s in res.slots.values()] == [1, 1, 1]


def test_a_model_larger_than_the_budget_loads_alone():
    res, alive = hosts("a", "b", gib=5.0, budget=1.0)
    stop = threading.Event()
    res.load("a", stop)
    res.load("b", stop)
    assert alive == {"b"}


def test_a_busy_model_is_never_cut_off_and_takes_no_new_work_while_another_waits():
    res, alive = hosts("a", "b")
    stop = threading.Event()
    order = []
    with res.use("a", stop):
        waiter_b = in_thread(lambda: res.load("b", stop) or order.append("b"))
        until(lambda: res.slots["b"].waiting == 1)
        time.sleep(0.2)
        assert alive == {"a"} and not order  # a is running a request: b waits for it
        # b has waited longer than this new request for a: a takes no new work until b had its turn
        waiter_a = in_thread(lambda: res.load("a", stop) or order.append("a"))
        until(lambda: res.slots["a"].waiting == 1)
        time.sleep(0.2)
        assert not order
    waiter_b.join(5)
    waiter_a.join(5)
    assert order == ["b", "a"] and alive == {"a"}


def test_a_model_just_loaded_serves_all_that_waited_for_it_as_one_batch():
    res, alive = hosts("a", "b")
    stop = threading.Event()
    order = []
    gate = threading.Event()

    def run(model):
        with res.use(model, stop):
            order.append(model)
            gate.wait(5)

    with res.use("a", stop):
        waiters = [in_thread(lambda: run("b")) for _ in range(3)]
        until(lambda: res.slots["b"].waiting == 3)
        waiters.append(in_thread(lambda: run("a")))  # after b began to wait: a takes it after b's turn
        until(lambda: res.slots["a"].waiting == 1)
    until(lambda: len(order) == 3)
    time.sleep(0.3)
    assert order == ["b", "b", "b"]  # all three at once, a waiting: one load of b for them
    gate.set()
    for waiter in waiters:
        waiter.join(5)
    assert order == ["b", "b", "b", "a"]
    assert [s.loads for s in res.slots.values()] == [2, 1]


def test_keep_alive_unloads_idle_models_only():
    res, alive = hosts("a", "b", budget=5.0, keep_alive=0.2)
    stop = threading.Event()
    res.load("a", stop)
    with res.use("b", stop):
        time.sleep(0.3)
        assert res.expire() == ["a"]  # b is in use: kept
    assert alive == {"b"}
    time.sleep(0.3)
    assert res.expire() == ["b"] and res.loaded() == []


def test_a_worker_of_one_model_keeps_it_for_life():
    res, alive = hosts("a", keep_alive=0.0)
    res.load("a", threading.Event())
    assert res.pinned and res.expire() == [] and alive == {"a"}


def test_waiting_for_a_model_ends_when_the_worker_stops():
    res, _ = hosts("a", "b")
    stop = threading.Event()
    failed = []

    def wait_for_b():
        try:
            res.load("b", stop)
        except Closed:
            failed.append("closed")

    with res.use("a", stop):
        waiter = in_thread(wait_for_b)
        stop.set()
        waiter.join(5)
    assert failed == ["closed"]
    res.close()
    with pytest.raises(Closed):
        res.load("a", threading.Event())


def test_a_worker_row_says_which_models_it_serves_and_which_it_has_loaded(tmp_path):
    """What /models and the dashboard read: a worker of several models serves each, loaded or not."""
    from common import liveness
    from common.db import make_engine, session_factory, transaction, upgrade

    url = f"sqlite:///{tmp_path / 'rows.db'}"
    upgrade(url)
    sessions = session_factory(make_engine(url))
    with transaction(sessions) as session:
        liveness.heartbeat(session, "many", ["a", "b", "c"], 1.0, running=2, ready=True, loaded=["b"], boot=True)
        liveness.heartbeat(session, "one", ["a"], 1.0, running=0, ready=True, loaded=["a"], boot=True)
        liveness.heartbeat(session, "gone", ["c"], 1.0, running=0, ready=True, loaded=["c"], boot=True,
                           stopped=True)
    with sessions() as session:
        assert liveness.live_workers(session, 30) == {"a": 2, "b": 1, "c": 1}
        assert liveness.loaded_on(session, 30) == {"a": ["one"], "b": ["many"]}
        states = {w.id: w for w in liveness.worker_states(session, 30)}
    assert set(states) == {"many", "one"}
    assert (states["many"].model, states["many"].models, states["many"].models_loaded) == ("a", ["a", "b", "c"], ["b"])
    assert (states["one"].models, states["one"].models_loaded, states["one"].alive) == (["a"], ["a"], True)
