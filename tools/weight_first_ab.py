"""Weight-first verify products (engine/cpu/weight_first.py), or with `--part numpy` a verify's
softmax and SwiGLU in numpy (engine/cpu/numpy_verify.py), on and off, side by side in one process.

Default: N pairs per workload of the bench's engine run (SmolLM2-135M float32 by default, greedy,
`auto` speculation, a fresh engine each), the model's linear layers switched between
`nn.Linear` ("off") and the weight-first classes ("on") between runs, with a plain run in each
pair as the reference; the arms' order alternates from pair to pair. Prints each pair's tok/s,
spec ÷ plain for both, on ÷ off, and whether every output was the same.

`--widths`: instead, whole verify forwards of w rows after a prefill, on and off interleaved
call by call (each rolled back), at one and two OpenBLAS threads; the median ratio per width.

    python tools/weight_first_ab.py --workloads echo,code-edit,qa,creative --pairs 3
    python tools/weight_first_ab.py --widths 2,4,8,16,17 --reps 8
    python tools/weight_first_ab.py --part numpy --widths 2,8,16 --context 450

With `--part numpy` the products stay weight-first in both arms and "off" hands every verify's
attention and SwiGLU back to mlx-lm's (as `SKULKP2P_NUMPY_VERIFY=0` would at load).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


PART = "weight-first"


def switch(model: Any, on: bool) -> None:
    import mlx.nn as nn

    from skulkp2p.engine.cpu import numpy_verify, weight_first

    if PART == "numpy":
        numpy_verify.active = on
        return

    for _, module in model.named_modules():
        if isinstance(module, nn.Linear) and not isinstance(module, nn.QuantizedLinear):
            module.__class__ = weight_first.WeightFirstLinear if on else nn.Linear
        elif isinstance(module, nn.Embedding) and not isinstance(module, nn.QuantizedEmbedding):
            module.__class__ = weight_first.WeightFirstEmbedding if on else nn.Embedding


def pairs(loaded: Any, workloads: list[str], count: int, max_tokens: int) -> None:
    from skulkp2p.bench.arms.mlx_arms import run_engine
    from skulkp2p.bench.workloads import WORKLOADS

    run_engine(loaded, WORKLOADS["qa"], 16, "auto")  # warm-up
    got: dict[tuple[str, str], list[Any]] = {}
    for i in range(count):
        for wl in workloads:
            order = ("off", "on", "plain") if i % 2 == 0 else ("plain", "on", "off")
            for arm in order:
                switch(loaded.model, arm == "on")
                run = run_engine(loaded, WORKLOADS[wl], max_tokens,
                                 "off" if arm == "plain" else "auto")
                got.setdefault((wl, arm), []).append(run)
                print(f"pair {i + 1} {wl} {arm}: {run.tok_s:.2f} tok/s"
                      + ("" if run.drafted is None else f", {run.accepted}/{run.drafted}"),
                      flush=True)
            same = len({tuple(got[(wl, a)][-1].tokens) for a in order}) == 1
            print(f"pair {i + 1} {wl}: identical {same}", flush=True)
    for wl in workloads:
        plain, off, on = ([r.tok_s for r in got[(wl, a)]] for a in ("plain", "off", "on"))
        gain = [a / b for a, b in zip(on, off, strict=True)]
        print(f"{wl}: spec÷plain off {[round(a / b, 2) for a, b in zip(off, plain, strict=True)]}"
              f", on {[round(a / b, 2) for a, b in zip(on, plain, strict=True)]}; on÷off per "
              f"pair {[round(g, 3) for g in gain]}, median {statistics.median(gain):.3f}")


def widths(loaded: Any, ws: list[int], reps: int, context: int) -> None:
    from skulkp2p.bench.workloads import ECHO_CODE
    from skulkp2p.engine.cache import caches
    from skulkp2p.engine.cpu import blas_threads
    from skulkp2p.engine.drafting.width_costs import width_tokens
    from skulkp2p.engine.model.forward import LocalForward

    tokens = width_tokens(loaded, ECHO_CODE, context + max(ws))
    fwd = LocalForward(loaded.model)
    fwd.prefill(tokens[:context])
    snap = caches.snapshot(fwd.cache, max(ws))
    for threads in (1, 2):
        t: dict[tuple[int, bool], list[float]] = {(w, on): [] for w in ws for on in (False, True)}
        with blas_threads.pinned(threads):
            for rep in range(reps + 1):  # rep 0 warms up
                for w in ws:
                    for on in ((False, True) if rep % 2 else (True, False)):
                        switch(loaded.model, on)
                        t0 = time.perf_counter()
                        fwd(tokens[context:context + w])
                        dt = time.perf_counter() - t0
                        caches.restore(fwd.cache, snap, reuse=True)
                        if rep:
                            t[(w, on)].append(dt)
        print(f"{threads} thread(s), {context} tokens of context: " + ", ".join(
            f"w{w} {statistics.median(t[(w, False)]) * 1e3:.1f} -> "
            f"{statistics.median(t[(w, True)]) * 1e3:.1f} ms "
            f"({statistics.median(t[(w, True)]) / statistics.median(t[(w, False)]):.3f})"
            for w in ws), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="echo,code-edit,qa,creative")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--widths", default=None, help="instead: whole verify forwards of these "
                   "widths, on and off interleaved")
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--part", choices=("weight-first", "numpy"), default="weight-first")
    p.add_argument("--model", default=None, help="a card id from the default store (default: "
                   "SmolLM2-135M from the test model store)")
    args = p.parse_args()
    global PART
    PART = args.part

    from skulkp2p.engine.cpu import blas
    blas.ensure_fast_blas()  # re-executes once with OpenBLAS preloaded, before mlx loads
    from skulkp2p.engine.model.loader import open_model
    from skulkp2p.models.store import ModelStore

    if args.model is None:
        from tests.helpers.models import test_data_dir
        loaded = open_model(ModelStore(test_data_dir()), "smollm2-135m", dtype="float32")
    else:
        loaded = open_model(ModelStore(), args.model, dtype="float32")
    if args.widths:
        widths(loaded, [int(w) for w in args.widths.split(",")], args.reps, args.context)
    else:
        pairs(loaded, args.workloads.split(","), args.pairs, args.max_tokens)


if __name__ == "__main__":
    main()
