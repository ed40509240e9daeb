"""Measure mlx CPU speed with the reference BLAS and with OpenBLAS preloaded.

    python tools/blas_probe.py                       # every configuration, matmul + model
    python tools/blas_probe.py --configs ref-bf16 openblas-f32 --parts model

Each configuration runs in its own child process (a preload only counts at process start):

    ref-bf16       SKULKP2P_BLAS=off, model in bfloat16 (what a node without OpenBLAS runs)
    ref-f32        SKULKP2P_BLAS=off, model in float32
    openblas-f32   ensure_fast_blas() re-exec, model in float32 (OPENBLAS_NUM_THREADS default)
    openblas-f32-t2  as openblas-f32 with OPENBLAS_NUM_THREADS=2
    openblas-bf16  OpenBLAS preloaded, model in bfloat16 (bf16 products do not use BLAS)

The model is a randomly initialised llama the size of SmolLM2-135M (30 layers, hidden 576,
intermediate 1536, 9 heads, 3 KV heads, vocab 49152, tied embeddings): weights do not change
the speed, and no download is needed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CONFIGS: dict[str, dict[str, str]] = {
    "ref-bf16": {"SKULKP2P_BLAS": "off", "dtype": "bfloat16"},
    "ref-f32": {"SKULKP2P_BLAS": "off", "dtype": "float32"},
    "openblas-f32": {"dtype": "float32"},
    "openblas-f32-t2": {"dtype": "float32", "OPENBLAS_NUM_THREADS": "2"},
    "openblas-bf16": {"dtype": "bfloat16"},
}
WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16)


def matmul_gflops(n: int, dtype: Any, budget_s: float = 3.0) -> float:
    """GFLOP/s of an n x n product on the CPU: median of up to 5 timed runs within the budget."""
    import mlx.core as mx

    a = mx.random.normal((n, n)).astype(dtype)
    b = mx.random.normal((n, n)).astype(dtype)
    mx.eval(a, b)
    mx.eval(a @ b)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 5 and (not times or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        mx.eval(a @ b)
        times.append(time.perf_counter() - t0)
    return 2.0 * n**3 / statistics.median(times) / 1e9


def build_model(dtype: Any) -> Any:
    import mlx.core as mx
    from mlx_lm.models.llama import Model, ModelArgs

    args = ModelArgs(
        model_type="llama", hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
        num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, vocab_size=49152,
        head_dim=64, rope_theta=100000.0, tie_word_embeddings=True,
    )
    model = Model(args)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def model_numbers(dtype: Any, prompt: int = 256, ctx: int = 64, decode: int = 16) -> dict:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    model = build_model(dtype)
    vocab = model.args.vocab_size
    out: dict[str, Any] = {}

    def prefill(tokens: Any, cache: list) -> Any:
        # As a serving engine does: the LM head only for the last position.
        h = model.model(tokens, cache=cache)
        logits = model.model.embed_tokens.as_linear(h[:, -1:])
        mx.eval(logits, [c.state for c in cache])
        return logits

    tokens = mx.random.randint(0, vocab, (1, prompt))
    prefill(tokens[:, :16], make_prompt_cache(model))  # warm-up
    runs = []
    for _ in range(2):
        cache = make_prompt_cache(model)
        t0 = time.perf_counter()
        prefill(tokens, cache)
        runs.append(time.perf_counter() - t0)
    out["prefill_tok_s"] = prompt / min(runs)

    # Single-token greedy decode after a short context.
    cache = make_prompt_cache(model)
    logits = prefill(tokens[:, :ctx], cache)
    y = mx.argmax(logits[:, -1], axis=-1)[:, None]
    steps = []
    for _ in range(decode + 2):
        t0 = time.perf_counter()
        logits = model(y, cache=cache)
        y = mx.argmax(logits[:, -1], axis=-1)[:, None]
        mx.eval(y)
        steps.append(time.perf_counter() - t0)
    out["decode_tok_s"] = 1.0 / statistics.median(steps[2:])

    # Cost of a forward of w tokens (all w logits, as when verifying w drafted tokens).
    cache = make_prompt_cache(model)
    prefill(tokens[:, :ctx], cache)
    widths: dict[int, float] = {}
    for w in WIDTHS:
        block = tokens[:, ctx : ctx + w]
        times = []
        for rep in range(6):
            t0 = time.perf_counter()
            mx.eval(model(block, cache=cache))
            dt = time.perf_counter() - t0
            trim_prompt_cache(cache, w)
            if rep:  # the first run of each width is a warm-up
                times.append(dt)
        widths[w] = statistics.median(times)
    out["width_ms"] = {w: 1e3 * t for w, t in widths.items()}
    out["width_rel"] = {w: t / widths[1] for w, t in widths.items()}
    return out


def child(config: str, parts: list[str]) -> None:
    from skulkp2p.engine.cpu import blas

    settings = CONFIGS[config]
    if not config.startswith("ref"):
        blas.ensure_fast_blas()  # re-execs this same command line once with the preload
    import mlx.core as mx

    report = blas.fast_path_report()
    dtype = getattr(mx, settings["dtype"])
    result: dict[str, Any] = {"config": config, "report": report,
                              "threads": os.environ.get("OPENBLAS_NUM_THREADS")}
    if "matmul" in parts:
        result["matmul_f32"] = {n: matmul_gflops(n, mx.float32) for n in (64, 256, 1024)}
        result["matmul_bf16"] = {n: matmul_gflops(n, mx.bfloat16) for n in (64, 256, 1024)}
    if "model" in parts:
        result["model"] = model_numbers(dtype)
    print("RESULT " + json.dumps(result), flush=True)


def run_config(config: str, parts: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SKULKP2P_") and k not in ("LD_PRELOAD", "OPENBLAS_NUM_THREADS")}
    env.update({k: v for k, v in CONFIGS[config].items() if k != "dtype"})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", config, "--parts", *parts]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{config} failed:\n{out.stdout}\n{out.stderr}")
    return json.loads(lines[-1][len("RESULT "):])


def print_tables(results: list[dict]) -> None:
    print("\nconfig            blas       report f32 GFLOP/s  threads")
    for r in results:
        rep = r["report"]
        print(f"{r['config']:<17} {rep['blas']:<10} {rep['gflops_f32']:>19.1f}  {r['threads']}")
    if any("matmul_f32" in r for r in results):
        print("\nmatmul GFLOP/s      n=64     n=256    n=1024")
        for r in results:
            for key in ("matmul_f32", "matmul_bf16"):
                row = r.get(key)
                if row:
                    label = f"{r['config']} {key[7:]}"
                    print(f"{label:<20}" + "".join(f"{row[str(n)]:>9.1f}" for n in (64, 256, 1024)))
    models = [r for r in results if "model" in r]
    if models:
        print("\nmodel (135M llama)   prefill256 tok/s  decode tok/s")
        for r in models:
            m = r["model"]
            print(f"{r['config']:<20} {m['prefill_tok_s']:>16.1f}  {m['decode_tok_s']:>12.1f}")
        print("\nforward of w tokens after 64 in cache: ms (cost relative to w=1)")
        print(f"{'w':<20}" + "".join(f"{w:>14}" for w in WIDTHS))
        for r in models:
            ms, rel = r["model"]["width_ms"], r["model"]["width_rel"]
            cells = "".join(f"{ms[str(w)]:>7.1f} ({rel[str(w)]:.2f})" for w in WIDTHS)
            print(f"{r['config']:<20}{cells}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS),
                        default=["ref-bf16", "ref-f32", "openblas-f32"])
    parser.add_argument("--parts", nargs="+", choices=["matmul", "model"],
                        default=["matmul", "model"])
    parser.add_argument("--child", choices=list(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print the raw results as JSON")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.parts)
        return
    results = [run_config(c, args.parts) for c in args.configs]
    if args.json:
        print(json.dumps(results, indent=1))
    print_tables(results)


if __name__ == "__main__":
    main()
