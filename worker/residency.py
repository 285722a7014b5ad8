"""Which of a worker's models are loaded: many models on few GPUs (issue 24).

A worker serves a set of models (``lmsp worker --model a,b``, ``LMSP_WORKER_MODELS``) but holds only
those that fit its memory budget (``LMSP_WORKER_MEMORY_BUDGET_GIB`` against each model's estimate,
``registry.memory_gib``). Work for a cold model loads it; to make room, the least recently used loaded
models are unloaded, and a model idle for the keep-alive (``LMSP_WORKER_KEEP_ALIVE_SECONDS``, as
Ollama's ``keep_alive``) is unloaded anyway. A worker of one model loads it at boot and keeps it for
life, as before (``pinned``).

Work waits here *before* it is claimed (``use``): a task whose model is cold stays ``queued`` in the
database while its message waits for the load, so unloading a model, or losing this worker, loses
nothing (the sweeper re-sends a message that was held when the worker died).

Order: the cold model waited for longest is loaded next. The loaded models it needs gone take no new
work from then on and are unloaded once their running requests end (never cut off), so a busy model
cannot keep another out for ever; but a model just loaded serves everything that waited for it during
its load, as one batch, before it yields: with work for two models queued, they take turns in batches
rather than a load per request. One load or unload at a time: each takes the machine anyway, and two
engines half-loaded would hold two engines' memory.

A load that fails (invariant 15: counted, bounded, reported) is tried again after ``retry_after``
seconds, and only into free memory: no loaded model is unloaded for a load that has not been shown to
work (one that failed and has not loaded since); a retry that would need room counts as failed too.
After ``max_failures`` failures in a row the model is unservable here: its waiters and every later
request get ``Unservable`` naming the cause (the runner fails such tasks ``model_unavailable``), and the
worker stops announcing it (``servable``), so ``GET /models`` shows it unavailable unless another
worker serves it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

from common.registry import ModelSpec

log = logging.getLogger("lmsp.residency")


class Closed(Exception):
    """The worker is stopping: no model is loaded or handed out any more."""


class Unservable(Exception):
    """The model's load failed too often here; the message is the cause."""


@dataclass(eq=False)
class Slot:
    spec: ModelSpec
    gib: float                    # what it holds once loaded (registry.memory_gib)
    load: Callable[[], object]    # a started engine host (worker/engine.py, worker/sim.py)
    engine: object | None = None
    users: int = 0                # requests holding the engine (use)
    waiting: int = 0              # requests waiting for it to be loaded, or to take new work again
    waiting_since: float = 0.0    # when the oldest of them began to wait
    last_used: float = 0.0        # monotonic
    loaded_at: float = 0.0        # monotonic: requests waiting since before it are its batch
    loads: int = 0
    failures: int = 0             # loads failed in a row (0: none since its last load worked)
    error: str | None = None      # the last load's own error
    cause: str | None = None      # why it is not loaded: the failures in a row and that error
    retry_at: float = 0.0         # monotonic: not tried again before
    broken: bool = False          # failed max_failures times: unservable here


class Residency:
    def __init__(self, slots: list[Slot], *, budget_gib: float, keep_alive: float, on_change=None,
                 max_failures: int = 3, retry_after: float = 10.0):
        self.slots = {slot.spec.id: slot for slot in slots}
        self.max_failures, self.retry_after = max_failures, retry_after
        self.pinned = len(slots) == 1  # one model: loaded at boot, kept for life
        self.budget, self.keep_alive = budget_gib, keep_alive
        self.on_change = on_change or (lambda: None)  # the loaded set changed (heartbeat, interactive lane)
        self._cond = threading.Condition()
        self._changing: Slot | None = None  # being loaded or unloaded
        self._stopping: set[str] = set()  # models whose engines are being stopped: loaded until they are gone
        self._closed = False

    # -- what is loaded -----------------------------------------------------------------------------
    @property
    def primary(self) -> Slot:
        return next(iter(self.slots.values()))

    def loaded(self) -> list[str]:
        """The models holding memory here: loaded, or being unloaded."""
        with self._cond:
            return [m for m, slot in self.slots.items() if slot.engine is not None or m in self._stopping]

    def servable(self) -> list[str]:
        """The models this worker serves: all but those whose load failed too often (its row needs one:
        a worker none of whose models can load still names its first)."""
        return [m for m, slot in self.slots.items() if not slot.broken] or [self.primary.spec.id]

    def running(self, model_id: str | None = None) -> int:
        slots = self.slots.values() if model_id is None else [self.slots[model_id]]
        return sum(engine.running() for slot in slots if (engine := slot.engine) is not None)

    # -- using a model ------------------------------------------------------------------------------
    @contextmanager
    def use(self, model_id: str, stop: threading.Event):
        """The model's engine, loaded first if it is cold (waiting meanwhile); ``Closed`` once ``stop``."""
        slot = self.slots[model_id]
        engine = self._acquire(slot, stop)
        try:
            yield engine
        finally:
            with self._cond:
                slot.users -= 1
                slot.last_used = time.monotonic()
                self._cond.notify_all()

    def _acquire(self, slot: Slot, stop: threading.Event):
        """The engine, once loaded: a load that fails is waited out and tried again (``_plan``), until the
        model is unservable."""
        while True:
            try:
                engine, doomed = self._turn(slot, stop)
            except Unservable:
                self.on_change()  # the worker's row stops announcing the model
                raise
            if engine is not None:
                return engine
            try:
                return self._load(slot, doomed)
            except Closed:
                raise
            except Exception:  # noqa: BLE001 - counted by _load; the next turn retries it or says Unservable
                continue

    def _turn(self, slot: Slot, stop: threading.Event):
        """(engine, None) when it is loaded and may take work; (None, victims) when this thread loads it."""
        with self._cond:
            since = time.monotonic()
            if not slot.waiting:
                slot.waiting_since = since
            slot.waiting += 1
            try:
                while True:
                    if self._closed or stop.is_set():
                        raise Closed()
                    if slot.broken:
                        raise Unservable(slot.cause)
                    target, leaving = self._plan()
                    if slot.engine is not None and not slot.engine.dead and (
                            slot not in leaving or since <= slot.loaded_at):
                        slot.users += 1
                        slot.last_used = time.monotonic()
                        return slot.engine, None
                    if slot is target and not any(s.users for s in leaving):
                        self._changing = slot
                        return None, [(victim, self._detach(victim)) for victim in leaving]
                    self._cond.wait(0.5)
            finally:
                slot.waiting -= 1

    def _plan(self) -> tuple[Slot | None, list[Slot]]:
        """The cold model to load next (waited for longest) and the loaded ones it needs gone, least
        recently used first; a model larger than the budget is loaded alone."""
        now = time.monotonic()
        cold = [s for s in self.slots.values() if s.engine is None and s.waiting and not s.broken and s.retry_at <= now]
        if self._changing is not None or not cold:
            return None, []
        target = min(cold, key=lambda s: s.waiting_since)
        resident = sorted((s for s in self.slots.values() if s.engine is not None), key=lambda s: s.last_used)
        free = self.budget - sum(s.gib for s in resident)
        leaving = []
        for slot in resident:
            if free >= target.gib:
                break
            leaving.append(slot)
            free += slot.gib
        if leaving and target.failures:  # not shown to work: nobody is unloaded for it
            self._failed(target, None)
            return None, []
        return target, leaving

    def _failed(self, slot: Slot, error: str | None) -> None:
        """(Under the lock.) A load of ``slot`` failed with ``error``, or was not tried (None): counted; at
        the bound the model is unservable."""
        slot.failures += 1
        slot.error = error or slot.error
        note = "" if error else " (not retried: it would need loaded models unloaded)"
        slot.cause = f"loading {slot.spec.id} failed {slot.failures} times in a row; the last: {slot.error}{note}"
        slot.retry_at = time.monotonic() + self.retry_after
        if slot.failures >= self.max_failures:
            slot.broken = True
            log.error("%s: not loaded again on this worker; its requests fail", slot.cause)
        else:
            log.warning("%s; tried again in %g s", slot.cause, self.retry_after)
        self._cond.notify_all()

    def _load(self, slot: Slot, doomed: list[tuple[Slot, object]]):
        engine = None
        try:
            for victim, old in doomed:
                self._unload(victim, old, "to make room for " + slot.spec.id)
            began = time.monotonic()
            log.info("loading %s", slot.spec.id)
            engine = slot.load()
            log.info("loaded %s in %.1f s", slot.spec.id, time.monotonic() - began)  # tests/bench/models.py reads it
        except Exception as exc:
            with self._cond:
                self._failed(slot, f"{type(exc).__name__}: {exc}"[:500])
            raise
        finally:
            with self._cond:
                self._changing = None
                if engine is not None and not self._closed:
                    slot.engine, slot.loads, slot.failures = engine, slot.loads + 1, 0
                    slot.users += 1
                    slot.last_used = slot.loaded_at = time.monotonic()
                self._cond.notify_all()
        if slot.engine is not engine:  # the worker began to stop while it loaded
            engine.shutdown()
            raise Closed()
        self.on_change()
        return engine

    def load(self, model_id: str, stop: threading.Event) -> None:
        """Load the model now if it is cold (the first of a worker's models, at boot)."""
        with self.use(model_id, stop):
            pass

    # -- unloading ----------------------------------------------------------------------------------
    def _detach(self, slot: Slot):
        """Under the lock: the slot is cold from now on, for every thread; its engine is returned to stop."""
        engine, slot.engine = slot.engine, None
        self._stopping.add(slot.spec.id)
        return engine

    def _unload(self, slot: Slot, engine, why: str) -> None:
        """Stop a detached engine, while this thread holds ``_changing``."""
        log.info("unloading %s (%s)", slot.spec.id, why)
        try:
            engine.shutdown()  # an engine host ends every process it started (worker/engine.py)
        except Exception:  # noqa: BLE001 - a dead engine may fail to stop cleanly; its processes still go
            log.warning("stopping the engine of %s failed", slot.spec.id, exc_info=True)
        finally:
            with self._cond:
                self._stopping.discard(slot.spec.id)
        self.on_change()

    def unload_idle(self, pred: Callable[[Slot], bool], why: str) -> list[str]:
        """Unload every loaded model nobody holds for which ``pred`` holds (never a pinned worker's)."""
        done = []
        while not self.pinned:
            with self._cond:
                idle = [s for s in self.slots.values() if s.engine is not None and not s.users and pred(s)]
                if not idle or self._changing is not None:
                    return done
                slot = self._changing = idle[0]
                engine = self._detach(slot)
            try:
                self._unload(slot, engine, why)
                done.append(slot.spec.id)
            finally:
                with self._cond:
                    self._changing = None
                    self._cond.notify_all()
        return done

    def expire(self) -> list[str]:
        """Unload the models idle for the keep-alive (a negative one: never)."""
        if self.keep_alive < 0:
            return []
        now = time.monotonic()
        return self.unload_idle(lambda s: not s.waiting and now - s.last_used >= self.keep_alive,
                                f"idle for {self.keep_alive:g} s")

    def drop_dead(self) -> list[str]:
        """Unload the dead engines nobody holds any more; work for them loads them again."""
        return self.unload_idle(lambda s: s.engine.dead, "its engine died")

    def replace(self, slot: Slot, cleanup=lambda: None) -> None:
        """A pinned worker's dead engine: a new one (the watch has stopped claiming meanwhile);
        ``cleanup`` runs between the two."""
        old, slot.engine = slot.engine, None
        try:
            if old is not None:  # None: the last load failed
                old.shutdown()
        except Exception:  # noqa: BLE001 - it is dead already
            log.warning("shutting the dead engine down failed", exc_info=True)
        cleanup()
        slot.engine = slot.load()
        slot.loads += 1
        self.on_change()

    def close(self) -> None:
        """Stop every engine; nothing is loaded after this."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            engines = [s.engine for s in self.slots.values() if s.engine is not None]
            for slot in self.slots.values():
                slot.engine = None
        for engine in engines:
            engine.shutdown()
