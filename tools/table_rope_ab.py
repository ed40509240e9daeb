"""Rotary embeddings from the table (engine/cpu/table_rope.py) on and off, side by side in one
process: plain and speculative decoding with each, and mlx-lm's own generate beside them.

    python tools/table_rope_ab.py --workloads code-edit,echo,qa --pairs 2

The bench's engine runs (SmolLM2-135M float32 from the test model store by default, greedy,
200 tokens, a fresh engine each), the model's ropes switched between `nn.RoPE` ("off") and
`TableRoPE` ("on") between runs; the arms' order reverses from pair to pair. Prints each run's
tok/s, whether every arm's tokens were the same, and per workload the per-pair ratios: plain
on ÷ off, spec on ÷ off, spec ÷ plain with each, plain ÷ mlx_lm with each.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ARMS = ("plain-off", "plain-on", "spec-off", "spec-on", "mlx_lm")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="code-edit,echo,qa")
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=200)
    args = p.parse_args()

    from skulkp2p.engine.cpu import blas
    blas.ensure_fast_blas()  # re-executes once with OpenBLAS preloaded, before mlx loads
    import mlx.nn as nn

    from skulkp2p.bench.arms.mlx_arms import run_engine, run_mlx_lm
    from skulkp2p.bench.workloads import WORKLOADS
    from skulkp2p.engine.cpu import table_rope
    from skulkp2p.engine.model.loader import open_model
    from skulkp2p.models.store import ModelStore
    from tests.helpers.models import test_data_dir

    loaded = open_model(ModelStore(test_data_dir()), "smollm2-135m", dtype="float32")
    ropes = [m for _, m in loaded.model.named_modules() if isinstance(m, nn.RoPE)]
    if not ropes or not all(type(m) is table_rope.TableRoPE for m in ropes):
        raise SystemExit("table_rope_ab: the model's ropes are not TableRoPE (turned off?)")

    def switch(on: bool) -> None:
        for m in ropes:
            m.__class__ = table_rope.TableRoPE if on else nn.RoPE

    run_engine(loaded, WORKLOADS["qa"], 16, "auto")  # warm-up
    got: dict[tuple[str, str], list] = {}
    workloads = args.workloads.split(",")
    for i in range(args.pairs):
        for wl in workloads:
            for arm in ARMS if i % 2 == 0 else ARMS[::-1]:
                if arm == "mlx_lm":
                    run = run_mlx_lm(loaded, WORKLOADS[wl], args.max_tokens)
                else:
                    switch(arm.endswith("-on"))
                    run = run_engine(loaded, WORKLOADS[wl], args.max_tokens,
                                     "off" if arm.startswith("plain") else "auto")
                got.setdefault((wl, arm), []).append(run)
                print(f"pair {i + 1} {wl} {arm}: {run.tok_s:.2f} tok/s", flush=True)
            same = len({tuple(got[(wl, a)][-1].tokens) for a in ARMS}) == 1
            print(f"pair {i + 1} {wl}: identical {same}", flush=True)
    switch(True)
    for wl in workloads:
        tok = {a: [r.tok_s for r in got[(wl, a)]] for a in ARMS}

        def ratio(a: str, b: str, tok: dict[str, list[float]] = tok) -> list[float]:
            return [round(x / y, 3) for x, y in zip(tok[a], tok[b], strict=True)]

        print(f"{wl}: plain on÷off {ratio('plain-on', 'plain-off')}, spec on÷off "
              f"{ratio('spec-on', 'spec-off')}, spec÷plain off {ratio('spec-off', 'plain-off')} "
              f"on {ratio('spec-on', 'plain-on')}, plain÷mlx_lm off "
              f"{ratio('plain-off', 'mlx_lm')} on {ratio('plain-on', 'mlx_lm')}")


if __name__ == "__main__":
    main()
