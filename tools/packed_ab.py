"""Ragged batched steps packed (engine/model/packed.py) against padded, SmolLM2-135M float32, one
process, cells interleaved so the machine's noise hits both alike:

    python tools/packed_ab.py [--reps R] [--runs N] [--max-tokens T]

First, one batched step of 4 rows (128 tokens of context each) for several width patterns
(one row drafting k, the others plain; two rows drafting; all drafting different depths), its
wall time padded and packed, median of R reps. Then N runs of 4 chat requests decoded together
(speculation auto, the batch_bench requests), alternating packed and padded, with tok/s per
run, the steps that were ragged, the padded token rows packing left out, and whether every
request's tokens equal the first run's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PATTERNS = [(2, 1, 1, 1), (3, 1, 1, 1), (4, 1, 1, 1), (7, 1, 1, 1), (4, 4, 1, 1), (3, 2, 2, 1),
            (7, 3, 2, 1), (4, 4, 4, 4)]


def steps(lm, reps: int) -> None:
    from skulkp2p.engine.batching.scheduler import BatchScheduler

    sched = BatchScheduler(lm.model, 4)
    sched.mixed_chunk = 0  # (rows driven by hand: no prompt may wait for their steps)
    with sched.cond:  # 4 rows joined by hand, each holding 128 tokens
        rows = [sched.forward() for _ in range(4)]
        for i, row in enumerate(rows):
            row.prefill([1 + (7 * i + j) % 500 for j in range(128)])
            sched._join(row)
            row.joined = True

    def step(widths: tuple[int, ...], mode: str) -> float:
        sched.pack_ragged = mode != "padded"
        sched.pack_mlps_from = 10**9 if mode == "head" else 0
        with sched.cond:
            for row, w in zip(rows, widths, strict=True):
                row.submitted = [5] * w
            t0 = time.perf_counter()
            sched._step()
            dt = time.perf_counter() - t0
            for row, w in zip(rows, widths, strict=True):
                row.rollback(0, w)
                row.result = None
        return dt

    modes = ["padded", "head", "packed"]
    times: dict[tuple[tuple[int, ...], str], list[float]] = {
        (p, k): [] for p in PATTERNS for k in modes}
    for rep in range(reps + 1):
        for p in PATTERNS:
            for k in (modes if rep % 2 else modes[::-1]):
                dt = step(p, k)
                if rep:  # the first round warms up
                    times[(p, k)].append(dt)
    med = {key: sorted(v)[len(v) // 2] for key, v in times.items()}
    print("one batched step of 4 rows, 128 tokens of context each (median of "
          f"{reps} reps, ms): widths, real/padded token rows, padded, head only packed, "
          "MLPs and head packed, their ratios to padded")
    for p in PATTERNS:
        a, h, b = (med[(p, k)] for k in modes)
        print(f"  {p}: {sum(p)}/{4 * max(p)}  {a * 1e3:6.1f}  {h * 1e3:6.1f}  {b * 1e3:6.1f}"
              f"  {h / a:.2f}  {b / a:.2f}")


def runs(lm, n: int, max_tokens: int) -> None:
    from skulkp2p.engine.decode.mlx_engine import MlxEngine
    from tools import batch_bench

    engine = MlxEngine(lm, 0, memory_tokens=0, max_batch=4)
    sched = engine.scheduler
    batch_bench._run(engine, batch_bench.chat_requests(4, max_tokens, "auto"), True)  # warm-up
    first = None
    rates: dict[bool, list[float]] = {False: [], True: []}
    for i in range(n):
        packed = i % 4 in (0, 3)  # packed, padded, padded, packed, ...
        sched.pack_ragged = packed
        ragged, skipped, count = sched.ragged, sched.padding_skipped, sched.steps
        out, seconds = batch_bench._run(
            engine, batch_bench.chat_requests(4, max_tokens, "auto"), True)
        tokens = [r.tokens for r in out]
        first = first or tokens
        rate = sum(len(t) for t in tokens) / seconds
        rates[packed].append(rate)
        drafts = [(r.speculation.drafted, r.speculation.accepted) for r in out]
        print(f"run {i + 1} {'packed' if packed else 'padded'}: {rate:.1f} tok/s, "
              f"{sched.steps - count} steps, {sched.ragged - ragged} ragged, padded token rows "
              f"left out {sched.padding_skipped - skipped}; same tokens {tokens == first}; "
              f"(drafted, accepted) {drafts}")
    for k in (False, True):
        v = sorted(rates[k])
        if v:
            print(f"{'packed' if k else 'padded'}: median {v[len(v) // 2]:.1f} tok/s over "
                  f"{len(v)} runs")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--runs", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=100)
    args = p.parse_args()
    from skulkp2p.engine.cpu import blas
    blas.ensure_fast_blas()  # re-executes once with OpenBLAS preloaded, before mlx loads
    from tools import batch_bench
    lm = batch_bench._load()
    if args.reps:
        steps(lm, args.reps)
    if args.runs:
        runs(lm, args.runs, args.max_tokens)
    sys.stdout.flush()
    os._exit(0)  # (see tools/batch_bench.py: MLX's native threads at exit)


if __name__ == "__main__":
    main()
