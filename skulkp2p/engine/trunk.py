"""The parts of an mlx-lm causal LM that drafters need: body, final norm, and output head.

mlx-lm models compute `head(norm(layers(embed(x))))` inside one `__call__`. An MTP head needs the
trunk's hidden state, after or before the final norm depending on the model; computing
`head(norm(h))` ourselves from the same tensors gives the same logits the model's own call gives.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn


class _Identity(nn.Module):
    def __call__(self, x: mx.array) -> mx.array:
        return x


class Trunk:
    def __init__(self, model: nn.Module):
        self.model = model
        self.text = getattr(model, "language_model", model)  # multimodal wrappers (qwen3_5)
        self.body = self.text.model
        args = getattr(self.text, "args", None)
        self.tied = bool(getattr(args, "tie_word_embeddings", False)) or not hasattr(
            self.text, "lm_head")

    @property
    def embed_tokens(self) -> nn.Module:
        return self.body.embed_tokens

    def head(self, h: mx.array) -> mx.array:
        if self.tied:
            return self.body.embed_tokens.as_linear(h)
        return self.text.lm_head(h)

    def norm(self, h: mx.array) -> mx.array:
        return self.body.norm(h)

    def hidden_before_norm(self, inputs: mx.array, cache: list[Any]) -> mx.array:
        """The last layer's output, before the final norm (the norm is bypassed for this call)."""
        norm = self.body.norm
        self.body.norm = _Identity()
        try:
            return self.body(inputs, cache)
        finally:
            self.body.norm = norm
