"""A batched forward's rotary embeddings from one table of sines and cosines per forward.

On a CPU, `mx.fast.rope` has no kernel of its own: MLX builds it from ~30 primitives per call,
and a third of them (positions, inverse frequencies, their product, cos, sin) compute the same
table in every call of a forward: twice per layer (queries and keys), once per layer, for the
same positions. In a 4-row step of SmolLM2-135M that is 60 calls and about a third of the step's
~4,300 primitives; each costs its dispatch whatever its size (docs/measurements/concurrency.md,
"The cost of one batched step").

Here the first call of a forward asks the layer's own rope for the table, by rotating a unit
input (first half ones, second half zeros: MLX's own fallback then returns exactly its cos in
the first half and its sin in the second: 1*c - 0*s = c, 1*s + 0*c = s), and every call of the
forward rotates with it: x1*c - x2*s and x1*s + x2*c, the same products in the same order as
the fallback, so the output is bit for bit the fallback's (tests/test_step_rope.py). Only where
that fallback is what runs: the plain `nn.RoPE` (not traditional: its pairs are interleaved, not
halves), on the CPU device (a GPU runs a fused kernel whose bits this would not reproduce).
"""

from __future__ import annotations

import contextlib

import mlx.core as mx
import mlx.nn as nn

from skulkp2p.engine.cpu.table_rope import TableRoPE, rotate_halves
from skulkp2p.engine.model.swapped import swapped


def shares_tables(rope: object) -> bool:
    """Whether this rope's output can come from a shared table bit for bit (module doc)."""
    # (TableRoPE: the same rope, whose int offsets come from its table; a batch's array offsets
    # run the fallback, as here)
    return (isinstance(rope, nn.RoPE) and type(rope) in (nn.RoPE, TableRoPE)
            and not rope.traditional and mx.default_device() == mx.cpu)


class RopeTables:
    """The sines and cosines of one forward, per (rope settings, width, offset array)."""

    def __init__(self) -> None:
        # (dims, base, scale, dtype, rows, width, id of the offsets) -> (cos, sin, the offsets)
        self._tables: dict[tuple[int, float, float, mx.Dtype, int, int, int],
                           tuple[mx.array, mx.array, mx.array]] = {}
        self.built = 0  # tables computed (tests: one per forward and rope setting)

    def rotate(self, rope: nn.RoPE, x: mx.array, offset: int | mx.array) -> mx.array:
        # (nn.RoPE annotates its offset int; mx.fast.rope, which it calls, takes arrays too)
        if x.ndim != 4 or not isinstance(offset, mx.array):
            return rope(x, offset=offset)  # type: ignore[arg-type]
        b, _, t, _ = x.shape
        dims = rope.dims
        # (the offset array itself is kept in the entry, so its id is not reused meanwhile)
        key = (dims, rope.base, rope.scale, x.dtype, b, t, id(offset))
        entry = self._tables.get(key)
        if entry is None:
            half = dims // 2
            unit = mx.concatenate([mx.ones((b, 1, t, half), x.dtype),
                                   mx.zeros((b, 1, t, dims - half), x.dtype)], axis=-1)
            table = rope(unit, offset=offset)  # type: ignore[arg-type]
            entry = (table[..., :half], table[..., half:dims], offset)
            self._tables[key] = entry
            self.built += 1
        cos, sin, _ = entry
        return rotate_halves(x, cos, sin)


class SharedRope(nn.Module):
    """A layer's rope for one forward, rotating with the forward's shared tables."""

    def __init__(self, inner: nn.RoPE, tables: RopeTables):
        super().__init__()
        self.inner = inner
        self.tables = tables

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        return self.tables.rotate(self.inner, x, offset)


def shared_ropes(layers: list[nn.Module], tables: RopeTables | None = None
                 ) -> contextlib.AbstractContextManager[None]:
    """Every layer whose rope qualifies (`shares_tables`) rotates from one table per forward
    for the duration of the forward; the others keep theirs."""
    tables = tables or RopeTables()
    owners = [la.self_attn for la in layers
              if shares_tables(getattr(getattr(la, "self_attn", None), "rope", None))]
    return swapped(owners, "rope", lambda rope: SharedRope(rope, tables))
