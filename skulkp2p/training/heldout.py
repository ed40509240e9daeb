"""Held-out acceptance: the held-out generations replayed through the engine's own decode loop
and MtpDrafter (the trunk's stored outputs stand in for the verifier), per position at each
depth, beside the baseline of a (token, token) -> next-label table."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import mlx.core as mx
import numpy as np

from skulkp2p.engine.decode.loop import DecodeStats, decode
from skulkp2p.engine.decode.sampling import SamplingParams, make_rng
from skulkp2p.engine.drafting.mtp_drafter import MtpDrafter
from skulkp2p.engine.model.forward import Forward
from skulkp2p.engine.model.mtp_head import MtpHead
from skulkp2p.engine.model.trunk import hidden_layers


class ReplayForward(Forward):
    """A Forward over a stored greedy generation: the verifier's rows are the trunk's recorded
    top-1 and hidden states, so decode() with an MtpDrafter counts exactly the acceptance the
    engine would see on that text (at the drafter's position in it). What it does not override
    is Forward's default: chains only, no lazy steps, no batch."""

    def __init__(self, tokens: np.ndarray, hidden: np.ndarray, top1: np.ndarray, vocab: int,
                 kind: str = "after"):
        """`hidden`: the stored rows of the trunk hidden `kind` (the head's conventions.hidden:
        the shards' "hidden", or their "layers" for "layers:i,j,k")."""
        self.hidden = kind
        self.tokens, self.h, self.top1, self.vocab = tokens, hidden, top1, vocab
        self.offset = 0
        self.last_hidden: mx.array | None = None

    def prefill(self, tokens: list[int]) -> None:
        self.offset = len(tokens)
        self.last_hidden = mx.array(self.h[:self.offset].astype(np.float32))

    def __call__(self, tokens: list[int]) -> mx.array:
        pos = np.arange(self.offset, self.offset + len(tokens))
        rows = np.zeros((len(tokens), self.vocab), np.float32)
        rows[np.arange(len(tokens)), self.top1[pos]] = 1.0
        self.last_hidden = mx.array(self.h[pos].astype(np.float32))
        self.offset += len(tokens)
        return mx.array(rows)

    def rollback(self, keep: int, dropped: int) -> None:
        self.offset -= dropped


def heldout_acceptance(head: MtpHead, shards: list[dict[str, np.ndarray]], vocab: int,
                       max_tokens: int | None = None, depths: tuple[int, ...] = (1, 2, 3),
                       context_bias: float = 0.0) -> dict[str, Any]:
    """Per-position acceptance at each of `depths` over the held-out generations (the drafter
    with this `context_bias`, the card's mtp_context_bias): `per_position` counts position k
    against every round that drafted it, `given_previous` against the rounds whose position
    k-1 was accepted (depth 2 given depth 1)."""
    result: dict[str, Any] = {}
    kind = head.conventions.hidden
    rows = "layers" if hidden_layers(kind) is not None else "hidden"
    for depth in depths:
        stats = DecodeStats()
        emitted = 0
        for s in shards:
            plen = int(s["prompt_len"])
            for b in range(s["tokens"].shape[0]):
                end = int(s["ends"][b])
                n_gen = min(end + 1, s["tokens"].shape[1]) - plen
                if n_gen < 2:
                    continue
                fwd = ReplayForward(s["tokens"][b], s[rows][b], s["top_ids"][b, :, 0], vocab,
                                    kind)
                prompt = [int(t) for t in s["tokens"][b, :plen]]
                out = list(decode(fwd, prompt, SamplingParams(), n_gen, make_rng(0),
                                  MtpDrafter(head, context_bias=context_bias), depth, stats))
                want = [int(t) for t in s["tokens"][b, plen:plen + n_gen]]
                if out != want:
                    raise RuntimeError("replay diverged from the stored generation")
                emitted += len(out)
                if max_tokens and emitted >= max_tokens:
                    break
            if max_tokens and emitted >= max_tokens:
                break
        per = [round(a / d, 4) if d else 0.0 for a, d in zip(stats.accepted_at, stats.drafted_at,
                                                               strict=True)]
        # position k's acceptance among the rounds whose position k-1 was accepted
        given = [round(a / p, 4) if p else 0.0 for a, p in zip(
            stats.accepted_at[1:], stats.accepted_at[:-1], strict=True)]
        result[f"depth{depth}"] = {
            "per_position": per,
            "given_previous": given,
            "rounds": stats.rounds,
            "tokens_per_round": round(emitted / max(stats.rounds, 1), 4),
        }
    return result


def pair_table_baseline(train: list[dict[str, np.ndarray]], held: list[dict[str, np.ndarray]]
                        ) -> float:
    """The baseline: the most frequent next label per (x_t, x_{t+1}) pair, learnt on the
    training generations, scored on the held-out generated positions (a miss when unseen)."""
    table: dict[tuple[int, int], Counter] = defaultdict(Counter)
    for s in train:
        for b in range(s["tokens"].shape[0]):
            toks, top1, end = s["tokens"][b], s["top_ids"][b, :, 0], int(s["ends"][b])
            for t in range(end - 1):
                table[int(toks[t]), int(toks[t + 1])][int(top1[t + 1])] += 1
    best = {k: c.most_common(1)[0][0] for k, c in table.items()}
    hits = total = 0
    for s in held:
        plen = int(s["prompt_len"])
        for b in range(s["tokens"].shape[0]):
            toks, top1, end = s["tokens"][b], s["top_ids"][b, :, 0], int(s["ends"][b])
            for t in range(plen - 2, end - 1):
                total += 1
                hits += int(best.get((int(toks[t]), int(toks[t + 1]))) == int(top1[t + 1]))
    return hits / max(total, 1)
