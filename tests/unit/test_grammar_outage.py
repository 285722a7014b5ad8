"""The grammar gate's transient failures are transient (issue 36, defect 3): a helper that gives no answer
while it loads a tokenizer, or a spawner that does not answer, takes the gate down for a backoff, during
which schema requests get 503 overloaded with Retry-After (never accepted unchecked), and the next
schema after it is checked again. A backend that is not installed at all keeps the static limits, each
such schema counted. Fake helpers in place of the processes (api/grammar_pool.py's are tested with the
real backend in tests/functional/test_edges.py). <1 s."""

import itertools

import pytest

from api.grammar import GrammarGate
from api.grammar_pool import Unavailable
from common.errors import LMSPError
from common.settings import Settings

GOOD, BAD = {"type": "object"}, {"type": "object", "bad": True}


class Script:
    spawn = "ok"        # or "stuck" (transient) or "absent" (no xgrammar)
    load = None         # None (loaded) or "no answer" (the helper died loading it)
    spawns = 0


class FakeHelper:
    def __init__(self, script: Script):
        self.script, self.alive, self.checkpoints = script, False, set()

    def start(self):
        self.script.spawns += 1
        if self.script.spawn != "ok":
            raise Unavailable("the grammar helpers' spawner does not answer" if self.script.spawn == "stuck"
                              else "No module named 'xgrammar'", absent=self.script.spawn == "absent")
        self.alive = True

    def load(self, checkpoint):
        if self.script.load is not None:
            self.alive = False
        return self.script.load

    def ask(self, job, timeout):
        return {"error": "it is bad" if '"bad"' in job["schema"] else None}


class FakePool:
    def __init__(self, script):
        self.script = script

    def take(self, wait):
        return FakeHelper(self.script)

    def give(self, helper):
        pass

    def replace(self, helper, then):
        then()


@pytest.fixture
def gate(monkeypatch):
    script = Script()
    g = GrammarGate(Settings(grammar_helpers=1))
    g._pool = FakePool(script)
    clock = [1000.0]
    monkeypatch.setattr("api.grammar.time.monotonic", lambda: clock[0])
    return g, script, clock


_SERIAL = itertools.count()


def _check(g, schema):
    g.check({**schema, "n": next(_SERIAL)}, "text.format", "/ckpt", "alice")  # a new schema each time: no cache


def _code(g, schema):
    try:
        _check(g, schema)
    except LMSPError as exc:
        return exc.code, exc.retry_after
    return "accepted", None


@pytest.mark.parametrize("failure", ["spawner-stuck", "no-answer-loading-the-tokenizer"])
def test_a_moment_of_failure_is_a_503_for_its_backoff_then_checked_again(gate, failure):
    g, script, clock = gate
    if failure == "spawner-stuck":
        script.spawn = "stuck"
    else:
        script.load = "no answer"
    assert _code(g, BAD) == ("overloaded", 1)  # not accepted unchecked
    spawns = script.spawns
    assert _code(g, GOOD) == ("overloaded", 1)  # within the backoff: the helpers are left alone
    assert script.spawns == spawns
    clock[0] += 1.5
    assert _code(g, GOOD) == ("overloaded", 2)  # failed again: the backoff doubles
    script.spawn, script.load = "ok", None
    clock[0] += 2.5
    assert _code(g, BAD) == ("invalid_request", None)  # back: checked by the backend again
    assert _code(g, GOOD) == ("accepted", None)
    assert g.bypassed == 0


def test_no_backend_installed_keeps_the_static_limits_and_counts_each_bypass(gate):
    g, script, _ = gate
    script.spawn = "absent"
    assert _code(g, BAD) == ("accepted", None)
    assert _code(g, BAD) == ("accepted", None)
    assert g.bypassed == 2 and script.spawns == 1
