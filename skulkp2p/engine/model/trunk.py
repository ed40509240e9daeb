"""The parts of an mlx-lm causal LM that drafters need: body, final norm, and output head.

mlx-lm models compute `head(norm(layers(embed(x))))` inside one `__call__`. An MTP head needs the
trunk's hidden state, after or before the final norm depending on the model; computing
`head(norm(h))` ourselves from the same tensors gives the same logits the model's own call gives.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

import mlx.core as mx
import mlx.nn as nn

from skulkp2p.engine.model.swapped import swapped


class _Identity(nn.Module):
    def __call__(self, x: mx.array) -> mx.array:
        return x


def _softcap(cap: float, x: mx.array) -> mx.array:
    return mx.tanh(x / cap) * cap


class Trunk:
    def __init__(self, model: nn.Module):
        self.model = model
        # multimodal wrappers (qwen3_5)
        self.text: nn.Module = model.language_model if hasattr(model, "language_model") \
            else model
        self.body: nn.Module = self.text.model
        args = getattr(self.text, "args", None)
        self.tied = bool(getattr(args, "tie_word_embeddings", False)) or not hasattr(
            self.text, "lm_head")
        # Gemma 2/3/4 cap their logits (tanh(x / c) * c) after the head, inside __call__: the
        # family's own (compiled) function where it has one, so the rows are bit for bit its own.
        self.softcap = getattr(self.text, "final_logit_softcapping", None)
        module = sys.modules.get(type(self.text).__module__)
        self._cap = getattr(module, "logit_softcap", None) or _softcap

    @property
    def embed_tokens(self) -> nn.Module:
        return self.body.embed_tokens

    def head(self, h: mx.array) -> mx.array:
        out = self.body.embed_tokens.as_linear(h) if self.tied else self.text.lm_head(h)
        if self.softcap:
            out = self._cap(self.softcap, out)
        return out

    def norm(self, h: mx.array) -> mx.array:
        return self.body.norm(h)

    def hidden_before_norm(self, inputs: mx.array, cache: Sequence[object]) -> mx.array:
        """The last layer's output, before the final norm (the norm is bypassed for this call)."""
        with swapped([self.body], "norm", lambda _: _Identity()):
            return self.body(inputs, cache)


# A forward's `hidden` for heads that read several depths of the trunk (EAGLE-3-class heads,
# style "eagle3"): "layers:2,15,29" keeps the outputs of those layers (the residual stream after
# each), concatenated per row [w, 3H]. Recording them costs a concatenation: the layers run anyway.
LAYERS_PREFIX = "layers:"
_T = TypeVar("_T")


def hidden_layers(kind: str | None) -> tuple[int, ...] | None:
    """The layer indices a `hidden` of the form "layers:i,j,k" names, or None for any other."""
    if not kind or not kind.startswith(LAYERS_PREFIX):
        return None
    try:
        picked = tuple(int(i) for i in kind[len(LAYERS_PREFIX):].split(","))
    except ValueError:
        raise ValueError(f"hidden {kind!r} must name layers as 'layers:i,j,k'") from None
    if not picked or min(picked) < 0:
        raise ValueError(f"hidden {kind!r} must name layers as 'layers:i,j,k'")
    return picked


def layers_hidden(picked: Sequence[int]) -> str:
    """The `hidden` that keeps the outputs of layers `picked` (hidden_layers' inverse)."""
    return LAYERS_PREFIX + ",".join(str(int(i)) for i in picked)


def check_hidden(kind: str | None) -> None:
    """Refuse a forward's `hidden` that is none of None, "after", "before", "layers:i,j,k"."""
    if kind in (None, "after", "before") or hidden_layers(kind) is not None:
        return
    raise ValueError(f"hidden must be 'after', 'before' or 'layers:i,j,k', got {kind!r}")


class _Recording:
    """Stands in for one decoder layer for one call: runs it and keeps its output."""

    def __init__(self, layer: nn.Module, into: dict[int, mx.array], index: int):
        self.layer, self.into, self.index = layer, into, index

    def __call__(self, *args: object, **kwargs: object) -> object:
        out = self.layer(*args, **kwargs)
        self.into[self.index] = out if isinstance(out, mx.array) else out[0]
        return out

    def __getattr__(self, name: str) -> object:
        return getattr(self.layer, name)


def run_recording(body: nn.Module, picked: Sequence[int], run: Callable[[], _T],
                  first: int = 0) -> tuple[_T, mx.array]:
    """`run()` (a forward of `body`) with the outputs of layers `picked` kept: (its result, the
    kept rows concatenated on the last axis, [..., len(picked) * H]). `first`: the global index
    of body.layers[0] (a stage's slice); every picked layer must be in the slice."""
    kept: dict[int, mx.array] = {}
    layers = list(body.layers)
    local = [i - first for i in picked]
    if any(not 0 <= i < len(layers) for i in local):
        raise ValueError(f"a head reading layers {tuple(picked)} needs them on this stage "
                         f"(layers {first}-{first + len(layers) - 1})")
    wrapped = [_Recording(layer, kept, i) if i in local else layer
               for i, layer in enumerate(layers)]
    with swapped([body], "layers", lambda _: wrapped):
        out = run()
    return out, mx.concatenate([kept[i] for i in local], axis=-1)
