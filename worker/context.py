"""What one worker process holds: its identity, its engine, its database and event plumbing."""

import logging
import threading
import time
from dataclasses import dataclass, field

import redis
from celery import Celery
from sqlalchemy.orm import Session, sessionmaker

from common.bus import Publisher
from common.db import transact_retrying
from common.lifecycle import Attempt
from common.registry import ModelSpec
from common.settings import Settings
from worker.rate import TokenRate
from worker.residency import Residency

log = logging.getLogger("lmsp.worker")


@dataclass
class Inflight:
    """One attempt this process runs, from its claim to its final event."""
    attempt: Attempt
    request_id: str | None = None   # the engine request, once submitted
    engine: object | None = None    # the engine it runs on (of its model)
    cancelled: bool = False
    fenced: bool = False            # another worker owns the task now: write nothing more
    write_error: dict | None = None  # an event of it could not be logged: it fails alone
    deltas: object | None = None    # its engine stream (worker.gate.Deltas), told of its live audience


@dataclass
class WorkerContext:
    settings: Settings
    worker_id: str
    sessions: sessionmaker[Session]
    celery: Celery
    publisher: Publisher
    writer: "object"  # worker.writer.EventWriter
    hosts: Residency  # the models it serves and their engines (worker/engine.py, worker/sim.py), loaded or not
    started_at: float = field(default_factory=time.time)  # this process's hold on worker_id (its heartbeats)
    stopping: threading.Event = field(default_factory=threading.Event)   # the process is ending
    draining: threading.Event = field(default_factory=threading.Event)   # SIGTERM: claim nothing more
    engine_ok: threading.Event = field(default_factory=threading.Event)  # claiming (not while a pinned engine reloads)
    attempts: dict[str, Inflight] = field(default_factory=dict)         # response id -> attempt
    tokens: TokenRate = field(default_factory=TokenRate)  # generated tokens, for the heartbeat's rate
    lock: threading.Lock = field(default_factory=threading.Lock)
    engine_lost_at: float | None = None  # monotonic time the engine was found dead (until a new one loads)
    broker_lost_at: float | None = None  # monotonic time its consumer lost the broker (until it consumes again)
    db_ok_since: float | None = None    # monotonic time of the first heartbeat after a database outage
    orphans: set = field(default_factory=set)  # own tasks seen not running at the last sweep
    hints_live: threading.Event = field(default_factory=threading.Event)  # subscribed to the api's cancel hints
    cancels_polled_at: float = 0.0  # monotonic time of the last poll for cancellations
    _broker_run_id: str | None = None
    _broker_client: "redis.Redis | None" = None

    def settled(self) -> bool:
        """Connected long enough that live workers have heartbeated again: only then judge leases."""
        return self.db_ok_since is not None and \
            time.monotonic() - self.db_ok_since >= 2 * self.settings.heartbeat_seconds + 1

    def broker_restarted(self) -> bool:
        """True once after the Redis broker came back empty (its run id changed)."""
        if not self.settings.broker.startswith(("redis://", "rediss://")):
            return False
        if self._broker_client is None:
            self._broker_client = redis.Redis.from_url(self.settings.broker, socket_timeout=2,
                                                       socket_connect_timeout=2)
        try:
            run_id = self._broker_client.info("server")["run_id"]
        except redis.RedisError:
            return False
        changed = self._broker_run_id is not None and run_id != self._broker_run_id
        self._broker_run_id = run_id
        return changed

    def spec(self, model_id: str) -> ModelSpec:
        return self.hosts.slots[model_id].spec

    @property
    def label(self) -> str:
        """The worker's models, for its own metrics: the model id of a worker of one."""
        return ",".join(self.hosts.slots)

    @property
    def log_direct(self) -> bool:
        """Without Redis a direct stream's events travel through the log too."""
        return not self.publisher.live

    def ready(self) -> bool:
        """Claiming: what /models and the readiness probe report. A worker of one model: its engine is
        loaded and alive. A worker of several is ready while it loads one (work for the others waits in
        their queues meanwhile, or goes to other workers); a dead engine of one is unloaded and loaded
        again on demand."""
        if self.hosts.pinned and ((engine := self.hosts.primary.engine) is None or engine.dead):
            return False
        return self.engine_ok.is_set() and self.writer.alive and not (self.draining.is_set() or self.stopping.is_set())

    def serving(self) -> bool:
        """``ready`` and reached by the broker: what its heartbeat, /readyz and GET /models report. A worker
        whose consumer lost the broker gets no work (nor does any direct request wait for it), though it
        goes on generating what it has."""
        return self.ready() and self.broker_lost_at is None

    def state(self) -> str:
        """What the workers panel shows: ready; loading (its first engine), reloading (a new engine after
        the old one died), reconnecting (to the broker) or draining (SIGTERM, or stopping)."""
        if self.draining.is_set() or self.stopping.is_set():
            return "draining"
        if self.ready():
            return "ready" if self.broker_lost_at is None else "reconnecting"
        return "loading" if self.engine_lost_at is None else "reloading"

    def write(self, fn):
        """``fn(session)`` as one transaction, replayed while Postgres is unreachable (for as long as
        it takes: the fence decides, once it is back, whether this worker still owns the work); what it
        returns is published after the commit."""
        result = transact_retrying(self.sessions, fn, log=log, stop=self.stopping)
        publish = result[1] if isinstance(result, tuple) else result
        if isinstance(publish, dict) and publish:
            self.publisher.publish_many(publish)
        return result

    def register(self, attempt: Attempt) -> Inflight:
        entry = Inflight(attempt)
        with self.lock:
            self.attempts[attempt.response_id] = entry
        return entry

    def release(self, attempt: Attempt) -> None:
        with self.lock:
            if (entry := self.attempts.get(attempt.response_id)) is not None and entry.attempt == attempt:
                del self.attempts[attempt.response_id]

    def running(self, attempt: Attempt) -> bool:
        """Whether an attempt equal to ``attempt`` runs here already."""
        with self.lock:
            entry = self.attempts.get(attempt.response_id)
            return entry is not None and entry.attempt == attempt

    def running_ids(self) -> set[str]:
        with self.lock:
            return set(self.attempts)

    def _stop(self, response_id: str, attempt: Attempt | None = None, **flags) -> None:
        """``attempt``: stop only that attempt (an older one's loss must not stop a newer one here)."""
        with self.lock:
            entry = self.attempts.get(response_id)
            if entry is None or (attempt is not None and entry.attempt != attempt):
                return
            for name, value in flags.items():
                setattr(entry, name, value)
            request_id, engine = entry.request_id, entry.engine
        if request_id is not None:
            engine.abort(request_id)

    def cancel(self, response_id: str) -> None:
        self._stop(response_id, cancelled=True)

    def heard(self, audience: dict[str, int], at: float) -> None:
        """How many live followers each response's publish sent at ``at`` reached (a follower's hint,
        heard at ``at``: 1): its stream paces its windows by it (worker.gate.Deltas.audience)."""
        for response_id, listeners in audience.items():
            entry = self.attempts.get(response_id)
            if entry is not None and entry.deltas is not None:
                entry.deltas.audience(listeners, at)

    def lose(self, attempt: Attempt, write_error: dict | None = None) -> None:
        """The attempt can no longer write (fenced, or its events were refused): stop generating."""
        if write_error is None:
            log.warning("attempt %s of %s was taken over; aborting its generation", attempt.number,
                        attempt.task_id or attempt.response_id)
            self._stop(attempt.response_id, attempt, fenced=True)
        else:
            log.error("events of %s could not be logged (%s); it fails alone", attempt.response_id,
                      write_error["detail"])
            self._stop(attempt.response_id, attempt, write_error=write_error)
