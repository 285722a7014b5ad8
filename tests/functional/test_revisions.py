"""Same snapshot everywhere (issue 35, defect 9): a hub model without a pinned revision is pulled at the
commit the first pull recorded in the shared database, on every host, and this host's api and workers
(which read the local cache) resolve that commit too. Two hosts are two Hugging Face caches laid out by
hand (tests/hubcache.py, HF_HUB_OFFLINE=1: no hub is reached) on one real Postgres database; on the
second, the branch has moved on. About 15 s."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.harness import CHECKPOINT, create_database, drop_database
from tests.hubcache import DEFAULT_REPO, lay_out_snapshot

LMSP = str(Path(sys.executable).parent / "lmsp")


@pytest.fixture
def database():
    from common.db import upgrade
    url = create_database(prefix="lmsp_rev")
    upgrade(url)
    yield url
    drop_database(url)


def lmsp(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([LMSP, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **env})


def test_every_host_pulls_and_serves_the_commit_the_first_pull_recorded(database, tmp_path):
    (tmp_path / "models.yaml").write_text(yaml.safe_dump({"models": [
        {"id": "hub:1", "checkpoint": DEFAULT_REPO, "context_window": 2048, "max_output_tokens": 256}]}))
    files = sorted(p.name for p in CHECKPOINT.iterdir() if p.is_file() and not p.name.startswith("."))
    first, _ = lay_out_snapshot(CHECKPOINT, tmp_path / "a", files=files)        # host a: main is `first`
    lay_out_snapshot(CHECKPOINT, tmp_path / "b", ref="then", files=files)       # host b has that snapshot,
    moved, _ = lay_out_snapshot(CHECKPOINT, tmp_path / "b", files=[f for f in files if f != "generation_config.json"])
    assert moved != first                                                        # but its main has moved on

    def host(name: str) -> dict:
        return {"HF_HOME": str(tmp_path / name), "LMSP_DATABASE_URL": database,
                "LMSP_MODELS_FILE": str(tmp_path / "models.yaml"), "LMSP_HOME": str(tmp_path / f"{name}-home")}

    done = lmsp(host("a"), "models", "pull", "hub:1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith(first) and f"commit {first} (on record" in done.stderr
    done = lmsp(host("b"), "models", "pull", "hub:1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith(first), "host b took its own branch's newest commit"
    # What b's api and workers load (they read the local cache only): the same commit.
    for name in ("a", "b"):
        doctor = lmsp(host(name), "doctor", "--model", "hub:1", "--min-free-gib", "0")
        line = next(line for line in doctor.stdout.splitlines() if "model hub:1" in line)
        assert line.startswith("ok") and f"at commit {first}" in line, (name, line)
    # Told otherwise: --update records the branch's newest for everyone (b's main on the hub: `moved`).
    (tmp_path / "b" / "hub" / ("models--" + DEFAULT_REPO.replace("/", "--")) / "refs" / "main").write_text(moved)
    done = lmsp(host("b"), "models", "pull", "hub:1", "--update")
    assert done.returncode == 0 and done.stdout.strip().endswith(moved), done.stderr
    done = lmsp(host("a"), "models", "pull", "hub:1")   # a follows: it has no such snapshot offline
    assert done.returncode == 1 and moved in done.stderr and "HF_HUB_OFFLINE" in done.stderr


def test_an_unmigrated_database_fails_the_pull_even_with_keep_going(tmp_path):
    """The api pod's init container runs `pull --all --keep-going` and may run before the migrate Job: it
    must fail (and be run again), not pass every model over and leave the api without tokenizers."""
    url = create_database(prefix="lmsp_rev_bare")
    try:
        (tmp_path / "models.yaml").write_text(yaml.safe_dump({"models": [
            {"id": "hub:1", "checkpoint": DEFAULT_REPO, "context_window": 2048, "max_output_tokens": 256}]}))
        lay_out_snapshot(CHECKPOINT, tmp_path / "hf")
        done = lmsp({"HF_HOME": str(tmp_path / "hf"), "LMSP_DATABASE_URL": url,
                     "LMSP_MODELS_FILE": str(tmp_path / "models.yaml"), "LMSP_HOME": str(tmp_path / "home")},
                    "models", "pull", "--all", "--tokenizer-only", "--keep-going")
        assert done.returncode == 1 and "run `lmsp migrate`" in done.stderr, done.stderr
    finally:
        drop_database(url)
