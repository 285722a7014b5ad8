"""A task's timeline (an extension of LMSP 1.0, spec 9.1): where its wall time went.

The worker records, per attempt, when the broker message reached it, when it claimed the task, handed
the prompt to the engine, was admitted to the engine's batch, got its first and last token and began
the final event's transaction, plus how long its events waited to be committed; each in a transaction
it makes anyway (the claim, loading -> running, the final event). From those points and the task's own
``created_at`` and ``ended_at``, ``durations`` splits the wall time into consecutive phases:

    queue      created -> the first attempt's message reached a worker (waiting for a free worker)
    retries    -> the final attempt's message reached its worker (earlier attempts, handed on)
    dispatch   -> claimed
    load       -> admitted to the engine (rendering the prompt, then waiting for a slot in the batch)
    prefill    -> first token
    decode     -> last token
    write_lag  -> the final event committed (events still in the writer, then the final transaction)

so they sum to ``ended_at - created_at`` exactly. A missing point (a task cancelled before its first
token, an attempt whose worker died) makes its phase 0 and the time goes to the phase before it.
``framework_overhead`` is not one more phase but the share of the others the framework itself spent:
dispatch, the prompt's rendering and write lag. Points come from two clocks (the api's created_at,
the worker's others): a phase is never negative, skew shows up in ``queue``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy import bindparam, insert, select, update
from sqlalchemy.orm import Session

from common.db import Compiled, run_batch
from common.tables import TaskAttempt

if TYPE_CHECKING:  # lifecycle builds response objects (common/resources.py), which import this module
    from common.lifecycle import Attempt

KEY = "x-lmsp-timeline"
PHASES = ("queue", "retries", "dispatch", "load", "prefill", "decode", "write_lag")
POINTS = ("delivered_at", "claimed_at", "submitted_at", "admitted_at", "first_token_at", "last_token_at",
          "finished_at")


# -- recording (worker): each in a transaction the worker makes anyway ------------------------------
def claimed(session: Session, attempt: Attempt, *, delivered_at: float, claimed_at: float) -> None:
    session.execute(insert(TaskAttempt).values(task_id=attempt.task_id, attempt=attempt.number,
                                               worker_id=attempt.worker_id, delivered_at=delivered_at,
                                               claimed_at=claimed_at))


_RECORDS: dict[tuple, Compiled] = {}


def record(session: Session, attempt: Attempt, **points) -> None:
    """Later points of the attempt (``POINTS``), and at its end ``commit_lag``: (batches, total lag,
    max lag) of the events the writer committed for it."""
    if "commit_lag" in points:
        batches, total, worst = points.pop("commit_lag") or (0, 0.0, 0.0)
        points.update(commit_batches=batches, commit_lag_sum=total, commit_lag_max=worst)
    step = _RECORDS.get(tuple(points))
    if step is None:  # one statement per set of points, compiled once: every attempt records twice
        step = _RECORDS[tuple(points)] = Compiled(update(TaskAttempt).where(
            TaskAttempt.task_id == bindparam("task_id"), TaskAttempt.attempt == bindparam("number")).values(
            {name: bindparam(f"point_{name}") for name in points}))
    run_batch(session, [(step, {"task_id": attempt.task_id, "number": attempt.number,
                                **{f"point_{name}": value for name, value in points.items()}})])


# -- reading ------------------------------------------------------------------------------------------
def attempts_of(session: Session, task_ids: list[str]) -> dict[str, list[TaskAttempt]]:
    """Every recorded attempt of these tasks, in attempt order: one query for a page of tasks."""
    out: dict[str, list[TaskAttempt]] = {}
    if task_ids:
        for row in session.execute(select(TaskAttempt).where(TaskAttempt.task_id.in_(task_ids))
                                   .order_by(TaskAttempt.task_id, TaskAttempt.attempt)).scalars():
            out.setdefault(row.task_id, []).append(row)
    return out


def durations(created_at: float, ended_at: float, attempts: list) -> dict[str, float]:
    """The phases of the module's docstring (seconds), and ``framework_overhead``. ``attempts``: rows
    (or anything with their attributes) in attempt order."""
    ended_at = max(ended_at, created_at)  # two clocks: never a negative phase
    final = attempts[-1] if attempts and attempts[-1].finished_at is not None else None
    marks = [created_at, attempts[0].delivered_at if attempts else None]
    if final is not None:
        marks += [final.delivered_at, final.claimed_at, final.admitted_at, final.first_token_at,
                  final.last_token_at]
    marks += [None] * (len(PHASES) - len(marks))
    later = ended_at
    for i in range(len(marks) - 1, 0, -1):  # a missing point: its phase is 0, the one before it runs on
        later = marks[i] = later if marks[i] is None else marks[i]
    points = [created_at]
    for mark in marks[1:]:  # out of order (two clocks): the phase is 0, never negative
        points.append(min(max(mark, points[-1]), ended_at))
    points.append(ended_at)
    phases = {name: points[i + 1] - points[i] for i, name in enumerate(PHASES)}
    prepare = 0.0
    if final is not None and final.submitted_at is not None:
        prepare = min(max(final.submitted_at - final.claimed_at, 0.0), phases["load"])
    phases["framework_overhead"] = phases["dispatch"] + prepare + phases["write_lag"]
    return phases


def extension(created_at: float, ended_at: float | None, attempts: list[TaskAttempt]) -> dict | None:
    """The task object's ``extensions`` member: the recorded attempts, and once the task has ended its
    wall time and durations. None for a task no worker has claimed yet that has not ended."""
    if not attempts and ended_at is None:
        return None
    doc: dict = {"queued_at": created_at, "ended_at": ended_at}
    if ended_at is not None:
        # created_at is the accepting api's clock, ended_at the database's: skewed, it may come first.
        doc["wall"] = max(ended_at - created_at, 0.0)
        doc["durations"] = durations(created_at, ended_at, attempts)
    doc["attempts"] = [_attempt(a) for a in attempts]
    return {KEY: doc}


def _attempt(row: TaskAttempt) -> dict:
    doc = {"attempt": row.attempt, "worker_id": row.worker_id, **{p: getattr(row, p) for p in POINTS}}
    if row.commit_batches:
        doc["commit_lag"] = {"batches": row.commit_batches, "mean": row.commit_lag_sum / row.commit_batches,
                             "max": row.commit_lag_max}
    return doc
