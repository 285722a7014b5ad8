"""A model named by Hugging Face repo id, end to end, offline: the default model laid out as a hub
snapshot in a temp HF_HOME, HF_HUB_OFFLINE=1; `lmsp models pull` finds it, the api counts tokens with
its tokenizer, a worker loads the same snapshot and a task succeeds. Costs one engine load (~40-60 s)."""

import time

import yaml

from tests.harness import CHECKPOINT, Client, Stack, model_entry, user, wait_for
from tests.hubcache import DEFAULT_REPO, lay_out_snapshot


def test_repo_id_from_an_offline_hub_cache_serves_a_task(tmp_path, pg_url):
    hf_home = tmp_path / "hf"
    _, snapshot = lay_out_snapshot(CHECKPOINT, hf_home)
    model = f"smollm2:hub{int(time.time() * 1000) % 10**8}"  # a queue of its own
    stack = Stack(tmp_path, pg_url, models=[model_entry(model, checkpoint=DEFAULT_REPO)])
    stack.env.update({"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"})
    try:
        pulled = stack.lmsp("models", "pull", model)
        assert pulled.stdout.strip().endswith(f"{model}\t{snapshot}"), pulled.stdout + pulled.stderr
        listed = stack.lmsp("models", "list", "--registry").stdout
        assert f"hub {DEFAULT_REPO}\tpresent {snapshot}" in listed
        assert yaml.safe_load(stack.models_file.read_text())["models"][0]["checkpoint"] == DEFAULT_REPO
        base = stack.start_api()
        stack.start_worker(model, "hub-0")
        alice = Client(base, stack.token("alice"))
        resp = alice.post("/lmsp/v1/tasks", {"type": "response", "input": {
            "model": model, "input": user("Say hello."), "temperature": 0, "max_output_tokens": 8}})
        assert resp.status_code == 202, resp.text
        task = resp.json()
        wait_for(lambda: alice.get(f"/lmsp/v1/tasks/{task['id']}").json()["status"] in
                 ("succeeded", "failed", "cancelled"), 300, "the task did not finish")
        done = alice.get(f"/lmsp/v1/tasks/{task['id']}").json()
        assert done["status"] == "succeeded", done
        assert done["response"]["usage"]["input_tokens"] > 0  # counted by the api with the snapshot's tokenizer
        log = (tmp_path / "worker-hub-0.log").read_text()
        assert f"from {snapshot}" in log  # the worker loaded the very snapshot the api read
    finally:
        stack.close()
