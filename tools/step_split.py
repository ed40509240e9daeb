"""Where a plain greedy step's time goes, ours against mlx_lm.generate, in one process.

    python tools/step_split.py [--workloads qa,code-edit] [--max-tokens 200] [--pairs 3]
                               [--threads 1] [--profile]

Arms, alternating, `--pairs` times each (bench/arms/mlx_arms.py, as the bench runs them):

- mlx_lm: `mlx_lm.stream_generate`;
- plain: a fresh MlxEngine (no prefix cache, speculation off): engine.generate's stream;
- generate_step: mlx-lm's token loop alone (no detokenizer, no responses);
- decode: ours alone (`decode()` on a LocalForward: no engine, no text, no chunks).

plain - decode is what our engine's layers add per token; decode - generate_step is the loop's.

Every forward of both arms runs with `--threads` OpenBLAS threads (blas_threads.pinned), so
the arms differ only in the Python around the model. Per arm, medians over the runs: decode
ms per token after the first, and the calling thread's CPU ms per token (time.thread_time:
the Python per step, which the pipelined step hides only while it is shorter than the
forward and a core is free for it). With --profile, one more run of each arm under cProfile:
the functions with the most own time, in microseconds per generated token.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def timed(fn: Any) -> tuple[Any, float]:
    c0 = time.thread_time()
    run = fn()
    return run, time.thread_time() - c0


def top(profile: cProfile.Profile, tokens: int, n: int = 14) -> list[str]:
    stats = pstats.Stats(profile)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:n]  # type: ignore[attr-defined]
    out = []
    for (path, line, name), (_, calls, tottime, cumtime, _) in rows:
        where = f"{Path(path).name}:{line}" if line else path
        out.append(f"{1e6 * tottime / tokens:8.1f} us/token own, {1e6 * cumtime / tokens:8.1f} "
                   f"cum, {calls / tokens:5.1f} calls/token  {name} ({where})")
    return out


@dataclass
class LoopRun:
    tokens: list[int]
    decode_s: float  # first token to last


def _prompt(loaded: Any, messages: Any, max_tokens: int) -> list[int]:
    from skulkp2p.bench.arms.mlx_arms import engine_request
    from skulkp2p.engine.decode.generate import prompt_tokens

    return prompt_tokens(loaded, engine_request(messages, max_tokens, "off"))


def _timed_loop(steps: Any, eos: set[int]) -> LoopRun:
    tokens: list[int] = []
    t_first = t_last = None
    for token in steps:
        token = int(token)
        if token in eos:
            break
        t_last = time.perf_counter()
        t_first = t_first or t_last
        tokens.append(token)
    assert t_first is not None and t_last is not None
    return LoopRun(tokens, t_last - t_first)


def loop_mlx_lm(loaded: Any, messages: Any, max_tokens: int) -> LoopRun:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    prompt = _prompt(loaded, messages, max_tokens)
    steps = generate_step(mx.array(prompt), loaded.model, max_tokens=max_tokens,
                          prefill_step_size=int(loaded.runtime.get("prefill_step", 2048)))
    return _timed_loop((t for t, _ in steps), set(loaded.tokenizer.eos_token_ids))


def loop_ours(loaded: Any, messages: Any, max_tokens: int) -> LoopRun:
    from skulkp2p.engine.decode.loop import decode
    from skulkp2p.engine.decode.sampling import SamplingParams, make_rng
    from skulkp2p.engine.model.forward import LocalForward

    prompt = _prompt(loaded, messages, max_tokens)
    forward = LocalForward(loaded.model, int(loaded.runtime.get("prefill_step", 2048)))
    return _timed_loop(decode(forward, prompt, SamplingParams(), max_tokens, make_rng(0)),
                       set(loaded.tokenizer.eos_token_ids))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="qa,code-edit")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()

    from skulkp2p.engine.cpu import blas
    blas.ensure_fast_blas()  # re-executes once with OpenBLAS preloaded, before mlx loads
    from skulkp2p.bench.arms.mlx_arms import run_engine, run_mlx_lm
    from skulkp2p.bench.workloads import WORKLOADS
    from skulkp2p.engine.cpu import blas_threads
    from skulkp2p.engine.model.loader import open_model
    from skulkp2p.models.store import ModelStore
    from tests.helpers.models import test_data_dir

    loaded = open_model(ModelStore(test_data_dir()), "smollm2-135m", dtype="float32")
    arms = {"mlx_lm": lambda m: run_mlx_lm(loaded, m, args.max_tokens),
            "plain": lambda m: run_engine(loaded, m, args.max_tokens, "off"),
            "generate_step": lambda m: loop_mlx_lm(loaded, m, args.max_tokens),
            "decode": lambda m: loop_ours(loaded, m, args.max_tokens)}
    with blas_threads.pinned(args.threads):
        for arm in arms.values():
            arm(WORKLOADS["qa"])  # warm-up
        for wl in args.workloads.split(","):
            messages = WORKLOADS[wl]
            figures: dict[str, dict[str, list[float]]] = {a: {"ms": [], "cpu": []} for a in arms}
            tokens = {}
            for i in range(args.pairs):
                order = list(arms)[i % len(arms):] + list(arms)[:i % len(arms)]
                for name in order:
                    run, cpu = timed(lambda name=name, m=messages: arms[name](m))
                    n = len(run.tokens)
                    tokens[name] = run.tokens
                    figures[name]["ms"].append(1000 * run.decode_s / max(n - 1, 1))
                    figures[name]["cpu"].append(1000 * cpu / max(n, 1))
            same = all(t == tokens["mlx_lm"] for t in tokens.values())
            print(f"## {wl}: {len(tokens['plain'])} tokens, greedy identical: {same}")
            base = statistics.median(figures["mlx_lm"]["ms"])
            for name, f in figures.items():
                ms, cpu = statistics.median(f["ms"]), statistics.median(f["cpu"])
                print(f"{name:13s} decode {ms:6.2f} ms/token ({ms / base:.3f}x mlx_lm), calling "
                      f"thread CPU {cpu:5.2f} ms/token  runs {[round(x, 2) for x in f['ms']]}")
            if args.profile:
                for name in arms:
                    prof = cProfile.Profile()
                    prof.enable()
                    run = arms[name](messages)
                    prof.disable()
                    print(f"### {name} under cProfile ({len(run.tokens)} tokens)")
                    for line in top(prof, max(len(run.tokens), 1)):
                        print("  " + line)
            sys.stdout.flush()


if __name__ == "__main__":
    main()
