"""What a batched head forward costs against the per-row head calls it replaces (SmolLM2-135M
float32 with its shipped EAGLE head, the test model store):

    python tools/head_batch_cost.py [REPS] [CONTEXT]

Four rows hold CONTEXT (default 300) head positions each. Cells, interleaved REPS times (default
20) so that the machine's noise hits them alike: one trunk step of one token (the unit the gate's
costs are relative to), one row's head call as MtpDrafter runs it alone (forward, argmax read),
the four rows' calls one after another (the scheduler before engine/batching/head_batch.py), and the four
rows' calls as one batched forward (`HeadRows.run`), for calls of 1 and 2 tokens (a round's
verified rows). Prints median milliseconds, the head call's cost relative to the trunk step (the
gate's d), and the batched forward against one call (the gate now prices D rows' calls at
c(D) times one: c(4) = 1.35 in the float32 table) and against four.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class _Alone:
    """The barrier of a batch that has no trunk rows: the caller runs the forward itself."""

    def __init__(self) -> None:
        self.cond = threading.Condition()

    def heads_if_ready(self) -> None:
        pass


def main(reps: int, context: int) -> None:
    from skulkp2p.engine.cpu import blas
    blas.ensure_fast_blas()  # re-executes once with OpenBLAS preloaded, before mlx loads
    import mlx.core as mx

    from skulkp2p.engine.batching.head_batch import HeadCall, HeadRows
    from skulkp2p.engine.drafting.gates import DEFAULT_WIDTH_COSTS
    from skulkp2p.engine.model.forward import LocalForward
    from tools import batch_bench

    lm = batch_bench._load()
    head = lm.mtp
    size = int(head.final_norm.weight.shape[0])
    rng = mx.random.key(0)
    caches = []
    for i in range(4):
        c = head.make_cache()
        n = context + 7 * i
        head(mx.random.normal((n, size), key=rng), mx.array([5 + i] * n), c)
        mx.eval(c.keys, c.values)
        caches.append(c)
    barrier = _Alone()
    rows = HeadRows(head, barrier)
    members = [object() for _ in range(4)]
    for m, c in zip(members, caches, strict=True):
        rows.join(m, c)
    x = mx.random.normal((4, 2, size), key=rng)
    trunk = LocalForward(lm.model)
    trunk.prefill(list(range(3, 3 + context)))
    mx.eval(x)

    def trunk_step(w: int) -> None:
        int(mx.argmax(trunk([7])[-1]).item())
        trunk.rollback(keep=0, dropped=1)

    def solo(w: int, n: int) -> None:
        for i, c in enumerate(caches[:n]):
            out = head(x[i, :w], mx.array([7] * w), c)
            int(mx.argmax(out.logits[-1]).item())
            c.trim(w)

    def batched(w: int) -> None:
        with barrier.cond:
            for i, m in enumerate(members):
                rows.pending[m] = HeadCall(x[i, :w], [7] * w)
            rows.run()
            for m in members:
                rows.trim(m, w)

    cells = {"trunk step, 1 row": lambda: trunk_step(1)}
    for w in (1, 2):
        cells[f"w={w} head call, 1 row"] = lambda w=w: solo(w, 1)
        cells[f"w={w} head calls, 4 rows one by one"] = lambda w=w: solo(w, 4)
        cells[f"w={w} head forward, 4 rows batched"] = lambda w=w: batched(w)
    times: dict[str, list[float]] = {k: [] for k in cells}
    for f in cells.values():  # warm-up
        f()
    for _ in range(reps):
        for name, f in cells.items():
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
    for k, v in med.items():
        print(f"{k:38s} {v:7.2f} ms")
    step = med["trunk step, 1 row"]
    c4 = DEFAULT_WIDTH_COSTS["float32"][4]
    for w in (1, 2):
        one = med[f"w={w} head call, 1 row"]
        four = med[f"w={w} head calls, 4 rows one by one"]
        both = med[f"w={w} head forward, 4 rows batched"]
        print(f"w={w}: head call / trunk step (d) {one / step:.3f}; batched 4 rows / one call "
              f"{both / one:.2f} (priced c(4) = {c4}); batched / one by one {both / four:.2f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20,
         int(sys.argv[2]) if len(sys.argv) > 2 else 300)
    sys.stdout.flush()
    os._exit(0)  # (see tools/batch_bench.py: MLX's native threads at exit)
