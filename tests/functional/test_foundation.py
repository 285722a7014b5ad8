"""The repo's basics with real processes: import-gguf, tokens, auth, health, refusal when unmigrated."""

import subprocess
import sys

from sqlalchemy import select

from common.db import make_engine, session_factory
from common.tables import ApiToken
from tests.harness import ROOT, Client, user


def test_import_gguf_registers_a_model_vllm_serves(imported, alice, model_id):
    entry = imported["entry"]
    assert entry["context_window"] == 8192  # SmolLM2's max_position_embeddings, read from the GGUF
    assert "GGUF tensors one at a time" in imported["stderr"]  # progress is shown
    assert imported["stdout"] == ""  # stdout stays clean for scripts
    # The imported checkpoint loads in the real vLLM engine and answers a chat prompt.
    resp = alice.post("/lmsp/v1/responses", {"model": model_id, "input": user("What is the capital of France?"),
                                             "max_output_tokens": 24, "temperature": 0})
    assert resp.status_code == 200, resp.text
    text = resp.json()["output"][0]["content"][0]["text"]
    assert "Paris" in text


def test_import_is_idempotent(stack, imported, model_id):
    from common.gguf import fetch_default_gguf
    from common.settings import Settings
    gguf = fetch_default_gguf(Settings().home / "downloads", lambda _: None)
    again = stack.lmsp("models", "import-gguf", str(gguf), "--id", model_id)
    assert "already imported" in again.stderr


def test_token_is_printed_once_and_stored_hashed(stack, pg_url, api):
    secret = stack.token("carol", "models:read")
    assert secret.startswith("lmsp_") and "\n" not in secret
    engine = make_engine(pg_url)
    with session_factory(engine)() as session:
        rows = session.execute(select(ApiToken).where(ApiToken.principal_id == "carol")).scalars().all()
    engine.dispose()
    assert len(rows) == 1
    assert secret not in (rows[0].token_hash, rows[0].scopes)
    assert rows[0].scopes.split() == ["models:read"]
    listing = stack.lmsp("tokens", "list").stdout
    assert rows[0].id in listing and secret not in listing
    client = Client(api, secret)
    assert client.get("/lmsp/v1/models").status_code == 200
    denied = client.get("/lmsp/v1/tasks/task_x")
    assert denied.status_code == 403 and denied.json()["code"] == "insufficient_scope"


def test_default_scopes_exclude_admin_and_reserved_scope_refused(stack):
    secret = stack.token("dave")
    assert secret
    refused = stack.lmsp("tokens", "create", "--principal", "dave", "--scopes", "tools:execute", check=False)
    assert refused.returncode != 0 and "reserved" in refused.stderr and refused.stdout == ""
    listing = stack.lmsp("tokens", "list").stdout
    dave = [line for line in listing.splitlines() if " dave " in line]
    assert dave and "admin" not in dave[0] and "tasks:write" in dave[0]


def test_every_route_but_health_needs_a_token(api):
    import requests
    assert requests.get(api + "/healthz").json() == {"status": "ok"}
    assert requests.get(api + "/readyz").status_code == 200
    for method, path in [("GET", "/lmsp/v1"), ("GET", "/lmsp/v1/models"), ("POST", "/lmsp/v1/responses"),
                         ("POST", "/lmsp/v1/tasks"), ("GET", "/lmsp/v1/tasks/task_1"),
                         ("GET", "/lmsp/v1/tasks/task_1/events"), ("POST", "/lmsp/v1/tasks/task_1/cancel"),
                         ("GET", "/lmsp/v1/responses/resp_1")]:
        resp = requests.request(method, api + path, headers={"Authorization": "Bearer nope"})
        assert resp.status_code == 401, (method, path)
        assert resp.headers["Content-Type"] == "application/problem+json"
        assert resp.headers["WWW-Authenticate"].startswith("Bearer")
        assert resp.json()["code"] == "unauthorized"
        assert resp.headers["LMSP-Version"] == "1.0"


def test_revoked_token_is_refused_at_once(stack, api):
    secret = stack.token("erin")
    client = Client(api, secret)
    assert client.get("/lmsp/v1/models").status_code == 200
    token_id = next(line.split()[0] for line in stack.lmsp("tokens", "list").stdout.splitlines()
                    if " erin " in line)
    stack.lmsp("tokens", "revoke", token_id)
    assert client.get("/lmsp/v1/models").status_code == 401


def test_services_refuse_an_unmigrated_database(stack, tmp_path):
    env = {**stack.env, "LMSP_DATABASE_URL": f"sqlite:///{tmp_path / 'new.db'}"}
    api = subprocess.run([sys.executable, "-c", "import api.wsgi"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert api.returncode != 0 and "lmsp migrate" in api.stderr
    worker = subprocess.run([sys.executable, "-m", "worker", "--model", "tiny:no-tools"], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert worker.returncode != 0 and "lmsp migrate" in worker.stderr
