"""Where a tensor group's call of w rows spends its time, by w: 2 rank processes on loopback
(the bench's `TensorBench`), then per width the fastest and median of N back-to-back calls
through a `TensorForward` (the ranks' time, as rank 0 reports it; every call rolled back after a
64-token prefill), 62 all-sums of w rows timed alone (`probe`) and a rank's compute of w rows
with no collective (`compute`). Run it under the bench lock:

    flock /tmp/skulk-bench.lock python tools/tensor_call_widths.py [--calls 20] [--widths 1,2,3,4,5,8,16]

    python tools/tensor_call_widths.py --cores-per-node 1 --head-ab 6 --widths 1,2,3,4,8,16

Prints one line per width; a width listed twice is measured twice (noise shows as a change).
`--cores-per-node K` pins the ranks and this process as `bench --cores-per-node` does.
`--head-ab N` instead times whole calls as the loop waits for them, the vocabulary-split head
(the ranks' logits) against this member's own head on the same group, alternating N times,
3 calls per width each time, and prints the medians side by side."""

from __future__ import annotations

import argparse
import statistics
import time

from skulkp2p.bench.arms.tensor_arm import TensorBench
from skulkp2p.engine.model.loader import serving_dtype
from skulkp2p.models.store import ModelStore

PREFILL = 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--widths", default="1,2,3,4,5,8,16,3,1")
    ap.add_argument("--cores-per-node", type=int, default=0)
    ap.add_argument("--head-ab", type=int, default=0, metavar="N")
    ap.add_argument("--link-delay-ms", type=float, default=0.0,
                    help="every hop through the bench's delaying proxy, as bench --link-delay-ms")
    args = ap.parse_args()
    from skulkp2p.engine.cpu import blas
    blas.ensure_fast_blas()  # as the bench's own CLI: OpenBLAS, inherited by the ranks
    widths = [int(w) for w in args.widths.split(",")]
    node_cpus = None
    if args.cores_per_node:
        from skulkp2p.bench.cores import node_cores, pin_this_process
        node_cpus = node_cores(2, args.cores_per_node)
        pin_this_process(node_cpus[0])
    bench = TensorBench(ModelStore(), args.model, serving_dtype(), 2,
                        link_delay_ms=args.link_delay_ms, node_cpus=node_cpus)
    loaded = bench.open()
    try:
        if args.head_ab:
            head_ab(loaded, sorted(set(widths)), args.head_ab)
            return
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


def head_ab(loaded, widths: list[int], rounds: int) -> None:
    import skulkp2p.engine.parallel.tensor.group as tensor

    split_max = tensor.SPLIT_LOGITS_MAX_BYTES
    ids = list(loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 20))
    took: dict[tuple[str, int], list[float]] = {}
    for n in range(rounds):
        for mode in (("split", "own") if n % 2 == 0 else ("own", "split")):
            tensor.SPLIT_LOGITS_MAX_BYTES = split_max if mode == "split" else 0
            fwd = loaded.make_forward(None, "after", None)
            fwd.prefill(ids[:PREFILL - 1])
            fwd(ids[PREFILL - 1:PREFILL])
            for width in widths:
                for _ in range(3):
                    t0 = time.perf_counter()
                    fwd(ids[PREFILL:PREFILL + width])
                    took.setdefault((mode, width), []).append(time.perf_counter() - t0)
                    fwd.rollback(PREFILL, width)
    tensor.SPLIT_LOGITS_MAX_BYTES = split_max
    for width in widths:
        split = statistics.median(took[("split", width)])
        own = statistics.median(took[("own", width)])
        print(f"w={width:2d}: split head {split * 1e3:6.1f} ms, the member's own head "
              f"{own * 1e3:6.1f} ms, split / own {split / own:.2f}", flush=True)


if __name__ == "__main__":
    main()
