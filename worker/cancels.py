"""Cancellations reach a running attempt two ways: the api's hint on Redis (``ControlListener``), at once,
and a poll of the database (``CancelWatch``) for the hints Redis lost."""

import threading
import time

import redis
from sqlalchemy import select, union_all

from common.bus import CONTROL, FOLLOWED, hinted
from common.states import CANCELLING
from common.tables import Response, Task
from worker.context import WorkerContext
from worker.steps import Loop, Step


def watch_cancellations(ctx: WorkerContext) -> None:
    """Stop what was cancelled. The api's hint on Redis (ControlListener) stops it at once; this poll
    catches hints Redis lost: every tick while the hint channel is down, every heartbeat while it is up
    (a hundred workers polling twice a second would be the database's busiest query)."""
    running = ctx.running_ids()
    now = time.monotonic()
    if not running or (ctx.hints_live.is_set() and now - ctx.cancels_polled_at < ctx.settings.heartbeat_seconds):
        return
    ctx.cancels_polled_at = now
    cancelled = select(Response.id).where(Response.id.in_(running), Response.status == "cancelled")
    cancelling = select(Task.response_id).where(Task.worker_id == ctx.worker_id, Task.status == CANCELLING,
                                                Task.response_id.in_(running))
    with ctx.sessions() as session:
        ids = list(session.execute(union_all(cancelled, cancelling)).scalars())
    for rid in ids:
        ctx.cancel(rid)


class CancelWatch(Loop):
    name, seconds = "lmsp-cancel-watch", 0.5
    tick = staticmethod(watch_cancellations)


class ControlListener(Step):
    """Redis hints from the api: abort this response now (the watch catches it anyway); a follower reads
    this response live now (its windows shorten at once; its next publish would tell as much). Without
    Redis, none."""

    def start(self, ctx: WorkerContext) -> None:
        self.halt = threading.Event()
        if ctx.publisher.live:
            threading.Thread(target=self._listen, args=(ctx,), name="lmsp-control", daemon=True).start()

    def stop(self, ctx: WorkerContext) -> None:
        self.halt.set()

    def _listen(self, ctx: WorkerContext) -> None:
        while not self.halt.is_set():
            try:
                pubsub = ctx.publisher.client.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(CONTROL, FOLLOWED)
                ctx.hints_live.set()
                while not self.halt.is_set():
                    message = pubsub.get_message(timeout=1.0)
                    if message and message["type"] == "message":
                        if message["channel"] == FOLLOWED.encode():
                            ctx.heard({hinted(message["data"]): 1}, time.monotonic())
                        else:
                            ctx.cancel(hinted(message["data"]))
            except (redis.RedisError, OSError):
                ctx.hints_live.clear()  # hints sent from now until resubscribed are lost: poll often
                self.halt.wait(1)
