"""Where a batched step's time goes: one process, cells interleaved, SmolLM2-135M float32.

    python tools/step_parts.py [--reps 7] [--lengths 120,200,300,380] [--threads 1]

Cells (ms, median of --reps after one warm-up round, every cell once per round in turn):

- solo: one token on a request's own mlx-lm cache (at the lengths' mean), as a lone request
  steps (LocalForward.__call__);
- verify4: one row of 4 tokens on that cache (a speculative verify);
- batch1: a BatchScheduler step of one row of one token (at the mean length);
- batch4: a BatchScheduler step of 4 rows of one token at --lengths;
- batch4eq: 4 rows of one token, every row at the mean length (one write column);
- batch4/own-rope: batch4 with each layer's own rope (BatchScheduler.share_rope False: the
  code before engine/cpu/step_rope.py).

Then the same batch4 / solo steps with one part of the layers taken out (the output is wrong,
the shapes are not): `-sdpa` (attention's products and softmax: queries go straight out),
`-mask` (attention without its mask), `-rope`, `-write` (the cache write: the keys come from the
buffer as they are). The difference to the whole step is what that part costs in it. `ops`: the
primitives in the step's graph (mx.export_to_dot, nodes), and `build`: the Python that builds it
(the forward's call, without its evaluation). Last, the floors (`_floors`): the weight
products alone for 1 and 4 token rows, and the attention alone for a solo step, a 4-token verify
and a 4-row step.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _load() -> Any:
    from skulkp2p.engine.model.loader import open_model
    from skulkp2p.models.store import ModelStore
    from tests.helpers.models import test_data_dir
    return open_model(ModelStore(test_data_dir()), "smollm2-135m", dtype="float32")


def _prompt(n: int, seed: int) -> list[int]:
    return [1 + (7 * seed + 13 * j) % 4000 for j in range(n)]


@contextlib.contextmanager
def _patched(module: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def _ablation(name: str) -> contextlib.AbstractContextManager[None]:
    import mlx_lm.models.llama as llama

    from skulkp2p.engine.cache import batch_cache

    base_sdpa = llama.scaled_dot_product_attention
    if name == "-sdpa":
        return _patched(llama, "scaled_dot_product_attention",
                        lambda q, k, v, cache, scale, mask, **_: q)
    if name == "-mask":
        return _patched(llama, "scaled_dot_product_attention",
                        lambda q, k, v, cache, scale, mask, **kw: base_sdpa(
                            q, k, v, cache=cache, scale=scale, mask=None, **kw))
    if name == "-rope":
        import mlx.nn as nn

        from skulkp2p.engine.cpu import step_rope
        stack = contextlib.ExitStack()
        stack.enter_context(_patched(nn.RoPE, "__call__", lambda self, x, offset=0: x))
        stack.enter_context(_patched(step_rope.SharedRope, "__call__",
                                     lambda self, x, offset=0: x))
        return stack
    if name == "-write":
        from mlx_lm.models.cache import KVCache

        def rows_fetch(self: Any, keys: Any, values: Any) -> Any:
            start, end = self._span(keys.shape[2])
            self._reserve(end, keys, values)
            return self.keys[:, :, start:end, :], self.values[:, :, start:end, :]

        def solo_fetch(self: Any, keys: Any, values: Any) -> Any:
            n = self.offset + keys.shape[2]
            return self.keys[..., :n, :], self.values[..., :n, :]

        stack = contextlib.ExitStack()
        stack.enter_context(_patched(batch_cache.RowsKVCache, "update_and_fetch", rows_fetch))
        stack.enter_context(_patched(KVCache, "update_and_fetch", solo_fetch))
        return stack
    return contextlib.nullcontext()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--lengths", default="120,200,300,380")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ablations", default="-sdpa,-mask,-rope,-write")
    args = p.parse_args()
    os.environ.setdefault("SKULKP2P_BLAS_THREADS", str(args.threads))
    from skulkp2p.engine.cpu import blas
    blas.ensure_fast_blas()  # re-executes once with OpenBLAS preloaded, before mlx loads
    import mlx.core as mx

    from skulkp2p.engine.batching.scheduler import BatchScheduler
    from skulkp2p.engine.model.forward import LocalForward

    lm = _load()
    lengths = [int(x) for x in args.lengths.split(",")]
    mean = round(statistics.mean(lengths))

    solo = LocalForward(lm.model, 2048)
    solo.prefill(_prompt(mean, 0))
    mx.eval([c.state for c in solo.local.cache])

    def batch(lens: list[int]) -> tuple[Any, list[Any]]:
        sched = BatchScheduler(lm.model, len(lens))
        sched.mixed_chunk = 0  # rows driven by hand
        with sched.cond:
            rows = [sched.forward() for _ in lens]
            for i, (row, n) in enumerate(zip(rows, lens, strict=True)):
                row.prefill(_prompt(n, i))
                sched._join(row)
                row.joined = True
        return sched, rows

    batches = {"batch1": batch([mean]), "batch4": batch(lengths),
               "batch4eq": batch([mean] * len(lengths))}

    def run_solo(w: int) -> Callable[[], float]:
        def go() -> float:
            t0 = time.perf_counter()
            mx.eval(solo([5] * w))
            dt = time.perf_counter() - t0
            solo.rollback(0, w)
            return dt
        return go

    def run_batch(name: str, share_rope: bool = True) -> Callable[[], float]:
        sched, rows = batches[name]

        def go() -> float:
            sched.share_rope = share_rope
            with sched.cond:
                for row in rows:
                    row.submitted = [5]
                t0 = time.perf_counter()
                sched._step()
                dt = time.perf_counter() - t0
                for row in rows:
                    row.rollback(0, 1)
                    row.result = None
            return dt
        return go

    cells: dict[str, Callable[[], float]] = {
        "solo": run_solo(1), "verify4": run_solo(4), "batch1": run_batch("batch1"),
        "batch4": run_batch("batch4"), "batch4eq": run_batch("batch4eq"),
        "batch4/own-rope": run_batch("batch4", share_rope=False)}
    cells.update(_floors(lm, lengths, mean, mx))
    ablations = [a for a in args.ablations.split(",") if a]
    for a in ablations:
        for base in ("solo", "batch4"):
            fn = cells[base]
            cells[f"{base}{a}"] = (lambda fn=fn, a=a: _with(a, fn))
    times: dict[str, list[float]] = {k: [] for k in cells}
    for rep in range(args.reps + 1):
        for name, fn in cells.items():
            dt = fn()
            if rep:
                times[name].append(dt)
    med = {k: 1000 * statistics.median(v) for k, v in times.items()}
    base = med["solo"]
    print(f"lengths {lengths} (solo/batch1 at {mean}), {args.threads} BLAS thread(s), "
          f"median of {args.reps} (ms; x solo):")
    for k, v in med.items():
        print(f"  {k:16s} {v:7.1f}  {v / base:5.2f}")
    for a in ablations:
        print(f"  part {a[1:]:6s}: solo {med['solo'] - med['solo' + a]:6.1f} ms, "
              f"batch4 {med['batch4'] - med['batch4' + a]:6.1f} ms")
    _graph(lm, solo, batches["batch4"], mx)
    sys.stdout.flush()
    os._exit(0)


def _floors(lm: Any, lengths: list[int], mean: int, mx: Any) -> dict[str, Callable[[], float]]:
    """What the step cannot go below on this CPU, each part alone over the model's real shapes:
    `weights1`/`weights4`: every layer's weight products and the head for 1 and 4 token rows
    (OpenBLAS, the weights read once per call); `attn1`, `attn1x4`, `attn4`: 30 layers'
    attention (mx.fast.scaled_dot_product_attention) for one query over one cache, 4 queries
    over one cache (a verify) and one query over each of 4 caches (a 4-row step, keys padded
    to the longest row, masked)."""
    from skulkp2p.engine.model.trunk import Trunk

    trunk = Trunk(lm.model)
    weights = []
    for layer in trunk.body.layers:
        a, f = layer.self_attn, layer.mlp
        weights += [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight,
                    f.gate_proj.weight, f.up_proj.weight, f.down_proj.weight]
    head = trunk.body.embed_tokens.weight if trunk.tied else trunk.text.lm_head.weight
    weights.append(head)

    def products(m: int) -> Callable[[], float]:
        xs = {w.shape[1]: mx.ones((m, w.shape[1])) for w in weights}
        mx.eval(list(xs.values()))

        def go() -> float:
            out = [xs[w.shape[1]] @ w.T for w in weights]
            t0 = time.perf_counter()
            mx.eval(out)
            return time.perf_counter() - t0
        return go

    attn = trunk.body.layers[0].self_attn
    heads, kv = attn.n_heads, attn.n_kv_heads
    dim = attn.q_proj.weight.shape[0] // heads
    layers = len(trunk.body.layers)
    end = max(lengths) + 1

    def attention(rows: int, width: int, keys: int, masked: bool) -> Callable[[], float]:
        k = [mx.random.normal((rows, kv, keys, dim)) for _ in range(2 * layers)]
        q = mx.random.normal((rows, heads, width, dim))
        lens = mx.array(lengths if rows > 1 else [keys - width])
        mask = (mx.arange(keys)[None, None, None, :]
                <= lens[:, None, None, None] + mx.arange(width)[None, None, :, None])
        mx.eval(k, q, mask)

        def go() -> float:
            out = [mx.fast.scaled_dot_product_attention(
                q, k[2 * i], k[2 * i + 1], scale=dim ** -0.5, mask=mask if masked else None)
                for i in range(layers)]
            t0 = time.perf_counter()
            mx.eval(out)
            return time.perf_counter() - t0
        return go

    return {"weights1": products(1), "weights4": products(4),
            "attn1": attention(1, 1, mean + 1, False), "attn1x4": attention(1, 4, mean + 4, True),
            "attn4": attention(len(lengths), 1, end, True)}


def _with(ablation: str, fn: Callable[[], float]) -> float:
    with _ablation(ablation):
        return fn()


def _count_ops(mx: Any, outputs: list[Any]) -> Counter[str]:
    """The graph's primitives by name (its dot export's boxes)."""
    buf = io.StringIO()
    mx.export_to_dot(buf, *outputs)
    return Counter(re.findall(r'label ="([^"]+)", shape=rectangle', buf.getvalue()))


def _graph(lm: Any, solo: Any, batch4: tuple[Any, list[Any]], mx: Any) -> None:
    """Primitives in each step's graph, and the Python time that builds it (no evaluation)."""
    from skulkp2p.engine.model.packed import packed_rows  # noqa: F401  (the step's own imports)

    def solo_graph() -> list[Any]:
        return [solo.local.stage.run_rows(mx.array([[5]]), solo.local.cache)[0]]

    sched, rows = batch4

    def batch_graph(share_rope: bool) -> Callable[[], list[Any]]:
        def build() -> list[Any]:
            sched.share_rope = share_rope
            with sched._ropes():
                return [sched.stage.run_rows(mx.array([[5]] * len(rows)), sched.layers)[0]]
        return build

    for name, build in (("solo", solo_graph), ("batch4/own-rope", batch_graph(False)),
                        ("batch4", batch_graph(True))):
        t0 = time.perf_counter()
        out = build()  # (once: a second build would chain onto this one's cache writes)
        built = time.perf_counter() - t0
        ops = _count_ops(mx, out)
        print(f"  graph {name}: {sum(ops.values())} primitives, built in "
              f"{1000 * built:.2f} ms; most: "
              + ", ".join(f"{k} {v}" for k, v in ops.most_common(12)))
        del out
        # The caches' writes evaluated (at the rows' lengths: masked, overwritten by the next
        # step), so that the next build's graph does not hold this one's.
        mx.eval([a for c in sched.layers for a in c.arrays()])


if __name__ == "__main__":
    main()
