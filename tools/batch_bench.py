"""Measure continuous batching on the MLX engine (engine/batching/scheduler.py), SmolLM2-135M float32.

    python tools/batch_bench.py 4 100            # 4 requests of 100 tokens: batched vs FIFO
    python tools/batch_bench.py 8 100 --arms off
    python tools/batch_bench.py --widths         # one batched forward vs rows and width

The first form runs the same chat requests one after another on an engine with max_batch 1
(FIFO) and all at once on one with max_batch N, per speculation arm, in one process, and prints
aggregate tok/s, the ratio, whether every request's tokens are the same both ways, and each
request's drafted/accepted counts. `--widths` times one batched forward of B rows of w tokens
each (128 tokens of context per row), cells interleaved so the machine's noise hits all alike,
relative to B = 1, w = 1, beside the cost table's c(B w) that the depth controller uses.
The model comes from the test model store (the same cache the tests use).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QUESTIONS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a hash table works, with an example in Python.",
    "Rewrite this code with type hints:\ndef add(a, b):\n    return a + b\n\n"
    "def mul(a, b):\n    return a * b\n",
    "List the planets of the solar system with one fact each.",
    "What are the benefits of regular exercise?", "Describe the water cycle.",
    "Translate to French: the cat sleeps on the warm windowsill.",
    "Give me a recipe for pancakes."]


def _load():
    from skulkp2p.engine.model.loader import open_model
    from skulkp2p.models.store import ModelStore
    from tests.helpers.models import test_data_dir
    return open_model(ModelStore(test_data_dir()), "smollm2-135m", dtype="float32")


def _run(engine, reqs, concurrent: bool):
    out = [None] * len(reqs)

    def go(i: int) -> None:
        gen = engine.generate(reqs[i])
        list(gen)
        out[i] = gen.result

    t0 = time.perf_counter()
    if concurrent:
        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(reqs))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    else:
        for i in range(len(reqs)):
            go(i)
    return out, time.perf_counter() - t0


def chat_requests(n: int, max_tokens: int, spec: str) -> list:
    """n chat requests over QUESTIONS (ids 0..n-1), each with this speculation setting."""
    from skulkp2p.engine.request import parse_request
    return [parse_request({"id": i, "messages": [{"role": "user", "content": QUESTIONS[
        i % len(QUESTIONS)]}], "max_tokens": max_tokens, "speculation": spec})
        for i in range(n)]


def concurrency(n: int, max_tokens: int, arms: list[str]) -> None:
    from skulkp2p.engine.decode.mlx_engine import MlxEngine

    lm = _load()
    fifo = MlxEngine(lm, 0, memory_tokens=0, max_batch=1)
    batch = MlxEngine(lm, 0, memory_tokens=0, max_batch=n)

    def reqs(spec: str):
        return chat_requests(n, max_tokens, spec)

    _run(fifo, reqs("off")[:1], False)  # warm up
    for spec in arms:
        rs = reqs(spec)
        alone, t_fifo = _run(fifo, rs, False)
        together, t_batch = _run(batch, rs, True)
        tokens = sum(len(r.tokens) for r in alone)
        same = sum(a.tokens == b.tokens for a, b in zip(alone, together, strict=True))
        drafts = [(r.speculation.drafted, r.speculation.accepted) if r.speculation else None
                  for r in together]
        print(f"{spec}: {n} clients, {tokens} tokens: FIFO {tokens / t_fifo:.1f} tok/s, "
              f"batched {sum(len(r.tokens) for r in together) / t_batch:.1f} tok/s = "
              f"{t_fifo / t_batch:.2f}x; identical {same}/{n}; peak rows "
              f"{batch.scheduler.peak}; batched (drafted, accepted) {drafts}")


def widths(reps: int) -> None:
    from skulkp2p.engine.batching.scheduler import BatchScheduler
    from skulkp2p.engine.drafting.gates import DEFAULT_WIDTH_COSTS, width_cost

    lm = _load()
    rows_, widths_ = [1, 2, 4, 8], [1, 2, 4, 8]
    batches = {}
    for b in rows_:
        sched = BatchScheduler(lm.model, b)
        sched.mixed_chunk = 0  # (rows driven by hand: no prompt may wait for their steps)
        with sched.cond:  # b rows joined by hand, each holding 128 tokens
            rows = [sched.forward() for _ in range(b)]
            for i, row in enumerate(rows):
                row.prefill([1 + (7 * i + j) % 500 for j in range(128)])
                sched._join(row)
                row.joined = True
        batches[b] = (sched, rows)

    def step(b: int, w: int) -> float:
        sched, rows = batches[b]
        with sched.cond:
            for row in rows:
                row.submitted = [5] * w
            t0 = time.perf_counter()
            sched._step()
            dt = time.perf_counter() - t0
            for row in rows:
                row.rollback(0, w)
                row.result = None
        return dt

    times: dict[tuple[int, int], list[float]] = {(b, w): [] for b in rows_ for w in widths_}
    for rep in range(reps + 1):
        for b in rows_:
            for w in widths_:
                dt = step(b, w)
                if rep:  # the first round warms up
                    times[(b, w)].append(dt)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    base = med[(1, 1)]
    table = DEFAULT_WIDTH_COSTS["float32"]
    print(f"one row of one token: {base * 1000:.1f} ms; cost relative to it (table c(B*w)):")
    for b in rows_:
        print(f"B={b}: " + "  ".join(f"w={w}: {med[(b, w)] / base:.2f} "
                                     f"({width_cost(table, b * w):.2f})" for w in widths_))
    print("plain batch speed-up per forward:", {b: round(b * base / med[(b, 1)], 2)
                                                for b in rows_})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("clients", nargs="?", type=int, default=4)
    p.add_argument("max_tokens", nargs="?", type=int, default=100)
    p.add_argument("--arms", default="off,auto", help="speculation arms, comma-separated")
    p.add_argument("--widths", action="store_true", help="time batched forwards instead")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    from skulkp2p.engine.cpu import blas
    blas.ensure_fast_blas()  # re-executes once with OpenBLAS preloaded, before mlx loads
    if args.widths:
        widths(args.reps)
    else:
        concurrency(args.clients, args.max_tokens, args.arms.split(","))
    # Threads that ran MLX leave native threads whose teardown at exit can abort (SIGABRT,
    # "terminate called without an active exception"; node/join.py leaves the same way).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
