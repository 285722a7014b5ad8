"""Many models on few GPUs (issue 24) on the real stack: one worker serves three models within a memory
budget that holds one of them at a time (worker/residency.py). The first (simulated) is loaded at boot,
the vLLM one is cold until a task for it comes; two simulated ones take turns while tasks for both wait.

The vLLM model is named by Hugging Face repo id, offline: the default model laid out as a hub snapshot in
a temp HF_HOME, HF_HUB_OFFLINE=1; `lmsp models pull` finds it, the api counts tokens with its tokenizer,
and the worker loads the same snapshot.

Cost: the vLLM engine's cold load (~20-40 s on 2 CPU cores), its keep-alive (8 s) and its stop; the rest ~10 s.
"""

import re
import time
import uuid

import pytest

from tests.functional.test_tasks import submit, wait_status
from tests.harness import CHECKPOINT, Client, Stack, engine_pids, model_entry, user, wait_for
from tests.hubcache import DEFAULT_REPO, lay_out_snapshot

SIM = {"kind": "sim", "ttft_ms": 50, "tokens_per_s": 20, "max_num_seqs": 8}
KEEP_ALIVE = 8


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, pg_url):
    run = uuid.uuid4().hex[:8]
    sim_a, sim_b, real = f"sim:a{run}", f"sim:b{run}", f"smollm2:cold{run}"
    # Each simulated model counts as 2 GiB and the vLLM one as 3 against a budget of 3: one at a time.
    tmp = tmp_path_factory.mktemp("models")
    _, snapshot = lay_out_snapshot(CHECKPOINT, tmp / "hf")
    stack = Stack(tmp, pg_url, models=[
        model_entry(sim_a, engine=SIM, memory_gib=2), model_entry(sim_b, engine=SIM, memory_gib=2),
        model_entry(real, memory_gib=3, checkpoint=DEFAULT_REPO)])
    stack.env.update({"HF_HOME": str(tmp / "hf"), "HF_HUB_OFFLINE": "1"})
    pulled = stack.lmsp("models", "pull", real)
    assert pulled.stdout.strip().endswith(f"{real}\t{snapshot}"), pulled.stdout + pulled.stderr
    assert f"hub {DEFAULT_REPO}\tpresent {snapshot}" in stack.lmsp("models", "list", "--registry").stdout
    worker_id = f"models-{run}"
    stack.start_worker(f"{sim_a},{sim_b},{real}", worker_id, LMSP_WORKER_MEMORY_BUDGET_GIB="3",
                       LMSP_WORKER_KEEP_ALIVE_SECONDS=str(KEEP_ALIVE), LMSP_WORKER_METRICS_PORT="0")
    client = Client(stack.start_api(), stack.token("alice"))
    yield {"client": client, "stack": stack, "worker": worker_id, "sim_a": sim_a, "sim_b": sim_b, "real": real,
           "snapshot": snapshot}
    stack.close()


def loaded_on(client, model):
    return client.get(f"/lmsp/v1/models/{model}").json()["extensions"]["x-lmsp-residency"]["loaded_on"]


def loads(fleet, model) -> int:
    text = (fleet["stack"].tmp / f"worker-{fleet['worker']}.log").read_text()
    return len(re.findall(rf"loaded {re.escape(model)} in ", text))


def test_a_cold_model_by_repo_id_is_loaded_when_its_task_comes_and_unloaded_after_its_keep_alive(fleet):
    client, worker, real, sim_a = fleet["client"], fleet["worker"], fleet["real"], fleet["sim_a"]
    model = client.get(f"/lmsp/v1/models/{real}").json()
    # Servable though no worker has it loaded: its worker loads it on demand.
    assert (model["status"], model["workers"], loaded_on(client, real)) == ("ready", 1, [])
    assert loads(fleet, sim_a) == 1 and not engine_pids(worker)  # the first model, at boot
    listed = fleet["stack"].lmsp("models", "list", "--url", client.base,
                                 "--token", client.http.headers["Authorization"].removeprefix("Bearer ")).stdout
    assert "LOADED ON" in listed and "none (loaded" in listed, listed

    task = submit(client, real, max_output_tokens=8).json()
    done = wait_status(client, task["id"], {"succeeded", "failed"}, timeout=900)
    assert done["status"] == "succeeded" and done["response"]["usage"]["output_tokens"] == 8, done
    assert done["response"]["usage"]["input_tokens"] > 0  # counted by the api with the snapshot's tokenizer
    log = (fleet["stack"].tmp / f"worker-{worker}.log").read_text()
    assert f"from {fleet['snapshot']}" in log  # the worker loaded the very snapshot the api read
    # The load happened while the task was still queued: nothing was claimed before the engine was up.
    timeline = done["extensions"]["x-lmsp-timeline"]
    assert len(timeline["attempts"]) == 1 and timeline["durations"]["queue"] > 1, timeline
    assert loaded_on(client, real) == [worker]
    assert engine_pids(worker)

    # Idle for the keep-alive: unloaded, and its engine's processes are gone (their memory is free). The
    # model counts as loaded until its engine has stopped: vLLM's clean exit (a 15 s grace, then SIGKILL
    # and a 10 s join) takes seconds more on a busy machine, hence the bound.
    wait_for(lambda: loaded_on(client, real) == [], KEEP_ALIVE + 45, "the keep-alive to unload the model")
    log = (fleet["stack"].tmp / f"worker-{worker}.log").read_text()
    assert f"unloading {real} (idle for {KEEP_ALIVE} s)" in log, "unloaded, but not for its keep-alive"
    wait_for(lambda: not engine_pids(worker), 15, "the engine processes to exit")
    assert client.get(f"/lmsp/v1/models/{real}").json()["status"] == "ready"


def test_models_take_turns_and_a_model_unloaded_while_its_tasks_wait_loses_none(fleet):
    """sim_a loaded and running a1; b1 arrives and waits (sim_a must go); a2 arrives after b1, so it waits
    too, queued, while sim_a is unloaded for sim_b. Every task succeeds, sim_a loaded again for a2."""
    client, sim_a, sim_b = fleet["client"], fleet["sim_a"], fleet["sim_b"]
    warm = submit(client, sim_a, max_output_tokens=2).json()["id"]
    assert wait_status(client, warm, {"succeeded", "failed"}, timeout=60)["status"] == "succeeded"
    before = loads(fleet, sim_a)
    tasks = []
    for model in (sim_a, sim_b, sim_a, sim_b):
        tasks.append(submit(client, model, max_output_tokens=30).json()["id"])  # 1.5 s each at 20 tokens/s
        time.sleep(0.4)
    for task_id in tasks:
        done = wait_status(client, task_id, {"succeeded", "failed", "cancelled"}, timeout=60)
        assert done["status"] == "succeeded" and done["response"]["usage"]["output_tokens"] == 30, done
        assert len(done["extensions"]["x-lmsp-timeline"]["attempts"]) == 1  # claimed once: after its load
    assert loads(fleet, sim_a) == before + 1, "sim_a was not unloaded while a2 waited for it"
    assert loads(fleet, sim_b) >= 1


def test_a_direct_request_for_a_model_loaded_nowhere_is_served(fleet):
    """The interactive lane drains a cold model's queue only while no live worker has it loaded; then it
    loads it for the person waiting (the response stays queued, unclaimed, meanwhile)."""
    client, sim_a, sim_b = fleet["client"], fleet["sim_a"], fleet["sim_b"]
    cold = sim_a if loaded_on(client, sim_b) else sim_b
    answer = client.post("/lmsp/v1/responses", {"model": cold, "input": user("Hello"), "max_output_tokens": 5})
    assert answer.status_code == 200 and answer.json()["status"] == "incomplete", answer.text
    assert loaded_on(client, cold) == [fleet["worker"]]

