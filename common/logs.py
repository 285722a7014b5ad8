"""Logging for every lmsp process: text for people, one JSON object a line for log collectors
(``LMSP_LOG_FORMAT=json``). Both carry the worker, task and response ids in scope, so one task's
story can be found across the api, its worker and the worker that took it over.

    logs.setup()                                  # once, at process start
    logs.bind_process(worker_id=ctx.worker_id)    # ids that hold for the whole process
    with logs.bound(task_id=t, response_id=r):    # ids that hold for this thread / block
        log.info("claimed")
"""

import contextvars
import json
import logging
import sys
from contextlib import contextmanager
from datetime import UTC, datetime

from common.settings import get_settings

IDS = ("worker_id", "task_id", "response_id")

_scoped: contextvars.ContextVar[tuple] = contextvars.ContextVar("lmsp_log_ids", default=())  # (key, value) pairs
_process: dict = {}


def bind_process(**ids: str) -> None:
    _process.update({k: v for k, v in ids.items() if v})


@contextmanager
def bound(**ids: str | None):
    token = _scoped.set(tuple({**dict(_scoped.get()), **{k: v for k, v in ids.items() if v}}.items()))
    try:
        yield
    finally:
        _scoped.reset(token)


class _AddIds(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in {**_process, **dict(_scoped.get())}.items():
            if not hasattr(record, key):  # an explicit extra={...} wins
                setattr(record, key, value)
        return True


def _ids(record: logging.LogRecord) -> dict:
    return {k: getattr(record, k) for k in IDS if getattr(record, k, None)}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
               "level": record.levelname, "logger": record.name, "message": record.getMessage(), **_ids(record)}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        ids = _ids(record)
        return text + (" [" + " ".join(f"{k}={v}" for k, v in ids.items()) + "]" if ids else "")


def setup(fmt: str | None = None, level: int = logging.INFO) -> None:
    fmt = fmt or get_settings().log_format  # settings refuse any format but these two
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_AddIds())
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # A Celery worker replaces the root handlers at start unless someone handles this signal.
    from celery.signals import setup_logging
    setup_logging.connect(_keep_ours, weak=False)


def _keep_ours(**_) -> None:
    pass
