"""How a trained EAGLE-style head's draft vocabulary limits it, and what a larger one costs.

    python -m skulkp2p head probe --work DIR/.train --sidecar SIDECAR [--sizes 8192,16384]
        [--model smollm2-135m] [--depths 1,2] [--timing-calls 300] [--json PATH]

`--work` is a `head train` work folder (its `train-*.npz` and `heldout-*.npz` shards). For the
sidecar's own vocabulary and for each size in `--sizes` (the most frequent greedy targets of the
training shards, head_init's `choose_vocab`; `0` is the whole vocabulary) it prints:

- the share of the held-out generated tokens inside the draft vocabulary (a token outside it
  can never be drafted, so never accepted);
- the held-out acceptance per position, replayed through the engine's decode loop and
  MtpDrafter exactly as `head train` measures it (the same shards, the same replay);
- the cost of one head call (append a verified row and score the draft vocabulary) against
  one trunk decode step, timed interleaved in this process (medians; read the ratio).

`--policies` also simulates confidence policies with the sidecar's own vocabulary: the head's
draft and its probability at every held-out position, for the first draft step and the second
(two_step_features: what the drafter computes when it chains), then rounds replayed offline
(`simulate`): draft d1 only when its probability is at least t1, add d2 only when its own is at
least t2; modelled speed = tokens / (verify cost c(1 + drafted) + head calls x --head-cost),
with c from --costs (relative to a one-token step; `bench --widths` measures them).

The head's weights are not changed: only which lm_head rows it scores (`restrict_vocab`), so a
larger vocabulary needs no retraining, but the head never learned to score the added rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from skulkp2p.engine.model.mtp_head import MtpHead, load_mtp_head
from skulkp2p.engine.model.trunk import Trunk, hidden_layers
from skulkp2p.training.head_fit import two_step_features
from skulkp2p.training.head_init import choose_vocab
from skulkp2p.training.head_options import HeadError, resolve_model
from skulkp2p.training.heldout import heldout_acceptance
from skulkp2p.training.shards import load_shards


@dataclass
class Predictions:
    """One held-out generation: its tokens (prompt and answer up to the last emitted one) and,
    per row t (the pair h_t, x_{t+1}), the head's first-step draft for x_{t+2} with its
    probability, and its second-step draft for x_{t+3} (chained from row t, fed x_{t+2})."""

    prompt_len: int
    tokens: np.ndarray
    first: np.ndarray
    first_p: np.ndarray
    second: np.ndarray
    second_p: np.ndarray


@dataclass
class PolicyResult:
    t1: float
    t2: float
    rounds: int
    tokens: int
    drafted: tuple[int, int]  # drafts offered at positions 1 and 2
    accepted: tuple[int, int]
    speed: float  # modelled, against plain decoding with the head off (1.0)

    def as_dict(self) -> dict[str, Any]:
        rate = [round(a / d, 4) if d else None for a, d in zip(self.accepted, self.drafted,
                                                               strict=True)]
        return {"t1": self.t1, "t2": self.t2, "rounds": self.rounds,
                "drafted": list(self.drafted), "accepted": list(self.accepted),
                "per_position": rate, "tokens_per_round": round(self.tokens / self.rounds, 4),
                "modelled_speed": round(self.speed, 4)}


def heldout_targets(shards: list[dict[str, np.ndarray]]) -> np.ndarray:
    """The tokens the held-out greedy generations emitted (what a draft must match)."""
    out = []
    for s in shards:
        plen, n = int(s["prompt_len"]), s["tokens"].shape[1]
        for b in range(s["tokens"].shape[0]):
            # the answer up to its EOS, as heldout_acceptance replays it
            out.append(s["tokens"][b, plen:min(int(s["ends"][b]) + 1, n)])
    return np.concatenate(out).astype(np.int64)


def predictions(head: MtpHead, shards: list[dict[str, np.ndarray]]) -> list[Predictions]:
    """The head's drafts at every row of every held-out generation, teacher forced (at depth 1
    that is what the replay computes: the head's cache holds the verified rows)."""
    ids = np.array(head.vocab_ids) if head.vocab_ids is not None else None
    out = []
    for s in shards:
        n = s["tokens"].shape[1]
        for b in range(s["tokens"].shape[0]):
            last = min(int(s["ends"][b]), n - 1)
            feature = "layers" if hidden_layers(head.conventions.hidden) else "hidden"
            hidden = mx.array(s[feature][b][None, :n - 1].astype(np.float32))
            post, post2 = two_step_features(head, hidden, mx.array(s["tokens"][b][None, 1:n]))
            picked = []
            for rows in (post[0], post2[0]):
                probs = mx.softmax(head.draft_logits(rows).astype(mx.float32), axis=-1)
                top = mx.argmax(probs, axis=-1)
                picked += [np.array(top), np.array(mx.max(probs, axis=-1))]
            if ids is not None:
                picked[0], picked[2] = ids[picked[0]], ids[picked[2]]
            out.append(Predictions(int(s["prompt_len"]), s["tokens"][b, :last + 1], *picked))
    return out


def simulate(preds: list[Predictions], t1: float, t2: float | None,
             costs: dict[int, float], head_cost: float) -> PolicyResult:
    """Greedy decode rounds over the stored generations: the pending token at p, draft 1 (row
    p - 1) if its probability >= t1, draft 2 if also `t2` is not None and its own >= t2; the
    verifier accepts the longest right prefix and emits one token more."""
    rounds = tokens = 0
    drafted, accepted = [0, 0], [0, 0]
    cost = 0.0
    for g in preds:
        last = len(g.tokens) - 1
        p = g.prompt_len  # the prefill emitted tokens[prompt_len]: the first pending token
        while p < last:
            row = p - 1
            width = calls = 0
            if g.first_p[row] >= t1:
                width = calls = 1
                if t2 is not None and p + 2 <= last:
                    calls = 2  # the second draft is computed, then kept only if sure enough
                    width = 2 if g.second_p[row] >= t2 else 1
            right = 0
            if width:
                drafted[0] += 1
                if g.first[row] == g.tokens[p + 1]:
                    right = 1
                    if width == 2 and g.second[row] == g.tokens[p + 2]:
                        right = 2
                if width == 2:
                    drafted[1] += 1
            accepted[0] += right >= 1
            accepted[1] += right == 2
            # one head call appends the verified rows; each draft past the first chains once
            cost += costs[1 + width] + head_cost * max(calls, 1)
            n = min(1 + right, last - p)
            rounds += 1
            tokens += n
            p += n
    return PolicyResult(t1, -1.0 if t2 is None else t2, rounds, tokens, tuple(drafted),
                        tuple(accepted), tokens / max(cost, 1e-9))


def time_costs(model: Any, head: MtpHead, calls: int, context: int = 256) -> dict[str, float]:
    """Median seconds of one trunk decode step and one head call (one verified row appended,
    its draft logits scored), interleaved so that the machine's load hits both alike."""
    trunk = Trunk(model)
    # (the trunk rows the head reads: an eagle3 head's are several layers' side by side)
    hsize = int(trunk.embed_tokens.weight.shape[1]) * len(
        hidden_layers(head.conventions.hidden) or (0,))
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(range(100, 100 + context))]), cache=cache))
    hcache = head.make_cache()
    rng = np.random.default_rng(0)
    out = head(mx.array(rng.standard_normal((context, hsize)), mx.float32),
               mx.arange(100, 100 + context, dtype=mx.int32), hcache)
    mx.eval(out.logits)
    trunk_s, head_s = [], []
    for i in range(calls):
        t0 = time.perf_counter()
        mx.eval(model(mx.array([[200 + i % 50]]), cache=cache))
        t1 = time.perf_counter()
        out = head(mx.array(rng.standard_normal((1, hsize)), mx.float32),
                   mx.array([200 + i % 50], dtype=mx.int32), hcache)
        mx.eval(mx.argmax(out.logits[-1]))
        t2 = time.perf_counter()
        trunk_s.append(t1 - t0)
        head_s.append(t2 - t1)
        for c in cache:  # keep the context length fixed
            c.trim(1)
        hcache.trim(1)
    return {"trunk_step_ms": 1000 * statistics.median(trunk_s),
            "head_call_ms": 1000 * statistics.median(head_s)}


def run(args: argparse.Namespace) -> int:
    """`head probe`: a JSON row per vocabulary and context bias (and per policy) on stdout."""
    if not args.sidecar.is_file():
        raise HeadError(f"--sidecar {args.sidecar} is not a file")
    held = load_shards(args.work, "heldout")
    train = load_shards(args.work, "train") + load_shards(args.work, "train-terse")
    if not held or not train:
        raise HeadError(f"--work {args.work} has no train-*.npz or heldout-*.npz shards")

    model_id, model_path = resolve_model(args.model)
    from skulkp2p.engine.model.loaded import load_model
    lm = load_model(model_path, model_id, dtype="float32")
    config = json.loads((model_path / "config.json").read_text())
    vocab = int(Trunk(lm.model).embed_tokens.weight.shape[0])
    eos = set(int(e) for e in lm.tokenizer.eos_token_ids)
    head = load_mtp_head(model_path, lm.model, config, sidecar=args.sidecar)
    if head is None or head.vocab_ids is None:
        raise HeadError(f"{args.sidecar} is no head with a reduced draft vocabulary")
    own = np.array(head.vocab_ids)
    targets = heldout_targets(held)
    print(f"held-out: {len(held)} shards, {targets.size} generated tokens; training shards: "
          f"{len(train)}", flush=True)

    rows: list[dict[str, Any]] = []
    candidates: list[tuple[str, np.ndarray]] = [(f"sidecar's own ({own.size})", own)]
    for k in args.sizes:
        ids = np.arange(vocab, dtype=np.int32) if k == 0 else choose_vocab(
            train, 0.0, vocab, eos, k)[0]
        candidates.append((f"top {ids.size}" if k else f"all ({vocab})", ids))
    for label, ids in candidates:
        head.restrict_vocab(mx.array(ids))
        inside = float(np.isin(targets, ids).mean())
        timing = {k: round(v, 3) for k, v in time_costs(lm.model, head,
                                                        args.timing_calls).items()}
        for bias in args.context_bias:
            row: dict[str, Any] = {"vocab": label, "size": int(ids.size),
                                   "heldout_inside": round(inside, 4), "context_bias": bias}
            acc = heldout_acceptance(head, held, vocab, depths=tuple(args.depths),
                                     context_bias=bias)
            for d in args.depths:
                row[f"depth{d}"] = acc[f"depth{d}"]["per_position"]
                if d > 1:
                    row[f"depth{d}_given_previous"] = acc[f"depth{d}"]["given_previous"]
            row.update(timing)
            rows.append(row)
            print(json.dumps(row), flush=True)
    policies: list[dict[str, Any]] = []
    if args.policies:
        head.restrict_vocab(mx.array(own))
        preds = predictions(head, held)
        grid = [(t1, None) for t1 in (0.0, 0.1, 0.2, 0.3)] + \
               [(0.0, t2) for t2 in (0.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8)]
        for t1, t2 in grid:
            policies.append(simulate(preds, t1, t2, args.costs, args.head_cost).as_dict())
            print(json.dumps(policies[-1]), flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps({"vocab": rows, "policies": policies}, indent=1))
    return 0

