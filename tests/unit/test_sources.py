"""Model sources (common/registry.py): a folder, a GGUF file, a Hugging Face repo id at a revision, each
resolved to the one local folder the api's tokenizer and the worker's engine load; `lmsp models pull`
and `lmsp models list --registry` on a hub cache laid out by hand, offline (tests reach no hub)."""

import os
import subprocess
import sys

import pytest
import yaml

from common import registry
from common.registry import CheckpointMissing, ModelSpec, local_checkpoint, source_of
from common.settings import get_settings
from tests.harness import CHECKPOINT
from tests.hubcache import DEFAULT_REPO, lay_out_snapshot


def spec(checkpoint: str, **kw) -> ModelSpec:
    return ModelSpec(id=kw.pop("id", "m:1"), checkpoint=checkpoint, context_window=2048, max_output_tokens=64, **kw)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An offline hub cache in a temp HF_HOME holding the default model as DEFAULT_REPO."""
    from huggingface_hub import constants
    home = tmp_path / "hf"
    commit, snapshot = lay_out_snapshot(CHECKPOINT, home)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(registry, "_resolved", {})
    return {"home": home, "commit": commit, "snapshot": snapshot}


def test_sources_are_told_apart(tmp_path):
    assert source_of(spec(str(tmp_path))).kind == "folder"
    assert source_of(spec("/models/x.gguf")).kind == "gguf"
    assert source_of(spec("Qwen/Qwen3-8B", revision="v1")) == registry.Source("hub", "Qwen/Qwen3-8B", "v1")
    assert source_of(spec("./Qwen/Qwen3-8B")).kind == "folder"
    assert source_of(spec("not a repo id")).kind == "folder"


def test_a_repo_id_resolves_to_the_cached_snapshot_at_its_revision(hub):
    assert local_checkpoint(spec(DEFAULT_REPO)) == str(hub["snapshot"])
    assert local_checkpoint(spec(DEFAULT_REPO, id="m:2", revision=hub["commit"])) == str(hub["snapshot"])
    with pytest.raises(CheckpointMissing, match="lmsp models pull m:3"):
        local_checkpoint(spec(DEFAULT_REPO, id="m:3", revision="v9"))


def test_offline_and_not_cached_says_what_to_do(hub):
    with pytest.raises(CheckpointMissing, match="HF_HUB_OFFLINE=1 forbids downloading it"):
        registry.pull(spec("acme/never-pulled"))
    with pytest.raises(CheckpointMissing, match=r"not in the Hugging Face cache .*lmsp models pull m:1"):
        local_checkpoint(spec("acme/never-pulled"))


def test_missing_folder_and_unimported_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("LMSP_HOME", str(tmp_path))
    get_settings.cache_clear()
    with pytest.raises(CheckpointMissing, match="is not a checkpoint folder"):
        local_checkpoint(spec(str(tmp_path / "nope")))
    with pytest.raises(CheckpointMissing, match="no GGUF file"):
        registry.pull(spec(str(tmp_path / "nope.gguf"), id="g:1"))
    with pytest.raises(CheckpointMissing, match="not imported yet; run `lmsp models pull g:1`"):
        local_checkpoint(spec(str(tmp_path / "nope.gguf"), id="g:1"))
    get_settings.cache_clear()


def test_api_tokenizer_reads_the_snapshot(hub):
    from common.prompt import load_tokenizer
    tok = load_tokenizer(local_checkpoint(spec(DEFAULT_REPO)))
    assert tok.encode("hello world")


def test_models_pull_and_list_offline(hub, tmp_path):
    models = tmp_path / "models.yaml"
    models.write_text(yaml.safe_dump({"models": [
        {"id": "smol:hub", "checkpoint": DEFAULT_REPO, "context_window": 2048, "max_output_tokens": 64},
        {"id": "other:hub", "checkpoint": "acme/never-pulled", "context_window": 2048, "max_output_tokens": 64}]}))
    env = {**os.environ, "LMSP_MODELS_FILE": str(models), "LMSP_HOME": str(tmp_path / "home")}

    def lmsp(*args):
        return subprocess.run([sys.executable, "-m", "lmsp", *args], env=env, capture_output=True, text=True)

    done = lmsp("models", "pull", "smol:hub")
    assert done.returncode == 0, done.stderr
    assert f"smol:hub\t{hub['snapshot']}" in done.stdout
    missing = lmsp("models", "pull", "other:hub")
    assert missing.returncode != 0 and "HF_HUB_OFFLINE=1 forbids downloading it" in missing.stderr
    assert "Traceback" not in missing.stderr
    assert lmsp("models", "pull").returncode != 0
    unknown = lmsp("models", "pull", "nope:1")
    assert unknown.returncode != 0 and "models list --registry" in unknown.stderr
    listed = lmsp("models", "list", "--registry").stdout
    assert f"smol:hub\thub {DEFAULT_REPO}\tpresent {hub['snapshot']}" in listed
    assert "other:hub\thub acme/never-pulled\tmissing (`lmsp models pull other:hub`)" in listed
