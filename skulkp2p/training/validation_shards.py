"""Validation answers for choosing a head's inference settings without fitting them to its
held-out set: greedy float32 answers (with the trunk's features, in `head train`'s shard format)
to one batch of the broad prompt list that training never answered, and to the hand-written
`sidecar_prompts.VALIDATION_PROMPTS`, one at a time.

    python -m skulkp2p head validation-shards --out DIR [--model smollm2-135m] [--batch-index 30]
        [--broad 32] [--gen-tokens 192]

Writes DIR/heldout-0000.npz (the broad batch) and DIR/heldout-0001.npz... (the fresh prompts),
named so that `head probe --work DIR` replays them (it also wants one train-*.npz there: link
one of the training shards). `--batch-index` must be a batch of `head train`'s shuffled list
(--batch 64 --prompt-tokens 96, seed 0) that no training shard answered: the smollm2-135m
head's run answered batches 0-29.
"""

from __future__ import annotations

import argparse
import random
import sys

from skulkp2p.engine.model.loaded import load_model
from skulkp2p.progress import ProgressBar
from skulkp2p.training.head_options import HeadError, resolve_model
from skulkp2p.training.prompt_batches import (
    batches_of,
    build_broad_prompts,
    chat_ids,
    tail_length,
)
from skulkp2p.training.shards import generate_shard, save_shard
from skulkp2p.training.sidecar_prompts import VALIDATION_PROMPTS


def run(args: argparse.Namespace) -> int:
    """`head validation-shards`: the shards in --out."""
    model_id, model_path = resolve_model(args.model)
    lm = load_model(model_path, model_id, dtype="float32")
    eos = set(int(e) for e in lm.tokenizer.eos_token_ids)
    train_p, _, _ = build_broad_prompts(lm.tokenizer, 0)
    batches = batches_of(train_p, 64, 96, tail_length(lm.tokenizer))
    random.Random(0).shuffle(batches)  # head train's order (--seed 0)
    if not 0 <= args.batch_index < len(batches):
        raise HeadError(f"--batch-index must be below {len(batches)}, got {args.batch_index}")
    args.out.mkdir(parents=True, exist_ok=True)
    save_shard(args.out / "heldout-0000.npz",
               generate_shard(lm.model, batches[args.batch_index][:args.broad],
                              args.gen_tokens, eos))
    bar = ProgressBar("answering the validation prompts", sys.stderr)
    for i, text in enumerate(VALIDATION_PROMPTS):
        save_shard(args.out / f"heldout-{i + 1:04d}.npz",
                   generate_shard(lm.model, [chat_ids(lm.tokenizer, text)], args.gen_tokens,
                                  eos))
        bar(i + 1, len(VALIDATION_PROMPTS))
    return 0
