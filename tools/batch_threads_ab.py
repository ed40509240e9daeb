"""In-process A/B of the OpenBLAS thread policy on a batch: 4 plain chat requests (the bench's
echo, code-edit, qa and creative, 100 tokens) decoded together on one MlxEngine (max_batch 4),
the policy counting the scheduler's forwards as one owner's ("after", engine/cpu/blas_threads.py) or
each calling thread's ("before", as it did), rounds alternating in one process:

    python tools/batch_threads_ab.py [PAIRS]

Prints each round's aggregate tok/s, its forwards per OpenBLAS thread count and how many the
policy counted as shared, then the median per mode. SmolLM2-135M float32 from the test store.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORKLOADS = ["echo", "code-edit", "qa", "creative"]


def one_round(engine: Any) -> float:
    """The 4 requests at once, each on its own thread: aggregate tokens per second."""
    from skulkp2p.bench.arms.mlx_arms import engine_request
    from skulkp2p.bench.workloads import WORKLOADS as PROMPTS

    tokens = [0] * len(WORKLOADS)

    def go(i: int) -> None:
        generation = engine.generate(engine_request(PROMPTS[WORKLOADS[i]], 100, "off"))
        for _ in generation:
            pass
        tokens[i] = len(generation.result.tokens)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(WORKLOADS))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(tokens) / (time.perf_counter() - t0)


def main() -> None:
    from skulkp2p.engine.cpu import blas

    blas.ensure_fast_blas()  # re-executes once with OpenBLAS preloaded, before mlx loads
    from skulkp2p.engine.cpu import blas_threads as bt
    from skulkp2p.engine.decode.mlx_engine import MlxEngine
    from skulkp2p.engine.model.loader import open_model
    from skulkp2p.models.store import ModelStore
    from tests.helpers.models import test_data_dir

    pairs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    loaded = open_model(ModelStore(test_data_dir()), "smollm2-135m", dtype="float32")
    policy = bt.policy()
    if policy is None:
        sys.exit("batch_threads_ab: no OpenBLAS thread policy in this process")
    after = bt.ThreadPolicy._note_thread

    def before(self: Any, now: float, owner: object | None) -> None:
        after(self, now, None)  # every calling thread its own owner, as before

    engine = MlxEngine(loaded, prefix_cache_mb=0, max_batch=len(WORKLOADS))
    one_round(engine)  # warm-up
    speeds: dict[str, list[float]] = {"before": [], "after": []}
    for r in range(pairs):
        for mode in (["after", "before"] if r % 2 else ["before", "after"]):
            bt.ThreadPolicy._note_thread = before if mode == "before" else after  # type: ignore
            forwards, shared = dict(policy.counters.forwards), policy.counters.shared
            speeds[mode].append(one_round(engine))
            now = policy.counters.forwards
            print(f"{mode:6s} {speeds[mode][-1]:6.2f} tok/s  forwards per thread count "
                  f"{ {k: now.get(k, 0) - forwards.get(k, 0) for k in sorted(now)} }  shared "
                  f"{policy.counters.shared - shared}", flush=True)
    bt.ThreadPolicy._note_thread = after  # type: ignore[method-assign]
    for mode, values in speeds.items():
        print(f"{mode}: median {statistics.median(values):.2f} tok/s over {len(values)} rounds")


if __name__ == "__main__":
    main()
