"""Fair share between principals: each model's queue is served in start-time fair queuing order, by
tokens (Goyal et al. 1996, SFQ; the service measure of Sheng et al., OSDI 2024, "Fairness in Serving
Large Language Models": the Virtual Token Counter).

A principal ``p`` of weight ``w`` has a clock per model, ``F_p``: the virtual finish of its last
charge. The model has a system virtual time ``V``: the virtual start of the latest task claimed.
A task of ``c`` tokens (its input + max output: all it may cost) is tagged when it is created::

    start = max(F_p, V)    finish = start + c / w    F_p := finish

A claim takes the queued task of its model with the least ``finish`` (the oldest of equals), through
an index that holds exactly the queued tasks in that order, and moves ``V`` up to its ``start``.
When the task ends, the charge it did not use (``c`` minus its input and output tokens) is given
back: ``F_p`` moves back by that share of its span, so the principal's next tasks are tagged
earlier (the correction by actual use; its tasks already queued keep their tags, so a later one may
pass them by what was given back: shares are kept between principals, not order within one).

Aging: ``V`` never decreases and no task starts before it, so a queued task is passed only by the
finitely many tasks whose tags are smaller (each principal's tags grow by at least 1/w per task),
then claimed: nothing starves, however long another principal's backlog. An idle principal earns no
credit: it comes back at ``V``.

The bound kept. VTC (Sheng et al.) proves that two backlogged clients' services differ by at most
2U, U about one batch's worth of cost. Here, SFQ's theorem (Goyal et al.) holds for the sequence of
claims: while principals f and g are both backlogged, the tokens W charged to the tasks claimed for
each in any run of consecutive claims satisfy::

    | W_f / w_f  -  W_g / w_g |  <=  C_f / w_f  +  C_g / w_g

where C is the largest charge of one of that principal's tasks (at most the model's context window).
Claims are made by S engine slots at once (workers x max_num_seqs), so over an interval of time, up
to S - 1 claims in flight may fall on either side of its ends: the bound over time adds
(S - 1) x max(C_f / w_f, C_g / w_g), the counterpart of VTC's batch term. Tokens served lag the
tokens claimed by what is in the batches. ``make bench FIGURES=F3,F4`` measures both.

Interactive requests (``POST /responses``) never enter this order: they have their own queue, and
the engine admits them before any task (worker/gate.py). Handed-on tasks are claimed by their own
message, ahead of the queue, as before.
"""

from __future__ import annotations

from sqlalchemy import bindparam, select, text, update
from sqlalchemy.orm import Session

from common.db import Compiled, fetch_batch, run_batch
from common.states import QUEUED
from common.tables import Principal, Task, VirtualTime

SYSTEM = ""  # the principal id of a model's row that holds its system virtual time
MIN_WEIGHT, MAX_WEIGHT = 0.01, 1000.0


def charge(input_tokens: int | None, max_tokens: int | None) -> int:
    """What a task may cost in tokens: its prompt and every output token it is allowed."""
    return (input_tokens or 0) + (max_tokens or 0)


def tags(clock: float, system: float, cost: int, weight: float) -> tuple[float, float]:
    """A new task's virtual (start, finish) on a principal clock at ``clock``, the model at ``system``."""
    start = max(clock, system)
    return start, start + cost / weight


def unused(start: float, finish: float, cost: int, used: int) -> float:
    """The virtual time a task charged (``start`` to ``finish`` for ``cost`` tokens) gives back when
    it used ``used`` tokens."""
    return 0.0 if cost <= 0 else (finish - start) * (cost - used) / cost


# -- creation: one step of lifecycle.create_task's batch ------------------------------------------------
_SYSTEM_NOW = "COALESCE((SELECT finish FROM virtual_times WHERE model = :fair_model AND principal_id = '')," \
              " 0)"
_SPAN = "(:fair_cost / (SELECT weight FROM principals WHERE id = :fair_principal))"
# Only when the task is written (its response exists: it had room); concurrent creations of one
# principal wait for each other on its row, so each gets the clock the previous one left.
CHARGE = Compiled(text(f"""
INSERT INTO virtual_times (model, principal_id, finish)
SELECT :fair_model, :fair_principal, {_SYSTEM_NOW} + {_SPAN}
WHERE EXISTS (SELECT 1 FROM responses WHERE id = :created_response)
ON CONFLICT (model, principal_id) DO UPDATE SET finish = CASE
    WHEN virtual_times.finish > {_SYSTEM_NOW} THEN virtual_times.finish ELSE {_SYSTEM_NOW} END + {_SPAN}"""))


def charge_params(model: str, principal: str, cost: int) -> dict:
    return {"fair_model": model, "fair_principal": principal, "fair_cost": cost}


def _clock(model, principal):
    return select(VirtualTime.finish).where(VirtualTime.model == model, VirtualTime.principal_id == principal)


# The SQL of a new task's virtual times, read from its principal's clock after ``CHARGE``: built once
# (building it per POST cost more than the rest of the statement's shape).
_FINISH = _clock(bindparam("fair_model"), bindparam("fair_principal")).scalar_subquery()
_WEIGHT = select(Principal.weight).where(Principal.id == bindparam("fair_principal")).scalar_subquery()
TASK_TAGS = {"virtual_finish": _FINISH, "virtual_start": _FINISH - bindparam("fair_cost") / _WEIGHT}


# -- the claim -----------------------------------------------------------------------------------------
def next_queued(session: Session, model):
    """The id of the queued task of ``model`` (a value or SQL) that finishes first, as a subquery for
    the claim's UPDATE: read from the head of ix_tasks_fair, skipping rows another claim holds."""
    pick = select(Task.id).where(Task.model == model, Task.status == QUEUED).order_by(
        Task.virtual_finish, Task.id).limit(1).correlate(None)
    if session.get_bind().dialect.name == "postgresql":
        pick = pick.with_for_update(skip_locked=True)
    return pick.scalar_subquery()


_NO_CLOCK = text("INSERT INTO virtual_times (model, principal_id, finish) VALUES (:model, '', :start) "
                 "ON CONFLICT (model, principal_id) DO NOTHING")


def advance(session: Session, task: Task) -> None:
    """A claim moves the model's system virtual time up to the claimed task's start. The row is
    locked only when it moves (a claim of an older tag reads it and leaves it)."""
    moved = session.execute(update(VirtualTime).where(
        VirtualTime.model == task.model, VirtualTime.principal_id == SYSTEM,
        VirtualTime.finish < task.virtual_start).values(finish=task.virtual_start)).rowcount
    if not moved:
        session.execute(_NO_CLOCK, {"model": task.model, "start": task.virtual_start})


# -- the end of a task ---------------------------------------------------------------------------------
# settle's statements, compiled once: every end of a task runs them.
_SETTLE = {queued: Compiled(update(Task).where(Task.id == bindparam("task_id"), *([Task.status == QUEUED] if queued else ()))
                            .values(cost=Task.cost).returning(Task.model, Task.principal_id, Task.cost,
                                                              Task.virtual_start, Task.virtual_finish))
           for queued in (False, True)}
_SETTLE_TASK = Compiled(update(Task).where(Task.id == bindparam("task_id")).values(
    cost=bindparam("new_cost"), virtual_start=bindparam("new_start"), virtual_finish=bindparam("new_finish")))
_GIVE_BACK = Compiled(update(VirtualTime).where(
    VirtualTime.model == bindparam("model"), VirtualTime.principal_id == bindparam("principal")).values(
    finish=VirtualTime.finish - bindparam("back")))


def settle(session: Session, task_id: str, used: int, *, queued: bool = False) -> bool:
    """Correct the charge of a task that ended having used ``used`` tokens (0: it never ran): every end
    of a task calls this once. Once only all the same: the task's charge becomes what it used and its
    span on the clock none (start = finish), so a second settle finds nothing left to give back.
    ``queued``: only while the task is still queued, which it then stays until this transaction ends.
    Locks the task's row before its principal's clock, as every writer of both does (no deadlock)."""
    rows = fetch_batch(session, [(_SETTLE[queued], {"task_id": task_id})])[0]
    if not rows:
        return False
    model, principal, cost, start, finish = rows[0]
    back = unused(start, finish, cost, min(used, cost))
    steps = []
    if finish > start:
        steps.append((_SETTLE_TASK, {"task_id": task_id, "new_cost": min(used, cost), "new_start": finish - back,
                                     "new_finish": finish - back}))
    if back:
        steps.append((_GIVE_BACK, {"model": model, "principal": principal, "back": back}))
    if steps:
        run_batch(session, steps)
    return True


def spend(session: Session, task: Task, used: int) -> None:
    """An attempt that is thrown away (a ``retry`` task starting over) used ``used`` tokens outside the
    task's charge, which covers one run: its principal's clock moves on by them."""
    if used <= 0:
        return
    weight = select(Principal.weight).where(Principal.id == task.principal_id).scalar_subquery()
    session.execute(update(VirtualTime).where(
        VirtualTime.model == task.model, VirtualTime.principal_id == task.principal_id).values(
        finish=VirtualTime.finish + used / weight))
