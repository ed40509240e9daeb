"""A random EAGLE-style drafting head for a tiny model (tests/test_eagle.py,
tests/test_head_trees.py)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from skulkp2p.engine.decode.loop import DecodeStats, decode
from skulkp2p.engine.decode.sampling import SamplingParams, make_rng
from skulkp2p.engine.drafting.mtp_drafter import MtpDrafter
from skulkp2p.engine.model.forward import LocalForward
from skulkp2p.engine.model.loaded import LoadedModel, load_model
from skulkp2p.engine.model.trunk import Trunk
from skulkp2p.training import head_init


def make_eagle_sidecar(base: Path, out: Path, vocab_ids: np.ndarray, seed: int = 0,
                       kind: str = "eagle") -> Path:
    """A random EAGLE-style head for the model at `base`: the training tool's starting tensors
    (`kind`'s naming: eagle, or eagle3 with a random fusion of three layers) with noise on
    every float tensor, so no part is the identity or zero."""
    lm = load_model(base, "base", dtype="float32")
    hidden = int(Trunk(lm.model).body.norm.weight.shape[0])
    rng = np.random.default_rng(seed)
    fc = (rng.standard_normal((hidden, 2 * hidden)) / np.sqrt(2 * hidden)).astype(np.float32)
    fuse = (rng.standard_normal((hidden, 3 * hidden)) / np.sqrt(3 * hidden)).astype(np.float32) \
        if kind == "eagle3" else None
    tensors = head_init.initial_tensors(lm.model, fc, vocab_ids, kind, fuse)
    noisy = {}
    for k, v in tensors.items():
        if v.dtype == mx.int32:
            noisy[k] = v
            continue
        noise = rng.standard_normal(v.shape).astype(np.float32) * 0.05
        noisy[k] = (v.astype(mx.float32) + mx.array(noise)).astype(mx.bfloat16)
    mx.save_safetensors(str(out), noisy)
    return out


TEXT = "The river was high after the rain. It carried branches, leaves and once a gate"


def decode_after_text(lm: LoadedModel, head=None, depth: int = 0,
                      stats: DecodeStats | None = None) -> list[int]:
    """Greedy tokens after TEXT, with the head drafting at `depth` (plain without a head)."""
    fwd = LocalForward(lm.model, hidden=head.conventions.hidden if head else None)
    drafter = MtpDrafter(head) if head else None
    return list(decode(fwd, lm.tokenizer.encode(TEXT), SamplingParams(), 24, make_rng(0),
                       drafter, depth, stats))
