"""Races on one task row on Postgres (the table itself is tested in tests/unit/test_states.py)."""

import threading

import pytest

from common import states
from common.db import make_engine, session_factory
from common.tables import Task
from tests import factories


@pytest.fixture(scope="module")
def sessions(pg_url):
    engine = make_engine(pg_url)
    yield session_factory(engine)
    engine.dispose()


def _race(sessions, task_id, targets):
    barrier = threading.Barrier(len(targets))
    results = {}

    def attempt(target):
        with sessions() as session:
            barrier.wait()
            results[target] = states.transition(session, task_id, target, only_from=["running"])
            session.commit()

    threads = [threading.Thread(target=attempt, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_cancel_and_complete_race_exactly_one_wins(sessions):
    winners = set()
    for _ in range(40):
        with sessions() as session:
            row = factories.task(session, "running")
            session.commit()
        results = _race(sessions, row.id, ["succeeded", "cancelling"])
        assert sum(results.values()) == 1, results
        winner = next(t for t, won in results.items() if won)
        winners.add(winner)
        with sessions() as session:
            assert session.get(Task, row.id).status == winner
    assert winners  # at least one outcome observed; both are legal winners
