"""The parts of an mlx-lm causal LM that drafters need: body, final norm, and output head.

mlx-lm models compute `head(norm(layers(embed(x))))` inside one `__call__`. An MTP head needs the
trunk's hidden state, after or before the final norm depending on the model; computing
`head(norm(h))` ourselves from the same tensors gives the same logits the model's own call gives.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

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
