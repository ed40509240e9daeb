"""The batch-aware gate against the gate it replaced, side by side in ONE process (SmolLM2-135M
float32, the test model store):

    python tools/batch_gate_ab.py [REPS]

Each rep runs, interleaved: the 4 chat requests of tools/batch_bench.py (100 tokens,
speculation auto) one after another (FIFO), all at once with speculation off, all at once with
the old gate (a draft priced as if it alone widened the batch: ((B - 1) + E(k)) c(B) /
(B (c(B (k + 1)) + d k)), patched in for its rounds), and all at once with today's gate. Every
output must equal the FIFO one. Prints each round's tok/s and drafts, then medians and the
new/old ratio per rep (a shared machine's noise hits both gates alike within a rep).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _old_best_depth(self, limit: int, batch=None) -> tuple[int, float]:
    from skulkp2p.engine.drafting.gates import SOLO, width_cost
    view = batch if batch is not None else self.batch() if self.batch is not None else SOLO
    rows = len(view.widths) + 1
    base = width_cost(self.costs, rows)
    best_k, best_gain = 0, 1.0
    expected, reach = 1.0, 1.0
    for k, a in enumerate(self.rates()[:limit], start=1):
        reach *= a
        expected += reach
        step = width_cost(self.costs, rows * (k + 1)) + self.draft_cost * k
        gain = (rows - 1 + expected) * base / (rows * step)
        if gain > best_gain:
            best_k, best_gain = k, gain
    return best_k, best_gain


def main(reps: int) -> None:
    from skulkp2p.engine.cpu import blas
    blas.ensure_fast_blas()  # re-executes once with OpenBLAS preloaded, before mlx loads
    from skulkp2p.engine.decode.mlx_engine import MlxEngine
    from skulkp2p.engine.drafting.gates import DepthController
    from tools import batch_bench

    new_best_depth = DepthController.best_depth
    n, max_tokens = 4, 100
    lm = batch_bench._load()
    fifo = MlxEngine(lm, 0, memory_tokens=0, max_batch=1)
    batch = MlxEngine(lm, 0, memory_tokens=0, max_batch=n)

    def reqs(spec: str) -> list:
        return batch_bench.chat_requests(n, max_tokens, spec)

    alone, _ = batch_bench._run(fifo, reqs("auto"), False)  # (also warms up)
    times: dict[str, list[float]] = {"fifo-auto": [], "batched-off": [], "batched-auto-old": [],
                                     "batched-auto-new": []}
    tokens = 0
    for rep in range(reps):
        for name, seconds in times.items():
            if name == "fifo-auto":
                out, t = batch_bench._run(fifo, reqs("auto"), False)
            else:
                DepthController.best_depth = (_old_best_depth if name.endswith("old")
                                              else new_best_depth)
                out, t = batch_bench._run(batch, reqs("off" if name.endswith("off")
                                                      else "auto"), True)
            if [r.tokens for r in out] != [r.tokens for r in alone]:
                raise SystemExit(f"{name}: an output differs from FIFO's")
            tokens = sum(len(r.tokens) for r in out)
            seconds.append(t)
            drafts = [(r.speculation.drafted, r.speculation.accepted) if r.speculation else None
                      for r in out]
            print(f"rep {rep} {name}: {tokens / t:.1f} tok/s {drafts}", flush=True)
    DepthController.best_depth = new_best_depth
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print("median tok/s:", {k: round(tokens / v, 1) for k, v in med.items()})
    print("x fifo-auto:", {k: round(med["fifo-auto"] / v, 2) for k, v in med.items()})
    print("new/old:", round(med["batched-auto-old"] / med["batched-auto-new"], 2), "per rep:",
          [round(o / w, 2) for o, w in zip(times["batched-auto-old"], times["batched-auto-new"],
                                           strict=True)])


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
    sys.stdout.flush()
    os._exit(0)  # (see tools/batch_bench.py: MLX's native threads at exit)
