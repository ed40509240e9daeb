"""The engine factory: which engine serves a model is decided here, once, from its card.

`join`, `pipe` and `bench` all open models through `open_engine`, so a GGUF card whose card says
`engine = "llama_server"` runs on its llama-server child everywhere (it is never converted and
run on MLX behind the user's back), and every other model runs on the MLX engine. A GGUF
repository named by its Hugging Face id runs on llama-server where this node has one
(`serves_gguf`, which the CLI gives the model store), else it is converted for MLX.

A model with both forms (an MLX card whose `[placement] gguf_card` names its GGUF card) runs on
the node's faster engine (`choose_engine`): llama-server where this node has a binary that runs
here and no Metal (Linux: CPU, CUDA, ...), MLX on Apple Silicon; `--engine mlx|llama-server`
overrides. The choice travels in the node's want (the GGUF card's size and slots for placement).

`max_batch` (how many requests an engine generates at once: `--max-batch`, else the card's
`[runtime] max_batch`, else the engine's default) is threaded through here to both engines.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from skulkp2p.engine.protocol import DEFAULT_PREFIX_CACHE_MB, Engine, PrefixDiskSettings

if TYPE_CHECKING:
    from skulkp2p.engine.model.loaded import LoadedModel
    from skulkp2p.models.store import ModelStore

log = logging.getLogger("skulkp2p.node")

ENGINE_CHOICES = ("auto", "mlx", "llama-server")  # `join --engine`, `pipe --engine`
MAX_BATCH_LIMIT = 256  # a bound on `--max-batch`: past it a typo, not a setting
PREFIX_CACHE_DIR = "prefix-cache"  # under the node's data dir: the prefix cache's entries on disk


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


def serves_gguf() -> bool:
    """Whether this node runs GGUF repositories (named by their Hugging Face id) on a
    llama-server child: when it has one (skulkp2p[served] or SKULKP2P_LLAMA_SERVER_BIN); else
    the store converts them for MLX. A card's own `[placement] engine` still decides for it."""
    from skulkp2p.served.binary import working_binary  # no mlx

    return working_binary() is not None


@dataclass(frozen=True)
class EngineChoice:
    """Which form of a model this node runs, and why (the log and /v1/models say it)."""
    engine: str  # "mlx" | "llama_server"
    load: str  # what the engine factory opens: the model as given, or its GGUF card's id
    reason: str


def choose_engine(store: ModelStore, model: str, wanted: str = "auto") -> EngineChoice:
    """The engine `model` runs on here. `wanted`: "auto" (the faster one this node can run),
    "mlx" or "llama-server" (ENGINE_CHOICES). Only a card with a `gguf_card` has a choice;
    any other model runs on the engine its card names, and asking for another is an error
    (ValueError) only where it cannot be honoured at all."""
    from skulkp2p.served.binary import INSTALL_HINT, working_binary  # no mlx
    from skulkp2p.served.child_config import wants_served

    if wanted not in ENGINE_CHOICES:
        raise ValueError(f"--engine must be one of {', '.join(ENGINE_CHOICES)}, got {wanted!r}")
    card = store.resolve(model, fetch=True).card
    if wants_served(card):
        if wanted == "mlx":
            raise ValueError(f"model {model} is a llama-server card (its GGUF is not converted "
                             "for MLX); use its MLX card, or --engine auto")
        return EngineChoice("llama_server", model, "its card's engine")
    gguf = card.placement.get("gguf_card") if card is not None else None
    if not gguf:
        if wanted == "llama-server":
            raise ValueError(f"model {model} has no GGUF form (its card names no "
                             "placement.gguf_card); use --engine auto or mlx")
        return EngineChoice("mlx", model, "its only engine here")
    if wanted == "mlx":
        return EngineChoice("mlx", model, "--engine mlx")
    if wanted == "llama-server":
        if working_binary() is None:
            raise ValueError("--engine llama-server: this node has no llama-server that runs "
                             f"here; run `{INSTALL_HINT}`")
        return EngineChoice("llama_server", gguf, f"--engine llama-server (GGUF form {gguf})")
    if sys.platform == "darwin":
        return EngineChoice("mlx", model, "auto: MLX on Metal is the faster engine on a Mac")
    if working_binary() is None:
        return EngineChoice("mlx", model, "auto: no llama-server that runs on this node "
                                          f"(`{INSTALL_HINT}` builds one)")
    return EngineChoice("llama_server", gguf, f"auto: llama-server runs here and this node has "
                                              f"no Metal (GGUF form {gguf})")


def uses_llama_server(store: ModelStore, spec: str) -> bool:
    from skulkp2p.served.child_config import wants_served

    return wants_served(store.resolve(spec, fetch=True).card)


def open_engine(store: ModelStore, spec: str, prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB,
                draft_memory_tokens: int | None = None, max_batch: int | None = None,
                engine: str | None = None,
                prefix_disk: PrefixDiskSettings | None = None) -> Engine:
    """Load `spec` (a card id, a local path or a Hugging Face repository id) on the engine its
    card names. Blocking: call it off the event loop (importing mlx-lm alone takes seconds).
    `prefix_cache_mb`: the MLX engine's prefix cache for the model (0: off); llama-server keeps
    its own prompt cache. `draft_memory_tokens`: the MLX engine's draft memory of earlier
    requests (0 = off; None: the card's, else the default). `max_batch`: requests generated at once (None: the card's
    `[runtime] max_batch`, else the engine's default). `engine`: choose between the model's
    forms (ENGINE_CHOICES, see choose_engine); None: the form `spec` names (what placement
    gave). `prefix_disk`: where the MLX engine keeps its prefix cache's entries on disk too
    (None: memory only)."""
    check_max_batch(max_batch)
    if engine is not None:
        choice = choose_engine(store, spec, engine)
        log.info("engine: %s serves %s (%s)", _ENGINE_NAMES[choice.engine], spec, choice.reason)
        spec = choice.load
    if uses_llama_server(store, spec):
        from skulkp2p.served.served_engine import open_served

        return open_served(store, spec, max_batch=max_batch)
    from skulkp2p.engine.runner.loader import open_model

    return mlx_engine(open_model(store, spec), prefix_cache_mb,
                      memory_tokens=draft_memory_tokens, max_batch=max_batch,
                      prefix_disk=prefix_disk)


_ENGINE_NAMES = {"mlx": "MLX", "llama_server": "llama-server"}


def mlx_engine(loaded: LoadedModel, prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB, *,
               memory_tokens: int | None = None, max_batch: int | None = None,
               prefix_disk: PrefixDiskSettings | None = None) -> Engine:
    """An MlxEngine over `loaded` (a whole model, or a ring's last stage)."""
    from skulkp2p.engine.runner.mlx_engine import MlxEngine

    return MlxEngine(loaded, prefix_cache_mb, memory_tokens=memory_tokens, max_batch=max_batch,
                     prefix_disk=prefix_disk)


def prefix_disk_settings(data_dir: Path, gb: float) -> PrefixDiskSettings | None:
    """The prefix cache's entries on disk under the node's data dir (`--prefix-cache-disk-gb`,
    0: off)."""
    if gb <= 0:
        return None
    return PrefixDiskSettings(Path(data_dir) / PREFIX_CACHE_DIR, int(gb * 1e9))
