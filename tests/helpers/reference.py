"""What the tests compare our decoding against: mlx-lm's own greedy generation."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm import stream_generate

from skulkp2p.engine.cpu import table_rope


def mlx_lm_tokens(lm, prompt: list[int], max_tokens: int) -> list[int]:
    """mlx-lm's greedy tokens for `prompt` on a loaded model, up to EOS (excluded)."""
    out = []
    with table_rope.stock():  # mlx-lm as it ships, not the engine's rope table
        for resp in stream_generate(lm.model, lm.tokenizer, mx.array(prompt),
                                    max_tokens=max_tokens):
            if resp.finish_reason == "stop" and resp.token in lm.tokenizer.eos_token_ids:
                break
            out.append(resp.token)
    return out
