import uuid

import pytest

from tests.harness import Client, Stack, create_database, drop_database, model_entry


@pytest.fixture(scope="session")
def pg_url():
    """A fresh Postgres database for this run, migrated, dropped at the end."""
    from common.db import upgrade
    url = create_database()
    upgrade(url)
    yield url
    drop_database(url)


@pytest.fixture(scope="session")
def model_id():
    return f"smollm2:t{uuid.uuid4().hex[:8]}"  # its own queue: parallel runs never share work


@pytest.fixture(scope="session")
def stack(tmp_path_factory, pg_url, model_id):
    tmp = tmp_path_factory.mktemp("stack")
    fault_model = model_id.replace(":t", ":f")
    s = Stack(tmp, pg_url, models=[
        model_entry(model_id),
        model_entry(fault_model),
        model_entry("tiny:no-tools", context_window=64, max_output_tokens=16,
                    capabilities={"tools": False, "structured_output": False, "conversations": False,
                                  "resume_snapshots": False}),
    ])
    s.fault_model = fault_model
    yield s
    s.close()


@pytest.fixture(scope="session")
def worker(stack, model_id):
    return stack.start_worker(model_id, f"test-{model_id}")


@pytest.fixture(scope="session")
def api(stack):
    return stack.start_api()


@pytest.fixture(scope="session")
def alice(stack, api, worker) -> Client:
    return Client(api, stack.token("alice"))


@pytest.fixture(scope="session")
def bob(stack, api) -> Client:
    return Client(api, stack.token("bob"))
