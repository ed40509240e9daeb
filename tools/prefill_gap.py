"""Plain decoding against mlx_lm.generate on long and short prompts, split into the prefill (time
to the first token) and the decode (ms per token after it), side by side in one process.

    python tools/prefill_gap.py [--workloads echo,code-edit,qa,creative] [--max-tokens 200]
                                [--pairs 5] [--json PATH]

For every workload (skulkp2p/bench/workloads.py, the bench's chat prompts), `--pairs` rounds of
four arms, in an order that rotates every round so that none always follows another:

- mlx_lm: `mlx_lm.stream_generate` as the bench runs it (bench/arms/mlx_arms.py: run_mlx_lm);
- plain: the engine as the bench runs it (a fresh MlxEngine, no prefix cache, speculation off:
  run_engine), i.e. stream() + decode() + text;
- loop: `decode()` alone on a LocalForward (no engine, no text, no lock);
- prefill: the prompt's prefill alone, ours (`LocalForward.prefill` of all but the last token,
  then the first step evaluated) and mlx-lm's (generate_step up to its first token).

Prints a table: medians of time to first token (ms), of decode time per token (ms) and of the
process's CPU time for the whole run (all threads' work, no waiting: what a loaded machine moves
least), each also as a ratio to mlx_lm's (< 1 is faster than mlx-lm; the prefill arms against
mlx-lm's prefill), and, with --json, every run's figures.
The model: SmolLM2-135M from the test model store, float32 (as the bench on OpenBLAS).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ARMS = ("mlx_lm", "plain", "loop", "prefill_ours", "prefill_mlx_lm")


def _loop(loaded: Any, prompt: list[int], max_tokens: int) -> tuple[float, float, int]:
    """decode() alone: (seconds to the first token, seconds after it, tokens)."""
    from skulkp2p.engine.decode.loop import decode
    from skulkp2p.engine.decode.sampling import SamplingParams, make_rng
    from skulkp2p.engine.model.forward import LocalForward

    eos = set(loaded.tokenizer.eos_token_ids)
    t0 = time.perf_counter()
    t_first = t_last = None
    n = 0
    forward = LocalForward(loaded.model, int(loaded.runtime.get("prefill_step", 2048)))
    for token in decode(forward, prompt, SamplingParams(), max_tokens, make_rng(0)):
        if token in eos:
            break
        t_last = time.perf_counter()
        t_first = t_first or t_last
        n += 1
    assert t_first is not None and t_last is not None
    return t_first - t0, t_last - t_first, n


def _prefill_ours(loaded: Any, prompt: list[int]) -> float:
    """Our prefill and first step (what decode() does before its first token)."""
    import mlx.core as mx

    from skulkp2p.engine.decode.sampling import log_probs
    from skulkp2p.engine.model.forward import LocalForward

    t0 = time.perf_counter()
    forward = LocalForward(loaded.model, int(loaded.runtime.get("prefill_step", 2048)))
    forward.prefill(prompt[:-1])
    logits, _ = forward.lazy_step(mx.array(prompt[-1:]))
    int(mx.argmax(log_probs(logits), axis=-1).item())
    return time.perf_counter() - t0


def _prefill_mlx_lm(loaded: Any, prompt: list[int]) -> float:
    """mlx-lm's generate_step up to its first token."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    t0 = time.perf_counter()
    steps = generate_step(mx.array(prompt), loaded.model, max_tokens=1,
                          prefill_step_size=int(loaded.runtime.get("prefill_step", 2048)))
    next(steps)
    elapsed = time.perf_counter() - t0
    steps.close()
    return elapsed


def measure(loaded: Any, workload: str, max_tokens: int, pairs: int) -> dict[str, Any]:
    from skulkp2p.bench.arms.mlx_arms import engine_request, run_engine, run_mlx_lm
    from skulkp2p.bench.workloads import WORKLOADS
    from skulkp2p.engine.decode.generate import prompt_tokens

    messages = WORKLOADS[workload]
    prompt = prompt_tokens(loaded, engine_request(messages, max_tokens, "off"))
    runs: dict[str, list[dict[str, float]]] = {a: [] for a in ARMS}
    for i in range(pairs):
        order = ARMS[i % len(ARMS):] + ARMS[:i % len(ARMS)]
        for arm in order:
            c0 = time.process_time()  # all of this process's threads: work, not waiting
            if arm == "mlx_lm":
                r = run_mlx_lm(loaded, messages, max_tokens)
                runs[arm].append({"ttft_s": r.ttft_s, "ms_per_token":
                                  1000 * r.decode_s / max(len(r.tokens) - 1, 1)})
            elif arm == "plain":
                r = run_engine(loaded, messages, max_tokens, "off")
                runs[arm].append({"ttft_s": r.ttft_s, "ms_per_token":
                                  1000 * r.decode_s / max(len(r.tokens) - 1, 1)})
            elif arm == "loop":
                first, rest, n = _loop(loaded, prompt, max_tokens)
                runs[arm].append({"ttft_s": first, "ms_per_token": 1000 * rest / max(n - 1, 1)})
            elif arm == "prefill_ours":
                runs[arm].append({"ttft_s": _prefill_ours(loaded, prompt)})
            else:
                runs[arm].append({"ttft_s": _prefill_mlx_lm(loaded, prompt)})
            runs[arm][-1]["cpu_s"] = time.process_time() - c0
    out: dict[str, Any] = {"prompt_tokens": len(prompt), "arms": {}}
    for arm, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        out["arms"][arm] = {"median": med, "runs": rs}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="echo,code-edit,qa,creative")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--json", dest="json_out", default=None)
    args = p.parse_args()

    from skulkp2p.engine.cpu import blas
    blas.ensure_fast_blas()  # re-executes once with OpenBLAS preloaded, before mlx loads
    from skulkp2p.bench.arms.mlx_arms import run_engine, run_mlx_lm
    from skulkp2p.bench.workloads import WORKLOADS
    from skulkp2p.engine.model.loader import open_model
    from skulkp2p.models.store import ModelStore
    from tests.helpers.models import test_data_dir

    loaded = open_model(ModelStore(test_data_dir()), "smollm2-135m", dtype="float32")
    run_engine(loaded, WORKLOADS["qa"], 16, "off")  # warm-up
    run_mlx_lm(loaded, WORKLOADS["qa"], 16)
    results = {}
    print("| workload | prompt tokens | arm | TTFT ms | × mlx_lm | decode ms/token | × mlx_lm "
          "| CPU s | × mlx_lm |")
    print("|---|---|---|---|---|---|---|---|---|")
    for wl in args.workloads.split(","):
        res = results[wl] = measure(loaded, wl, args.max_tokens, args.pairs)
        base = res["arms"]["mlx_lm"]["median"]
        base_prefill = res["arms"]["prefill_mlx_lm"]["median"]["ttft_s"]
        for arm, a in res["arms"].items():
            med = a["median"]
            ref = base_prefill if arm.startswith("prefill") else base["ttft_s"]
            ref_cpu = res["arms"]["prefill_mlx_lm" if arm.startswith("prefill") else "mlx_lm"][
                "median"]["cpu_s"]
            per = med.get("ms_per_token")
            print(f"| {wl} | {res['prompt_tokens']} | {arm} | {1000 * med['ttft_s']:.1f} | "
                  f"{med['ttft_s'] / ref:.3f} | "
                  + (f"{per:.2f} | {per / base['ms_per_token']:.3f} | " if per else "- | - | ")
                  + f"{med['cpu_s']:.2f} | {med['cpu_s'] / ref_cpu:.3f} |")
        sys.stdout.flush()
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
