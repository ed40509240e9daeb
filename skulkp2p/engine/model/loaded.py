"""A model in memory: its trunk loaded with mlx-lm's classes (MTP tensors stripped), cast to the
serving dtype, optionally cut to one ring stage's layers, with its MTP head beside it."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from skulkp2p.engine.cpu import switch
from skulkp2p.engine.json_types import JSONValue
from skulkp2p.engine.model.arrays import leaves, materialize
from skulkp2p.engine.model.stage import StageSpan, slice_model
from skulkp2p.engine.model.trunk import Trunk, hidden_layers
from skulkp2p.engine.protocol import VerifyCosts

log = logging.getLogger("skulkp2p.engine")

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


@dataclass
class LoadedModel:
    id: str
    path: Path
    model: nn.Module
    tokenizer: Any
    context_length: int
    dtype: str
    runtime: dict[str, Any] = field(default_factory=dict)
    speculation: dict[str, Any] = field(default_factory=dict)  # the card's [speculation]
    chat: dict[str, Any] = field(default_factory=dict)  # the card's [chat] (tool_parser)
    # Measured verify costs, when bench has run; a tensor group's live table (call_costs.py)
    width_costs: Mapping[int, float] | None = None
    # The seconds behind width_costs when measured where the model runs (a tensor group's)
    verify_costs: VerifyCosts | None = None
    mtp: Any = None  # a loaded MTP head, when the model has one
    draft: LoadedModel | None = None  # a draft model, when the card names one
    assistant: Any = None  # a Gemma 4 assistant drafter (engine/drafting/assistant.py), when the card pairs one
    span: StageSpan | None = None  # the layers held here, when this node is one ring stage
    # (request, hidden, interrupt) -> a Forward; set on the last stage of a ring (RingForward)
    make_forward: Callable[..., Any] | None = None
    # Every layer's cache of the WHOLE model trims exactly (no recurrent state, no rotating
    # window); a ring stage, which holds only some layers, learns it at load time.
    caches_trim: bool = True
    # Parameters of the whole model when only part of it is held here (a tensor-parallel
    # group's loop member holds no layers): what a drafter's cost is relative to.
    whole_params: int | None = None


def is_mtp_key(key: str, num_layers: int | None) -> bool:
    """MTP head tensors in any of the namings real checkpoints use (Qwen `mtp.*`, MiMo
    `model.mtp_layers.*`, DeepSeek's extra layer past num_hidden_layers), and the trained
    EAGLE-style heads' `eagle.*`."""
    return (key.startswith(("mtp.", "eagle.")) or ".mtp." in key
            or key.startswith("model.mtp_layers.")
            or (num_layers is not None and key.startswith(f"model.layers.{num_layers}.")))


def _trunk_classes(config: dict[str, Any]) -> tuple[type[nn.Module], type]:
    """mlx-lm's classes for the family, with MTP tensors stripped before its strict load (some
    families' sanitize keeps them and the load then refuses them). The drafter loads them itself."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    n_layers = config.get("num_hidden_layers") or config.get("text_config", {}).get(
        "num_hidden_layers")

    def sanitize(self: nn.Module, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = {k: v for k, v in weights.items() if not is_mtp_key(k, n_layers)}
        parent = getattr(super(trunk, self), "sanitize", None)
        return parent(weights) if parent else weights

    # A subclass of the family's class chosen at run time (named as it, defined here)
    trunk: type[nn.Module] = type(model_class.__name__, (model_class,), {"sanitize": sanitize})
    return trunk, args_class


def load_model(path: Path, model_id: str, context_length: int | None = None,
               dtype: str = "bfloat16", runtime: Mapping[str, JSONValue] | None = None,
               speculation: Mapping[str, JSONValue] | None = None,
               sidecar: Path | None = None, span: StageSpan | None = None,
               head_only: bool = False) -> LoadedModel:
    """Load the trunk with mlx-lm's classes (MTP tensors stripped), cast it to `dtype`, and load
    its MTP head beside it when the checkpoint or a sidecar has one.

    With `span`, only that stage's layers are kept (see stage.py): the model is loaded lazily and
    cut before anything is evaluated; only the last stage loads the MTP head. `head_only`
    keeps no layer at all, only the embedding, final norm, head and drafter: the member of a
    tensor-parallel group that runs the decode loop (engine/parallel/tensor/group.py)."""
    from mlx_lm.utils import load_model as mlx_load_model
    from mlx_lm.utils import load_tokenizer

    from skulkp2p.engine.model.mtp_conventions import CONVENTION_FIELDS, has_mtp_tensors
    from skulkp2p.engine.model.mtp_head import load_mtp_head

    if head_only:
        from skulkp2p.engine.model.stage import drop_layers
        span = None
    model, config = mlx_load_model(Path(path), lazy=span is not None or head_only,
                                   get_model_classes=_trunk_classes)
    from mlx_lm.models.cache import make_prompt_cache

    from skulkp2p.engine.cache.caches import exactly_trimmable
    caches_trim = exactly_trimmable(make_prompt_cache(model))  # cache objects only, no weights
    whole_params = None
    if span is not None or head_only:
        # A drafter's cost is weighed against a step of the whole model, not of the layers
        # held here (a ring's last stage, a tensor group's loop member): counted before slicing.
        whole_params = sum(v.size for v in leaves(model.parameters()))  # shapes only
    if span is not None:
        # The last stage runs the drafter: an MTP head embeds its draft tokens, the Gemma 4
        # assistant the target's embedding of its own.
        keep = span.last and (has_mtp_tensors(Path(path), config, sidecar)
                              or (speculation or {}).get("drafter") == "assistant")
        slice_model(model, span, keep_embedding=keep)
    template = None
    if head_only:  # one unevaluated layer stays aside: an MTP head copies its class
        template = list(Trunk(model).body.layers)[:1]
        drop_layers(model)
    tokenizer = load_tokenizer(Path(path), eos_token_ids=config.get("eos_token_id"))
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    model.set_dtype(DTYPES[dtype])
    materialize(model)
    ctx = context_length or config.get("max_position_embeddings") or config.get(
        "text_config", {}).get("max_position_embeddings") or 4096
    speculation = dict(speculation or {})
    overrides = {k: v for k, v in speculation.items() if k in CONVENTION_FIELDS}
    if template:
        Trunk(model).body.layers = template
    try:
        head = None if span is not None and not span.last else load_mtp_head(
            Path(path), model, config, overrides=overrides, sidecar=sidecar)
    finally:
        if template:
            drop_layers(model)
    picked = hidden_layers(head.conventions.hidden) if head is not None else None
    if picked is not None and (head_only or (span is not None and min(picked) < span.start)):
        # A head that reads several depths of the trunk needs them all where it runs: a ring's
        # last stage or a tensor group holds only some (or slices of each).
        log.warning("%s: MTP head reads layers %s, not all held here: no head drafting",
                    model_id, picked)
        head = None
    if head is not None:
        log.info("%s: MTP head loaded (%s style, hidden %s the final norm, depth up to %d)",
                 model_id, head.conventions.style, head.conventions.hidden,
                 head.conventions.max_depth)
    # The CPU switch's model pieces, where install() ran and the model is float32 on the CPU
    switch.apply(model, dtype)
    return LoadedModel(model_id, Path(path), model, tokenizer, int(ctx), dtype,
                       dict(runtime or {}), speculation, mtp=head, span=span,
                       caches_trim=caches_trim, whole_params=whole_params)
