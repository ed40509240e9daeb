"""Train a drafting head (a sidecar) for a model that has none, by self-distillation, trunk frozen.

Usage::

    python -m skulkp2p head train --model ID|DIR --out DIR [--minutes 30] [--steps N] [--resume]
        [--kind eagle|eagle3|qwen] [--data broad|stdlib] [--init-from SIDECAR]

What it trains (the README's "MTP sidecars"; read by skulkp2p.engine.model.mtp_head.load_mtp_head): by
default an EAGLE-style head (``--kind eagle``, tensors ``eagle.*``: fc with a bias, one decoder
layer of the trunk's own family, final norm, reduced vocabulary), or the first head's layout in
qwen naming ``mtp.*`` (``--kind qwen``, no fc bias). Either way: from the trunk's hidden state
h_t (after its final norm) and the embedding of token t+1, predict what the trunk itself
predicts for t+2. The targets are the trunk's top-k distribution at t+1, so the head learns
what the verifier accepts.

How (the lessons of the first attempt):

1. Data: the model's own answers, in batches, in float32 through our own trunk (so the features
   are what serving computes; measured on this 2-core CPU, this batched generation with features
   ran at 275 tok/s at batch 64 against llama-server's 251 tok/s with 32 slots on the Q4_1 GGUF,
   which would still need a feature pass). ``--data broad`` (default): the chat prompt list of
   sidecar_prompts.py (questions, explanations, instructions, stories, poems, letters,
   code), half the batches answered greedily and half sampled (``--sample-share``,
   ``--temperature``); held out: its separate hand-written prompts of another style, answered
   greedily one at a time (equal-length batches would cut their content). ``--data stdlib``: the
   first head's prompts, built from Python stdlib docstrings/source and /usr/share/doc texts, one
   source file in ten held out. Training rows are mostly generated text: what the head drafts on.
2. A reduced draft vocabulary: the K most frequent target tokens (covering --coverage of the
   training targets). The head scores K rows of the shared lm_head, so a draft costs a small
   fraction of a trunk step; it stays exact because the verifier decides every token.
3. A head that starts close to right (or from an earlier head, ``--init-from``): the decoder
   layer is a copy of the trunk's last layer with its residual output projections (o_proj,
   down_proj) zeroed, so it starts as the identity; the final norm is the trunk's; fc is the
   ridge-regression solution mapping [norm(embed(x_{t+1})), norm(h_t)] to the trunk's next
   hidden state, so the initial head already predicts x_{t+2} as a linear model would instead
   of starting from a large loss.
4. Loss: cross-entropy against the trunk's top-k distribution at t+1 (over the draft vocabulary)
   plus a feature term pulling the head's normed output towards the trunk's h_{t+1}, which is what
   the head is fed back at depth > 1 (EAGLE's lesson).
5. Held-out acceptance is measured by replaying the held-out generations through the engine's
   own decode loop and MtpDrafter (the trunk's stored outputs stand in for the verifier): per
   position at depths 1-3, beside the baseline of a (token, token) -> next-label table.

The run is bounded (--minutes, shared between generation and training), shows progress, and is
resumable (--resume): generated shards and a checkpoint (head + optimizer + step) live in
OUT/.train/. The result is OUT/mtp.safetensors (bf16, the shared lm_head is not stored) and
OUT/mtp.provenance.toml.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from skulkp2p.engine.model.mtp_conventions import VOCAB_IDS, fused_layers
from skulkp2p.engine.model.mtp_head import MtpHead, load_mtp_head
from skulkp2p.engine.model.trunk import Trunk, layers_hidden
from skulkp2p.progress import ProgressBar
from skulkp2p.training.head_fit import Batches, make_loss, teacher_forced_accuracy
from skulkp2p.training.head_init import (
    choose_vocab,
    head_tensors,
    initial_tensors,
    kept_vocab,
    ridge_fc,
    ridge_fuse,
    warm_start_tensors,
)
from skulkp2p.training.head_options import EVAL_SHARE, PREFIXES, HeadError, resolve_model
from skulkp2p.training.heldout import heldout_acceptance, pair_table_baseline
from skulkp2p.training.prompt_batches import (
    batches_of,
    build_broad_prompts,
    build_prompts,
    build_terse_prompts,
    tail_length,
    terse_batches,
    terse_bounds,
)
from skulkp2p.training.publish import sha256_file, write_sidecar
from skulkp2p.training.shards import generate_shard, load_shards, save_shard, temperatures

CHECKPOINT_EVERY_S = 60.0
DATA_NOTES = {  # the provenance's word on where the training text came from
    "broad": "float32 generations of the base, greedy and sampled ({share:.0%} of batches, "
             "temperature {t}), answering the broad chat prompt list of "
             "skulkp2p/training/sidecar_prompts.py; held out: its separate hand-written prompts of another "
             "style, answered greedily",
    "stdlib": "float32 generations of the base, greedy and sampled ({share:.0%} of batches, "
              "temperature {t}), from prompts built from Python stdlib docstrings/source and "
              "/usr/share/doc texts; 1 in 10 source files held out",
}


def _log(msg: str) -> None:
    print(f"head train: {msg}", file=sys.stderr, flush=True)


def train(args: argparse.Namespace) -> Path:
    t_start = time.monotonic()
    budget = args.minutes * 60.0
    out = Path(args.out)
    work = out / ".train"
    model_id, model_path = resolve_model(args.model, args.data_dir)  # before OUT is touched
    if work.exists() and not args.resume:
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    from skulkp2p.engine.model.loaded import load_model
    lm = load_model(model_path, model_id, dtype="float32")
    config = json.loads((model_path / "config.json").read_text())
    if config.get("quantization"):
        raise HeadError("train on a full-precision base (the sidecar is quantised on load "
                        "beside a quantised one)")
    vocab = int(Trunk(lm.model).embed_tokens.weight.shape[0])
    eps = float(config.get("rms_norm_eps", 1e-6))
    eos = set(int(e) for e in lm.tokenizer.eos_token_ids)
    # An eagle3 head reads a low, a middle and a high layer: the shards keep their outputs.
    fused = fused_layers(len(Trunk(lm.model).body.layers)) if args.kind == "eagle3" \
        else None

    # 1. prompts and generations (held-out first: it is needed whatever the budget)
    if args.data == "broad":
        train_p, held_p, counts = build_broad_prompts(lm.tokenizer, args.seed)
    else:
        train_p, held_p, counts = build_prompts(lm.tokenizer, args.seed, args.limit_files)
    tail = tail_length(lm.tokenizer)
    # Batches are length buckets: shuffle them, so neither set is only the shortest prompts.
    # Held-out batches of 1 keep every prompt whole (equal-length batches cut content).
    held_b = batches_of(held_p, args.heldout_batch or args.batch, args.prompt_tokens, tail)
    random.Random(args.seed + 1).shuffle(held_b)
    held_b = held_b[:args.heldout_batches or None]
    train_b = batches_of(train_p, args.batch, args.prompt_tokens, tail)
    random.Random(args.seed).shuffle(train_b)
    if args.max_batches:
        train_b = train_b[:args.max_batches]
    skip = set(args.skip_batches)
    if any(not 0 <= i < len(train_b) for i in skip):
        raise HeadError(f"--skip-batches must be below {len(train_b)} (the training "
                        f"batches), got {sorted(skip)}")
    made = [i for i in sorted(skip) if (work / f"train-{i:04d}.npz").exists()]
    if made:
        raise HeadError(f"--skip-batches {made} already answered in {work} "
                        f"(train-{made[0]:04d}.npz): a skipped batch must stay out of training")
    # Terse numbered answers (--terse) are a list of their own, in shards train-terse-*: adding
    # them leaves the broad list's batches, and so the shards already generated, as they were.
    terse_b: list[list[list[int]]] = []
    if args.terse:
        if args.data != "broad":
            raise HeadError("--terse goes with --data broad")
        # A larger --terse than before adds batches of the messages not yet answered.
        bounds = terse_bounds(work / "terse.json", args.terse, any(work.glob("train-terse-*")))
        terse_b = terse_batches(build_terse_prompts(lm.tokenizer, args.seed, bounds[-1]),
                                bounds, args.batch, args.prompt_tokens, tail, args.seed)
        counts["terse_prompts"] = bounds[-1]
    if not held_b or not train_b:
        raise HeadError("too few prompts for one batch; lower --batch")
    gen_deadline = t_start + budget * args.gen_share
    # Generation runs until its share of the time is spent (or the prompts run out): the bar
    # shows the larger of the two fractions.
    bar = ProgressBar("generating", sys.stderr)
    # The terse batches come before the rest of the broad list: a resumed run with --terse
    # spends its generation time on them first.
    jobs = [("heldout", i, b) for i, b in enumerate(held_b)] + \
           [("train-terse", i, b) for i, b in enumerate(terse_b)] + \
           [("train", i, b) for i, b in enumerate(train_b)]
    for j, (kind, i, prompts) in enumerate(jobs):
        path = work / f"{kind}-{i:04d}.npz"
        if path.exists():
            continue
        if kind == "train" and i in skip:
            continue  # held for validation (head validation-shards): never trained on
        training = kind != "heldout"
        if training and time.monotonic() > gen_deadline and any(work.glob("train-*")):
            break
        deadline = gen_deadline if training else None
        # Training batches alternate greedy and sampled answers (--sample-share of them
        # sampled, by batch index); held-out answers are greedy, as the bench decodes.
        sampled = training and int((i + 1) * args.sample_share) > int(i * args.sample_share)
        temperature = args.temperature if sampled else 0.0
        # A batch's samples do not depend on resuming (terse batches draw from seeds of their own).
        mx.random.seed(args.seed * 100_003 + i + (50_000 if kind == "train-terse" else 0))
        save_shard(path, generate_shard(lm.model, prompts, args.gen_tokens, eos, deadline,
                                        temperature, fused))
        spent = (time.monotonic() - t_start) / max(gen_deadline - t_start, 1e-9)
        bar(max(int(1000 * spent), int(1000 * (j + 1) / len(jobs))), 1000)
        _log(f"{kind} batch {i}: {len(prompts)} x {len(prompts[0])} prompt tokens, "
             f"{time.monotonic() - t_start:.0f}s")
    bar(1, 1)
    if args.generate_only:
        _log(f"generated; {time.monotonic() - t_start:.0f}s")
        return work
    held = load_shards(work, "heldout")
    shards = load_shards(work, "train")
    gen_rows = sum(int(np.minimum(s["ends"], s["tokens"].shape[1]).sum()) for s in shards)
    _log(f"{len(shards)} training shards ({gen_rows} rows), {len(held)} held-out shards, "
         f"{time.monotonic() - t_start:.0f}s")

    # 2. the starting head (or the checkpoint)
    ckpt, state_file = work / "checkpoint.safetensors", work / "state.json"
    state: dict[str, Any] = json.loads(state_file.read_text()) if (
        args.resume and state_file.exists()) else {}
    if state:
        head_file = ckpt
        vocab_ids = np.array(mx.load(str(ckpt))[PREFIXES[args.kind] + VOCAB_IDS])
        coverage = state["coverage"]
    else:
        vocab_ids, coverage = choose_vocab(shards, args.coverage, vocab, eos, args.vocab)
        if args.keep_vocab:
            if not args.init_from:
                raise HeadError("--keep-vocab goes with --init-from")
            vocab_ids, coverage = kept_vocab(args.init_from, shards, vocab)
        head_file = work / "init.safetensors"
        if args.init_from:
            start = warm_start_tensors(model_path, lm.model, config, args.init_from, vocab_ids,
                                       args.kind)
        else:
            start = initial_tensors(lm.model, ridge_fc(lm.model, shards, eps), vocab_ids,
                                    args.kind, ridge_fuse(shards, eps) if fused else None)
        mx.save_safetensors(str(head_file), start)
    head = load_mtp_head(model_path, lm.model, config, sidecar=head_file)
    head.set_dtype(mx.float32)
    batches = Batches(shards, vocab_ids, vocab, args.train_batch, args.seed + len(state),
                      args.feature_noise, fused=fused is not None)
    # Draft steps unrolled in training (training-time test): eagle3 3 by default, each later
    # step's loss at --depth2-weight (0.5 unless given); eagle 2 with --depth2-weight.
    ttt = args.ttt_steps or (3 if fused else 2)
    later_weight = args.depth2_weight or (0.5 if fused else 0.0)
    acc0, second0 = teacher_forced_accuracy(head, batches, held, steps=max(ttt, 2))[:2]
    _log(f"draft vocabulary {len(vocab_ids)} tokens ({coverage:.1%} of training targets); "
         f"held-out teacher-forced accuracy at start: depth-1 {acc0:.1%}, second step "
         f"{second0:.1%}")

    # 3. training
    loss_and_grad = nn.value_and_grad(head, make_loss(args.feat_weight, later_weight, ttt))
    step = int(state.get("step", 0))
    train_deadline = t_start + budget * (1.0 - EVAL_SHARE)
    # Each run has its own time budget: a resumed run starts a new schedule from its step.
    total, start = 0, step
    opt = optim.AdamW(learning_rate=args.lr, weight_decay=0.01)
    opt.init(head.trainable_parameters())
    if state:
        opt.state = tree_unflatten(list(mx.load(str(work / "optimizer.safetensors")).items()))
    bar = ProgressBar("training", sys.stderr)
    last_ckpt = time.monotonic()
    t_train = time.monotonic()
    losses: list[float] = []
    steps_here = 0
    runs: list[str] = list(state.get("runs", []))  # earlier runs of a resumed training

    def this_run() -> str:
        return (f"{args.minutes:g} min budget, {time.monotonic() - t_start:.0f} s, steps "
                f"{start}-{step}, lr {args.lr:g}, {len(shards)} shards")
    while True:
        if args.steps and step >= args.steps:
            break
        if total and step >= total:
            break
        if time.monotonic() > train_deadline and steps_here > 0:
            break
        if not total and steps_here == 5:
            # Fix the schedule's length from the measured step time and the time left.
            per = (time.monotonic() - t_train) / steps_here
            total = step + max(1, int((train_deadline - time.monotonic()) / per))
            if args.steps:
                total = min(total, args.steps)
        span = max((total or args.steps or 1000) - start, 1)
        warm = min(20, max(1, span // 10))
        frac = min((step - start) / span, 1.0)
        opt.learning_rate = args.lr * min(1.0, (step - start + 1) / warm) * (
            0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        (loss, ce), grads = loss_and_grad(head, *batches.sample())
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(head, grads)
        mx.eval(head.trainable_parameters(), opt.state, loss, ce)
        losses.append(float(ce))
        step += 1
        steps_here += 1
        bar(step, max(total or args.steps or step, step))
        if step % 50 == 0:
            accs = teacher_forced_accuracy(head, batches, held, steps=max(ttt, 2))
            _log(f"step {step}: ce {np.mean(losses[-50:]):.3f}, held-out teacher-forced "
                 f"per step " + ", ".join(f"{a:.1%}" for a in accs))
        if time.monotonic() - last_ckpt > CHECKPOINT_EVERY_S:
            _checkpoint(work, head, opt, step, total, start, coverage, runs + [this_run()])
            last_ckpt = time.monotonic()
    bar(1, 1)
    _checkpoint(work, head, opt, step, total, start, coverage, runs + [this_run()])
    train_s = time.monotonic() - t_train

    # 4. held-out acceptance through the real drafter, and the sidecar
    acc1, second1 = teacher_forced_accuracy(head, batches, held, steps=2)
    acceptance = heldout_acceptance(head, held, vocab, args.eval_tokens)
    baseline = pair_table_baseline(shards, held)
    _log("held-out acceptance per position: " + "; ".join(
        f"depth {d}: {acceptance[f'depth{d}']['per_position']} (given the one before: "
        f"{acceptance[f'depth{d}']['given_previous']})" for d in (1, 2, 3)) +
        f" (pair-table baseline {baseline:.1%})")
    tensors = head_tensors(head, mx.bfloat16)
    model_files = sorted(model_path.glob("*.safetensors"))
    provenance = {
        "format": "skulkp2p mtp sidecar 1",
        "made_by": "python -m skulkp2p head train",
        "base_model": model_id,
        "model_type": str(config.get("model_type")),
        "licence": "as the base model's",
        "conventions": {
            "style": args.kind, "prefix": PREFIXES[args.kind],
            "hidden": layers_hidden(fused) if fused else "after",
            "concat": "embed_first",
            "norm_offset": 0.0, "chain": "after", "zero_first_embed": False, "layers": 1,
            "dtype": "bfloat16", "vocab_ids": len(vocab_ids),
            "shared_lm_head": "not stored: the base's lm_head rows for vocab_ids are used",
        },
        "acceptance": {
            "measured_on": "held-out greedy generations of the base (float32), replayed through "
                           "the engine's decode loop and MtpDrafter",
            "depth1_per_position": acceptance["depth1"]["per_position"],
            "depth2_per_position": acceptance["depth2"]["per_position"],
            "depth3_per_position": acceptance["depth3"]["per_position"],
            "depth2_given_previous": acceptance["depth2"]["given_previous"],
            "depth3_given_previous": acceptance["depth3"]["given_previous"],
            "depth3_tokens_per_round": acceptance["depth3"]["tokens_per_round"],
            "teacher_forced_depth1_start": round(acc0, 4),
            "teacher_forced_depth1_end": round(acc1, 4),
            "teacher_forced_second_step_start": round(second0, 4),
            "teacher_forced_second_step_end": round(second1, 4),
            "pair_table_baseline": round(baseline, 4),
        },
        "training": {
            "steps": step, "runs": runs + [this_run()],
            "batch_sequences": args.train_batch, "lr": args.lr,
            "feat_weight": args.feat_weight, "depth2_weight": later_weight,
            "training_time_test_steps": ttt if later_weight > 0 else 1,
            **({"fused_layers": list(fused)} if fused else {}),
            "feature_noise": args.feature_noise,
            "init_from": (f"{args.init_from.name} (sha256 {sha256_file(args.init_from)})"
                          if args.init_from else "ridge fit"),
            "optimizer": "AdamW (wd 0.01), cosine, clip 1.0",
            "train_seconds": round(train_s, 1),
            "total_seconds_this_run": round(time.monotonic() - t_start, 1),
            "minutes_budget": args.minutes, "seed": args.seed,
            "generation_batch": args.batch, "prompt_tokens_max": args.prompt_tokens,
            "gen_tokens": args.gen_tokens, "train_shards": len(shards),
            "heldout_shards": len(held), "train_rows": gen_rows,
            "draft_vocab_coverage": round(coverage, 4),
            "data": DATA_NOTES[args.data].format(share=args.sample_share,
                                                 t=temperatures(shards, args.temperature)),
            **counts,
        },
        "source": {f.name: {"sha256": sha256_file(f), "bytes": f.stat().st_size}
                   for f in [model_path / "config.json", *model_files]},
    }
    return write_sidecar(out, tensors, provenance,
                         f"MTP head for {model_id} trained by python -m skulkp2p head train")


def _checkpoint(work: Path, head: MtpHead, opt: optim.Optimizer, step: int, total: int,
                start: int, coverage: float, runs: list[str]) -> None:
    mx.save_safetensors(str(work / "checkpoint.tmp.safetensors"), head_tensors(head, mx.float32))
    mx.save_safetensors(str(work / "optimizer.tmp.safetensors"), dict(tree_flatten(opt.state)))
    (work / "checkpoint.tmp.safetensors").replace(work / "checkpoint.safetensors")
    (work / "optimizer.tmp.safetensors").replace(work / "optimizer.safetensors")
    (work / "state.json").write_text(json.dumps({"step": step, "total_steps": total,
                                                 "schedule_start": start,
                                                 "coverage": coverage, "runs": runs}))


def run(args: argparse.Namespace) -> int:
    """`head train`: the run, then the sidecar's path on stdout."""
    mx.random.seed(args.seed)
    print(train(args))
    return 0
