"""Measure a Gemma 4 target and its assistant on a 2-stage pipeline ring beside one node.

    python tools/assistant_ring_cost.py [--target DIR --assistant DIR] [--split 2]
        [--tokens 96] [--depth 3] [--reps 5] [--dtype float32]

Without folders it builds the tiny gemma4_text target and its ordered (centroid head) assistant
(tools/tiny_gemma4.py) in a temporary folder. The ring is two stages in this process, [0, split)
and [split, L), every frame going through the wire codec (`InProcessLink`: encoded, signed-off,
decoded as the TCP link does, without the socket). Four arms run interleaved `reps` times, one
request of `tokens` greedy tokens each: plain and assistant-drafted, on one node and on the
ring. It prints JSON: ms per token (median), the ring's frame bytes per round and per hidden row
that crossed (of which per-layer inputs), and the assistant's drafted/accepted counts. Every
arm's tokens must equal plain one-node decoding (it exits non-zero otherwise).
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


def measure(target: Path, assistant_dir: Path, split: int, tokens: int, depth: int,
            reps: int, dtype: str) -> dict:
    from skulkp2p.engine.decode.loop import DecodeStats, decode
    from skulkp2p.engine.decode.sampling import SamplingParams, make_rng
    from skulkp2p.engine.drafting.assistant import AssistantDrafter, load_assistant
    from skulkp2p.engine.model.forward import LocalForward
    from skulkp2p.engine.model.loaded import DTYPES, load_model
    from skulkp2p.engine.model.stage import StageModel, StageSpan
    from skulkp2p.engine.parallel.ring.traversal import InProcessLink, RingForward, StageWorker

    whole = load_model(target, "target", dtype=dtype)
    total = len(whole.model.layers)
    parts = [load_model(target, "target", dtype=dtype, span=StageSpan(a, b, total),
                        speculation={"drafter": "assistant"})
             for a, b in ((0, split), (split, total))]
    one_node = load_assistant(assistant_dir, whole.model, DTYPES[dtype])
    last = parts[-1]
    on_ring = load_assistant(assistant_dir, last.model, DTYPES[dtype],
                             first_layer=last.span.start)
    prompt = whole.tokenizer.encode("The river was high after the rain, and the")
    args = whole.model.args
    per_row_values = args.hidden_size + (total - split) * (args.hidden_size_per_layer_input or 0)

    def run(arm: str) -> tuple[list[int], float, dict]:
        ring = arm.startswith("ring")
        hidden = "after" if arm.endswith("assistant") else None
        link = None
        if ring:
            link = InProcessLink([StageWorker(StageModel(parts[0].model, parts[0].span), 1)])
            fwd = RingForward(StageModel(last.model, last.span), link, term=1, instance="i",
                              request="r", hidden=hidden)
        else:
            fwd = LocalForward(whole.model, hidden=hidden)
        drafter = None
        if hidden:
            drafter = AssistantDrafter(on_ring if ring else one_node, SamplingParams(),
                                       np.random.default_rng(0))
        stats = DecodeStats()
        t0 = time.perf_counter()
        out = list(decode(fwd, prompt, SamplingParams(), tokens, make_rng(0), drafter,
                          depth if drafter else 0, stats))
        took = time.perf_counter() - t0
        info = {"drafted": stats.drafted, "accepted": stats.accepted}
        if ring:
            # Prefill traversals (the prompt's rows) are left out of the per-round figures.
            info.update(bytes=link.bytes, traversals=fwd.traversals, rows=fwd.link_rows)
        return out, took, info

    arms = ("one_plain", "one_assistant", "ring_plain", "ring_assistant")
    times: dict[str, list[float]] = {a: [] for a in arms}
    infos: dict[str, dict] = {}
    reference = None
    for _ in range(reps):
        for arm in arms:
            out, took, info = run(arm)
            if reference is None:
                reference = out
            if out != reference:
                raise SystemExit(f"{arm}: tokens differ from plain one-node decoding")
            times[arm].append(took)
            infos[arm] = info
    itemsize = mx.array(0, dtype=DTYPES[dtype]).itemsize
    result = {
        "dtype": dtype, "tokens": tokens, "depth": depth, "reps": reps,
        "split": [[0, split], [split, total]],
        "ms_per_token": {a: round(1000 * statistics.median(t) / tokens, 3)
                         for a, t in times.items()},
        "hidden_row_bytes": args.hidden_size * itemsize,
        "frame_row_bytes": per_row_values * itemsize,  # hidden + per-layer inputs ahead
    }
    for arm in ("ring_plain", "ring_assistant"):
        info = infos[arm]
        rounds = info["traversals"] - 1  # the prefill (one chunk here)
        result[arm] = {**info, "rounds": rounds,
                       "bytes_per_traversal": round(info["bytes"] / max(info["traversals"], 1))}
    for arm in ("one_assistant", "ring_assistant"):
        result.setdefault(arm, {}).update(drafted=infos[arm]["drafted"],
                                          accepted=infos[arm]["accepted"])
    ms = result["ms_per_token"]
    result["ratios"] = {
        "ring_plain/one_plain": round(ms["ring_plain"] / ms["one_plain"], 3),
        "ring_assistant/ring_plain": round(ms["ring_assistant"] / ms["ring_plain"], 3),
        "one_assistant/one_plain": round(ms["one_assistant"] / ms["one_plain"], 3),
    }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path)
    parser.add_argument("--assistant", type=Path)
    parser.add_argument("--split", type=int, default=2, help="the first stage's layers")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    if (args.target is None) != (args.assistant is None):
        parser.error("give both --target and --assistant, or neither")
    with tempfile.TemporaryDirectory() as tmp:
        target, assistant = args.target, args.assistant
        if target is None:
            from tools import tiny_gemma4
            target = tiny_gemma4.make_target(Path(tmp) / "gemma4-tiny")
            assistant = tiny_gemma4.make_assistant(Path(tmp) / "assistant", "ordered")
        print(json.dumps(measure(target, assistant, args.split, args.tokens, args.depth,
                                 args.reps, args.dtype), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
