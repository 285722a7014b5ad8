import os
import uuid

import pytest
import yaml

from tests.harness import PG_URL, REDIS_URL, Client, Stack, create_database, drop_database, model_entry

# Tests run several engines at once on two cores. vLLM's "auto" binding puts every one of them on the
# first core (keeping the last for its scheduler) and the workers on the other, so one core queued five
# engines' forward passes and process starts while the other idled. Unbound, one OpenMP thread each,
# the kernel spreads them. Production keeps "auto" (one engine per host); tests/bench pins every side
# alike (tests/bench/verdict.py).
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def pg_server():
    """The Postgres server the run's database is made on (tests/faults overrides it with its own)."""
    return PG_URL


@pytest.fixture(scope="session")
def pg_url(pg_server):
    """A fresh Postgres database for this run, migrated, dropped at the end."""
    from common.db import upgrade
    url = create_database(server=pg_server)
    upgrade(url)
    yield url
    drop_database(url)


@pytest.fixture(scope="session")
def redis_url():
    """The Redis the run's processes use (tests/faults overrides it with its own)."""
    return REDIS_URL


@pytest.fixture(scope="session")
def model_id():
    return f"smollm2:t{uuid.uuid4().hex[:8]}"  # its own queue: parallel runs never share work


@pytest.fixture(scope="session")
def stack(tmp_path_factory, pg_url, redis_url, model_id):
    tmp = tmp_path_factory.mktemp("stack")
    fault_model = model_id.replace(":t", ":f")
    pair_model = model_id.replace(":t", ":p")  # two workers of its own (tests/faults/test_faults.py)
    s = Stack(tmp, pg_url, redis_url=redis_url, models=[
        model_entry(fault_model),
        model_entry(pair_model),
        model_entry("tiny:no-tools", context_window=64, max_output_tokens=16,
                    capabilities={"tools": False, "structured_output": False, "conversations": False,
                                  "resume_snapshots": False}),
    ])
    s.fault_model = fault_model
    s.pair_model = pair_model
    yield s
    s.close()


@pytest.fixture(scope="session")
def imported(stack, model_id):
    """The session's model comes from `lmsp models import-gguf` under an id it has never seen."""
    from common.gguf import fetch_default_gguf
    from common.settings import Settings

    gguf = fetch_default_gguf(Settings().home / "downloads", lambda _: None)
    done = stack.lmsp("models", "import-gguf", str(gguf), "--id", model_id)
    entries = yaml.safe_load(stack.models_file.read_text())["models"]
    entry = next(e for e in entries if e["id"] == model_id)
    # Smaller than the registered defaults: several engines share this 2-core machine in tests.
    tuned = model_entry(model_id, checkpoint=entry["checkpoint"])
    stack.models_file.write_text(yaml.safe_dump(
        {"models": [tuned if e["id"] == model_id else e for e in entries]}))
    return {"entry": entry, "stderr": done.stderr, "stdout": done.stdout}


@pytest.fixture(scope="session")
def worker(stack, model_id, imported):
    return stack.start_worker(model_id, f"test-{model_id}")


@pytest.fixture(scope="session")
def api(stack, imported):
    return stack.start_api()


@pytest.fixture(scope="session")
def alice(stack, api, worker) -> Client:
    return Client(api, stack.token("alice"))


@pytest.fixture(scope="session")
def bob(stack, api) -> Client:
    return Client(api, stack.token("bob"))
