"""The CPU no-spin plugin (issue 36, defect 6): vLLM calls it outside any ``try``, so whatever shape
vLLM's shared-memory queue has, it never raises; it patches only the shape it was written for and
otherwise leaves vLLM as shipped with one warning. Fake vLLM modules; the real one is checked by the
engine tests (a CPU engine starts with it). <1 s."""

import sys
import types

import pytest

from common.registry import ENGINE_NO_SPIN
from worker import vllm_plugin

MODULE = "vllm.distributed.device_communicators.shm_broadcast"


class Shipped:  # the shape of vLLM 0.32's SpinCondition
    def __init__(self, busy_loop_s: float = 1):
        self.last_read = 0.0
        self.busy_loop_s = busy_loop_s

    def wait(self, timeout_ms: int | None = None) -> None:
        pass


class Moved:  # a later vLLM: another signature, the busy window kept elsewhere
    def __init__(self):
        self.deadline = 0.0

    def wait(self, timeout_ms, poller) -> None:
        pass


@pytest.fixture
def vllm_as(monkeypatch):
    monkeypatch.setenv(ENGINE_NO_SPIN, "1")
    monkeypatch.setattr(vllm_plugin, "_warned", False, raising=False)

    def install(cls):
        module = types.ModuleType(MODULE)
        if cls is not None:
            module.SpinCondition = cls
        monkeypatch.setitem(sys.modules, MODULE, module)
        return cls
    return install


def test_the_shape_it_was_written_for_is_patched(vllm_as):
    cls = vllm_as(type("Spin", (Shipped,), {}))
    vllm_plugin.register()
    vllm_plugin.register()  # loaded twice in a process: patched once
    assert cls.wait.no_spin and cls.wait.__closure__ is not None


@pytest.mark.parametrize("cls", [None, Moved], ids=["class-gone", "other-shape"])
def test_another_shape_leaves_vllm_as_shipped_with_one_warning(vllm_as, caplog, cls):
    cls = vllm_as(cls if cls is None else type("Spin", (cls,), {}))
    original = None if cls is None else cls.wait
    with caplog.at_level("WARNING", logger="lmsp.vllm_plugin"):
        vllm_plugin.register()
        vllm_plugin.register()
    if cls is not None:
        assert cls.wait is original
    warnings = [r for r in caplog.records if "no-spin patch is off" in r.getMessage()]
    assert len(warnings) == 1
