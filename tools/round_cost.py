"""Where the time of a decode round goes, per part (SmolLM2-135M float32 on this CPU by default).

    python tools/round_cost.py [--workload echo] [--speculation auto] [--max-tokens 200]
                               [--runs 3] [--clock wall|cpu] [--json PATH]

Runs one of the bench's workloads (skulkp2p/bench/workloads.py), greedy, through a fresh
MlxEngine per run (no prefix cache, no draft memory: the bench's measured request), with timers
around the parts of every round after the prefill:

- forward: the verify forward (`Forward.__call__`: its graph built, then evaluated), with the
  graph building also shown alone, and the rollback after it (on a float32 CPU node a verify
  of 3+ rows hands its softmax and SwiGLU to numpy, engine/cpu/numpy_verify.py, which evaluates
  the graph layer by layer as it is built, so there "graph build" holds most of the forward);
- drafter: `propose`/`propose_tree` and `observe`/`observe_tree` of the request's drafter,
  gates included; under `auto` also
  split into the suffix drafter and the MTP head (their own propose/observe/follow);
- accept: choosing every row's token (`decode.greedy_tokens`);
- text/stop: detokenising and stop-string handling (`TextAssembler.add`);
- other: the rest of the window from the end of the prefill to the last token received — the
  loop's own bookkeeping, chunks, the engine's lock and generators.

`--clock cpu` times every part in CPU time of the whole process (`time.process_time`: the
BLAS threads' work included, waiting excluded), which a loaded machine moves far less than wall
time; `wall` (default) is `time.perf_counter`. `--speculation`: `auto` (default), `off` (plain: pipelined, so the forward's evaluation hides
in `other`), or DRAFTER:DEPTH such as `lookup:16`. Prints a table (ms per round, median of the
runs, and the share of the window) and, with --json, the per-run figures. The model comes from
the test model store (the cache the tests use), or --model ID from the default store.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PARTS = ("forward", "  graph build", "  rollback", "drafter", "  suffix drafter", "  MTP head",
         "accept", "text/stop", "other")


class Timers:
    """Seconds spent per part inside the measured window (from the prefill's end on)."""

    def __init__(self) -> None:
        self.clock = time.perf_counter
        self.running: set[str] = set()
        self.open = False
        self.spent: dict[str, float] = defaultdict(float)
        self.rounds = 0

    def wrap(self, part: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.open or part in self.running:  # (a part calling itself counts once)
                return fn(*args, **kwargs)
            self.running.add(part)
            t0 = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[part] += self.clock() - t0
                self.running.discard(part)
        return timed


def _speculation(text: str) -> Any:
    if text in ("auto", "off"):
        return text
    drafter, _, depth = text.partition(":")
    return {"drafter": drafter, "depth": int(depth or 4)}


def _instrument(timers: Timers) -> None:
    """Timers around the loop's parts, in the modules that call them."""
    from skulkp2p.engine.decode import generate
    from skulkp2p.engine.decode import loop as decode
    from skulkp2p.engine.drafting.gates import GatedDrafter, LookupThenModel

    decode.greedy_tokens = timers.wrap("accept", decode.greedy_tokens)

    class TimedText(generate.TextAssembler):
        add = timers.wrap("text/stop", generate.TextAssembler.add)

    generate.TextAssembler = TimedText
    choose = generate._choose_drafter

    def inner_part(gated: Any, part: str) -> None:
        inner = gated.inner if isinstance(gated, GatedDrafter) else gated
        # (prefetch: an MTP head's early start of its next draft, gates.LookupThenModel)
        for name in ("propose", "observe", "follow", "propose_branches", "prefetch"):
            if hasattr(inner, name):
                setattr(inner, name, timers.wrap(part, getattr(inner, name)))

    def chosen(*args: Any, **kwargs: Any) -> Any:
        drafter, depth, hidden = choose(*args, **kwargs)
        if drafter is not None:
            if isinstance(drafter, LookupThenModel):
                inner_part(drafter.lookup, "  suffix drafter")
                inner_part(drafter.model, "  MTP head")
            elif type(getattr(drafter, "inner", drafter)).__name__ == "SuffixDrafter":
                inner_part(drafter, "  suffix drafter")
            for name in ("propose", "observe", "propose_tree", "observe_tree"):
                if hasattr(drafter, name):  # (decode asks for trees where the forward takes them)
                    setattr(drafter, name, timers.wrap("drafter", getattr(drafter, name)))
        return drafter, depth, hidden

    generate._choose_drafter = chosen


def _engine(loaded: Any, timers: Timers) -> Any:
    """A fresh engine whose rows time their forward calls and open the window after the
    prefill."""
    from skulkp2p.engine.batching.row_forward import RowForward
    from skulkp2p.engine.decode.mlx_engine import MlxEngine

    engine = MlxEngine(loaded, prefix_cache_mb=0, memory_tokens=0)
    sched = engine.scheduler
    if sched is None:
        raise SystemExit("this model is not batchable: the tool times the MLX engine's rows")
    stage_run = sched.stage.run
    sched.stage.run = timers.wrap("  graph build", stage_run)

    class TimedRow(RowForward):
        def prefill(self, tokens: list[int]) -> None:
            super().prefill(tokens)
            timers.spent.clear()
            timers.rounds = 0
            timers.open = True
            timers.t_start = timers.clock()

        def __call__(self, tokens: list[int]) -> Any:
            if timers.open:
                timers.rounds += 1
            return timers.wrap("forward", super().__call__)(tokens)

        def rollback(self, keep: int, dropped: int) -> None:
            timers.wrap("  rollback", super().rollback)(keep, dropped)

    sched.forward = lambda hidden=None, interrupt=None: TimedRow(sched, hidden, interrupt)
    return engine


def measure(loaded: Any, workload: str, speculation: Any, max_tokens: int) -> dict[str, Any]:
    from skulkp2p.bench.arms.mlx_arms import engine_request
    from skulkp2p.bench.workloads import WORKLOADS

    timers = _TIMERS
    engine = _engine(loaded, timers)
    gen = engine.generate(engine_request(WORKLOADS[workload], max_tokens, speculation))
    t_last = None
    for chunk in gen:
        if chunk.tokens:
            t_last = timers.clock()
    timers.open = False
    result = gen.result
    assert result is not None and t_last is not None
    window = t_last - timers.t_start
    spent = dict(timers.spent)
    top = ("forward", "drafter", "accept", "text/stop")
    spent["other"] = window - sum(spent.get(p, 0.0) for p in top)
    spec = result.speculation
    return {"window_s": window, "rounds": timers.rounds, "tokens": len(result.tokens),
            "drafted": spec.drafted if spec else 0, "accepted": spec.accepted if spec else 0,
            "lazy_steps": getattr(engine.scheduler, "lazy_steps", None),
            "spent_s": {p: round(spent.get(p, 0.0), 6) for p in PARTS}}


_TIMERS = Timers()


def pipelined_versus_rounds(loaded: Any, workload: str, max_tokens: int, pairs: int,
                            quiet: bool = False) -> None:
    """Back-to-back pairs on one LocalForward each: pipelined against the round loop (a
    forward without lazy steps). Plain greedy, or with `quiet` a gated suffix drafter that
    starts off (what `auto` runs on a novel prompt on a model without a head of its own):
    quiet stretches (decode._pipelined with a drafter) against one-token rounds. Wall tok/s and CPU time
    per token (process_time: every thread's work, which load moves less)."""
    from skulkp2p.bench.arms.mlx_arms import engine_request
    from skulkp2p.bench.workloads import WORKLOADS
    from skulkp2p.engine.decode.generate import prompt_tokens
    from skulkp2p.engine.decode.loop import DecodeStats, decode
    from skulkp2p.engine.decode.sampling import SamplingParams, make_rng
    from skulkp2p.engine.drafting.gates import DEFAULT_WIDTH_COSTS, GatedDrafter
    from skulkp2p.engine.drafting.suffix import SuffixDrafter
    from skulkp2p.engine.model.forward import LocalForward

    class RoundLoop(LocalForward):  # no lazy steps: decode() runs its round loop
        def __getattribute__(self, name: str) -> Any:
            if name == "lazy_step":
                raise AttributeError(name)
            return super().__getattribute__(name)

    prompt = prompt_tokens(loaded, engine_request(WORKLOADS[workload], 1, "off"))

    def tok_s(cls: type, n: int) -> tuple[float, float, list[int], int]:
        drafter = GatedDrafter(SuffixDrafter(), DEFAULT_WIDTH_COSTS["float32"], 16,
                               start_on=False, can_return=True) if quiet else None
        stats = DecodeStats()
        stamps, tokens = [], []
        c0 = 0.0
        for token in decode(cls(loaded.model), prompt, SamplingParams(), n, make_rng(0),
                            drafter, 16 if quiet else 0, stats):
            stamps.append(time.perf_counter())
            if len(stamps) == 1:
                c0 = time.process_time()
            tokens.append(token)
        cpu = (time.process_time() - c0) / max(len(stamps) - 1, 1)
        return (len(stamps) - 1) / (stamps[-1] - stamps[0]), cpu, tokens, stats.pipelined

    tok_s(LocalForward, 8)  # warm-up
    tok_s(RoundLoop, 8)
    ratios, cpu_ratios = [], []
    for i in range(pairs):
        arms = (LocalForward, RoundLoop) if i % 2 == 0 else (RoundLoop, LocalForward)
        got = {cls: tok_s(cls, max_tokens) for cls in arms}
        piped, loop = got[LocalForward], got[RoundLoop]
        ratios.append(piped[0] / loop[0])
        cpu_ratios.append(piped[1] / loop[1])
        print(f"pair {i + 1}: pipelined {piped[0]:.2f} tok/s ({piped[3]} tokens pipelined, "
              f"{piped[1] * 1000:.1f} CPU ms/token), round loop {loop[0]:.2f} tok/s "
              f"({loop[1] * 1000:.1f} CPU ms/token), ratio {ratios[-1]:.3f}, identical "
              f"{piped[2] == loop[2]}")
    print(f"{workload}, {max_tokens} tokens{', quiet lookup' if quiet else ''}: pipelined / "
          f"round loop tok/s, median of {pairs} pairs {statistics.median(ratios):.3f} (min "
          f"{min(ratios):.3f}, max {max(ratios):.3f}); CPU time per token pipelined / round "
          f"loop {statistics.median(cpu_ratios):.3f}")


def versus_mlx_lm(loaded: Any, workload: str, max_tokens: int, pairs: int) -> None:
    from skulkp2p.bench.arms.mlx_arms import run_engine, run_mlx_lm
    from skulkp2p.bench.workloads import WORKLOADS

    messages = WORKLOADS[workload]
    run_engine(loaded, WORKLOADS["qa"], 16, "off")  # warm-up
    run_mlx_lm(loaded, WORKLOADS["qa"], 16)
    ratios: list[float] = []
    cpu_ratios: list[float] = []
    for i in range(pairs):
        # alternate which goes first, so that neither always follows the other
        order = ("plain", "mlx_lm") if i % 2 == 0 else ("mlx_lm", "plain")
        got, cpu = {}, {}
        for arm in order:
            c0 = time.process_time()  # all of this process's threads: work, not waiting
            got[arm] = run_engine(loaded, messages, max_tokens, "off") if arm == "plain" \
                else run_mlx_lm(loaded, messages, max_tokens)
            cpu[arm] = (time.process_time() - c0) / max(len(got[arm].tokens), 1)
        same = got["plain"].tokens == got["mlx_lm"].tokens
        ratios.append(got["plain"].tok_s / got["mlx_lm"].tok_s)
        cpu_ratios.append(cpu["plain"] / cpu["mlx_lm"])
        print(f"pair {i + 1}: plain {got['plain'].tok_s:.2f} tok/s, mlx_lm "
              f"{got['mlx_lm'].tok_s:.2f} tok/s, ratio {ratios[-1]:.3f}; CPU ms per token "
              f"plain {cpu['plain'] * 1000:.1f}, mlx_lm {cpu['mlx_lm'] * 1000:.1f}; "
              f"identical {same}")
    print(f"{workload}, {max_tokens} tokens: plain / mlx_lm tok/s, median of {pairs} pairs "
          f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}); "
          f"CPU time per token plain / mlx_lm {statistics.median(cpu_ratios):.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="echo")
    p.add_argument("--speculation", default="auto", type=_speculation)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--model", default=None, help="a card id from the default store "
                   "(default: SmolLM2-135M from the test model store)")
    p.add_argument("--json", dest="json_out", default=None)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="time the parts in wall time (perf_counter) or in the process's CPU "
                        "time (process_time: all threads' work, no waiting)")
    p.add_argument("--loop-pairs", type=int, default=0, metavar="N",
                   help="instead: N back-to-back pairs of plain greedy on one LocalForward, "
                        "pipelined and in the round loop (decode() directly); tok/s ratio")
    p.add_argument("--quiet-pairs", type=int, default=0, metavar="N",
                   help="instead: as --loop-pairs with a gated suffix drafter that starts off "
                        "(auto on a novel prompt without a head): quiet stretches pipelined "
                        "against one-token rounds")
    p.add_argument("--pairs", type=int, default=0, metavar="N",
                   help="instead: N back-to-back pairs of plain (speculation off, a fresh "
                        "engine) and mlx_lm.stream_generate on the workload; each pair's "
                        "decode tok/s ratio and their median (a busy machine moves both alike "
                        "within a pair more than across a whole bench run)")
    args = p.parse_args()

    from skulkp2p.engine.cpu import blas
    blas.ensure_fast_blas()  # re-executes once with OpenBLAS preloaded, before mlx loads
    from skulkp2p.bench.workloads import WORKLOADS
    from skulkp2p.engine.model.loader import open_model
    from skulkp2p.models.store import ModelStore

    if args.workload not in WORKLOADS:
        raise SystemExit(f"unknown workload {args.workload!r}: one of {', '.join(WORKLOADS)}")
    if args.model is None:
        from tests.helpers.models import test_data_dir
        loaded = open_model(ModelStore(test_data_dir()), "smollm2-135m", dtype="float32")
    else:
        loaded = open_model(ModelStore(), args.model)
    if args.pairs:
        versus_mlx_lm(loaded, args.workload, args.max_tokens, args.pairs)
        return
    if args.loop_pairs or args.quiet_pairs:
        pipelined_versus_rounds(loaded, args.workload, args.max_tokens,
                                args.loop_pairs or args.quiet_pairs, quiet=bool(args.quiet_pairs))
        return
    _TIMERS.clock = time.process_time if args.clock == "cpu" else time.perf_counter
    _instrument(_TIMERS)
    measure(loaded, "qa", args.speculation, 16)  # warm-up
    runs = [measure(loaded, args.workload, args.speculation, args.max_tokens)
            for _ in range(args.runs)]
    per_round = {part: statistics.median(r["spent_s"][part] / max(r["rounds"], 1) for r in runs)
                 for part in PARTS}
    window = statistics.median(r["window_s"] / max(r["rounds"], 1) for r in runs)
    last = runs[-1]
    print(f"{args.workload}, speculation {args.speculation}, {last['tokens']} tokens in "
          f"{last['rounds']} rounds ({last['accepted']}/{last['drafted']} drafts accepted), "
          f"median of {len(runs)} runs: {window * 1000:.2f} ms per round ({args.clock} time); "
          f"{last['lazy_steps']} pipelined steps (plain greedy or quiet stretches)")
    print(f"{'part':<18} {'ms/round':>9} {'share':>6}")
    for part in PARTS:
        print(f"{part:<18} {per_round[part] * 1000:>9.3f} {per_round[part] / window:>6.1%}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({
            "workload": args.workload, "speculation": args.speculation, "runs": runs,
            "ms_per_round": {p: round(v * 1000, 4) for p, v in per_round.items()},
            "window_ms_per_round": round(window * 1000, 4)}, indent=2) + "\n")


if __name__ == "__main__":
    main()
