"""Validation answers for choosing a head's inference settings without fitting them to its
held-out set: greedy float32 answers (with the trunk's features, train_sidecar's shard format)
to one batch of the broad prompt list that training never answered, and to the hand-written
`sidecar_prompts.VALIDATION_PROMPTS`, one at a time.

    python tools/validation_shards.py --out DIR [--model smollm2-135m] [--batch-index 30]
        [--broad 32] [--gen-tokens 192]

Writes DIR/heldout-0000.npz (the broad batch) and DIR/heldout-0001.npz... (the fresh prompts),
named so that tools/head_vocab_probe.py --work DIR replays them (it also wants one train-*.npz
there: link one of the training shards). `--batch-index` must be a batch of train_sidecar's
shuffled list (--batch 64 --prompt-tokens 96, seed 0) that no training shard answered: the
smollm2-135m head's run answered batches 0-29.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `skulkp2p` and `tools` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if __name__ == "__main__":  # before mlx loads: the fast float32 path on Linux CPUs
    from skulkp2p.engine.cpu import blas

    blas.ensure_fast_blas()

from skulkp2p.engine.model.loaded import load_model  # noqa: E402
from tools.sidecar_prompts import VALIDATION_PROMPTS  # noqa: E402
from tools.train_sidecar import (  # noqa: E402
    _chat_ids,
    _resolve_model,
    _save_shard,
    _tail_length,
    batches_of,
    build_broad_prompts,
    generate_shard,
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="validation_shards", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch-index", type=int, default=30)
    p.add_argument("--broad", type=int, default=32, help="prompts of that batch to answer")
    p.add_argument("--gen-tokens", type=int, default=192)
    args = p.parse_args(argv)
    model_id, model_path = _resolve_model(args.model, None)
    lm = load_model(model_path, model_id, dtype="float32")
    eos = set(int(e) for e in lm.tokenizer.eos_token_ids)
    train_p, _, _ = build_broad_prompts(lm.tokenizer, 0)
    batches = batches_of(train_p, 64, 96, _tail_length(lm.tokenizer))
    random.Random(0).shuffle(batches)  # train_sidecar's order (--seed 0)
    if not 0 <= args.batch_index < len(batches):
        p.error(f"--batch-index must be below {len(batches)}, got {args.batch_index}")
    args.out.mkdir(parents=True, exist_ok=True)
    _save_shard(args.out / "heldout-0000.npz",
                generate_shard(lm.model, batches[args.batch_index][:args.broad],
                               args.gen_tokens, eos))
    for i, text in enumerate(VALIDATION_PROMPTS):
        _save_shard(args.out / f"heldout-{i + 1:04d}.npz",
                    generate_shard(lm.model, [_chat_ids(lm.tokenizer, text)], args.gen_tokens,
                                   eos))
        print(f"validation_shards: {i + 1}/{len(VALIDATION_PROMPTS)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
