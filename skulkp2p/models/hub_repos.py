"""Hugging Face repositories through huggingface_hub only: its cache and its environment
(HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE, its token sources), listings, downloads of only the files
a model loads (resumable, with the hub's own tqdm bars), and its cache scan and deletion.

Nothing here re-implements the cache: a snapshot is found with `snapshot_download`
(`local_files_only` when offline or when a name must not trigger a download), listed from its
folder, and removed through `scan_cache_dir(...).delete_revisions(...)`. What is added is the check
that a snapshot holds every file its model loads (a shard listed in
model.safetensors.index.json, an interrupted `.incomplete` blob), so a partial download never
loads.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skulkp2p.models.repo_ids import RepoRef

# What mlx-lm's own loader fetches of a model repository (mlx_lm.utils.DEFAULT_ALLOW_PATTERNS):
# the weights, configs, tokenizer files and chat templates; never other formats' weights.
MLX_PATTERNS = ["*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken",
                "tiktoken.model", "*.txt", "*.jsonl", "*.jinja"]
# The small files a card is inferred from, fetched before (and without) the weights.
METADATA_FILES = ("config.json", "tokenizer_config.json", "chat_template.jinja",
                  "chat_template.json", "generation_config.json", "model.safetensors.index.json")
INDEX = "model.safetensors.index.json"
# llama.cpp's name for a GGUF split into parts: the first part is what a loader is given.
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<part>\d{5})-of-(?P<total>\d{5})\.gguf$", re.IGNORECASE)
# llama.cpp's own default quantisation for `-hf owner/repo` without one.
DEFAULT_QUANT = "Q4_K_M"


class RepoUnavailable(Exception):
    """A repository that cannot be used: missing, gated, offline and not cached, incomplete, or
    without files a model loads. The message is one line and says which and why."""


def offline() -> bool:
    """HF_HUB_OFFLINE, as huggingface_hub reads it (or as set after it was imported)."""
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE", "").strip().lower()
    return bool(constants.HF_HUB_OFFLINE) or env in ("1", "true", "yes", "on")


def cache_dir() -> Path:
    """The hub cache huggingface_hub uses (HF_HUB_CACHE, else HF_HOME/hub, else its default)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _one_line(text: object, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _unavailable(ref: RepoRef, error: BaseException, local_only: bool) -> RepoUnavailable:
    """The hub's error as one clear line."""
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo = ref.repo
    if isinstance(error, GatedRepoError):
        return RepoUnavailable(
            f"Hugging Face repository {repo} is gated: accept its conditions on "
            f"https://huggingface.co/{repo} and log in (`hf auth login`, or HF_TOKEN)")
    if isinstance(error, RepositoryNotFoundError):
        return RepoUnavailable(
            f"Hugging Face repository {repo} does not exist, or is private (log in with "
            "`hf auth login`, or set HF_TOKEN)")
    if isinstance(error, RevisionNotFoundError):
        return RepoUnavailable(f"Hugging Face repository {repo} has no revision "
                               f"{ref.revision!r}")
    if isinstance(error, LocalEntryNotFoundError):
        where = f"the local Hugging Face cache ({cache_dir()})"
        if offline():
            why = "HF_HUB_OFFLINE is set"
        elif local_only:
            why = "only the cache was looked at"
        else:
            why = "the hub cannot be reached"
        rev = f" at revision {ref.revision}" if ref.revision else ""
        detail = str(error)
        if "incomplete" in detail.lower():
            return RepoUnavailable(f"Hugging Face repository {repo}{rev}: the cached download "
                                   f"is incomplete and {why}: {_one_line(detail)}")
        return RepoUnavailable(f"Hugging Face repository {repo}{rev} is not in {where} and "
                               f"{why}")
    return RepoUnavailable(f"Hugging Face repository {repo}: {type(error).__name__}: "
                           f"{_one_line(error)}")


@dataclass(frozen=True)
class RepoListing:
    """A repository's files at one commit: from the hub (`online`) or from the local snapshot."""

    ref: RepoRef
    commit: str | None
    files: dict[str, int | None]  # path in the repository -> size in bytes (None: unknown)
    folder: Path | None  # the local snapshot folder, when one is cached
    online: bool

    @property
    def ggufs(self) -> list[str]:
        """The GGUF files a model is (multimodal projectors aside)."""
        return sorted(f for f in self.files if f.lower().endswith(".gguf")
                      and "mmproj" not in f.rsplit("/", 1)[-1].lower())

    @property
    def layout(self) -> str:
        """"mlx" (config.json and safetensors weights: mlx-lm's layouts, quantised ones
        included, and plain checkpoints it loads), "gguf", or "" (neither)."""
        if self.ref.selector:
            return "gguf"
        weights = INDEX in self.files or any(f.endswith(".safetensors") for f in self.files)
        if "config.json" in self.files and (weights or not self.ggufs):
            return "mlx"
        return "gguf" if self.ggufs else ""

    def size_of(self, files: Iterable[str]) -> int | None:
        sizes = [self.files.get(f) for f in files]
        return None if any(s is None for s in sizes) else sum(s or 0 for s in sizes)

    def local(self, file: str) -> Path | None:
        """The file in the local snapshot, if it is there whole (a snapshot entry whose blob
        is missing is not)."""
        if self.folder is None:
            return None
        path = self.folder / file
        return path if path.is_file() else None


def _snapshot_files(folder: Path) -> dict[str, int | None]:
    out: dict[str, int | None] = {}
    for path in sorted(folder.rglob("*")):
        if path.is_dir():
            continue
        rel = path.relative_to(folder).as_posix()
        try:
            out[rel] = path.stat().st_size
        except OSError:  # a snapshot entry whose blob is missing
            out[rel] = None
    return out


def local_snapshot(ref: RepoRef, revision: str | None = None) -> Path:
    """The cached snapshot folder of `ref` (huggingface_hub's lookup of refs/ and snapshots/);
    LocalEntryNotFoundError when there is none."""
    from huggingface_hub import snapshot_download

    # allow_patterns=[]: only the folder is asked for; completeness is checked per model later.
    return Path(snapshot_download(ref.repo, revision=revision or ref.revision,
                                  local_files_only=True, allow_patterns=[]))


def list_repo(ref: RepoRef, fetch: bool) -> RepoListing:
    """The repository's files: asked of the hub when `fetch` (and not offline), else (or when the
    hub cannot be reached) the cached snapshot's. A missing, gated or uncached repository raises
    RepoUnavailable."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    network_error: BaseException | None = None
    hub_error: BaseException | None = None
    if fetch and not offline():
        from huggingface_hub import HfApi
        from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

        try:
            info = HfApi().model_info(ref.repo, revision=ref.revision, files_metadata=True)
        except (RepositoryNotFoundError, RevisionNotFoundError) as e:  # gated ones included
            hub_error = e  # a copy cached earlier still serves, as snapshot_download has it
        except Exception as e:  # no connection, a timeout, the hub down: the cache may do
            network_error = e
        else:
            files = {s.rfilename: s.size for s in info.siblings or ()}
            folder = None
            if info.sha:
                try:
                    folder = local_snapshot(ref, info.sha)
                except LocalEntryNotFoundError:
                    folder = None
            return RepoListing(ref, info.sha, files, folder, online=True)
    try:
        folder = local_snapshot(ref)
    except LocalEntryNotFoundError as e:
        if hub_error is not None:
            raise _unavailable(ref, hub_error, False) from None
        if network_error is not None:
            raise RepoUnavailable(
                f"Hugging Face repository {ref.repo} is not in the local Hugging Face cache "
                f"({cache_dir()}) and the hub cannot be reached: "
                f"{type(network_error).__name__}: {_one_line(network_error, 200)}") from None
        raise _unavailable(ref, e, not fetch) from None
    except Exception as e:  # a malformed name the hub's validators refuse, a broken cache
        raise _unavailable(ref, e, not fetch) from None
    return RepoListing(ref, folder.name, _snapshot_files(folder), folder, online=False)


def download(listing: RepoListing, patterns: list[str]) -> Path:
    """The snapshot with the files matching `patterns`, downloaded when missing (resumable,
    with the hub's own progress bars); only the cache when offline or the listing came from
    it. The commit the listing saw is what is downloaded."""
    from huggingface_hub import snapshot_download

    local_only = offline() or not listing.online
    revision = listing.commit if listing.online and listing.commit else listing.ref.revision
    try:
        return Path(snapshot_download(listing.ref.repo, revision=revision,
                                      allow_patterns=patterns, local_files_only=local_only))
    except KeyboardInterrupt:
        raise
    except Exception as e:
        raise _unavailable(listing.ref, e, local_only) from None


# --- which GGUF ---------------------------------------------------------------------------


def _quant_pattern(quant: str) -> re.Pattern[str]:
    # Q4_K matches "x-Q4_K.gguf" but not "x-Q4_K_M.gguf"; Q4_K_M not "x-IQ4_K_M.gguf".
    return re.compile(rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9]|_[A-Za-z0-9])",
                      re.IGNORECASE)


def _groups(files: list[str]) -> dict[str, list[str]]:
    """GGUF files grouped into models: a split model's parts together, in order."""
    groups: dict[str, list[str]] = {}
    for f in sorted(files):
        m = _SPLIT.match(f)
        groups.setdefault(m.group("stem") if m else f, []).append(f)
    return groups


def select_gguf(listing: RepoListing) -> list[str]:
    """The GGUF file (or the parts of a split one, first part first) the name selects: its
    `:file.gguf`, its `:QUANT`, else the only one, else Q4_K_M (llama.cpp's default)."""
    ref = listing.ref
    ggufs = listing.ggufs
    where = f"Hugging Face repository {ref.repo}" + (f"@{ref.revision}" if ref.revision else "")
    if not listing.online:
        where += " (as cached here)"
    if not ggufs:
        raise RepoUnavailable(f"{where} has no GGUF files (nor config.json with safetensors "
                              "weights)")
    groups = _groups(ggufs)
    sel = ref.selector
    if sel and ref.selects_file:
        chosen = [g for g in groups.values()
                  if any(f == sel or f.rsplit("/", 1)[-1] == sel for f in g)]
        what = f"file {sel!r}"
    else:
        quant = sel or DEFAULT_QUANT
        pattern = _quant_pattern(quant)
        chosen = [g for g in groups.values() if pattern.search(g[0].rsplit("/", 1)[-1])]
        what = f"quantisation {quant!r}"
        if not sel and len(groups) == 1:
            chosen = list(groups.values())
    names = ", ".join(g[0] for g in groups.values())
    if not chosen:
        hint = "name one as OWNER/REPO:QUANT or OWNER/REPO:FILE.gguf"
        if not sel:
            raise RepoUnavailable(f"{where} has several GGUF files and no {DEFAULT_QUANT}: "
                                  f"{hint} (it has: {_one_line(names, 200)})")
        raise RepoUnavailable(f"{where} has no GGUF file of {what} (it has: "
                              f"{_one_line(names, 200)})")
    if len(chosen) > 1:
        raise RepoUnavailable(f"{where}: {what} matches several GGUF files "
                              f"({_one_line(', '.join(g[0] for g in chosen), 200)}); name one "
                              "as OWNER/REPO:FILE.gguf")
    return chosen[0]


# --- is a snapshot whole ------------------------------------------------------------------


def _safetensors_end(path: Path) -> int:
    """Where a safetensors file's data ends by its header: its whole size."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    return 8 + n + max(ends, default=0)


def _interrupted(folder: Path) -> list[Path]:
    """The repository's `.incomplete` blobs (downloads the hub started and did not finish)."""
    blobs = folder.parent.parent / "blobs"
    return sorted(blobs.glob("*.incomplete")) if blobs.is_dir() else []


def check_complete(ref: RepoRef, folder: Path, needed: Iterable[str]) -> None:
    """Raise RepoUnavailable unless every file in `needed` is in the snapshot, whole."""
    missing = []
    for name in needed:
        path = folder / name
        if not path.is_file():
            missing.append(name)
        elif name.endswith(".safetensors"):
            try:
                if path.stat().st_size < _safetensors_end(path):
                    missing.append(f"{name} (truncated)")
            except (OSError, ValueError, KeyError, struct.error):
                missing.append(f"{name} (unreadable)")
    if not missing:
        return
    sample = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3
                                        else "")
    partial = _interrupted(folder)
    interrupted = (f"; {len(partial)} interrupted download(s) in "
                   f"{partial[0].parent} (*.incomplete)" if partial else "")
    how = ("HF_HUB_OFFLINE is set: pull it once online" if offline()
           else f"run `python -m skulkp2p models pull {ref.id}` to finish it")
    raise RepoUnavailable(f"Hugging Face repository {ref.id}: the download in {folder} is "
                          f"incomplete, it lacks {sample}{interrupted}; {how}")


def mlx_needed(folder: Path) -> list[str]:
    """The files an MLX-layout snapshot must hold to load: config.json and every weights file
    (each shard model.safetensors.index.json lists, else the model*.safetensors present)."""
    needed = ["config.json"]
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            needed += sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            needed.append(f"{INDEX} (unreadable)")
    else:
        weights = sorted(p.relative_to(folder).as_posix()
                         for p in folder.glob("model*.safetensors"))
        needed += weights or ["model.safetensors"]
    return needed


# --- what the weights are, without reading them -------------------------------------------

_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2,
                "BF16": 2, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1,
                "F8_E5M2": 1, "F8_E8M0": 1}


def _header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header: dict[str, Any] = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def weight_facts(listing: RepoListing, folder: Path) -> tuple[list[str] | None, int | None]:
    """(tensor names, bytes of tensor data) of an MLX-layout repository, from
    model.safetensors.index.json, else the local files' headers, else (online) the hub's
    safetensors metadata (headers read by range requests): never the weights themselves."""
    names: list[str] | None = None
    total: int | None = None
    index = folder / INDEX
    if index.is_file():
        try:
            doc = json.loads(index.read_text(encoding="utf-8"))
            names = list(doc.get("weight_map", {}))
            size = (doc.get("metadata") or {}).get("total_size")
            total = int(size) if size is not None else None
        except (OSError, ValueError, TypeError, AttributeError):
            names, total = None, None
    weights = sorted(f for f in listing.files if f.endswith(".safetensors") and "/" not in f)
    local = [folder / f for f in weights if (folder / f).is_file()]
    if weights and len(local) == len(weights) and (names is None or total is None):
        try:
            headers = [_header(p) for p in local]
            names = [k for h in headers for k in h]
            total = sum(v["data_offsets"][1] - v["data_offsets"][0]
                        for h in headers for v in h.values())
        except (OSError, ValueError, KeyError, TypeError, struct.error):
            pass
    if (names is None or total is None) and listing.online and weights:
        try:
            from huggingface_hub import HfApi

            meta = HfApi().get_safetensors_metadata(listing.ref.repo,
                                                    revision=listing.commit)
            tensors = [t for fm in meta.files_metadata.values() for t in fm.tensors.items()]
            names = names if names is not None else [n for n, _ in tensors]
            if total is None:
                total = sum(t.data_offsets[1] - t.data_offsets[0] for _, t in tensors)
        except Exception:  # the hub's metadata is a nicety: the file sizes stand in
            pass
    if total is None:
        total = listing.size_of(weights) if weights else None
    return names, total


def read_prefix(listing: RepoListing, file: str, n: int) -> bytes:
    """The first `n` bytes of a repository file: from the cache, else by a range request
    (huggingface_hub's HfFileSystem)."""
    local = listing.local(file)
    if local is not None:
        with open(local, "rb") as f:
            return f.read(n)
    if not listing.online:
        raise RepoUnavailable(f"Hugging Face repository {listing.ref.repo}: {file} is not in the "
                              "local cache")
    from huggingface_hub import HfFileSystem

    try:
        with HfFileSystem().open(f"{listing.ref.repo}/{file}", "rb",
                                 revision=listing.commit) as f:
            data = f.read(n)
            return bytes(data) if data is not None else b""
    except Exception as e:
        raise _unavailable(listing.ref, e, False) from None


# --- the cache as `models list` and `models rm` see it --------------------------------------


@dataclass(frozen=True)
class CachedRepo:
    repo: str
    path: Path
    size_bytes: int
    revisions: tuple[tuple[str, tuple[str, ...]], ...]  # (commit, refs pointing at it)
    incomplete_bytes: int  # interrupted downloads in its blobs/


def cached_repos() -> list[CachedRepo]:
    """The model repositories in the hub cache (huggingface_hub's scan_cache_dir)."""
    from huggingface_hub import scan_cache_dir

    try:
        info = scan_cache_dir(cache_dir())
    except Exception:  # no cache yet (CacheNotFound), or not a folder
        return []
    incomplete: dict[Path, int] = {}
    for part in getattr(info, "incomplete_files", ()):  # huggingface_hub 1.x lists these
        repo_path = part.file_path.parent.parent
        incomplete[repo_path] = incomplete.get(repo_path, 0) + part.size_on_disk
    out = []
    for repo in info.repos:
        if repo.repo_type != "model":
            continue
        revisions = tuple(sorted((r.commit_hash, tuple(sorted(r.refs))) for r in repo.revisions))
        out.append(CachedRepo(repo.repo_id, Path(repo.repo_path), repo.size_on_disk, revisions,
                              incomplete.get(Path(repo.repo_path), 0)))
    return sorted(out, key=lambda r: r.repo)


def delete_cached(ref: RepoRef) -> int | None:
    """Delete the repository's cached revisions (the one `ref` names, else all) through
    huggingface_hub's cache deletion; the bytes freed (None: it was not cached)."""
    from huggingface_hub import scan_cache_dir

    try:
        info = scan_cache_dir(cache_dir())
    except Exception:  # no cache yet (CacheNotFound), or not a folder
        return None
    commits = [r.commit_hash for repo in info.repos
               if repo.repo_type == "model" and repo.repo_id == ref.repo
               for r in repo.revisions
               if ref.revision is None or ref.revision == r.commit_hash
               or ref.revision in r.refs]
    if not commits:
        return None
    strategy = info.delete_revisions(*commits)
    freed = int(strategy.expected_freed_size)
    strategy.execute()
    return freed
