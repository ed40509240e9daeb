"""Where the time of a batched speculative step goes (SmolLM2-135M float32, the test model
store): 4 chat requests of 100 tokens decode together on one MlxEngine, and every part that runs
under the scheduler's lock is timed by wrapping it (the lock serialises them, so their wall times
add up):

    python tools/batch_profile.py [auto|off] [ROWS] [packed|padded]

The third argument is how the gates price a ragged step (`BatchScheduler.price_packed`): as it
runs packed (the default) or padded to the widest (as before packing), for an A/B of the gates.
After the parts, every step of the run grouped by its rows' widths: real and padded token rows,
median seconds, and the price the gates' cost model gives it, padded and packed
(gates.step_cost), then the depths the gates chose in the batch.

Parts: the batched forward (graph building in run_rows, its KV writes and masks, and mx.eval of
the step), each row's drafting (the gate's depth choice and the drafter), the batched head
forwards (engine/batching/head_batch.py: every drafting row's head call at once), each row's accept
(greedy_tokens) and rollback, the settles, and the prompts' prefill. Prints seconds and the
share of the run's wall time. A warm-up run goes first.

A row's drafting and observe may run the batched head forward (the row that completes the
barrier runs everyone's) and may wait for the other rows' calls (the lock let go, their turns
timed as theirs): those parts are timed on their own lines and taken out of the row's lines,
which show the row's own time. "head drafting, all of it" adds the head's share: the batched
forwards and the head drafter's own time.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

spent: collections.defaultdict[str, float] = collections.defaultdict(float)
calls: collections.Counter[str] = collections.Counter()
_apart = threading.local()  # seconds of timed-apart parts (head forwards, waits) on this thread


def _timed(owner: object, name: str, label: str, apart: bool = False) -> None:
    """Time `owner.name` under `label`; `apart`: its time is taken out of the enclosing timed
    calls on this thread (a batched head forward or a wait inside a row's drafting)."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        before = getattr(_apart, "s", 0.0)
        try:
            return inner(*args, **kwargs)
        finally:
            took = time.perf_counter() - t0
            nested = getattr(_apart, "s", 0.0) - before
            spent[label] += took - nested
            calls[label] += 1
            if apart:
                _apart.s = before + took
    setattr(owner, name, wrapper)


def main(spec: str, n: int, price: str = "packed") -> None:
    from skulkp2p.engine.cpu import blas
    blas.ensure_fast_blas()  # re-executes once with OpenBLAS preloaded, before mlx loads
    from skulkp2p.engine.batching import head_batch, row_forward, scheduler
    from skulkp2p.engine.cache import batch_cache
    from skulkp2p.engine.decode import generate
    from skulkp2p.engine.decode import loop as decode
    from skulkp2p.engine.decode.mlx_engine import MlxEngine
    from skulkp2p.engine.drafting import gates, suffix
    from skulkp2p.engine.drafting.mtp_drafter import MtpDrafter
    from skulkp2p.engine.model import stage
    from tools import batch_bench

    _timed(scheduler.BatchScheduler, "_step", "step (all of it)")
    # Each step's seconds by its padded token rows (rows x widest), against the cost table.
    by_size: collections.defaultdict[int, list[float]] = collections.defaultdict(list)
    step = scheduler.BatchScheduler._step

    # Every step as it ran: its rows' widths and seconds (the per-step log, `--steps`).
    step_log: list[tuple[tuple[int, ...], float]] = []

    def sized(self) -> None:
        widths = tuple(len(r.submitted) for r in self.active)
        size = len(widths) * max(widths)
        t0 = time.perf_counter()
        step(self)
        took = time.perf_counter() - t0
        by_size[size].append(took)
        step_log.append((widths, took))
    scheduler.BatchScheduler._step = sized
    # Every depth the gates chose in the batch: (rows in the forward, the others' widest,
    # drafting rows, depth chosen, depth it would choose alone).
    choices: list[tuple[int, int, int, int, int]] = []
    choose = gates.GatedDrafter._depth

    def chosen(self, k: int) -> int:
        depth = choose(self, k)
        c = self._active
        view = c.batch() if c.batch is not None else gates.SOLO
        choices.append((len(view.widths) + 1, max(view.widths, default=1), view.drafting,
                        depth, c.best_depth(k, gates.SOLO)[0]))
        return depth
    gates.GatedDrafter._depth = chosen
    _timed(stage.StageModel, "run_rows", "  step: graph building (run_rows)")
    _timed(batch_cache.RowsKVCache, "update_and_fetch", "    of it: KV writes")
    _timed(batch_cache.RowsKVCache, "make_mask", "    of it: masks")
    _timed(scheduler.BatchScheduler, "_settle", "settles")
    _timed(row_forward.RowForward, "prefill", "row: prefill (waits included)")
    _timed(gates.GatedDrafter, "propose", "row: drafting (gate + drafter)")
    _timed(gates.GatedDrafter, "_depth", "  row: the gate's depth choice")
    _timed(MtpDrafter, "propose", "  row: MTP head drafts (own time)")
    _timed(head_batch.HeadRows, "run", "head: batched head forwards (all rows)", apart=True)
    _timed(head_batch.HeadRows, "wait", "head: waits for the other rows' calls", apart=True)
    _timed(suffix.SuffixDrafter, "propose", "  row: lookup drafts")
    _timed(gates.GatedDrafter, "observe", "row: drafter observe")
    _timed(decode, "greedy_tokens", "row: accept (greedy_tokens)")
    _timed(row_forward.RowForward, "rollback", "row: rollback")
    _timed(row_forward.RowForward, "batch_view", "row: batch view")

    lm = batch_bench._load()
    engine = MlxEngine(lm, 0, memory_tokens=0, max_batch=n)
    if price not in ("packed", "padded"):
        raise SystemExit(f"batch_profile: the price is 'packed' or 'padded', got {price!r}")
    engine.scheduler.price_packed = price == "packed"

    def reqs() -> list:
        return batch_bench.chat_requests(n, 100, spec)

    batch_bench._run(engine, reqs(), True)  # warm-up
    spent.clear()
    calls.clear()
    by_size.clear()
    step_log.clear()
    choices.clear()
    steps = engine.scheduler.steps
    ragged0, packed0 = engine.scheduler.ragged, engine.scheduler.packed_steps
    skipped0 = engine.scheduler.padding_skipped
    out, seconds = batch_bench._run(engine, reqs(), True)
    tokens = sum(len(r.tokens) for r in out)
    print(f"{n} rows, speculation {spec}: {seconds:.3f} s, {tokens / seconds:.1f} tok/s, "
          f"{engine.scheduler.steps - steps} batched steps")
    head = (spent["head: batched head forwards (all rows)"]
            + spent["  row: MTP head drafts (own time)"])
    spent["head drafting, all of it"] = head
    for label, s in spent.items():
        print(f"{label:38s} {s:7.3f} s {100 * s / seconds:5.1f}%  calls {calls[label]}")
    sched = engine.scheduler
    rows_run = sum(size * len(ts) for size, ts in by_size.items())
    print(f"ragged steps {sched.ragged - ragged0}, packed {sched.packed_steps - packed0}: "
          f"{sched.padding_skipped - skipped0} padded token rows of {rows_run} run left out "
          "of the head (and the MLPs, from PACK_MLPS_FROM padded rows)")
    for h in engine.scheduler.heads.values():
        print(f"batched head: {h.forwards} forwards ran {h.calls} row calls "
              f"({h.calls / max(h.forwards, 1):.2f} rows each, at most {h.peak})")
    costs = generate._costs(lm)  # noqa: SLF001 - the table the gates read
    base = sorted(by_size.get(n, [0.0]))[len(by_size.get(n, [0.0])) // 2] or None
    print(f"step seconds by padded token rows (B x widest), median; relative to {n} rows of 1 "
          "token, beside the cost table's c(B W) / c(B) the gate prices them with:")
    for size in sorted(by_size):
        ts = sorted(by_size[size])
        med = ts[len(ts) // 2]
        rel = f"{med / base:.2f}" if base else "-"
        print(f"  {size:3d}: {med * 1e3:7.1f} ms x{len(ts):<3d} measured {rel}  table "
              f"{gates.width_cost(costs, size) / gates.width_cost(costs, n):.2f}")
    print("drafted/accepted:", [(r.speculation.drafted, r.speculation.accepted)
                                if r.speculation else None for r in out])
    _steps_report(step_log, choices, costs, n, engine.scheduler)


def _steps_report(step_log, choices, costs, n: int, sched) -> None:
    """Steps grouped by their rows' widths (sorted): how many, real and padded token rows,
    median seconds against as many rows of one token, and what the cost model prices them at
    against those (gates.step_cost: padded, and packed as the step ran); then the depths the
    gates chose in the batch against what they would choose alone."""
    import dataclasses
    import statistics

    from skulkp2p.engine.drafting import gates
    packing = dataclasses.replace(sched._packing, mlps_from=sched.pack_mlps_from)
    plain: dict[int, list[float]] = {}
    for w, t in step_log:
        if max(w) == 1:
            plain.setdefault(len(w), []).append(t)
    base = {b: statistics.median(ts) for b, ts in plain.items()}
    groups: dict[tuple[int, ...], list[float]] = {}
    for w, t in step_log:
        groups.setdefault(tuple(sorted(w, reverse=True)), []).append(t)
    print(f"steps by rows' widths ({len(step_log)} steps; plain steps' median ms by rows: "
          + ", ".join(f"{b}: {t * 1e3:.1f}" for b, t in sorted(base.items()))
          + "; measured and priced relative to the same rows plain):")
    for w, ts in sorted(groups.items(), key=lambda kv: -len(kv[1]))[:24]:
        b, real, padded = len(w), sum(w), len(w) * max(w)
        med = statistics.median(ts)
        rel = f"{med / base[b]:.2f}" if b in base else "  - "
        one = gates.width_cost(costs, b)
        print(f"  {str(w):16s} x{len(ts):<4d} real {real:3d} padded {padded:3d}  "
              f"{med * 1e3:6.1f} ms  measured {rel}  priced padded "
              f"{gates.step_cost(costs, w) / one:.2f} packed "
              f"{gates.step_cost(costs, w, packing) / one:.2f}")
    batch = [c for c in choices if c[0] > 1]
    if batch:
        drafted = [c for c in batch if c[3] > 0]
        backed = [c for c in batch if c[3] == 0 and c[4] > 0]
        print(f"gate choices in a batch: {len(batch)}; drafted {len(drafted)} (mean depth "
              f"{statistics.mean(c[3] for c in drafted) if drafted else 0:.2f}), backed off "
              f"where alone it would draft {len(backed)} (alone's mean depth "
              f"{statistics.mean(c[4] for c in backed) if backed else 0:.2f})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "auto",
         int(sys.argv[2]) if len(sys.argv) > 2 else 4,
         sys.argv[3] if len(sys.argv) > 3 else "packed")
    sys.stdout.flush()
    os._exit(0)  # (see tools/batch_bench.py: MLX's native threads at exit)
