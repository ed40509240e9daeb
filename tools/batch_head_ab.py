"""Batched head drafts against per-row ones, side by side in ONE process (SmolLM2-135M float32
with its shipped EAGLE head, the test model store):

    python tools/batch_head_ab.py [REPS]

Each rep runs, interleaved: the 4 chat requests of tools/batch_bench.py (100 tokens,
speculation auto) one after another (FIFO), all at once with speculation off, and all at once
with speculation auto three ways: each row's head on its own (`solo-heads`: the rows' head
calls one at a time, as before engine/batching/head_batch.py; `RowForward.head_batch` patched to say
"alone" for its rounds), the heads batched with the gate pricing D drafting rows' heads as D
separate drafters (`batched-heads`, `MtpDrafter.shared_in_batch` off), and batched with the gate
pricing them as one head forward over D rows (`batched-heads+gate`, today's). Every output must
equal the FIFO one. The arms' order turns by one each rep. Prints each round's tok/s and
drafts, then medians, x FIFO, and per-rep ratios against `solo-heads` (a shared machine's noise
hits the arms of one rep alike).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(reps: int) -> None:
    from skulkp2p.engine.cpu import blas
    blas.ensure_fast_blas()  # re-executes once with OpenBLAS preloaded, before mlx loads
    from skulkp2p.engine.batching.row_forward import RowForward
    from skulkp2p.engine.decode.mlx_engine import MlxEngine
    from skulkp2p.engine.drafting.mtp_drafter import MtpDrafter
    from tools import batch_bench

    batched_head = RowForward.head_batch
    n, max_tokens = 4, 100
    lm = batch_bench._load()
    fifo = MlxEngine(lm, 0, memory_tokens=0, max_batch=1)
    batch = MlxEngine(lm, 0, memory_tokens=0, max_batch=n)

    def reqs(spec: str) -> list:
        return batch_bench.chat_requests(n, max_tokens, spec)

    def arm(name: str) -> None:
        solo_heads = name == "solo-heads"
        RowForward.head_batch = (lambda self, head: None) if solo_heads else batched_head
        MtpDrafter.shared_in_batch = name == "batched-heads+gate"

    alone, _ = batch_bench._run(fifo, reqs("auto"), False)  # (also warms up)
    batch_bench._run(batch, reqs("auto"), True)
    times: dict[str, list[float]] = {"fifo-auto": [], "batched-off": [], "solo-heads": [],
                                     "batched-heads": [], "batched-heads+gate": []}
    tokens = 0
    names = list(times)
    for rep in range(reps):
        # (the arms' order turns by one each rep: a slot that is slower for another reason,
        # say another job's phase, does not always fall to the same arm)
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            seconds = times[name]
            arm(name)
            heads = sum(h.forwards for h in batch.scheduler.heads.values())
            if name == "fifo-auto":
                out, t = batch_bench._run(fifo, reqs("auto"), False)
            else:
                out, t = batch_bench._run(batch, reqs("off" if name.endswith("off")
                                                      else "auto"), True)
            if [r.tokens for r in out] != [r.tokens for r in alone]:
                raise SystemExit(f"{name}: an output differs from FIFO's")
            tokens = sum(len(r.tokens) for r in out)
            seconds.append(t)
            drafts = [(r.speculation.drafted, r.speculation.accepted) if r.speculation else None
                      for r in out]
            heads = sum(h.forwards for h in batch.scheduler.heads.values()) - heads
            print(f"rep {rep} {name}: {tokens / t:.1f} tok/s, batched head forwards {heads}, "
                  f"drafted/accepted {drafts}", flush=True)
    arm("batched-heads+gate")
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print("median tok/s:", {k: round(tokens / v, 1) for k, v in med.items()})
    print("x fifo-auto:", {k: round(med["fifo-auto"] / v, 2) for k, v in med.items()})
    for name in ("batched-heads", "batched-heads+gate"):
        print(f"{name} / solo-heads per rep:",
              [round(s / b, 2) for s, b in zip(times["solo-heads"], times[name], strict=True)])


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
    sys.stdout.flush()
    os._exit(0)  # (see tools/batch_bench.py: MLX's native threads at exit)
