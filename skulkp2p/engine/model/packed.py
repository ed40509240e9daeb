"""A ragged batched step's per-token work over its real tokens only.

A batched step runs B rows padded on the right to the widest row's W tokens (scheduler.py), so a
step where one row verifies 6 drafts and three rows verify one token runs 4 x 7 = 28 token rows
for 10 real ones. Attention needs the [B, W] layout (each row reads its own cache), but a
layer's MLP and the output head work token by token: they run here on the real tokens gathered
into one [N, H] block (N = the sum of the rows' widths), and the MLP's output goes back into the
[B, W] layout with zeros at the padded positions. A padded position's hidden row only feeds its
own key and value, which sit past its row's length, are masked from every real query, and are
overwritten by the row's next step, so what it holds never reaches a real token.

A CPU forward over many token rows is compute-bound (docs/measurements/concurrency.md,
"Batching in one process"): the MLPs are about three quarters of
a SmolLM2 layer's weights and the head a fifth of the model's, so the padded rows' share of them
is what this saves.

A mixed step (a joining prompt's chunk riding in the decoding rows' step: scheduler.py) is
ragged at its widest, one row of C tokens beside rows of 1: there the attention projections
(a quarter of a SmolLM2 layer) run packed too (`attention`), and the head runs only on the rows
that want logits (`heads`: a prompt's chunk wants none), else padding the decoding rows to the
chunk's width would cost more than the step they save.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from skulkp2p.engine.model.swapped import swapped


@dataclass(frozen=True)
class PackedRows:
    """Where a ragged step's real tokens sit: `index` picks them out of the flattened [B * W]
    positions (row by row, in order); `inverse` maps each of the B * W positions to its row in
    the packed block, or to N (a zero row) for a padded position; `offsets[i]` is where row i's
    tokens start in the packed block."""
    widths: tuple[int, ...]
    width: int
    index: mx.array
    inverse: mx.array
    offsets: tuple[int, ...]
    mlps: bool = True  # the MLPs too, not only the final norm and head
    # The tokens whose logits are wanted, per row (None: all of them): their flattened
    # positions, and where row i's start in the head's block.
    heads: tuple[int, ...] | None = None
    head_index: mx.array | None = None
    head_offsets: tuple[int, ...] | None = None
    attention: bool = False  # the attention projections too (a mixed step)

    @property
    def tokens(self) -> int:
        return sum(self.widths)

    def gather_heads(self, x: mx.array) -> mx.array:
        """[B, W, H] -> the rows of the tokens whose logits are wanted, [N_heads, H]."""
        if self.head_index is None:
            return self.gather(x)
        return x.reshape(-1, *x.shape[2:])[self.head_index]

    def gather(self, x: mx.array) -> mx.array:
        """[B, W, ...] -> the real tokens' rows [N, ...]."""
        return x.reshape(-1, *x.shape[2:])[self.index]

    def scatter(self, packed: mx.array) -> mx.array:
        """[N, H] -> [B, W, H], zeros at the padded positions."""
        zero = mx.zeros((1, packed.shape[-1]), dtype=packed.dtype)
        full = mx.concatenate([packed, zero], axis=0)[self.inverse]
        return full.reshape(len(self.widths), self.width, packed.shape[-1])

    def row(self, packed: mx.array, i: int) -> mx.array:
        """Row i's own rows of a packed block."""
        return packed[self.offsets[i]:self.offsets[i] + self.widths[i]]

    def head_row(self, logits: mx.array, i: int) -> mx.array:
        """Row i's logits (its last `heads[i]` tokens') of the head's block."""
        if self.heads is None or self.head_offsets is None:
            return self.row(logits, i)
        return logits[self.head_offsets[i]:self.head_offsets[i] + self.heads[i]]


def packed_rows(widths: list[int], mlps_from: int = 0, heads: list[int] | None = None,
                attention: bool = False) -> PackedRows | None:
    """The packing of a step whose rows have these widths, or None when no row is padded
    (every row as wide as the widest: nothing to save) and every token wants logits. The MLPs
    are packed only when at least `mlps_from` token rows are padding (below it their gathers
    cost about what they save). `heads[i]`: how many of row i's last tokens want logits (a
    prompt's chunk: none); `attention`: pack the attention projections too."""
    width = max(widths)
    if heads is not None and all(h == w for h, w in zip(heads, widths, strict=True)):
        heads = None
    if heads is None and all(w == width for w in widths):
        return None
    index: list[int] = []
    inverse: list[int] = []
    offsets: list[int] = []
    n = sum(widths)
    for i, w in enumerate(widths):
        offsets.append(len(index))
        inverse += list(range(len(index), len(index) + w)) + [n] * (width - w)
        index += [i * width + j for j in range(w)]
    padding = len(widths) * width - n
    head_index = head_offsets = None
    if heads is not None:
        picked: list[int] = []
        starts: list[int] = []
        for i, (w, k) in enumerate(zip(widths, heads, strict=True)):
            if not 0 <= k <= w:
                raise ValueError(f"row {i} wants logits of {k} of its {w} tokens")
            starts.append(len(picked))
            picked += [i * width + j for j in range(w - k, w)]
        head_index, head_offsets = mx.array(picked), tuple(starts)
    return PackedRows(tuple(widths), width, mx.array(index), mx.array(inverse), tuple(offsets),
                      mlps=padding >= mlps_from, heads=None if heads is None else tuple(heads),
                      head_index=head_index, head_offsets=head_offsets,
                      attention=attention and padding >= mlps_from)


class _OnRealTokens(nn.Module):
    """A token-wise module (a layer's MLP, an attention projection) run on the step's real
    tokens only (see the module's docstring). Called on anything but the step's [B, W] rows, an
    MLP is an error (`strict`: its layer runs only on them) and a projection runs as it is (a
    family may call it on other shapes)."""

    def __init__(self, inner: nn.Module, rows: PackedRows, strict: bool):
        super().__init__()
        self.inner = inner
        self.rows = rows
        self.strict = strict

    def __call__(self, x: mx.array) -> mx.array:
        step = (len(self.rows.widths), self.rows.width)
        if x.ndim != 3 or x.shape[:2] != step:
            if self.strict:
                raise ValueError(f"packed module got rows {x.shape[:-1]}, its step has {step}")
            return self.inner(x)
        return self.rows.scatter(self.inner(self.rows.gather(x)[None])[0])


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _attention_of(layer: nn.Module) -> nn.Module | None:
    """A layer's attention module whose projections are plain token-wise modules, else None."""
    attn = getattr(layer, "self_attn", None)
    if isinstance(attn, nn.Module) and all(isinstance(getattr(attn, p, None), nn.Module)
                                           for p in PROJECTIONS):
        return attn
    return None


@contextlib.contextmanager
def packed_attention(layers: list[nn.Module], rows: PackedRows) -> Iterator[None]:
    """Every layer's attention projections run on the step's real tokens for one forward
    (layers without the usual q/k/v/o projections keep theirs)."""
    attns = [a for a in (_attention_of(la) for la in layers) if a is not None]
    with contextlib.ExitStack() as stack:
        for name in PROJECTIONS:
            stack.enter_context(swapped(attns, name, lambda p: _OnRealTokens(p, rows, strict=False)))
        yield


def packs_mlps(layers: list[nn.Module]) -> bool:
    """Whether every layer has an `mlp` that this module may run on packed tokens: a module
    called on the hidden rows alone (dense or mixture-of-experts, token by token)."""
    return bool(layers) and all(isinstance(getattr(la, "mlp", None), nn.Module)
                                for la in layers)


def packed_mlps(layers: list[nn.Module], rows: PackedRows
                ) -> contextlib.AbstractContextManager[None]:
    """Every layer's MLP runs on the step's real tokens for the duration of one forward."""
    return swapped(layers, "mlp", lambda mlp: _OnRealTokens(mlp, rows, strict=True))
