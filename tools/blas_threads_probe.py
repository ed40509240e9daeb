"""Time forwards of a SmolLM2-135M-sized model with 1 and 2 OpenBLAS threads, quiet or loaded.

    python tools/blas_threads_probe.py                 # as the machine is
    python tools/blas_threads_probe.py --load 1        # with one CPU-bound process beside it

The count is switched at run time with openblas_set_num_threads (as engine/cpu/blas_threads.py
does), between forwards. Prints, per count, the median milliseconds of a forward of w tokens
evaluated and waited for (a verify, w = 1, 4, 9, 16) and of a pipelined one-token step (the
next step built and evaluated asynchronously while Python reads the current token, as
decode._pipelined does), and the load average before and after. The model's weights are random
(blas_probe.build_model): they do not change the speed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

WIDTHS = (1, 4, 9, 16)
HOG = "while True: pass"


def measure(rounds: int, reps: int, steps: int) -> dict:
    import mlx.core as mx
    from blas_probe import build_model
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    from skulkp2p.engine.cpu.blas_threads import OpenBlasThreads

    blas = OpenBlasThreads.find()
    if blas is None:
        sys.exit("no OpenBLAS in this process")
    model = build_model(mx.float32)
    tokens = mx.random.randint(0, model.args.vocab_size, (1, 128))
    cache = make_prompt_cache(model)
    mx.eval(model(tokens[:, :64], cache=cache))

    def width_ms(w: int) -> float:
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            mx.eval(model(tokens[:, 64:64 + w], cache=cache))
            times.append(time.perf_counter() - t0)
            trim_prompt_cache(cache, w)
        return 1e3 * statistics.median(times[1:])  # the first is a warm-up

    def step_ms() -> float:
        c = make_prompt_cache(model)
        mx.eval(model(tokens[:, :64], cache=c))

        def step(y: mx.array) -> mx.array:
            out = mx.argmax(model(y, cache=c)[:, -1], axis=-1)[:, None]
            mx.async_eval(out)
            return out

        y = step(mx.array([[5]]))
        t0 = time.perf_counter()
        for _ in range(steps):
            ahead = step(y)
            int(y.item())
            y = ahead
        mx.eval(y)
        return 1e3 * (time.perf_counter() - t0) / steps

    out: dict[str, list] = {"1": [], "2": []}
    for _ in range(rounds):  # the counts interleaved, so a load change hits both
        for n in (1, 2):
            mx.synchronize()
            blas.set(n)
            assert blas.get() == n
            row = {str(w): round(width_ms(w), 1) for w in WIDTHS}
            row["step"] = round(step_ms(), 1)
            out[str(n)].append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--load", type=int, default=0, help="CPU-bound processes beside it")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.rounds, args.reps, args.steps)))
        return
    from skulkp2p.engine.cpu import blas

    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(args.load)]
    try:
        before = os.getloadavg()
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
        lib = blas.find_openblas()
        fast, why = blas._fast_env(lib) if lib else (None, "cmeel-openblas not installed")
        if fast is None:
            sys.exit(f"no OpenBLAS: {why}")
        env.update(LD_PRELOAD=fast["LD_PRELOAD"], LD_LIBRARY_PATH=fast.get("LD_LIBRARY_PATH", ""),
                   PYTHONPATH=str(REPO))
        out = subprocess.run([sys.executable, __file__, "--child", "--rounds", str(args.rounds),
                              "--reps", str(args.reps), "--steps", str(args.steps)],
                             env=env, capture_output=True, text=True, check=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        for hog in hogs:
            os.kill(hog.pid, signal.SIGTERM)
            hog.wait()
    print(json.dumps({"load_procs": args.load, "loadavg_before": before,
                      "loadavg_after": os.getloadavg(), "ms": result}, indent=1))


if __name__ == "__main__":
    main()
