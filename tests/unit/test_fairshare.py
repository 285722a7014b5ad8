"""Fair share (issue 24, part 1): the ordering logic alone, then the real lifecycle core claiming on the
unit layer's SQLite (the embedded mode's database), the engine's admission order and the weight's CLI."""

import heapq
import random
import uuid

import pytest
from sqlalchemy import select

from common import events, fairshare, lifecycle
from common.states import R
from common.tables import Principal, Task, VirtualTime
from tests import factories
from tests.unit.test_operator import env, lmsp  # noqa: F401 - env is a fixture
from worker.gate import GenParams, Request


class Queue:
    """The scheduler of common/fairshare.py in memory: tags at arrival, the least finish claimed first."""

    def __init__(self, weights: dict[str, float]):
        self.weights, self.clocks, self.system, self.heap, self.n = weights, dict.fromkeys(weights, 0.0), 0.0, [], 0

    def submit(self, who: str, cost: int) -> None:
        start, finish = fairshare.tags(self.clocks[who], self.system, cost, self.weights[who])
        self.clocks[who] = finish
        self.n += 1
        heapq.heappush(self.heap, (finish, self.n, start, who, cost))

    def claim(self) -> tuple[str, int]:
        _, _, start, who, cost = heapq.heappop(self.heap)
        self.system = max(self.system, start)
        return who, cost


def test_a_late_principal_is_served_before_a_flood_drains():
    q = Queue({"a": 1, "b": 1})
    for _ in range(500):
        q.submit("a", 300)
    first = [q.claim()[0] for _ in range(20)]  # a's first 20 are claimed while b has nothing queued
    for _ in range(10):
        q.submit("b", 300)
    order = [q.claim()[0] for _ in range(40)]
    # b comes back at the system's virtual time: from now on it takes every other claim.
    assert first == ["a"] * 20 and [i for i, who in enumerate(order) if who == "b"] == list(range(0, 20, 2))


@pytest.mark.parametrize("seed", range(5))
def test_weights_share_tokens_within_the_bound(seed):
    """Costs vary per task: the service is shared by tokens, not by count, and the normalised
    difference between the two backlogged principals never exceeds the bound the module states."""
    rng = random.Random(seed)
    weights = {"a": 1.0, "b": 2.0}
    q = Queue(weights)
    costs = {"a": [rng.randint(50, 1000) for _ in range(400)], "b": [rng.randint(50, 300) for _ in range(800)]}
    for who in ("a", "b"):
        for cost in costs[who]:
            q.submit(who, cost)
    served, worst = {"a": 0, "b": 0}, 0.0
    bound = max(costs["a"]) / weights["a"] + max(costs["b"]) / weights["b"]
    while all(served[w] < sum(costs[w]) * 0.9 for w in weights):  # both still backlogged
        who, cost = q.claim()
        served[who] += cost
        worst = max(worst, abs(served["a"] / weights["a"] - served["b"] / weights["b"]))
    assert worst <= bound
    assert served["b"] / served["a"] == pytest.approx(2, rel=0.1)


def test_nothing_starves_behind_a_stream_of_smaller_tasks():
    """Aging: a large task waits while others keep coming, but the system's virtual time passes its
    tag, and from then on every newcomer is tagged after it."""
    q = Queue({"big": 1, "small": 1, "more": 1})
    q.submit("big", 5000)
    claims = 0
    while True:
        q.submit("small", 100)  # one newcomer per claim, for ever
        q.submit("more", 100)
        claims += 1
        if q.claim()[0] == "big":
            break
        assert claims < 200
    assert claims <= 2 * 5000 // 100 + 2


def test_unused_charge_is_given_back_in_proportion():
    assert fairshare.unused(10.0, 110.0, 200, 50) == 75.0
    assert fairshare.unused(10.0, 110.0, 200, 200) == 0.0
    assert fairshare.unused(0.0, 0.0, 0, 0) == 0.0  # a task queued before fair share: charged nothing


def _create(session, principal: str, model: str, input_tokens: int = 100, max_tokens: int = 100) -> Task:
    factories.principal(session, principal)
    response = lifecycle.new_response(principal=principal, model=model, request={"input": []},
                                      input_tokens=input_tokens, max_tokens=max_tokens, status=R.IN_PROGRESS,
                                      stored=False, previous_response_id=None)
    task = lifecycle.new_task(response, "retry")
    assert lifecycle.create_task(session, response, task, lifecycle.Room(10**6, 10**6), commit=True)
    return session.get(Task, task.id)


def test_the_claim_takes_the_task_that_finishes_first(unit):
    """Each message claims the queue's next in fair order, its own task or another; a message with
    nothing left to claim claims nothing."""
    model = f"fair:{uuid.uuid4().hex[:6]}"
    with unit.sessions() as session:
        session.add(Principal(id=f"heavy-{model}", created_at=0, weight=2.0))
        flood = [_create(session, "flood-" + model, model) for _ in range(12)]
        late = [_create(session, "late-" + model, model) for _ in range(2)]
        heavy = [_create(session, f"heavy-{model}", model) for _ in range(4)]
        assert [t.virtual_finish for t in flood[:3]] == [200.0, 400.0, 600.0]
        assert [t.virtual_finish for t in heavy[:2]] == [100.0, 200.0]  # weight 2: half the virtual time
        claimed = []
        for message in [*flood, *late, *heavy]:  # the broker delivers in order of submission
            got, _ = lifecycle.claim(session, message.id, "w", model=model)
            session.commit()
            claimed.append(None if got is None else got.task.principal_id.split("-")[0])
        # By finish tag (ties: the oldest): heavy 100, flood 200, late 200, heavy 200, heavy 300, ...
        assert claimed[:8] == ["heavy", "flood", "late", "heavy", "heavy", "flood", "late", "heavy"]
        assert claimed[8:] == ["flood"] * 10
        system = session.get(VirtualTime, (model, fairshare.SYSTEM)).finish
        assert system == max(t.virtual_start for t in flood)  # the latest start claimed


def test_use_corrects_the_charge(unit, alice):
    """A task that used less than it was charged, or was cancelled while queued, gives the rest back:
    the principal's next task is tagged earlier."""
    model = f"fair:{uuid.uuid4().hex[:6]}"
    who = f"user-{model}"
    with unit.sessions() as session:
        first, second = _create(session, who, model), _create(session, who, model)
        assert lifecycle.cancel(session, second)[0] is False
        session.commit()
        assert session.get(Task, second.id).status == "cancelled"
        clock = select(VirtualTime.finish).where(VirtualTime.model == model, VirtualTime.principal_id == who)
        assert session.execute(clock).scalar() == 200.0  # the cancelled one's 200 given back
        got, _ = lifecycle.claim(session, first.id, "w", model=model)
        assert lifecycle.start(session, got.attempt)
        lifecycle.finish(session, got.attempt, R.COMPLETED, seq=events.Sequence(1), emitted=[], output=[],
                         usage={"input_tokens": 100, "output_tokens": 20, "total_tokens": 120})
        session.commit()
        assert session.execute(clock).scalar() == 120.0  # charged 200, used 120
        assert _create(session, who, model).virtual_start == 120.0


def test_the_engine_admits_people_first_then_tasks_by_virtual_finish():
    people = Request("p", GenParams(max_tokens=1, priority=0, rank=0.0))
    early, late = (Request(i, GenParams(max_tokens=1, priority=1, rank=r)) for i, r in (("e", 5.0), ("l", 9.0)))
    assert sorted([late, early, people]) == [people, early, late]


def test_a_weight_is_set_with_a_token_and_listed(env, capsys):  # noqa: F811 - the fixture
    assert lmsp(capsys, "tokens", "create", "--principal", "team-a", "--weight", "2.5")[0] in (0, None)
    code, _, out = lmsp(capsys, "tokens", "list")
    assert code in (0, None) and "WEIGHT" in out and "2.5" in out.splitlines()[1], out
    for bad in ("0", "-1", "nan", "1e9"):
        code, lines, _ = lmsp(capsys, "tokens", "create", "--principal", "team-b", "--weight", bad)
        assert code not in (0, None) and "weight" in lines[-1], lines
