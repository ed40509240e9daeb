"""Replay greedy outputs through the decode loop with an oracle verifier, to weigh drafting
policies (chains against token trees) without running the model.

Greedy output is a pure function of the model and the prompt, so once a request's output is
known, which drafts a round accepts is known too: an oracle forward that answers each row with
the true next token (where the row's path matches the output) drives the real decode loop, the
real drafters, gates and tree builder. Each verify's width is priced with the width cost table
(the machine's measured one, or the default), so the tool reports, per workload, tokens per
round and the modelled speed-up over plain: tokens / sum of c(width). It measures nothing about
speed itself: the bench does.

    python tools/tree_sim.py OUTS.json [--costs float32] [--depth 16]

OUTS.json: {workload: {"prompt": [ids], "tokens": [ids], "setup": [[ids], ...]}} (greedy
outputs, e.g. from the bench's plain arm).
"""

from __future__ import annotations

import argparse
import json
import sys

import mlx.core as mx
import numpy as np

from skulkp2p.engine.decode.loop import DecodeStats, decode
from skulkp2p.engine.decode.sampling import SamplingParams, make_rng
from skulkp2p.engine.drafting.gates import (
    DEFAULT_WIDTH_COSTS,
    GatedDrafter,
    repetition_score,
    width_cost,
)
from skulkp2p.engine.drafting.suffix import SuffixDrafter, SuffixMemory


class OracleForward:
    """Answers every row with the output's next token where the row's path is the output so
    far (a wrong path gets a token that matches nothing). Counts the verify widths."""

    trees = True
    last_hidden = None

    def __init__(self, truth: list[int], start: int, vocab: int):
        self.truth = truth
        self.pos = start  # tokens the "cache" holds
        self.vocab = vocab
        self.widths: list[int] = []
        self._start = 0

    def _rows(self, paths: list[list[int]]) -> mx.array:
        out = np.zeros((len(paths), self.vocab), dtype=np.float32)
        for j, path in enumerate(paths):
            at = self.pos + len(path)
            right = self.truth[self.pos:at] == path and at < len(self.truth)
            out[j, self.truth[at] if right else self.vocab - 1] = 1.0
        return mx.array(out)

    def prefill(self, tokens: list[int]) -> None:
        self.pos += len(tokens)

    def __call__(self, tokens: list[int]) -> mx.array:
        self.widths.append(len(tokens))
        rows = self._rows([tokens[:j + 1] for j in range(len(tokens))])
        self._start, self.pos = self.pos, self.pos + len(tokens)
        return rows

    def rollback(self, keep: int, dropped: int) -> None:
        self.pos -= dropped

    def verify_tree(self, tokens: list[int], parents: list[int]) -> mx.array:
        self.widths.append(len(tokens))
        paths = []
        for j in range(len(tokens)):
            path, node = [], j
            while node >= 0:
                path.append(tokens[node])
                node = parents[node]
            paths.append(path[::-1])
        rows = self._rows(paths)
        self._start, self.pos = self.pos, self.pos + len(tokens)
        return rows

    def keep_path(self, path: list[int]) -> None:
        self.pos = self._start + 1 + len(path)


def replay(prompt: list[int], tokens: list[int], setup: list[list[int]], costs: dict,
           depth: int, trees: bool) -> dict:
    truth = prompt + tokens
    memory = SuffixMemory(65536)
    for earlier in setup:
        memory.add(earlier)
    inner = SuffixDrafter(memory=memory)
    inner.prepare(prompt)
    drafter = GatedDrafter(inner, costs, depth, start_on=repetition_score(prompt) >= 0.02
                           or inner.memory_match >= 16, can_return=True, prior_accept=0.8,
                           trees=trees)
    forward = OracleForward(truth, 0, max(truth) + 2)
    stats = DecodeStats()
    out = list(decode(forward, prompt, SamplingParams(), len(tokens), make_rng(0), drafter,
                      depth, stats, history=[]))
    assert out == tokens, "the replay left the output: the oracle or the loop is wrong"
    cost = sum(width_cost(costs, w) for w in forward.widths)
    return {"rounds": len(forward.widths), "tree_rounds": stats.tree_rounds,
            "drafted": stats.drafted, "accepted": stats.accepted,
            "tokens_per_round": round(len(tokens) / len(forward.widths), 3),
            "modelled_speedup": round(len(tokens) / cost, 3),
            "side_offered": drafter.side_offered, "side_taken": drafter.side_taken}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("outputs")
    p.add_argument("--costs", default="float32", choices=sorted(DEFAULT_WIDTH_COSTS))
    p.add_argument("--depth", type=int, default=16)
    args = p.parse_args(argv)
    with open(args.outputs) as f:
        data = json.load(f)
    costs = DEFAULT_WIDTH_COSTS[args.costs]
    for name, w in data.items():
        for trees in (False, True):
            r = replay(w["prompt"], w["tokens"], w.get("setup", []), costs, args.depth, trees)
            print(f"{name:10s} {'trees' if trees else 'chain':5s} {json.dumps(r)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
