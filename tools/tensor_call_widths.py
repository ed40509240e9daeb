"""Where a tensor group's call of w rows spends its time, by w: 2 rank processes on loopback
(the bench's `TensorBench`), then per width the fastest and median of N back-to-back calls
through a `TensorForward` (the ranks' time, as rank 0 reports it; every call rolled back after a
64-token prefill), 62 all-sums of w rows timed alone (`probe`) and a rank's compute of w rows
with no collective (`compute`). Run it under the bench lock:

    flock /tmp/skulk-bench.lock python tools/tensor_call_widths.py [--calls 20] [--widths 1,2,3,4,5,8,16]

Prints one line per width; a width listed twice is measured twice (noise shows as a change)."""

from __future__ import annotations

import argparse
import statistics

from skulkp2p.bench.tensor import TensorBench
from skulkp2p.engine.loader import serving_dtype
from skulkp2p.models.store import ModelStore

PREFILL = 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--widths", default="1,2,3,4,5,8,16,3,1")
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    bench = TensorBench(ModelStore(), args.model, serving_dtype(), 2)
    loaded = bench.open()
    try:
        fwd = loaded.make_forward(None, None, None)
        ids = list(loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 20))
        fwd.prefill(ids[:PREFILL])
        rank0 = bench.ranks[0]
        collectives = bench.per_call_collectives
        for width in widths:
            calls = []
            for _ in range(args.calls):
                before = fwd.ranks_s
                fwd(ids[PREFILL:PREFILL + width])
                fwd.rollback(PREFILL, width)
                calls.append(fwd.ranks_s - before)
            alone = rank0.probe(width, collectives * 5) / 5
            compute = rank0.compute(width, 5) / 5
            print(f"w={width:2d}: a call in the ranks {statistics.median(calls) * 1e3:7.1f} ms "
                  f"(fastest {min(calls) * 1e3:6.1f}); {collectives} all-sums alone "
                  f"{alone * 1e3:6.1f} ms; compute alone {compute * 1e3:6.1f} ms", flush=True)
    finally:
        bench.close()


if __name__ == "__main__":
    main()
