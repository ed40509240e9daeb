"""The data a head learns from: the model's own answers, generated in equal-length batches in
float32 through our own trunk (so the features are what serving computes), each saved as a shard
(.npz) with, per position, the hidden state after the final norm and the trunk's top-k logits.
Measured on a 2-core CPU, this batched generation with features ran at 275 tok/s at batch 64,
against llama-server's 251 tok/s with 32 slots on the Q4_1 GGUF, which would still need a
feature pass (docs/measurements/mtp-sidecars.md).
"""

from __future__ import annotations

import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from skulkp2p.engine.model.trunk import Trunk, run_recording

TOP_K = 8  # teacher distribution kept per position


def generate_shard(model: nn.Module, prompts: list[list[int]], gen_tokens: int,
                   eos: set[int], deadline: float | None = None,
                   temperature: float = 0.0, layers: tuple[int, ...] | None = None
                   ) -> dict[str, np.ndarray]:
    """Continuations of equal-length prompts, batched, float32: greedy, or sampled at
    `temperature` (more varied text; the targets stay the trunk's top-k at every position,
    which is what the verifier decides by). Returns, per sample and position: tokens, the hidden
    state after the final norm, the trunk's top-k logits; `ends` is the first EOS position (or
    the length). Past `deadline` (time.monotonic) the answers are cut short: a batch takes
    minutes on a busy CPU and must not overrun the budget. `layers`: also keep those layers'
    outputs per position, concatenated ("layers", what an EAGLE-3-class head reads)."""
    trunk = Trunk(model)
    cache = make_prompt_cache(model)
    batch, plen = len(prompts), len(prompts[0])
    hidden, top_ids, top_vals, tokens = [], [], [], [mx.array(prompts, dtype=mx.int32)]
    kept: list[np.ndarray] = []

    def step(x: mx.array) -> mx.array:
        if layers:
            h, deep = run_recording(trunk.body, layers, lambda: trunk.body(x, cache))
        else:
            h, deep = trunk.body(x, cache), None
        logits = trunk.head(h).astype(mx.float32)
        ids = mx.argpartition(-logits, TOP_K - 1, axis=-1)[..., :TOP_K]
        vals = mx.take_along_axis(logits, ids, -1)
        order = mx.argsort(-vals, axis=-1)  # top-1 first: it is the greedy token
        ids, vals = mx.take_along_axis(ids, order, -1), mx.take_along_axis(vals, order, -1)
        mx.eval(h, ids, vals, *([] if deep is None else [deep]))
        if deep is not None:
            kept.append(np.array(deep.astype(mx.float16)))
        hidden.append(np.array(h.astype(mx.float16)))
        top_ids.append(np.array(ids.astype(mx.int32)))
        top_vals.append(np.array(vals.astype(mx.float16)))
        if temperature > 0:
            return mx.random.categorical(logits[:, -1] / temperature)[:, None].astype(mx.int32)
        return ids[:, -1:, 0]

    nxt = step(tokens[0])
    for i in range(gen_tokens):
        tokens.append(nxt)
        nxt = step(nxt)  # the last step gives the final token's hidden state and targets too
        if i % 16 == 15:
            seen = np.concatenate([np.array(t) for t in tokens[1:]], axis=1)
            if all(any(int(x) in eos for x in row) for row in seen):
                break
            if deadline is not None and time.monotonic() > deadline:
                break
    toks = np.concatenate([np.array(t) for t in tokens], axis=1).astype(np.int32)
    ends = np.full(batch, toks.shape[1], np.int32)
    for b in range(batch):
        hits = [j for j in range(plen, toks.shape[1]) if int(toks[b, j]) in eos]
        if hits:
            ends[b] = hits[0]
    extra = {"layers": np.concatenate(kept, axis=1),
             "layer_ids": np.array(layers, np.int32)} if layers else {}
    return {**extra, "tokens": toks, "hidden": np.concatenate(hidden, axis=1),
            "top_ids": np.concatenate(top_ids, axis=1),
            "top_vals": np.concatenate(top_vals, axis=1),
            "prompt_len": np.array(plen, np.int32), "ends": ends,
            "temperature": np.array(temperature, np.float32)}


def save_shard(path: Path, shard: dict[str, np.ndarray]) -> None:
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **shard)
    tmp.replace(path)


def load_shards(work: Path, kind: str) -> list[dict[str, np.ndarray]]:
    return [dict(np.load(p)) for p in sorted(work.glob(f"{kind}-*.npz"))]


def temperatures(shards: list[dict[str, np.ndarray]], default: float) -> str:
    """The sampling temperatures the shards were generated at (a resumed generation may use
    another one), e.g. "0.6 and 0.8"; shards that do not record theirs count as `default`."""
    temps = sorted({float(s["temperature"]) if "temperature" in s else default
                    for s in shards} - {0.0})
    return " and ".join(f"{t:g}" for t in temps) or f"{default:g}"
