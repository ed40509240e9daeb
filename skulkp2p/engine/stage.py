"""One stage of a pipeline ring: a contiguous slice of an mlx-lm model's layers.

A ring member holds layers [start, end) of L. The first stage also holds the embedding; the last
stage holds the final norm, the output head (lm_head, or the embedding when tied) and the
drafter. Everything else is replaced by nothing *before* the weights are evaluated (the model is
loaded lazily), so the memory a stage uses is its share, not the whole model.

Running a slice reuses the family's own body (`model.model`): its `layers` list is replaced by
the slice, the indices it uses to pick a cache for building masks (`fa_idx`, `ssm_idx`,
`swa_idx`) are re-pointed into the slice, a non-first stage feeds hidden rows in through
`input_embeddings`, and a non-last stage's final norm is an identity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from skulkp2p.engine.trunk import Trunk, _Identity

MASK_INDEX_ATTRS = ("fa_idx", "ssm_idx", "swa_idx")


@dataclass(frozen=True)
class StageSpan:
    start: int
    end: int
    total: int  # layers in the whole model

    @property
    def first(self) -> bool:
        return self.start == 0

    @property
    def last(self) -> bool:
        return self.end == self.total

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end <= self.total:
            raise ValueError(f"bad layer range [{self.start}, {self.end}) of {self.total}")


class _NoEmbedding(nn.Module):
    """Stands in for a dropped embedding: a stage past the first is fed hidden rows."""

    def __call__(self, x: mx.array) -> mx.array:
        raise RuntimeError("this stage holds no embedding")


def _kind(layer: Any) -> tuple[Any, ...]:
    return (getattr(layer, "is_linear", None), getattr(layer, "use_sliding", None))


def slice_model(model: nn.Module, span: StageSpan, keep_embedding: bool = False) -> nn.Module:
    """Cut `model` down to the layers of `span` in place (before its weights are evaluated, so
    the dropped ones are never read). `keep_embedding` keeps the embedding on a non-first stage
    (the last stage of a tied model, or one whose MTP head embeds its draft tokens)."""
    trunk = Trunk(model)
    body = trunk.body
    layers = list(body.layers)
    if len(layers) != span.total:
        raise ValueError(f"model has {len(layers)} layers, span says {span.total}")
    kept = layers[span.start:span.end]
    for attr in MASK_INDEX_ATTRS:
        idx = getattr(body, attr, None)
        if idx is None:
            continue
        want = _kind(layers[idx])
        body.__setattr__(attr, next((i for i, layer in enumerate(kept) if _kind(layer) == want),
                                    None))
    body.layers = kept
    if not span.first and not (keep_embedding or (span.last and trunk.tied)):
        body.embed_tokens = _NoEmbedding()
    if not span.last:
        body.norm = _Identity()
        if hasattr(trunk.text, "lm_head"):
            trunk.text.lm_head = _Identity()
    return model


def drop_layers(model: nn.Module) -> nn.Module:
    """Keep no layer (before the weights are read): embedding, final norm and head only."""
    Trunk(model).body.layers = []
    return model


def param_bytes(module: nn.Module) -> int:
    """Bytes of parameters this module holds (what a stage actually keeps in memory)."""
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


class StageModel:
    """Runs one stage's slice: tokens (first stage) or hidden rows in, hidden rows or, on the
    last stage, logits out. `hidden` ('after'/'before' the final norm) keeps the last stage's
    trunk rows for an MTP drafter, as LocalForward does."""

    def __init__(self, model: nn.Module, span: StageSpan):
        self.model = model
        self.span = span
        self.trunk = Trunk(model)

    def run(self, x: mx.array | list[int], cache: list[Any], *, logits: bool = True,
            hidden: str | None = None) -> tuple[mx.array | None, mx.array | None]:
        """(output rows [w, H] or logits [w, V] on the last stage, trunk rows for a drafter)."""
        if self.span.first:
            inputs, emb = mx.array(x)[None], None
        else:
            inputs, emb = None, x[None]
        if not self.span.last:
            return self.trunk.body(inputs, cache, input_embeddings=emb)[0], None
        out, h = self.run_rows(inputs, cache, logits=logits, hidden=hidden, embeddings=emb)
        return (None if out is None else out[0]), (None if h is None else h[0])

    def run_rows(self, inputs: mx.array | None, cache: list[Any], *, logits: bool = True,
                 hidden: str | None = None, embeddings: mx.array | None = None
                 ) -> tuple[mx.array | None, mx.array | None]:
        """The last stage on a batch: token rows [B, W] (or hidden rows [B, W, H]) in; logits
        [B, W, V] and the trunk rows [B, W, H] a drafter reads out. One request is B = 1."""
        body = self.trunk.body
        emb = embeddings
        if hidden == "before":
            norm = body.norm
            body.norm = _Identity()
            try:
                h = body(inputs, cache, input_embeddings=emb)
            finally:
                body.norm = norm
            normed = norm(h)
        else:
            h = normed = body(inputs, cache, input_embeddings=emb)
        out = self.trunk.head(normed) if logits else None
        return out, (h if hidden else None)
