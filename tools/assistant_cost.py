"""Measure a Gemma 4 assistant round's drafting cost beside one plain target step.

    python tools/assistant_cost.py [--target DIR --assistant DIR] [--deep] [--depth 3] [--reps 200]

Without folders it builds the tiny gemma4_text target and its two tiny assistants
(tools/tiny_gemma4.py) in a temporary folder; `--deep` makes that target shaped like the
published ones beside the same 4-layer assistant (30 layers of width 256, the last 10 KV-shared:
the assistant a small part of the target, as on E2B/E4B, instead of 4 layers beside 6). For each assistant it times, interleaved, the
median of: one plain step of the target (one token through every layer),
one draft round (`propose` of `depth` tokens: depth assistant passes over the live cache) and a
verify of depth + 1 tokens (rolled back to its first token, as a round whose drafts were all
rejected); the context grows as in decoding, past the sliding window. It prints JSON with the
times and their ratios to the plain step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np


def _median_ms(samples: list[float]) -> float:
    return round(1000 * statistics.median(samples), 4)


def measure(target: Path, assistant_dir: Path, depth: int, reps: int, dtype: str) -> dict:
    from mlx_lm import load

    from skulkp2p.engine.decode.sampling import SamplingParams
    from skulkp2p.engine.drafting.assistant import AssistantDrafter, load_assistant
    from skulkp2p.engine.model.forward import LocalForward
    from skulkp2p.engine.model.loaded import DTYPES

    model, tokenizer = load(str(target))
    model.set_dtype(DTYPES[dtype])
    assistant = load_assistant(assistant_dir, model, DTYPES[dtype], block_size=depth + 1)
    prompt = tokenizer.encode("The river was high after the rain, and the old men on the bridge")
    forward = LocalForward(model, hidden="after")
    forward.prefill(prompt[:-1])
    drafter = AssistantDrafter(assistant, SamplingParams(), np.random.default_rng(0))
    drafter.begin(prompt, forward)
    plain, draft, verify = [], [], []
    history = list(prompt)
    for _ in range(reps):
        # As decoding does: a plain step appends its token; a round drafts, verifies and keeps
        # the pending token (the drafts are dropped), so the context grows by two per rep.
        t0 = time.perf_counter()
        mx.eval(forward([history[-1]]))
        t1 = time.perf_counter()
        history.append(history[-1])
        drafter.observe(0, 0, [history[-1]], forward)
        t2 = time.perf_counter()
        tokens, _ = drafter.propose(history, depth)
        t3 = time.perf_counter()
        mx.eval(forward([history[-1], *tokens]))
        t4 = time.perf_counter()
        forward.rollback(keep=1, dropped=depth)
        drafter.observe(depth, 0, [history[-1]], forward)
        history.append(history[-1])
        plain.append(t1 - t0)
        draft.append(t3 - t2)
        verify.append(t4 - t3)
    p, d, v = _median_ms(plain), _median_ms(draft), _median_ms(verify)
    return {"assistant": str(assistant_dir), "head": "centroid" if
            assistant.config.use_ordered_embeddings else "dense", "depth": depth, "dtype": dtype,
            "plain_step_ms": p, "draft_round_ms": d, "verify_ms": v,
            "draft_round_over_plain_step": round(d / p, 3),
            "draft_pass_over_plain_step": round(d / depth / p, 3),
            "verify_over_plain_step": round(v / p, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path)
    parser.add_argument("--assistant", type=Path, action="append")
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--deep", action="store_true",
                        help="a deep target (30 layers, width 256) beside the tiny assistant")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        target, assistants = args.target, args.assistant
        if target is None:
            from tools import tiny_gemma4
            if args.deep:  # the generator reads its shape from these module constants
                tiny_gemma4.HIDDEN, tiny_gemma4.INTERMEDIATE = 256, 1024
                tiny_gemma4.NUM_LAYERS, tiny_gemma4.NUM_KV_SHARED = 30, 10
                tiny_gemma4.LAYER_TYPES = (["sliding_attention"] * 5 + ["full_attention"]) * 5
            target = tiny_gemma4.make_target(Path(tmp) / "target")
            assistants = [tiny_gemma4.make_assistant(Path(tmp) / kind, kind)
                          for kind in tiny_gemma4.ASSISTANT_KINDS]
        if not assistants:
            parser.error("--target needs --assistant")
        results = [measure(target, a, args.depth, args.reps, args.dtype) for a in assistants]
    json.dump(results, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
