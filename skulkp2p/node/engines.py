"""The engine factory: which engine serves a model is decided here, once, from its card.

`join`, `pipe` and `bench` all open models through `open_engine`, so a GGUF card whose card says
`engine = "llama_server"` runs on its llama-server child everywhere (it is never converted and
run on MLX behind the user's back), and every other model runs on the MLX engine.

`max_batch` (how many requests an engine generates at once: `--max-batch`, else the card's
`[runtime] max_batch`, else the engine's default) is threaded through here to both engines.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from skulkp2p.engine.protocol import DEFAULT_PREFIX_CACHE_MB, Engine

if TYPE_CHECKING:
    from skulkp2p.engine.model.loaded import LoadedModel
    from skulkp2p.models.store import ModelStore

log = logging.getLogger("skulkp2p.node")

MAX_BATCH_LIMIT = 256  # a bound on `--max-batch`: past it a typo, not a setting


class MaxBatchError(ValueError):
    """A `--max-batch` value no engine can run."""


def check_max_batch(value: int | None) -> int | None:
    """`value` if it is a usable `--max-batch` (None: not given); raise MaxBatchError if not."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_BATCH_LIMIT:
        raise MaxBatchError(f"--max-batch must be a whole number from 1 to {MAX_BATCH_LIMIT}, "
                            f"got {value!r}")
    return value


def uses_llama_server(store: ModelStore, spec: str) -> bool:
    from skulkp2p.served.child_config import wants_served

    return wants_served(store.resolve(spec).card)


def open_engine(store: ModelStore, spec: str, prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB,
                draft_memory_tokens: int | None = None, max_batch: int | None = None) -> Engine:
    """Load `spec` (a card id or a local path) on the engine its card names. Blocking: call it
    off the event loop (importing mlx-lm alone takes seconds). `prefix_cache_mb`: the MLX
    engine's prefix cache for the model (0: off); llama-server keeps its own prompt cache.
    `draft_memory_tokens`: the MLX engine's draft memory of earlier requests (0 = off; None:
    the card's, else the default). `max_batch`: requests generated at once (None: the card's
    `[runtime] max_batch`, else the engine's default)."""
    check_max_batch(max_batch)
    if uses_llama_server(store, spec):
        from skulkp2p.served.served_engine import open_served

        return open_served(store, spec, max_batch=max_batch)
    from skulkp2p.engine.runner.loader import open_model

    return mlx_engine(open_model(store, spec), prefix_cache_mb,
                      memory_tokens=draft_memory_tokens, max_batch=max_batch)


def mlx_engine(loaded: LoadedModel, prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB, *,
               memory_tokens: int | None = None, max_batch: int | None = None) -> Engine:
    """An MlxEngine over `loaded` (a whole model, or a ring's last stage)."""
    from skulkp2p.engine.runner.mlx_engine import MlxEngine

    return MlxEngine(loaded, prefix_cache_mb, memory_tokens=memory_tokens, max_batch=max_batch)
