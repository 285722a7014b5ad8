"""The Celery app both sides share: the api sends by task name, the worker consumes.

Interactive ``POST /responses`` work has a queue of its own per model (see
worker/interactive.py); within a queue, kombu's Redis transport keeps one list
per priority step and reads the most urgent first (lower is sooner).
"""

import os
import uuid
from time import monotonic

from celery import Celery
from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.json import dumps

from common.settings import Settings

RUN_TASK = "lmsp.run"
INTERACTIVE, BACKGROUND = 0, 6


class _AtomicFilesystemChannel(filesystem.Channel):
    """kombu's filesystem channel creates a message file and then writes it. A consumer polling in between
    takes the empty file, fails to parse it and stops the worker (seen: `lmsp dev` ended on a
    JSONDecodeError). A message is written under a name no consumer matches, then renamed into place."""

    def _put(self, queue, payload, **kwargs):
        path = os.path.join(self.data_folder_out, f"{int(round(monotonic() * 1000))}_{uuid.uuid4()}.{queue}.msg")
        try:
            with open(path + ".part", "wb") as f:
                f.write(dumps(payload).encode())
            os.replace(path + ".part", path)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {path!r} to directory") from exc


class FilesystemTransport(filesystem.Transport):
    Channel = _AtomicFilesystemChannel


def make_celery(settings: Settings) -> Celery:
    app = Celery("lmsp", broker=settings.broker, set_as_current=False)
    options: dict = {}
    if settings.broker.startswith("filesystem"):
        folder = settings.broker_folder
        folder.mkdir(parents=True, exist_ok=True)
        # The default 1 s poll would add up to a second to every request on one machine; the exchange
        # tables (control_folder) would otherwise land in the current directory.
        options = {"data_folder_in": str(folder), "data_folder_out": str(folder),
                   "control_folder": str(folder / "control"), "polling_interval": 0.05}
        app.conf.broker_transport = f"{__name__}:FilesystemTransport"
    else:
        # No ack emulation: a message leaves Redis when a worker takes it. Postgres decides who runs a task
        # (the claim) and the sweeper re-sends what may be lost, so Redis needs no unacked set to restore
        # (kombu's restore of it crashes the worker after a Redis restart) and never redelivers a long task.
        options.update({"priority_steps": list(range(10)), "sep": ":", "queue_order_strategy": "priority",
                        "ack_emulation": False})
    app.conf.update(
        broker_transport_options=options,
        broker_connection_retry_on_startup=True,
        task_serializer="json",
        accept_content=["json"],
        task_acks_late=False,               # acked on receipt: a lost message is re-sent by the sweeper ...
        worker_prefetch_multiplier=1,       # ... and the Postgres claim makes any second delivery a no-op
        task_ignore_result=True,
        worker_hijack_root_logger=False,
        worker_cancel_long_running_tasks_on_connection_loss=False,
        broker_heartbeat=0,
    )
    return app


def dispatch(celery: Celery, queue: str, payload: dict, priority: int) -> None:
    # What send_task would work out for every message, given: the reprs monitors show (its own are a
    # recursive saferepr), and nothing to declare (a queue named without an exchange goes to kombu's
    # anonymous one, which puts the message straight on the queue's list; the workers declare theirs).
    celery.send_task(RUN_TASK, kwargs=payload, queue=queue, priority=priority, declare=[], argsrepr="()",
                     kwargsrepr=repr(payload))


def queue_length(celery: Celery, queue: str) -> int:
    """Messages waiting in the broker for ``queue`` (not counting ones a worker holds).

    A passive declare asks the transport itself: on Redis it sums every priority list
    of the queue, and a queue with no list at all (never used, or drained) is not found.
    """
    with celery.connection_for_write() as conn:
        try:
            return conn.default_channel.queue_declare(queue, passive=True).message_count
        except ChannelError:
            return 0


def check_reachable(celery: Celery) -> None:
    """Raise unless the broker answers now: one try, no wait between tries (kombu's default retries
    took the readiness probe 6 s to answer while Redis refused connections, past a probe's timeout)."""
    with celery.connection_for_write() as conn:
        conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0, timeout=2)
        try:  # a passive declare asks the transport itself (on Redis, a round trip)
            conn.default_channel.queue_declare("lmsp.readyz", passive=True)
        except ChannelError:
            pass  # "no such queue" is an answer
