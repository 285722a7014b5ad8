"""A Hugging Face hub cache laid out by hand, as `huggingface_hub` leaves it after a download
(blobs named by content hash, a snapshot folder of symlinks per commit, a ref naming the commit): the
repo-id code path runs for real with HF_HUB_OFFLINE=1 and nothing downloaded (tests reach no hub)."""

import hashlib
import os
from pathlib import Path

DEFAULT_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"


def lay_out_snapshot(folder: Path, hf_home: Path, repo_id: str = DEFAULT_REPO, ref: str = "main",
                     files: list[str] | None = None) -> tuple[str, Path]:
    """``folder``'s files as ``repo_id`` at a made-up commit under ``hf_home``; (commit, snapshot dir).
    Blobs are hard links where the file system allows (no copy of the weights)."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    names = files if files is not None else sorted(p.name for p in folder.iterdir()
                                                    if p.is_file() and not p.name.startswith("."))
    commit = hashlib.sha1("\n".join(names).encode() + repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name in names:
        source = folder / name
        blob = repo / "blobs" / hashlib.sha256(f"{source.resolve()}:{source.stat().st_size}".encode()).hexdigest()
        if not blob.exists():
            try:
                os.link(source, blob)
            except OSError:
                blob.write_bytes(source.read_bytes())
        link = snapshot / name
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return commit, snapshot
