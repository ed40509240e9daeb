"""The engine factory: which engine serves a model is decided here, once, from its card.

`join`, `pipe` and `bench` all open models through `open_engine`, so a GGUF card whose card says
`engine = "llama_server"` runs on its llama-server child everywhere (it is never converted and
run on MLX behind the user's back), and every other model runs on the MLX engine.
"""

from __future__ import annotations

from typing import Any

from skulkp2p.engine.protocol import DEFAULT_PREFIX_CACHE_MB, Engine


def uses_llama_server(store: Any, spec: str) -> bool:
    from skulkp2p.served.model import wants_served

    return wants_served(store.resolve(spec).card)


def open_engine(store: Any, spec: str, prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB,
                draft_memory_tokens: int | None = None) -> Engine:
    """Load `spec` (a card id or a local path) on the engine its card names. Blocking: call it
    off the event loop (importing mlx-lm alone takes seconds). `prefix_cache_mb`: the MLX
    engine's prefix cache for the model (0: off); llama-server keeps its own prompt cache.
    `draft_memory_tokens`: the MLX engine's draft memory of earlier requests (0 = off; None:
    the card's, else the default)."""
    if uses_llama_server(store, spec):
        from skulkp2p.served.model import open_served

        return open_served(store, spec)
    from skulkp2p.engine.loader import open_model
    from skulkp2p.engine.mlx_engine import MlxEngine

    return MlxEngine(open_model(store, spec), prefix_cache_mb,
                     memory_tokens=draft_memory_tokens)
