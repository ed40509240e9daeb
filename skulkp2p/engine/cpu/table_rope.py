"""Rotary position embeddings from a table of cosines and sines, on a CPU node.

MLX 0.32 has no CPU kernel for `mx.fast.rope`: each call runs its fallback as about twenty ops,
recomputing the frequencies and the cosines and sines of its positions every time, for the
queries and the keys of every layer, each op paying its dispatch however small. With the table
every forward costs less, one row most (SmolLM2-135M: 102 to 89 ms; docs/measurements/
decode-loop.md, "Rotary embeddings from a table", in the decode loop).

`TableRoPE` computes the same cosines and sines once, for positions 0..N (N doubling as
contexts grow), with the fallback's own formula and ops (positions x scale times
exp(-i log(base) / half), then cos and sin, in float32), so every entry is bit for bit the
value the fallback computes for that position; a call slices its rows out of the table and
rotates with one compiled function (the fallback's products and sums, in its order). Its
output equals `mx.fast.rope`'s bit for bit (tests/test_table_rope.py checks offsets up to
20,000, both layouts, partial rotation), so it is used for every forward, plain decoding
included, which stays bit-identical to `mlx_lm.generate`.

`install(model)` turns a loaded model's plain `nn.RoPE` modules (not the scaled variants of
mlx-lm's rope_utils, which pass their own frequencies) into `TableRoPE`, in place. It diverts
float32 inputs on the CPU with an integer offset; anything else (a batch's per-row offsets, other
dtypes, a GPU) runs `mx.fast.rope` (a batch's steps share one table per forward instead:
step_rope.py), and so does everything inside `stock()`: the bench's mlx-lm
arm and the tests' mlx-lm reference run mlx-lm as it ships on the same model object.
load_model calls `install` through the CPU switch (switch.apply, once switch.install ran).
`SKULKP2P_TABLE_ROPE=0` turns it off (read at load).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import threading
from collections.abc import Iterator

import mlx.core as mx
import mlx.nn as nn

from skulkp2p.engine.cpu.weight_first import cpu_float32_switch

ENV = "SKULKP2P_TABLE_ROPE"
FIRST_POSITIONS = 4096
# Past this many positions the table (2 x half-dims x 4 bytes a position: 256 bytes for a
# 64-dim head) stops growing and calls run mlx's rope.
MAX_POSITIONS = 1 << 20

_stock: contextvars.ContextVar[bool] = contextvars.ContextVar("table_rope_stock", default=False)
_tables: dict[tuple[int, float, float], tuple[mx.array, mx.array]] = {}
_grow = threading.Lock()


def enabled(dtype: str) -> bool:
    """Whether a model loaded in `dtype` gets it: float32 on the CPU, not turned off."""
    return cpu_float32_switch(dtype, ENV)


@contextlib.contextmanager
def stock() -> Iterator[None]:
    """Forwards run inside get mlx's own `mx.fast.rope` (a peer measured as it ships)."""
    token = _stock.set(True)
    try:
        yield
    finally:
        _stock.reset(token)


def install(model: nn.Module) -> int:
    """Swap the class of `model`'s plain `nn.RoPE` modules to `TableRoPE` (their attributes
    stay); how many were swapped."""
    swapped = 0
    for _, module in model.named_modules():
        if type(module) is nn.RoPE:
            module.__class__ = TableRoPE
            swapped += 1
    return swapped


def table(dims: int, base: float, scale: float, positions: int) -> tuple[mx.array, mx.array]:
    """(cos, sin), each [P, dims / 2] float32 for positions 0..P-1, P >= `positions`: the values
    mlx's rope fallback computes, built once per (dims, base, scale) and doubled as needed."""
    key = (dims, float(base), float(scale))
    got = _tables.get(key)
    if got is not None and got[0].shape[0] >= positions:
        return got
    with _grow:
        got = _tables.get(key)
        if got is not None and got[0].shape[0] >= positions:
            return got
        size = FIRST_POSITIONS
        while size < positions:
            size *= 2
        half = dims // 2
        # The fallback's formula, op for op, so that each entry is bit for bit its value.
        where = mx.multiply(mx.arange(size, dtype=mx.float32), mx.array(scale, mx.float32))
        inv_freqs = mx.exp(mx.multiply(mx.arange(0, -half, -1, dtype=mx.float32),
                                       mx.array(math.log(base) / half, mx.float32)))
        theta = mx.multiply(mx.expand_dims(where, -1), inv_freqs)
        got = (mx.cos(theta), mx.sin(theta))
        mx.eval(*got)
        _tables[key] = got
        return got


def _rotate_halves(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    parts = [x1 * cos - x2 * sin, x1 * sin + x2 * cos]
    if x.shape[-1] > 2 * half:
        parts.append(x[..., 2 * half:])
    return mx.concatenate(parts, axis=-1)


def _rotate_pairs(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    half = cos.shape[-1]
    x1, x2 = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
    out = mx.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    out = out.reshape(*x.shape[:-1], 2 * half)
    if x.shape[-1] > 2 * half:
        out = mx.concatenate([out, x[..., 2 * half:]], axis=-1)
    return out


_rotate = {False: mx.compile(_rotate_halves), True: mx.compile(_rotate_pairs)}


def rotate_halves(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """The fallback's non-traditional rotation of x [..., D] by cos and sin [..., dims / 2]
    (broadcast against x), the unrotated tail past dims appended; compiled."""
    return _rotate[False](x, cos, sin)


def rope(x: mx.array, dims: int, traditional: bool, base: float, scale: float,
         offset: int) -> mx.array:
    """`mx.fast.rope(x, dims, traditional=, base=, scale=, offset=)` for x [..., T, D] with
    at least 3 dimensions, from the table."""
    t = x.shape[-2]
    cos, sin = table(dims, base, scale, offset + t)
    return _rotate[traditional](x, cos[offset:offset + t], sin[offset:offset + t])


class TableRoPE(nn.RoPE):
    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if (isinstance(offset, int) and 0 <= offset and offset + x.shape[-2] <= MAX_POSITIONS
                and x.ndim >= 3 and x.dtype == mx.float32 and mx.default_device() == mx.cpu
                and not _stock.get()):
            return rope(x, self.dims, self.traditional, self.base, self.scale, offset)
        # nn.RoPE annotates its offset int, but hands it to mx.fast.rope, which takes an array
        # of per-row offsets too (a batch's)
        return super().__call__(x, offset)  # type: ignore[arg-type]
