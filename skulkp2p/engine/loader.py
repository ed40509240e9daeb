"""From a model name to a loaded model: resolve the card, pull it if needed, pick the dtype."""

from __future__ import annotations

import logging
import os
import sys

from skulkp2p.engine.generate import LoadedModel, load_model
from skulkp2p.models.store import ModelStore
from skulkp2p.progress import ProgressBar

log = logging.getLogger("skulkp2p.loader")


def serving_dtype() -> str:
    """float32 where a fast BLAS is active on a Linux CPU node, else the weights' bfloat16."""
    if env := os.environ.get("SKULKP2P_DTYPE"):
        return env
    try:
        from skulkp2p.engine import blas
    except ImportError:
        return "bfloat16"
    return blas.fast_path_report()["dtype"]


def open_model(store: ModelStore, spec: str, dtype: str | None = None) -> LoadedModel:
    resolved = store.resolve(spec)
    path = store.pull(spec, progress=lambda label: ProgressBar(label, sys.stderr))
    card = resolved.card
    dtype = dtype or serving_dtype()
    log.info("loading %s from %s (%s)", resolved.id, path, dtype)
    loaded = load_model(path, resolved.id,
                        context_length=card.context_length if card and card.family else None,
                        dtype=dtype, runtime=card.runtime if card else None)
    if card is not None:
        loaded.speculation = dict(card.speculation)
    from skulkp2p.bench import load_width_costs  # written by `bench --widths` on this machine
    loaded.width_costs = load_width_costs(resolved.id, dtype, store.data_dir)
    if loaded.width_costs:
        log.info("verify width costs for %s (%s) measured here: %s", resolved.id, dtype,
                 ", ".join(f"w{w}={c:.2f}" for w, c in sorted(loaded.width_costs.items())[:8]))
    return loaded
