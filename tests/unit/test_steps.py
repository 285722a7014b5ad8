"""The worker's steps (worker/steps.py): started in order, stopped in reverse, each once."""

import threading
from types import SimpleNamespace

import pytest

from worker import main
from worker.drain import Drain
from worker.steps import Blueprint, Engines, Step

calls: list[str] = []


def step(name: str, fail_start=False, fail_stop=False) -> type[Step]:
    def start(self, ctx):
        calls.append(f"start {name}")
        if fail_start:
            raise RuntimeError(name)

    def stop(self, ctx):
        calls.append(f"stop {name}")
        if fail_stop:
            raise RuntimeError(name)

    return type(name, (Step,), {"start": start, "stop": stop})


@pytest.fixture
def ctx():
    calls.clear()
    return SimpleNamespace(stopping=threading.Event())


def test_steps_start_in_order_and_stop_in_reverse_each_once(ctx):
    worker = Blueprint([step("a"), step("b"), step("c")])
    worker.start(ctx)
    worker.stop(ctx)
    worker.stop(ctx)
    assert calls == ["start a", "start b", "start c", "stop c", "stop b", "stop a"]


def test_a_step_that_fails_to_start_stops_those_before_it(ctx):
    worker = Blueprint([step("a"), step("b", fail_start=True), step("c")])
    with pytest.raises(RuntimeError):
        worker.start(ctx)
    assert calls == ["start a", "start b", "stop a"] and ctx.stopping.is_set()


def test_a_step_that_fails_to_stop_does_not_keep_the_others_running(ctx):
    worker = Blueprint([step("a"), step("b", fail_stop=True), step("c")])
    worker.start(ctx)
    worker.stop(ctx)
    assert calls[3:] == ["stop c", "stop b", "stop a"]


def test_stop_through_a_step_leaves_those_before_it_for_the_next_stop(ctx):
    a, b, c = step("a"), step("b"), step("c")
    worker = Blueprint([a, b, c])
    worker.start(ctx)
    worker.stop(ctx, through=b)
    assert calls[3:] == ["stop c", "stop b"]
    worker.stop(ctx)
    assert calls[5:] == ["stop a"]


def test_the_worker_drains_before_its_engines_stop_and_consumes_last():
    order = main.STEPS
    assert order[-1] is main.Consumer
    assert order.index(Drain) > order.index(Engines) > order.index(main.heart.Heart)
