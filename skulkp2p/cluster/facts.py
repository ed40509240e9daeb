"""Facts a node announces to the cluster beyond its configuration: the memory it offers, and a
model's placement facts (layers, size, KV shape) read from its card or its config.json."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from skulkp2p.cluster.placement import ModelSpec, tail_start_of

if TYPE_CHECKING:
    from skulkp2p.models.store import ModelStore


def available_memory() -> int:
    """Bytes this machine could give a model now (Linux: MemAvailable; else physical)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def offered_memory(limit: int | None) -> int:
    avail = available_memory()
    if limit is None:
        return avail
    return min(limit, avail) if avail else limit


def model_spec(store: ModelStore, model: str) -> ModelSpec:
    """Placement facts for a card id or a local mlx folder (read from its config.json)."""
    resolved = store.resolve(model)
    if resolved.path is None:
        card = resolved.card
        assert card is not None, "a resolved model has a card or a folder"
        spec = ModelSpec.from_card(card)
        if card.source.kind == "local":  # e.g. a .gguf file: loaded by its path
            spec = dataclasses.replace(spec, source=str(Path(model).expanduser().resolve())
                                       if Path(model).expanduser().exists() else spec.source)
        return spec
    path = Path(resolved.path)
    cfg = json.loads((path / "config.json").read_text())
    cfg = {**cfg, **cfg.get("text_config", {})}
    heads = int(cfg.get("num_attention_heads") or 1)
    hidden = int(cfg.get("hidden_size") or 0)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors")) or 1
    return ModelSpec(resolved.id, int(cfg.get("num_hidden_layers") or 1), size,
                     int(cfg.get("max_position_embeddings") or 4096), hidden,
                     int(cfg.get("num_key_value_heads") or heads),
                     int(cfg.get("head_dim") or (hidden // heads if hidden else 0)),
                     source=str(path), tail_start=tail_start_of(cfg))
