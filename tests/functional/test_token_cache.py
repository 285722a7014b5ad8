"""Token lookups cached in each api process (api/token_cache.py), revocation still immediate: a revoke
is refused by every process of a two-process api in the very next request each one answers; a token
created a moment ago works at once on every process. The cache's expiry is a minute here, so only the
revoke's announcement over Redis can make the refusal come in time."""

import psutil
import pytest

from tests.per_process import PerProcess, token_id


@pytest.fixture(scope="module")
def two_processes(stack, imported):
    base = stack.start_api(workers=2, threads=8, LMSP_TOKEN_CACHE_SECONDS="60")
    probe = PerProcess(base, psutil.Process(stack.procs[-1].pid))
    assert len(probe.workers()) == 2
    return probe


def test_a_revoked_token_is_refused_by_every_process_at_once(stack, two_processes):
    secret = stack.token("cached-rita")
    assert set(two_processes.every(secret).values()) == {200}   # each process has it cached now
    assert set(two_processes.every(secret).values()) == {200}
    stack.lmsp("tokens", "revoke", token_id(stack, "cached-rita"))
    assert two_processes.every(secret) == dict.fromkeys(two_processes.workers(), 401)


def test_a_new_token_works_at_once_on_every_process(stack, two_processes):
    assert set(two_processes.every(stack.token("cached-sam")).values()) == {200}  # warm, and Redis heard
    assert set(two_processes.every(stack.token("cached-tom")).values()) == {200}
