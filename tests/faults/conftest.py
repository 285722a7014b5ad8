"""The fault tests stop, restart and flush Postgres and Redis: they get servers of their own, so they
run beside the other tests (`make test` runs them as a lane of their own) and never touch the shared ones."""

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.harness import Client
from tests.servers import PgCluster, RedisServer


@pytest.fixture(scope="session")
def private_servers():
    # Not under pytest's basetemp: initdb runs as postgres, which cannot enter root's private folders.
    root = Path(tempfile.mkdtemp(prefix="lmsp-faults-"))
    os.chmod(root, 0o755)
    pg = PgCluster(root / "pg")
    redis_server = RedisServer(root)
    yield pg, redis_server
    redis_server.close()
    pg.close()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_server(private_servers):
    return private_servers[0].url()


@pytest.fixture(scope="session")
def redis_url(private_servers):
    return f"redis://127.0.0.1:{private_servers[1].port}/0"


@pytest.fixture(scope="session")
def imported():
    """No model of the session's own: the fault tests run on the pair (test_faults.py), two workers of
    the stack's pair_model, so this lane loads no engine that no fault needs."""


@pytest.fixture(scope="session")
def alice(stack, api) -> Client:
    return Client(api, stack.token("alice"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed fault test shows the end of every api log of its stack: a request that hung or was cut
    is seen from the server's side too (the worker logs are in the assertions that need them)."""
    outcome = yield
    report = outcome.get_result()
    stack = item.funcargs.get("stack")
    if report.failed and stack is not None:
        for log in sorted(stack.tmp.glob("api-*.log")):
            lines = log.read_text(errors="replace").splitlines()
            report.sections.append((f"{log.name}, last 40 lines", "\n".join(lines[-40:])))
