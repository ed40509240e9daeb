"""A verify's few token rows times a weight, computed weight-first on a CPU node's BLAS.

A linear layer computes `x @ W.T`: x the token rows (1 to ~17 in a verify), W the weight (out x
in, thousands of rows). On the float32 OpenBLAS path of a Linux CPU node (engine/cpu/blas.py), with
two OpenBLAS threads, that product is slower for a few rows than the same numbers computed as
`(W @ x.T).T`, where the weight is the operand with many rows (whole verify forwards 10-25%
cheaper with two threads, a wash with one); one row is a matrix-vector product either way and
is left alone. In the decode loop that made echo's and code-edit's speculative runs faster
with the same drafts (docs/measurements/decode-loop.md, "Weight-first verify products").

Only verify forwards (`verify_rows()`, entered by forward.StageCache.run around a verify of
2+ rows) take the weight-first product. Prefill chunks and one-token steps run mlx-lm's own
`x @ W.T`, so a prompt's cache and plain decoding stay bit-identical to `mlx_lm.generate`. A
verify row's numbers were already summed in another order than a one-token step's (a matrix
product against a matrix-vector one); greedy output equal to plain decoding is what the
exactness tests check.

`install(model)` turns a loaded model's plain `nn.Linear` layers and its `nn.Embedding` (a
tied output head calls `as_linear`) into the subclasses below, in place and sharing their
weights; quantized layers are not touched. load_model calls it through the CPU switch
(switch.apply, once switch.install ran). `SKULKP2P_WEIGHT_FIRST=0` turns it off (load time).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator

import mlx.core as mx
import mlx.nn as nn

ENV = "SKULKP2P_WEIGHT_FIRST"
# Wider than this is a prefill chunk (verifies are at most ~33 rows): the row-major product.
MAX_ROWS = 64

_verifying: contextvars.ContextVar[bool] = contextvars.ContextVar("weight_first", default=False)


@contextlib.contextmanager
def verify_rows(on: bool = True) -> Iterator[None]:
    """Products built inside (a verify forward's graph) go weight-first where `on`."""
    token = _verifying.set(on)
    try:
        yield
    finally:
        _verifying.reset(token)


def is_verifying() -> bool:
    """Whether the graph being built is a verify's (inside `verify_rows()`, on)."""
    return _verifying.get()


def product(x: mx.array, weight: mx.array) -> mx.array:
    """`x @ weight.T`, weight-first for 2..MAX_ROWS rows inside `verify_rows()`."""
    rows = x.size // x.shape[-1] if x.ndim else 0
    if rows < 2 or rows > MAX_ROWS or not _verifying.get():
        return x @ weight.T
    flat = x.reshape(rows, x.shape[-1])
    return (weight @ flat.T).T.reshape(*x.shape[:-1], weight.shape[0])


class WeightFirstLinear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        if not _verifying.get():
            return super().__call__(x)
        y = product(x, self["weight"])
        return y + self["bias"] if "bias" in self else y


class WeightFirstEmbedding(nn.Embedding):
    def as_linear(self, x: mx.array) -> mx.array:
        return product(x, self.weight)


def enabled(dtype: str) -> bool:
    """Whether a model loaded in `dtype` gets it here: float32 on the CPU, not turned off."""
    return cpu_float32_switch(dtype, ENV)


def cpu_float32_switch(dtype: str, env: str) -> bool:
    """A CPU-node switch (this one, numpy_verify's, table_rope's): float32 on the CPU, `env` not
    set to 0 / off / false / no."""
    return dtype == "float32" and mx.default_device() == mx.cpu \
        and os.environ.get(env, "1").strip().lower() not in ("0", "off", "false", "no")


def install(model: nn.Module) -> int:
    """Swap the classes of `model`'s plain linear and embedding layers (the weights, the
    parameter tree and every attribute stay as they are: only the method changes); how many
    layers were swapped."""
    swapped = 0
    for _, module in model.named_modules():
        if type(module) is nn.Linear:
            module.__class__ = WeightFirstLinear
            swapped += 1
        elif type(module) is nn.Embedding:
            module.__class__ = WeightFirstEmbedding
            swapped += 1
    return swapped
