"""A timeline of one batched round of the concurrency bench's clients on one MlxEngine (no HTTP):
when each prefill forward and each batched step ran (which rows, which widths), and when each
client got its first and its last token.

    python tools/batch_timeline.py [--clients 4] [--max-tokens 100] [--speculation off]
                                   [--workloads echo,code-edit,qa,creative]

The model: SmolLM2-135M from the test model store, float32 (tools/batch_bench.py). Every
workload is served once alone first (warm-up, and each one's solo time to first token). Then
the clients are released together, each its own thread; the forwards are timed by wrapping
the scheduler's (the lock serialises them, so a line's start is when the forward began).
Prints the events in order, then per client: time to first token, tokens, end; and the steps
grouped by rows x widest width (median ms).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=100)
    ap.add_argument("--speculation", default="off")
    ap.add_argument("--workloads", default="echo,code-edit,qa,creative")
    ap.add_argument("--steps", action="store_true", help="print every step, not only a summary")
    args = ap.parse_args()

    from skulkp2p.engine.cpu import blas
    blas.ensure_fast_blas()  # re-executes once with OpenBLAS preloaded, before mlx loads
    from skulkp2p.bench.workloads import WORKLOADS
    from skulkp2p.engine.batching import scheduler
    from skulkp2p.engine.decode.mlx_engine import MlxEngine
    from skulkp2p.engine.request import parse_request
    from tools import batch_bench

    events: list[tuple[float, str]] = []
    t_start = [0.0]

    def note(text: str, t0: float) -> None:
        events.append((t0 - t_start[0], f"{(time.perf_counter() - t0) * 1e3:7.1f} ms  {text}"))

    names: dict[int, str] = {}

    def who(row: object) -> str:
        return names.get(id(row), "?")

    prefill_group = scheduler.BatchScheduler._prefill_together

    def timed_prefill(self, group, hidden):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        prefill_group(self, group, hidden)
        note("prefill " + " + ".join(f"{who(c.row)}:{len(c.tokens)}" for c in group), t0)
    scheduler.BatchScheduler._prefill_together = timed_prefill  # type: ignore[method-assign]

    step = scheduler.BatchScheduler._step
    step_sizes: dict[tuple[int, int], list[float]] = {}

    def timed_step(self):  # type: ignore[no-untyped-def]
        rows = list(self.active)
        widths = [len(r.submitted) for r in rows]
        chunk = getattr(self, "riding", None)
        t0 = time.perf_counter()
        step(self)
        took = time.perf_counter() - t0
        step_sizes.setdefault((len(rows), max(widths)), []).append(took)
        if args.steps or chunk or max(widths) > 1:
            note("step " + " ".join(f"{who(r)}:{w}" for r, w in zip(rows, widths, strict=True)),
                 t0)
    scheduler.BatchScheduler._step = timed_step  # type: ignore[method-assign]

    make_row = scheduler.BatchScheduler.forward
    current = threading.local()

    def named_forward(self, *a, **k):  # type: ignore[no-untyped-def]
        row = make_row(self, *a, **k)
        names[id(row)] = getattr(current, "name", "?")
        return row
    scheduler.BatchScheduler.forward = named_forward  # type: ignore[method-assign]

    lm = batch_bench._load()
    engine = MlxEngine(lm, 0, memory_tokens=0, max_batch=args.clients)
    workloads = args.workloads.split(",")
    clients = [workloads[i % len(workloads)] for i in range(args.clients)]

    def request(wl: str):  # type: ignore[no-untyped-def]
        return parse_request({"messages": WORKLOADS[wl], "max_tokens": args.max_tokens,
                              "temperature": 0, "speculation": args.speculation})

    solo: dict[str, float] = {}
    for wl in workloads:
        t0 = time.perf_counter()
        gen = engine.generate(request(wl))
        first = None
        for _ in gen:
            first = first or time.perf_counter() - t0
        solo[wl] = first or 0.0
    events.clear()
    step_sizes.clear()

    firsts: list[float | None] = [None] * len(clients)
    ends: list[float] = [0.0] * len(clients)
    counts: list[int] = [0] * len(clients)

    def client(i: int) -> None:
        current.name = f"{clients[i]}#{i}"
        gen = engine.generate(request(clients[i]))
        for _ in gen:
            if firsts[i] is None:
                firsts[i] = time.perf_counter() - t_start[0]
                events.append((firsts[i], f"           FIRST TOKEN {current.name}"))
        ends[i] = time.perf_counter() - t_start[0]
        counts[i] = len(gen.result.tokens)
        events.append((ends[i], f"           END {current.name} ({counts[i]} tokens)"))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(clients))]
    t_start[0] = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t_start[0]
    for at, text in sorted(events):
        print(f"{at:8.3f} s {text}")
    print(f"wall {wall:.3f} s, {sum(counts)} tokens, {sum(counts) / wall:.1f} tok/s; solo TTFT "
          + ", ".join(f"{wl} {s:.3f}" for wl, s in solo.items()))
    for i, wl in enumerate(clients):
        print(f"  {wl}#{i}: first token {firsts[i]:.3f} s (solo {solo[wl]:.3f}), "
              f"{counts[i]} tokens, end {ends[i]:.3f} s")
    print("steps by rows x widest: median ms (count)")
    for (b, w), ts in sorted(step_sizes.items()):
        print(f"  {b} x {w:3d}: {statistics.median(ts) * 1e3:7.1f} ms ({len(ts)})")


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # (see tools/batch_bench.py: MLX's native threads at exit)
