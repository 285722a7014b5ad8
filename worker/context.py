"""What one worker process holds: its identity, its engine, its database and event plumbing."""

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from celery import Celery
from sqlalchemy.orm import Session, sessionmaker

from common.bus import Publisher
from common.registry import ModelSpec
from common.settings import Settings
from worker.writer import EventWriter


@dataclass
class Inflight:
    request_id: str
    direct: bool
    cancelled: bool = False


@dataclass
class WorkerContext:
    settings: Settings
    worker_id: str
    spec: ModelSpec
    sessions: sessionmaker[Session]
    celery: Celery
    publisher: Publisher
    writer: EventWriter
    engine: "object"  # worker.engine.EngineHost
    stopping: threading.Event = field(default_factory=threading.Event)
    inflight: dict[str, Inflight] = field(default_factory=dict)   # response id -> engine request
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Recovered tasks run here, beside the Celery pool, in the same engine batch.
    recovered: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(16, "lmsp-recovered"))

    @property
    def log_direct(self) -> bool:
        """Without Redis a direct stream's events travel through the log too."""
        return not self.publisher.live

    def cancel(self, response_id: str) -> None:
        with self.lock:
            entry = self.inflight.get(response_id)
            if entry is None or entry.cancelled:
                return
            entry.cancelled = True
        self.engine.abort(entry.request_id)
