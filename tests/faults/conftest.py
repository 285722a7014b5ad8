"""The fault tests stop, restart and flush Postgres and Redis: they get servers of their own, so they
run beside the other tests (`make test` runs them as a lane of their own) and never touch the shared ones."""

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml

from tests.harness import model_entry
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
def imported(stack, model_id):
    """The session's model, registered straight from the default checkpoint: the faults need a model, not
    the GGUF import that tests/functional/test_foundation.py proves (a minute of CPU saved in this lane)."""
    entries = yaml.safe_load(stack.models_file.read_text())["models"]
    stack.models_file.write_text(yaml.safe_dump({"models": [*entries, model_entry(model_id)]}))
