"""The lifecycle core: every write of a task or response status, and every event row, happens here.

Each operation runs inside the caller's transaction and returns the events to
publish once it commits (docs/architecture.md, invariant 2: persist, then announce). A worker
writes only through an ``Attempt``: the attempt number it got when it claimed
the task is a fencing token, and every write is conditional on it still being
current, so a worker that lost its task (paused past its lease, cut off from
Postgres) can no longer write (invariant 4).
"""

from __future__ import annotations

import json
import time
from collections import namedtuple
from dataclasses import dataclass

from sqlalchemy import JSON, String, bindparam, case, exists, func, insert, select, text, tuple_, update
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from common import eventlog, events, fairshare, liveness, timeline
from common.db import Compiled, commit_lazily, db_now, driver_row, fetch_batch, fetch_on, json_at, run_batch
from common.errors import LMSPError, problem
from common.events import Event, Sequence
from common.ids import is_id, new_id
from common.resources import echoed, event_response, is_background
from common.states import (
    CANCELLED,
    CANCELLING,
    FAILED,
    LIVE,
    LOADING,
    QUEUED,
    RUNNING,
    SUCCEEDED,
    TASK_OUTCOME,
    R,
    fenced_moves,
    respond,
    respond_returning,
    transition,
    transition_returning,
)
from common.tables import Base, QueueCount, Response, Task, Worker
from common.tables import Event as EventRow

# Response id -> events to publish after the commit; no events: its task changed where no event says so
# (a claim, a cancel's ``cancelling``), a notice for its long polls only (common/bus.py ``CHANGED``).
Publish = dict[str, list[Event]]


class Fenced(Exception):
    """This attempt is no longer the task's current one: another worker owns it now."""


# An attempt's fence: its task, still at its number and its worker (the worker too: a claim a database
# crash lost lets another worker claim the same number). _FENCE is it with parameters (Attempt.fence),
# for statements compiled once (states.fenced_moves); Attempt.task_where, with the attempt's values.
_FENCE_BY = {"task_id": Task.id, "number": Task.attempt, "worker": Task.worker_id}
_FENCE = tuple(column == bindparam(name) for name, column in _FENCE_BY.items())


@dataclass(frozen=True)
class Attempt:
    """A worker's right to write one response: a task's claim, or a direct response it runs."""
    response_id: str
    task_id: str | None
    number: int
    worker_id: str

    def task_where(self):
        return tuple(_FENCE_BY[name] == value for name, value in self.fence().items())

    def fence(self) -> dict:
        """``_FENCE``'s parameters for this attempt."""
        return {"task_id": self.task_id, "number": self.number, "worker": self.worker_id}

    def direct_where(self):
        return Response.id == self.response_id, Response.worker_id == self.worker_id


def restarted_error(detail: str) -> dict:
    return problem("server_restarted", detail)


# -- creating work (api) ------------------------------------------------------------------------
def new_response(*, principal: str, model: str, request: dict, input_tokens: int, max_tokens: int,
                 status: R, stored: bool, previous_response_id: str | None,
                 instructions: str | None = None) -> Response:
    now = time.time()
    return Response(id=new_id("response"), principal_id=principal, model=model, request=request,
                    echo=echoed(request, instructions), input_tokens=input_tokens, max_tokens=max_tokens, status=status,
                    stored=stored, previous_response_id=previous_response_id, created_at=now, updated_at=now)


@dataclass(frozen=True)
class Room:
    """Queue limits a new task must fit in: fewer than ``mine`` queued tasks of its principal and
    fewer than ``total`` of its model, not counting itself."""
    mine: int
    total: int


def _queued(kind: str, name=None):
    """The queued tasks of a principal or a model (``name``; the parameter ``<kind>_queue`` if None)."""
    count = select(QueueCount.queued).where(QueueCount.kind == kind, QueueCount.name == (
        bindparam(f"{kind}_queue") if name is None else name)).scalar_subquery()
    return func.coalesce(count, 0)


def _typed(columns) -> list:
    return [bindparam(c.key, type_=c.type) for c in columns]


_STEPS: dict[tuple, Compiled] = {}
_NOW = db_now()


def _row_step(row: Base, *, after: str | None = None, room: bool = False, **sql) -> tuple[Compiled, dict]:
    """An INSERT of ``row``'s set columns (and the SQL expressions ``sql``), compiled once per shape:
    the ORM's unit of work costs more than the database does on this path. ``after``: only if the
    response of that id exists (it was inserted in this transaction, so the room check let it in);
    ``room``: only while the queues have room (parameters principal_queue, model_queue, max_mine, max_total)."""
    table = row.__table__
    values = {c.key: getattr(row, c.key) for c in table.columns if getattr(row, c.key) is not None}
    key = (table.name, tuple(values), tuple(sql), after is not None, room)
    step = _STEPS.get(key)
    if step is None:
        columns = [table.c[name] for name in values]
        source = select(*_typed(columns), *sql.values())
        if after is not None:
            source = source.where(exists().where(Response.id == bindparam("created_response")))
        if room:
            source = source.where(_queued("principal") < bindparam("max_mine"),
                                  _queued("model") < bindparam("max_total"))
        step = _STEPS[key] = Compiled(insert(table).from_select([*columns, *(table.c[n] for n in sql)], source))
    for c in table.columns:
        if c.key in values and isinstance(c.type, JSON):
            values[c.key] = json.dumps(values[c.key])  # the driver's own cursor takes JSON as text
    if after is not None:
        values["created_response"] = after
    return step, values


# Transaction-scoped advisory locks (a principal's and a model's, always in one order: no deadlock) held
# to the commit, so concurrent creations cannot all see room under a limit and overshoot it.
_LOCK = Compiled(select(func.pg_advisory_xact_lock(func.hashtext(bindparam("first"))),
                        func.pg_advisory_xact_lock(func.hashtext(bindparam("second")))))


def new_task(response: Response, on_restart: str) -> Task:
    """The task that will produce ``response`` (not written yet: ``create_task``)."""
    now = response.created_at
    return Task(id=new_id("task"), principal_id=response.principal_id, response_id=response.id, type="response",
                model=response.model, status=QUEUED, on_restart=on_restart, attempt=0, created_at=now,
                updated_at=now, dispatches=1, events_expired=False,
                cost=fairshare.charge(response.input_tokens, response.max_tokens))


def create_task(session: Session, response: Response, task: Task, room: Room | None = None, *,
                also: tuple[Base, ...] = (), commit: bool = False) -> bool:
    """Task, response and event #1 in the caller's transaction (7.1: persist before answering); on
    Postgres in one round trip. The rows are not attached to the session.

    With ``room``, the task is created only while its queues have room, counted under locks held
    until the commit (two concurrent creations cannot both take the last place); False when they
    have none, and nothing is written. ``also``: rows (not added to the session) written exactly when
    the task is. ``commit``: commit the transaction too, on Postgres in the same round trip, so no
    round trip of ours falls inside the locks."""
    seq, name, data = events.opening(event_response(response, queued=is_background(response)))
    first = EventRow(response_id=response.id, seq=seq, name=name, data=data, created_at=time.time())
    steps = []
    if room is not None and session.get_bind().dialect.name == "postgresql":
        lock_order = sorted((f"principal:{task.principal_id}", f"model:{task.model}"))
        steps.append((_LOCK, {"first": lock_order[0], "second": lock_order[1]}))
    head, values = _row_step(response, room=room is not None)
    if room is not None:
        values.update(principal_queue=response.principal_id, model_queue=response.model, max_mine=room.mine,
                      max_total=room.total)
    at = len(steps)
    # The principal's clock is charged, then the task tagged from it (common/fairshare.py).
    fair = fairshare.charge_params(task.model, task.principal_id, task.cost)
    tagged, task_values = _row_step(task, after=response.id, dispatched_at=_NOW, **fairshare.TASK_TAGS)
    steps += [(head, values), (fairshare.CHARGE, {**fair, "created_response": response.id}),
              (tagged, {**task_values, **fair}), _row_step(first, after=response.id),
              *(_row_step(row, after=response.id) for row in also)]
    return run_batch(session, steps, commit=commit)[at] == 1


def queued(session: Session, principal: str, model: str) -> tuple[int, int]:
    """Queued tasks of ``principal`` and of ``model``: what a ``Room`` limits."""
    return tuple(session.execute(select(_queued("principal", principal), _queued("model", model))).one())


def create_direct(session: Session, response: Response) -> Response:
    commit_lazily(session)  # a person waits for this commit; a direct response is not durable work
    session.add(response)
    return response


def create_warmed(session: Session, response: Response) -> Response:
    """A response of WebSocket mode's ``generate: false``: its context only, finished as it is made (no
    worker, no output, no events logged), so that a later turn can continue it."""
    response.status, response.output = R.COMPLETED, []
    response.usage = {"input_tokens": response.input_tokens, "output_tokens": 0,
                      "total_tokens": response.input_tokens}
    session.add(response)
    return response


# -- the final event ----------------------------------------------------------------------------
_SHOWN = (Response.id, Response.created_at, Response.model, Response.output, Response.usage, Response.status,
          Response.error, Response.incomplete_details, Response.previous_response_id,
          Response.echo)  # what event_response reads


def _final(session: Session, response_id: str, status: R, *, seq: Sequence | None = None, emitted=(),
           output=None, usage=None, error=None, logged: bool = True) -> list[Event]:
    """Items still to emit + the one final event, numbered by ``seq`` (the writer's own ``Sequence``) or,
    for a writer that holds none (a cancel, a sweep), by one after the log's last event; and the
    response row in its final state."""
    incomplete = {"reason": "max_output_tokens"} if status == R.INCOMPLETE else None
    values = {"error": error, "incomplete_details": incomplete}
    if output is not None:
        values.update(output=output, usage=usage)
    # The row as it ends (RETURNING: no extra round trip) is the final event's response object; not its
    # request, which may be a megabyte.
    row = respond_returning(session, response_id, status, columns=_SHOWN, **values) or session.execute(
        select(*_SHOWN).where(Response.id == response_id)).one()
    ending = events.final(response_id, status, usage=usage if status != R.CANCELLED else None,
                          error=error, incomplete_details=incomplete, response=event_response(row))
    if seq is None:
        seq = Sequence(eventlog.max_seq(session, response_id))
    batch = seq.number([*emitted, ending])
    if logged:
        eventlog.append(session, response_id, batch)
    return batch


def _task_final(session: Session, task: Task, status: R, **kw) -> Publish:
    """The task reached its terminal state in this transaction: write its response's final event."""
    return {task.response_id: _final(session, task.response_id, status, **kw)}


# -- claims (worker) ------------------------------------------------------------------------------
# A claim reads its rows with the driver's own cursor and statements compiled once, as create_task
# writes them: the ORM's identity map and row objects cost more than the database does on this path.
TaskRow = namedtuple("TaskRow", Task.__table__.columns.keys())
ResponseRow = namedtuple("ResponseRow", Response.__table__.columns.keys())
_JSON_AT = {TaskRow: json_at(Task.__table__.columns), ResponseRow: json_at(Response.__table__.columns)}


def _row(kind, rows: list, pg: bool):
    """The first of ``rows`` (driver tuples of a whole table row) as ``kind``."""
    return driver_row(kind, rows[0], _JSON_AT[kind], pg) if rows else None


_SYNC_OFF = Compiled(text("SET LOCAL synchronous_commit = off"))  # commit_lazily's, in the claim's round trip
_LIVE_SQL = text(f"tasks.status IN ({', '.join(sorted(repr(str(s)) for s in LIVE))})")
_MODEL = bindparam("model", type_=String)  # None: the message's own task's model
# A task handed on mid-run (live, no owner) is taken by its own message, ahead of the queue.
_OWN = Compiled(update(Task).where(
    Task.id == bindparam("task_id"), _LIVE_SQL, Task.worker_id.is_(None), Task.model == func.coalesce(
        _MODEL, Task.model)).values(worker_id=bindparam("worker"), attempt=Task.attempt + 1)
    .returning(*Task.__table__.c))
_RESPONSE_OF = Compiled(select(*Response.__table__.c).where(Response.id == bindparam("response_id")))


def read_response(conn: Connection, response_id: str) -> ResponseRow | None:
    """A response's whole row, read with the driver's cursor on a Core connection (one round trip)."""
    rows = fetch_on(conn, [(_RESPONSE_OF, {"response_id": response_id})])[0]
    return _row(ResponseRow, rows, conn.dialect.name == "postgresql")


def _claim_queued_sql(timed: bool) -> Compiled:
    """Postgres: the queue's claim as one statement (queued -> loading, attempt + 1, on the head of
    ix_tasks_fair skipping rows another claim holds; fairshare.advance; timeline.claimed's row with
    ``timed``) returning the task and its response: sent with the commit, its locks (the task's row, the
    model's clock and queue count) are held for no round trip of ours."""
    cols = Task.__table__.columns.keys()
    timeline_sql = (",\ntimed AS (INSERT INTO task_attempts (task_id, attempt, worker_id, delivered_at, claimed_at)"
                    " SELECT id, attempt, :worker, :delivered_at, :claimed_at FROM fresh)") if timed else ""
    return Compiled(text(f"""
WITH fresh AS (
    UPDATE tasks SET status = '{LOADING}', updated_at = {db_now().compile(dialect=postgresql.dialect())}, worker_id = :worker, attempt = attempt + 1
    WHERE id = (SELECT id FROM tasks WHERE model = COALESCE(:model, (SELECT model FROM tasks WHERE id = :task_id))
                AND status = '{QUEUED}' ORDER BY virtual_finish, id LIMIT 1 FOR UPDATE SKIP LOCKED)
      AND status = '{QUEUED}'
    RETURNING {", ".join(cols)}),
moved AS (
    UPDATE virtual_times v SET finish = f.virtual_start FROM fresh f
    WHERE v.model = f.model AND v.principal_id = '{fairshare.SYSTEM}' AND v.finish < f.virtual_start RETURNING 1),
clock AS (
    INSERT INTO virtual_times (model, principal_id, finish) SELECT model, '{fairshare.SYSTEM}', virtual_start
    FROM fresh WHERE NOT EXISTS (SELECT FROM moved) ON CONFLICT (model, principal_id) DO NOTHING){timeline_sql}
SELECT {", ".join(f"fresh.{c}" for c in cols)}, {", ".join(f"r.{c}" for c in Response.__table__.columns.keys())}
FROM fresh JOIN responses r ON r.id = fresh.response_id"""))


_CLAIM_QUEUED = {timed: _claim_queued_sql(timed) for timed in (False, True)}


@dataclass
class Claim:
    attempt: Attempt
    task: TaskRow | Task
    response: ResponseRow | Response
    log: list[Event]     # the response's events so far (a handed-on task continues after them)
    fresh: bool          # claimed from queued, not handed on mid-run

    def sequence(self) -> Sequence:
        """The attempt's numbering, on after the log; a fresh claim does not read its log again: it holds
        only #1, the ``response.created`` that ``create_task`` logged."""
        return Sequence(self.log[-1][0] if self.log else 1)


def claim(session: Session, task_id: str, worker_id: str, *, model: str | None = None, retried: bool = False,
          busy: frozenset[str] = frozenset(), points: dict | None = None,
          commit: bool = False) -> tuple[Claim | None, Publish]:
    """Take work for the message of ``task_id``: that task if it was handed on mid-run (loading/running/
    cancelling with no owner; its message jumped the queue), else the queued task of its model that
    comes first in fair-share order (common/fairshare.py), the message's own or another: every queued
    task has a message, so each message claims one task while any is queued, then nothing (a
    duplicate delivery, a cancelled task's message). Either is one conditional UPDATE (queued ->
    loading for the queue); a new attempt number fences every earlier owner. ``model``: only tasks of
    that model (the worker's).

    ``retried``: this claim's transaction is being replayed (its commit's reply was lost), so a task
    of the model still loading under this worker id is our own claim, committed after all, unless it is
    running here (its response id in ``busy``): taken again rather than left for the sweeper to judge an
    orphan. ``points``: the attempt's first timeline points (delivered_at; claimed_at is set here),
    recorded with the claim. ``commit``: commit the claim's transaction too (on Postgres, a claim from
    the queue in the same round trip)."""
    pg = session.get_bind().dialect.name == "postgresql"
    if points is not None:
        points["claimed_at"] = time.time()
    params = {"task_id": task_id, "worker": worker_id, "model": model}
    # Lazily committed: a claim the database loses in a crash leaves the task queued for the sweeper,
    # and this attempt fenced out of every write; the next ordinary commit makes it durable anyway.
    task = _row(TaskRow, fetch_batch(session, [(_SYNC_OFF, {})] * pg + [(_OWN, params)])[-1], pg)
    fresh = adopted = False
    if task is None and retried:
        task = _adopt(session, model if model is not None else _model_of(session, task_id), worker_id, busy)
        adopted = task is not None
    if task is None:
        if pg:
            claimed = _claim_queued(session, params, points, commit)
            return claimed, _changed(claimed)
        task = _claim_queued_orm(session, model if model is not None else _model_of(session, task_id), worker_id)
        if task is None:
            return None, {}
        fresh = True
    if task.status == CANCELLING:  # cancelled while nobody ran it: finish the cancellation now
        transition(session, task.id, CANCELLED, only_from=[CANCELLING])
        return None, _task_final(session, task, R.CANCELLED)
    response = _row(ResponseRow, fetch_batch(session, [(_RESPONSE_OF, {"response_id": task.response_id})])[0], pg)
    log = [] if fresh else eventlog.read(session, response.id, 0, limit=10**9)
    if adopted and len(log) <= 1:  # our own claim from queued: nothing ran yet
        fresh, log = True, []
    claimed = Claim(Attempt(response.id, task.id, task.attempt, worker_id), task, response, log, fresh)
    if points is not None:
        timeline.claimed(session, claimed.attempt, **points)
    if commit:
        session.commit()
    return claimed, _changed(claimed)


def _changed(claimed: Claim | None) -> Publish:
    """A claim's notice: queued -> loading (or a new attempt of a task handed on) logs no event."""
    return {} if claimed is None else {claimed.attempt.response_id: []}


def _claim_queued(session: Session, params: dict, points: dict | None, commit: bool) -> Claim | None:
    step = (_CLAIM_QUEUED[points is not None], {**params, **(points or {})})
    rows = fetch_batch(session, [step], commit=commit)[0]
    if not rows:
        # The statement sees the tasks committed before it began, less the rows other claims hold. A claim
        # that took this message's task can have had its own committed after that: its task was then left
        # queued until the sweeper re-sent a message (a minute; 2-6 tasks in 40 bursts of 64 here). A new
        # statement sees it: a message claims nothing only when every queued task is another's. After a
        # commit the caller's transaction is over, so the second look is a transaction of its own.
        if commit:
            with Session(session.get_bind()) as again:
                rows = fetch_batch(again, [step], commit=True)[0]
        else:
            rows = fetch_batch(session, [step])[0]
    if not rows:
        return None
    split = len(TaskRow._fields)
    task, response = TaskRow._make(rows[0][:split]), ResponseRow._make(rows[0][split:])
    return Claim(Attempt(response.id, task.id, task.attempt, params["worker"]), task, response, [], True)


def _claim_queued_orm(session: Session, model: str, worker_id: str) -> Task | None:
    """SQLite (the embedded mode, one writer): the queue's claim as statements in turn."""
    task = transition_returning(session, fairshare.next_queued(session, model), LOADING, only_from=[QUEUED],
                                worker_id=worker_id, attempt=Task.attempt + 1)
    if task is not None:
        fairshare.advance(session, task)
    return task


def _adopt(session: Session, model: str, worker_id: str, busy: frozenset[str]) -> Task | None:
    """A replayed claim's own task, claimed from queued by the commit whose reply was lost (rare)."""
    ours = select(Task.id).where(Task.model == model, Task.status == LOADING, Task.worker_id == worker_id,
                                 Task.response_id.not_in(busy)).order_by(Task.virtual_finish).limit(1)
    return session.execute(update(Task).where(Task.id == ours.correlate(None).scalar_subquery()).values(
        attempt=Task.attempt + 1).returning(Task).execution_options(populate_existing=True)).scalar_one_or_none()


def _model_of(session: Session, task_id: str) -> str | None:
    return session.execute(select(Task.model).where(Task.id == task_id)).scalar()


_CLAIM_DIRECT = Compiled(update(Response).where(
    Response.id == bindparam("response_id"), Response.status == R.QUEUED.value,
    Response.model == func.coalesce(_MODEL, Response.model)).values(
    status=R.IN_PROGRESS.value, updated_at=db_now(), worker_id=bindparam("worker"))
    .returning(*Response.__table__.c))


def claim_direct(session: Session, response_id: str, worker_id: str, model: str | None = None, *,
                 commit: bool = False) -> tuple[Attempt, ResponseRow] | None:
    """queued -> in_progress, one conditional UPDATE (``commit``: committed in the same round trip)."""
    pg = session.get_bind().dialect.name == "postgresql"
    steps = [(_SYNC_OFF, {})] * pg + [(_CLAIM_DIRECT, {"response_id": response_id, "worker": worker_id,
                                                       "model": model})]
    # Lazily committed: on the way to a person's first token, like create_direct.
    row = _row(ResponseRow, fetch_batch(session, steps, commit=commit)[-1], pg)
    return None if row is None else (Attempt(response_id, None, 0, worker_id), row)


def _current(session: Session, attempt: Attempt) -> Task | None:
    return session.execute(select(Task).where(*attempt.task_where()).execution_options(
        populate_existing=True)).scalar_one_or_none()


def start(session: Session, attempt: Attempt) -> bool:
    """loading -> running at the first token. False when a cancel got there first; Fenced when the
    task is no longer this attempt's."""
    commit_lazily(session)  # the events that follow are committed durably, and this with them
    if fenced_moves(session, _FENCE, attempt.fence(), [(RUNNING, (LOADING,))])[0]:
        return True
    task = _current(session, attempt)
    if task is None or task.status not in LIVE:
        raise Fenced(attempt)
    return task.status == RUNNING  # a task handed on mid-run is running already


# -- events (worker) ---------------------------------------------------------------------------------
def fenced_out(session: Session, attempts: list[Attempt]) -> set[Attempt]:
    """Lock the rows of the attempts still current (so no takeover commits between this check and the
    caller's inserts) and return those that are not."""
    tasks = [a for a in attempts if a.task_id is not None]
    direct = [a for a in attempts if a.task_id is None]
    held: set[tuple[str, str]] = set()  # (response id, worker id): two workers may hold one attempt number
    if tasks:
        # A no-op UPDATE rather than SELECT ... FOR UPDATE: it locks on SQLite too.
        held |= set(session.execute(update(Task).where(
            tuple_(Task.id, Task.attempt, Task.worker_id).in_([(a.task_id, a.number, a.worker_id) for a in tasks]),
            Task.status.in_(LIVE)).values(attempt=Task.attempt).returning(Task.response_id, Task.worker_id)).all())
    if direct:
        held |= set(session.execute(update(Response).where(
            tuple_(Response.id, Response.worker_id).in_([(a.response_id, a.worker_id) for a in direct]),
            Response.status == R.IN_PROGRESS).values(worker_id=Response.worker_id)
            .returning(Response.id, Response.worker_id)).all())
    return {a for a in attempts if (a.response_id, a.worker_id) not in held}


# The writer's group commit on Postgres (docs/architecture.md, invariant 11: no per-event round trip):
# one statement locks the rows of the attempts still current and logs the events of those attempts only.
# A share lock, not ``fenced_out``'s no-op UPDATE: it holds off a takeover's UPDATE just as well (which
# then waits for this commit; one that committed first fails the re-checked WHERE), without writing a
# new version of the task's row, its index entries and its WAL for every batch. The rows go as binary
# arrays, unnested by the database (text arrays cost a regex per element to quote JSON).
_APPEND_PG = f"""
WITH fence AS (
    SELECT * FROM unnest(%(task_ids)b::text[], %(numbers)b::int[], %(rids)b::text[], %(workers)b::text[])
        WITH ORDINALITY AS f(task_id, number, response_id, worker_id, key)),
held AS (
    SELECT f.key FROM fence f JOIN tasks t ON t.id = f.task_id
    WHERE t.attempt = f.number AND t.worker_id = f.worker_id
        AND t.status IN ({", ".join(f"'{s}'" for s in sorted(LIVE))})
    FOR SHARE OF t),
held_direct AS (
    SELECT f.key FROM fence f JOIN responses r ON r.id = f.response_id
    WHERE f.task_id IS NULL AND r.worker_id = f.worker_id AND r.status = '{R.IN_PROGRESS}'
    FOR SHARE OF r),
kept AS (SELECT key FROM held UNION ALL SELECT key FROM held_direct),
logged AS (
    INSERT INTO events (response_id, seq, name, data, created_at)
    SELECT e.response_id, e.seq, e.name, e.data, %(now)b
    FROM unnest(%(keys)b::int[], %(event_rids)b::text[], %(seqs)b::int[], %(names)b::text[], %(datas)b::text[])
        AS e(key, response_id, seq, name, data)
    WHERE e.key IN (SELECT key FROM kept))
SELECT key FROM kept"""


def append_on(conn: Connection, batches: dict[Attempt, list[Event]]) -> set[Attempt]:
    """``append`` on Postgres, on a Core connection: on one of ``db.autocommit``'s (the writer's), the
    statement is a transaction of its own, without a session's BEGIN and COMMIT round trips."""
    attempts = list(batches)
    keys, rids, seqs, names, datas = [], [], [], [], []
    for key, attempt in enumerate(attempts, 1):
        batch = batches[attempt]
        keys += [key] * len(batch)
        rids += [attempt.response_id] * len(batch)
        for seq, name, data in batch:
            seqs.append(seq)
            names.append(name)
            datas.append(data)
    kept = {row[0] for row in conn.exec_driver_sql(_APPEND_PG, {
        "task_ids": [a.task_id for a in attempts], "numbers": [a.number for a in attempts],
        "rids": [a.response_id for a in attempts], "workers": [a.worker_id for a in attempts],
        "now": time.time(), "keys": keys, "event_rids": rids, "seqs": seqs, "names": names, "datas": datas})}
    return {a for key, a in enumerate(attempts, 1) if key not in kept}


def append(session: Session, batches: dict[Attempt, list[Event]]) -> set[Attempt]:
    """Log the batches of every attempt still current; return the attempts refused."""
    if session.get_bind().dialect.name == "postgresql":
        return append_on(session.connection(), batches)
    refused = fenced_out(session, list(batches))
    for attempt, batch in batches.items():
        if attempt not in refused:
            eventlog.append(session, attempt.response_id, batch)
    return refused


def already_logged(session: Session, response_id: str, batch: list[Event]) -> bool:
    """True when exactly these events are in the log: a commit whose reply was lost and is replayed."""
    rows = eventlog.read(session, response_id, batch[0][0] - 1, limit=len(batch))
    return [tuple(r) for r in rows] == [tuple(e) for e in batch]


# -- finishing (worker) -------------------------------------------------------------------------------
def finish(session: Session, attempt: Attempt, status: R, *, seq: Sequence, emitted, output, usage,
           error=None, logged: bool = True) -> Publish:
    """The outcome of a generation, as one final event, after ``emitted`` (the items still open), both
    numbered by ``seq``, the attempt's own numbering. A cancel that committed first wins: the response
    then ends cancelled. Fenced when the attempt lost the task."""
    if attempt.task_id is None:
        return _finish_direct(session, attempt, status, seq=seq, emitted=emitted, output=output,
                              usage=usage, error=error, logged=logged)
    fence = attempt.task_where()
    target = TASK_OUTCOME[status]
    if target == SUCCEEDED:  # a lazily committed start a database crash lost leaves it loading
        won = fenced_moves(session, _FENCE, attempt.fence(),
                           [(RUNNING, (LOADING,)), (SUCCEEDED, (RUNNING,))])[1]
    else:
        won = target != CANCELLED and transition(session, attempt.task_id, target, only_from=[LOADING, RUNNING],
                                                 where=fence, error=error if target == FAILED else None)
    if not won:
        # Cancelled, or a cancel won the race against completion: finish the cancellation.
        transition(session, attempt.task_id, CANCELLING, only_from=[LOADING, RUNNING], where=fence)
        if not transition(session, attempt.task_id, CANCELLED, only_from=[CANCELLING], where=fence):
            raise Fenced(attempt)
        status = R.CANCELLED
    if (usage or {}).get("total_tokens") is not None:  # what it used corrects what it was charged
        fairshare.settle(session, attempt.task_id, usage["total_tokens"])
    batch = _final(session, attempt.response_id, status, seq=seq, emitted=emitted,
                   output=output, usage=usage, error=error, logged=logged)
    return {attempt.response_id: batch}


def _finish_direct(session: Session, attempt: Attempt, status: R, **kw) -> Publish:
    row = session.execute(select(Response.status, Response.worker_id).where(
        Response.id == attempt.response_id).with_for_update()).one()  # an abort waits for this commit
    if row.status == R.CANCELLED:  # the api marked it: its client went away; keep what it cost
        session.execute(update(Response).where(Response.id == attempt.response_id).values(
            output=kw["output"], usage=kw["usage"]))
        status, kw["emitted"] = R.CANCELLED, ()
    elif row.status != R.IN_PROGRESS or row.worker_id != attempt.worker_id:
        raise Fenced(attempt)
    return {attempt.response_id: _final(session, attempt.response_id, status, **kw)}


# -- handing a task on -----------------------------------------------------------------------------
def hand_on(session: Session, task_id: str, *, error: dict, attempt: int | None = None,
            owner_expired_after: float | None = None, unstarted_again: bool = False,
            crashed_after: int | None = None, used: int | None = None) -> tuple[bool, Publish]:
    """An attempt ended without an outcome (its worker restarted, drained, lost its engine or its
    lease): apply the task's ``on_restart`` policy (7.5). ``cancelling`` -> ``cancelled`` whatever the
    policy; ``fail`` -> ``failed`` with ``error``; ``retry``/``resume`` -> the task keeps its state with
    no owner and a new attempt number, to be claimed again from its model's queue.

    ``attempt`` is the attempt the caller saw (a stale view changes nothing); ``owner_expired_after``
    makes it a takeover: it wins only while the owner's lease is still expired by the database's clock.
    ``unstarted_again``: a task still ``loading`` (no token generated, nothing that could have had an
    effect) is run again whatever its policy: its engine died under it, the service did not restart.
    ``crashed_after``: the engine died while this task was in it (prefilling or decoding), so it may be
    what killed it (a poison request): counted, and the task fails ``generation_failed`` at that many
    crashes instead of going round every worker of its model forever, failing others' running tasks each
    time. After its first crash a task runs alone (worker/apart.py), so an innocent one finishes.
    ``used``: the tokens the attempt used, when its worker knows (else estimated): an end settles the
    task's fair-share charge, a ``retry`` starting over is charged what it threw away.
    Returns (whether a broker message must be sent for the task, events to publish).
    """
    where = [Task.status.in_(LIVE)]
    if attempt is not None:
        where.append(Task.attempt == attempt)
    if owner_expired_after is not None:
        where.append(Task.worker_id.in_(select(Worker.id).where(liveness.expired(owner_expired_after))))
    # Fence every earlier owner first: the row is ours from here to the commit.
    task = session.execute(update(Task).where(Task.id == task_id, *where).values(
        attempt=Task.attempt + 1, crashes=Task.crashes + int(crashed_after is not None)).returning(Task)
        .execution_options(populate_existing=True)).scalar_one_or_none()
    if task is None:
        return False, {}
    used = _used(session, task.response_id, used, started=task.status != LOADING)
    if task.status == CANCELLING:
        transition(session, task_id, CANCELLED, only_from=[CANCELLING])
        fairshare.settle(session, task_id, used)
        return False, _task_final(session, task, R.CANCELLED)
    if crashed_after is not None and task.crashes >= crashed_after:
        error = problem("generation_failed", f"The engine died {task.crashes} times while running this "
                        "request, alone after the first (the limit, LMSP_MAX_ATTEMPTS); it is not run again")
        transition(session, task_id, FAILED, only_from=[LOADING, RUNNING], error=error)
        fairshare.settle(session, task_id, used)
        return False, _task_final(session, task, R.FAILED, error=error)
    if task.on_restart == "fail" and not (unstarted_again and task.status == LOADING):
        transition(session, task_id, FAILED, only_from=[LOADING, RUNNING], error=error)
        fairshare.settle(session, task_id, used)
        return False, _task_final(session, task, R.FAILED, error=error)
    if task.on_restart == "retry":
        fairshare.spend(session, task, used)  # the next attempt starts over: this one's tokens are spent
    session.execute(update(Task).where(Task.id == task_id).values(
        worker_id=None, dispatched_at=db_now(), dispatches=Task.dispatches + 1))
    return True, {}


def _used(session: Session, response_id: str, used: int | None, started: bool = True) -> int:
    """The tokens an attempt used, as its worker counted them, else its prompt once it had started."""
    if used is not None or not started:
        return used or 0
    return session.execute(select(Response.input_tokens).where(Response.id == response_id)).scalar() or 0


def fail_write(session: Session, attempt: Attempt, error: dict, used: int | None = None) -> Publish:
    """An event of this attempt could not be written (a value the database refuses, a foreign row at
    its sequence number): the task fails alone, its final event numbered after the log (``used``: as
    ``hand_on``'s)."""
    if attempt.task_id is None:
        if not respond(session, attempt.response_id, R.FAILED, only_from=[R.IN_PROGRESS],
                       where=attempt.direct_where(), error=error):
            raise Fenced(attempt)
        return {}
    fence = attempt.task_where()
    if transition(session, attempt.task_id, FAILED, only_from=[LOADING, RUNNING], where=fence, error=error):
        status = R.FAILED
    elif transition(session, attempt.task_id, CANCELLED, only_from=[CANCELLING], where=fence):
        status = R.CANCELLED
    else:
        raise Fenced(attempt)
    fairshare.settle(session, attempt.task_id, _used(session, attempt.response_id, used))
    return {attempt.response_id: _final(session, attempt.response_id, status, error=error)}


# -- the api's side ------------------------------------------------------------------------------------
def cancel(session: Session, task: Task, lease_seconds: float | None = None) -> tuple[bool, Publish]:
    """7.3. Returns (whether the owning worker must be told to stop, events to publish). A task whose
    owner's lease expired (by the database's clock) is cancelled at once: with no worker alive at all,
    no sweeper would ever finish its cancellation."""
    if task.status == QUEUED and fairshare.settle(session, task.id, 0, queued=True):
        transition(session, task.id, CANCELLED, only_from=[QUEUED])  # settle holds it queued: this wins
        return False, _task_final(session, task, R.CANCELLED)  # no worker owns a queued task
    if transition(session, task.id, CANCELLING, only_from=[LOADING, RUNNING]) or task.status == CANCELLING:
        owner = session.execute(select(Task.worker_id).where(Task.id == task.id)).scalar()
        if owner is None:  # handed on, nobody runs it now: the cancellation completes at once
            return False, hand_on(session, task.id, error={})[1]
        cancelling = {task.response_id: []}  # no event says so until its owner stops
        if lease_seconds is None:
            return True, cancelling
        _, publish = hand_on(session, task.id, error={}, owner_expired_after=lease_seconds)
        return not publish, publish or cancelling
    return False, {}


def abort_direct(session: Session, response_id: str) -> bool:
    """The client of a direct response went away."""
    return respond(session, response_id, R.CANCELLED, only_from=[R.QUEUED, R.IN_PROGRESS])


def watched_direct(session: Session, response_id: str) -> None:
    """The api still waits for this queued direct response (it re-sent its message): see
    ``fail_abandoned_direct``."""
    session.execute(update(Response).where(Response.id == response_id, Response.status == R.QUEUED)
                    .values(updated_at=db_now()))


def fail_abandoned_direct(session: Session, older_than: float) -> list[str]:
    """Queued direct responses no api has watched for ``older_than`` seconds (by the database's clock):
    the api that accepted one died, and its message was lost, so no one else would ever end it."""
    return list(session.execute(update(Response).where(
        Response.status == R.QUEUED, Response.updated_at < db_now() - older_than).values(
        status=R.FAILED, updated_at=db_now(), error=restarted_error(
            "The api that accepted this response stopped before a worker took it; send the request again"))
        .returning(Response.id)).scalars())


def fail_unclaimed_direct(session: Session, response_id: str, error: dict) -> bool:
    """A direct response no worker took (none serves its model any more)."""
    return respond(session, response_id, R.FAILED, only_from=[R.QUEUED], error=error)


DIRECT_WORKER_STOPPED = "The worker generating this response stopped; send the request again"


def fail_orphaned_direct(session: Session, response_id: str, lease_seconds: float) -> bool:
    """A direct response whose worker's lease expired (by the database's clock): with no other worker
    left to sweep, its waiting client's stream ends here."""
    return respond(session, response_id, R.FAILED, only_from=[R.IN_PROGRESS],
                   where=[Response.worker_id.in_(select(Worker.id).where(liveness.expired(lease_seconds)))],
                   error=restarted_error(DIRECT_WORKER_STOPPED))


def fail_direct(session: Session, worker_ids: list[str], error: dict) -> list[str]:
    """Direct responses of dead workers: the api's followers see the row and end their streams."""
    rows = session.execute(update(Response).where(
        Response.worker_id.in_(worker_ids), Response.status == R.IN_PROGRESS,
        ~exists().where(Task.response_id == Response.id)).values(
        status=R.FAILED, error=error, updated_at=time.time()).returning(Response.id)).scalars()
    return list(rows)


# -- broker messages -------------------------------------------------------------------------------------
def due_dispatches(session: Session, model: str, requeue_after: float, *, force: bool = False) -> list[str]:
    """Tasks of ``model`` waiting for a broker message that may be lost: queued ones, and ones handed on
    with no owner. Each is due ``requeue_after`` x 2^(n-1) (at most 16x) after its n-th message, so a
    long backlog does not fill the broker with copies; ``force`` (the broker restarted empty) makes
    every one due now. Marks the ones returned as sent; concurrent sweepers never both get one."""
    now = session.execute(select(db_now())).scalar()
    # Due in SQL, so a long backlog waiting out its backoff is neither returned nor written; the partial
    # index of unowned tasks (model, dispatched_at) keeps the read to this model's tasks waiting for one.
    backoff = case((Task.dispatches <= 1, 1), (Task.dispatches == 2, 2), (Task.dispatches == 3, 4),
                   (Task.dispatches == 4, 8), else_=16) * requeue_after
    return list(session.execute(update(Task).where(
        Task.model == model, Task.status.in_([QUEUED, *LIVE]), Task.worker_id.is_(None),
        Task.dispatched_at < now - (1 if force else requeue_after),
        *(() if force else (Task.dispatched_at < now - backoff,))).values(
        dispatched_at=now, dispatches=Task.dispatches + 1).returning(Task.id)).scalars())


def stored_response(session: Session, principal: str, response_id: str | None) -> Response | None:
    """The principal's response of that id if it was stored (``store`` on a model with conversations):
    what GET /responses/{id} and previous_response_id may read; None otherwise, or for a malformed id."""
    if not is_id("response", response_id):
        return None
    return session.execute(select(Response).where(Response.id == response_id, Response.principal_id == principal,
                                                  Response.stored.is_(True))).scalar_one_or_none()


def require_task(session: Session, principal: str, task_id: str) -> Task:
    task = session.execute(select(Task).where(Task.id == task_id, Task.principal_id == principal)
                           .execution_options(populate_existing=True)).scalar_one_or_none() \
        if is_id("task", task_id) else None
    if task is None:
        raise no_task(task_id)
    return task


_FOLLOWED_COLUMNS = (Task.id, Task.response_id, Task.model, Task.status, Task.ended_at, Task.events_expired)
_FOLLOWED = Compiled(select(*_FOLLOWED_COLUMNS, (db_now() - Task.ended_at).label("ended_ago")).where(
    Task.id == bindparam("task_id"), Task.principal_id == bindparam("principal")))
FollowedTask = namedtuple("FollowedTask", [*(c.key for c in _FOLLOWED_COLUMNS), "ended_ago"])


def followed_task(conn: Connection, principal: str, task_id: str) -> FollowedTask:
    """What a follower needs of ``principal``'s task (``ended_ago``: seconds since it ended by the
    database's clock): one compiled statement read with the driver's cursor, on a connection of
    ``db.autocommit``'s (one round trip), since each of a storm of followers asks it as it connects."""
    rows = fetch_on(conn, [(_FOLLOWED, {"task_id": task_id, "principal": principal})])[0] \
        if is_id("task", task_id) else []
    if not rows:
        raise no_task(task_id)
    return FollowedTask._make(rows[0])


def no_task(task_id: str) -> LMSPError:
    return LMSPError("task_not_found", f"No task {task_id}")

