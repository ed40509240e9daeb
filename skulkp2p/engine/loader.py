"""From a model name to a loaded model: resolve the card, pull it if needed, pick the dtype."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

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
    speculation = dict(card.speculation) if card else {}
    sidecar = None
    if speculation.get("mtp_sidecar"):
        sidecar = Path(speculation["mtp_sidecar"])
        if not sidecar.is_absolute() and card.file is not None:
            sidecar = card.file.parent / sidecar  # relative to the card, e.g. a file in the project
    loaded = load_model(path, resolved.id,
                        context_length=card.context_length if card and card.family else None,
                        dtype=dtype, runtime=card.runtime if card else None,
                        speculation=speculation, sidecar=sidecar)
    if speculation.get("draft_model"):
        loaded.draft = open_model(store, speculation["draft_model"], dtype)
        from skulkp2p.engine.draft_model import check_compatible
        check_compatible(loaded.tokenizer, loaded.draft.tokenizer,
                         _vocab_size(loaded), _vocab_size(loaded.draft))
    from skulkp2p.bench import load_width_costs  # written by `bench --widths` on this machine
    loaded.width_costs = load_width_costs(resolved.id, dtype, store.data_dir)
    if loaded.width_costs:
        log.info("verify width costs for %s (%s) measured here: %s", resolved.id, dtype,
                 ", ".join(f"w{w}={c:.2f}" for w, c in sorted(loaded.width_costs.items())[:8]))
    return loaded


def _vocab_size(loaded: LoadedModel) -> int:
    from skulkp2p.engine.trunk import Trunk
    return int(Trunk(loaded.model).embed_tokens.weight.shape[0])
