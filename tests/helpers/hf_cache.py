"""A Hugging Face hub cache laid out exactly as huggingface_hub lays it, from local files:
`models--OWNER--NAME/blobs/<etag>`, `snapshots/<commit>/<path>` symlinks into blobs/ (relative,
as the hub writes them), `refs/<branch or tag>` holding the commit. No network: the tests run
with HF_HUB_OFFLINE=1 and HF_HOME / HF_HUB_CACHE pointing at the cache built here."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import pytest

# Files the hub stores with Git LFS (etag: sha256 of the content); the rest are plain git
# blobs (etag: the git blob sha1), as on huggingface.co.
_LFS = (".safetensors", ".gguf", ".bin")


def _etag(name: str, path: Path) -> str:
    data_hash = hashlib.sha256() if name.endswith(_LFS) else hashlib.sha1()
    if not name.endswith(_LFS):
        data_hash.update(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            data_hash.update(chunk)
    return data_hash.hexdigest()


def commit_of(repo: str, tag: str) -> str:
    """A stable 40-hex commit id for a repository's version `tag`."""
    return hashlib.sha1(f"{repo}@{tag}".encode()).hexdigest()


def add_repo(cache: Path, repo: str, files: Mapping[str, Path | bytes | str],
             refs: tuple[str, ...] = ("main",), commit: str | None = None) -> Path:
    """Put `files` (path in the repository -> a local file to take, or its content) into the
    cache as one commit of `repo`, pointed at by `refs`; the snapshot folder. A big local file
    is hard-linked into blobs/ where the filesystem allows (else copied)."""
    commit = commit or commit_of(repo, refs[0] if refs else "x")
    root = Path(cache) / f"models--{repo.replace('/', '--')}"
    blobs = root / "blobs"
    snapshot = root / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        if isinstance(content, Path):
            source = content
        else:
            source = blobs / ".staging"
            source.write_bytes(content.encode() if isinstance(content, str) else content)
        blob = blobs / _etag(name, source)
        if not blob.exists():
            if source.parent == blobs:
                os.replace(source, blob)
            else:
                try:
                    os.link(source, blob)
                except OSError:
                    shutil.copyfile(source, blob)
        elif source.parent == blobs:
            source.unlink()
        entry = snapshot / name
        entry.parent.mkdir(parents=True, exist_ok=True)
        if entry.is_symlink() or entry.exists():
            entry.unlink()
        entry.symlink_to(os.path.relpath(blob, entry.parent))
    (root / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (root / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (root / "refs" / ref).write_text(commit)  # no newline, as the hub writes it
    return snapshot


def model_files(folder: Path) -> dict[str, Path]:
    """Every file of a model folder, by its name (what a repository of it would hold)."""
    return {p.name: p for p in sorted(Path(folder).iterdir()) if p.is_file()}


def use_cache(monkeypatch: pytest.MonkeyPatch, home: Path) -> Path:
    """Point huggingface_hub at HOME/hub, offline, in this process and in the processes it
    starts (the environment), also where huggingface_hub was imported before; the cache."""
    from huggingface_hub import constants

    cache = Path(home) / "hub"
    cache.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache
