"""One stage of a pipeline ring: a contiguous slice of an mlx-lm model's layers.

A ring member holds layers [start, end) of L. The first stage also holds the embedding; the last
stage holds the final norm, the output head (lm_head, or the embedding when tied) and the
drafter. Everything else is replaced by nothing *before* the weights are evaluated (the model is
loaded lazily), so the memory a stage uses is its share, not the whole model.

Running a slice reuses the family's own body (`model.model`): its `layers` list is replaced by
the slice, the indices it uses to pick a cache for building masks (`fa_idx`, `ssm_idx`,
`swa_idx`) are re-pointed into the slice, a non-first stage feeds hidden rows in through
`input_embeddings`, and a non-last stage's final norm is an identity.

Gemma 4 (`gemma4_text`) needs two more things (`_Gemma4Slice`): its KV-shared layers read the K/V
that a cache-owning layer computed in the same call, so a stage boundary may never fall between
them (placement keeps that tail on the last stage: `placement.tail_start_of`); and its per-layer
inputs are computed from the token ids and the embedding, which only the first stage has, so
the first stage computes them for every layer and they travel beside the hidden rows (one row
each: hidden | per-layer inputs of the layers still ahead, flattened).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import mlx.core as mx
import mlx.nn as nn

from skulkp2p.engine.model.arrays import leaves
from skulkp2p.engine.model.packed import PackedRows, packed_attention, packed_mlps
from skulkp2p.engine.model.swapped import swapped
from skulkp2p.engine.model.tree import (
    KVLayer,
    TreeInputs,
    TreeView,
    tree_inputs,
    tree_ropes,
    validate_parents,
)
from skulkp2p.engine.model.trunk import Trunk, _Identity, hidden_layers, run_recording

if TYPE_CHECKING:
    from mlx_lm.models.cache import KVCache, RotatingKVCache

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


def _kind(layer: object) -> tuple[object, ...]:
    return (getattr(layer, "is_linear", None), getattr(layer, "use_sliding", None))


class _Gemma4Slice:
    """What a Gemma 4 slice needs to run: its layers' KV-sharing re-pointed into the slice, the
    caches of its owning layers only, and per-layer inputs computed (first stage) or carried."""

    def __init__(self, body: nn.Module, span: StageSpan):
        owners = span.total - int(body.config.num_kv_shared_layers or 0)
        sources = [i for j, i in enumerate(body.previous_kvs) if j != i]
        cut = [i for j, i in enumerate(body.previous_kvs)
               if span.start <= j < span.end and not span.start <= i < span.end]
        if cut:
            raise ValueError(f"layers [{span.start}, {span.end}) hold KV-shared layers whose "
                             f"source layer {cut[0]} is on another stage: a Gemma 4 stage "
                             f"boundary must not fall after layer {min(sources)}")
        self.span = span
        self.owners_here = max(0, min(span.end, owners) - span.start)
        self.per_layer = int(body.hidden_size_per_layer_input or 0)
        self.args = body.config
        body.previous_kvs = [i - span.start for i in body.previous_kvs[span.start:span.end]]

    def make_cache(self) -> list[KVCache | RotatingKVCache]:
        from mlx_lm.models.cache import KVCache, RotatingKVCache
        types = self.args.layer_types[self.span.start:self.span.start + self.owners_here]
        return [KVCache() if t == "full_attention" else
                RotatingKVCache(max_size=self.args.sliding_window, keep=0) for t in types]


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
    if getattr(body, "previous_kvs", None) is not None and hasattr(body, "_make_masks"):
        gemma = _Gemma4Slice(body, span)
        # Read by StageModel; the instance attribute is what make_prompt_cache calls.
        body.stage_slice = gemma
        model.make_cache = gemma.make_cache
        if not span.first and gemma.per_layer:
            # Only the first stage computes per-layer inputs: the largest table of the small
            # Gemma 4 models (vocab x layers x 256) stays there.
            for name in ("embed_tokens_per_layer", "per_layer_model_projection",
                         "per_layer_projection_norm"):
                setattr(body, name, None)
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
    return sum(v.nbytes for v in leaves(module.parameters()))


def _rows_in(x: mx.array | list[int]) -> mx.array:
    """What a stage past the first is sent: hidden rows (only the first is sent tokens)."""
    if not isinstance(x, mx.array):
        raise TypeError("a stage past the first is sent hidden rows, not tokens")
    return x


def _kv(cache: Sequence[object]) -> Sequence[KVLayer]:
    """The caches of a tree forward: plain KV caches, which a model that verifies trees holds
    in every layer (tree.tree_capable), or a batch's rows of them."""
    return cast("Sequence[KVLayer]", cache)


class StageModel:
    """Runs one stage's slice: tokens (first stage) or hidden rows in, hidden rows or, on the
    last stage, logits out. `hidden` ('after'/'before' the final norm) keeps the last stage's
    trunk rows for an MTP drafter, as LocalForward does."""

    def __init__(self, model: nn.Module, span: StageSpan):
        self.model = model
        self.span = span
        self.trunk = Trunk(model)

    def run(self, x: mx.array | list[int], cache: Sequence[object], *, logits: bool = True,
            hidden: str | None = None, tree: list[int] | None = None
            ) -> tuple[mx.array | None, mx.array | None]:
        """(output rows [w, H] or logits [w, V] on the last stage, trunk rows for a drafter).
        `tree`: the parents of the w tokens (engine/model/tree.py; -1 first), verified as one tree."""
        gemma = getattr(self.trunk.body, "stage_slice", None)
        if gemma is not None:
            if tree is not None:
                raise ValueError("a Gemma 4 stage verifies chains only")
            return self._run_gemma4(gemma, x, cache, logits=logits, hidden=hidden)
        if self.span.first:
            inputs, emb = mx.array(x)[None], None
        else:
            inputs, emb = None, _rows_in(x)[None]
        shape = None
        if tree is not None:
            validate_parents(tree)
            shape = tree_inputs([int(_kv(cache)[0].offset)], [tree], len(tree))
        if not self.span.last:
            if shape is None:
                return self.trunk.body(inputs, cache, input_embeddings=emb)[0], None
            with tree_ropes(self.trunk.body.layers, shape.positions):
                views = [TreeView(c, shape.mask) for c in _kv(cache)]
                return self.trunk.body(inputs, views, input_embeddings=emb)[0], None
        out, h = self.run_rows(inputs, cache, logits=logits, hidden=hidden, embeddings=emb,
                               tree=shape)
        return (None if out is None else out[0]), (None if h is None else h[0])

    def run_batch(self, x: mx.array, cache: Sequence[object], tree: TreeInputs | None = None
                  ) -> mx.array:
        """A stage that is not the last on a batch (engine/parallel/ring/batch_rows.py): token rows [B, W]
        (first stage) or hidden rows [B, W, H] in, hidden rows [B, W, H] out. `tree`: some
        rows are token trees (engine/model/tree.py): the rows' mask and positions."""
        if tree is not None:
            with tree_ropes(self.trunk.body.layers, tree.positions):
                return self.run_batch(x, [TreeView(c, tree.mask) for c in _kv(cache)])
        if self.span.last:
            raise ValueError("the last stage runs its batch with run_rows")
        if getattr(self.trunk.body, "stage_slice", None) is not None:
            raise ValueError("Gemma 4 stages are not batched (sliding-window layers)")
        if self.span.first:
            return self.trunk.body(x, cache)
        return self.trunk.body(None, cache, input_embeddings=x)

    def _run_gemma4(self, gemma: _Gemma4Slice, x: mx.array | list[int], cache: Sequence[object], *,
                    logits: bool, hidden: str | None) -> tuple[mx.array | None, mx.array | None]:
        """A Gemma 4 slice. Per-layer inputs (where the model has them): the first stage
        computes them as the model's own call does (from the token ids and the scaled
        embedding); a later stage takes the hidden rows and its layers' inputs from the row it
        was sent, and feeds the hidden rows in unscaled (the model scales `input_embeddings` as
        if they were token embeddings)."""
        body = self.trunk.body
        here = self.span.end - self.span.start
        per_layer = None
        if self.span.first:
            inputs, emb = mx.array(x)[None], None
            if gemma.per_layer:
                scaled = body.embed_tokens(inputs) * body.embed_scale
                per_layer = body._project_per_layer_inputs(
                    scaled, body._get_per_layer_inputs(inputs, None))
        else:
            size = self.trunk.text.args.hidden_size
            rows = _rows_in(x)
            inputs, emb = None, rows[None, :, :size]
            if gemma.per_layer:
                per_layer = rows[None, :, size:].reshape(1, rows.shape[0], -1, gemma.per_layer)
        saved = body.hidden_size_per_layer_input, body.embed_scale
        body.hidden_size_per_layer_input = 0  # the inputs are given: use them as they are
        if not self.span.first:
            body.embed_scale = 1.0
        try:
            mine = None if per_layer is None else per_layer[:, :, :here, :]
            if not self.span.last:
                h = body(inputs, cache, input_embeddings=emb, per_layer_inputs=mine)[0]
                if per_layer is None:
                    return h, None
                ahead = per_layer[0, :, here:, :].reshape(h.shape[0], -1)
                return mx.concatenate([h, ahead.astype(h.dtype)], axis=-1), None
            out, h = self.run_rows(inputs, cache, logits=logits, hidden=hidden,
                                   embeddings=emb, per_layer_inputs=mine)
        finally:
            body.hidden_size_per_layer_input, body.embed_scale = saved
        return (None if out is None else out[0]), (None if h is None else h[0])

    def run_rows(self, inputs: mx.array | None, cache: Sequence[object], *, logits: bool = True,
                 hidden: str | None = None, embeddings: mx.array | None = None,
                 per_layer_inputs: mx.array | None = None, tree: TreeInputs | None = None,
                 packed: PackedRows | None = None
                 ) -> tuple[mx.array | None, mx.array | None]:
        """The last stage on a batch: token rows [B, W] (or hidden rows [B, W, H]) in; logits
        [B, W, V] and the trunk rows [B, W, H] a drafter reads out. One request is B = 1.
        `tree`: the rows are token trees (engine/model/tree.py): their mask and positions.
        `packed`: the rows are ragged; the layers' MLPs and the head run on their real tokens
        only (engine/model/packed.py), and the logits come back packed, [N, V] (`packed.row`)."""
        if tree is not None:
            with tree_ropes(self.trunk.body.layers, tree.positions):
                return self.run_rows(inputs, [TreeView(c, tree.mask) for c in _kv(cache)],
                                     logits=logits, hidden=hidden, embeddings=embeddings,
                                     per_layer_inputs=per_layer_inputs, packed=packed)
        if packed is not None and packed.attention:
            with packed_attention(self.trunk.body.layers, packed):
                return self.run_rows(inputs, cache, logits=logits, hidden=hidden,
                                     embeddings=embeddings, per_layer_inputs=per_layer_inputs,
                                     packed=dataclasses.replace(packed, attention=False))
        if packed is not None and packed.mlps:
            with packed_mlps(self.trunk.body.layers, packed):
                out, h = self._run_rows(inputs, cache, logits=logits, hidden=hidden,
                                        embeddings=embeddings, per_layer_inputs=per_layer_inputs,
                                        packed=packed)
            return out, h
        return self._run_rows(inputs, cache, logits=logits, hidden=hidden, embeddings=embeddings,
                              per_layer_inputs=per_layer_inputs, packed=packed)

    def _run_rows(self, inputs: mx.array | None, cache: Sequence[object], *, logits: bool,
                  hidden: str | None, embeddings: mx.array | None,
                  per_layer_inputs: mx.array | None, packed: PackedRows | None
                  ) -> tuple[mx.array | None, mx.array | None]:
        body = self.trunk.body
        picked = hidden_layers(hidden)
        if picked is not None:
            # An eagle3 head reads the outputs of a few layers (trunk.run_recording).
            return run_recording(body, picked, lambda: self._run_rows(
                inputs, cache, logits=logits, hidden=None, embeddings=embeddings,
                per_layer_inputs=per_layer_inputs, packed=packed)[0], self.span.start)
        emb = embeddings
        extra = {} if per_layer_inputs is None else {"per_layer_inputs": per_layer_inputs}
        if hidden == "before" or (packed is not None and logits):
            # (packed: the final norm too runs on the real tokens only, before the head)
            norm = body.norm
            with swapped([body], "norm", lambda _: _Identity()):
                h = body(inputs, cache, input_embeddings=emb, **extra)
            normed = norm(h if packed is None else packed.gather_heads(h))
            if hidden != "before":
                h = None if not hidden else norm(h)
        else:
            h = normed = body(inputs, cache, input_embeddings=emb, **extra)
        out = self.trunk.head(normed) if logits else None
        return out, (h if hidden else None)
