"""The KV caches of several requests in one batch, each row at its own length.

mlx-lm's `BatchKVCache` left-pads rows so that they share one write index; it fits a batch whose
rows all grow by the same number of tokens per step. A batch that verifies drafts grows each row
by its own count (a row keeps 1 + accepted of its w tokens), so here every row keeps its own
length instead: a step writes row i's w tokens at its length, RoPE takes the per-row lengths as
an array offset (as with BatchKVCache), and the mask lets query j of row i see keys up to
length_i + j. A rollback is a length going down; nothing moves. Rows join from an ordinary
per-request cache (after their prompt was prefilled) and leave by a gather of the others.

All layers share one `RowLengths`: the model reads `offset` in every layer before the step's
write, so lengths advance only after the whole forward (`RowLengths.advance`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from skulkp2p.engine.tree import compact_positions

# Buffers grow by this many positions (as mlx-lm's KVCache does).
STEP = 256


class RowLengths:
    """The tokens each row holds, shared by every layer's cache."""

    def __init__(self) -> None:
        self.lengths: list[int] = []
        self._offset: mx.array | None = None

    @property
    def offset(self) -> mx.array:
        if self._offset is None:
            self._offset = mx.array(self.lengths, dtype=mx.int32)
        return self._offset

    def set(self, lengths: list[int]) -> None:
        self.lengths = list(lengths)
        self._offset = None


class RowsKVCache:
    """One layer's keys and values for the rows of a batch, [B, H, capacity, D] each."""

    def __init__(self, rows: RowLengths):
        self.rows = rows
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.width = 0  # tokens per row in the current step (set before the forward)

    @property
    def offset(self) -> mx.array:
        return self.rows.offset

    def _reserve(self, need: int, like_k: mx.array, like_v: mx.array) -> None:
        have = 0 if self.keys is None else self.keys.shape[2]
        if need <= have:
            return
        grow = ((need - have + STEP - 1) // STEP) * STEP
        b, h, _, dk = like_k.shape
        pad_k = mx.zeros((b, h, grow, dk), like_k.dtype)
        pad_v = mx.zeros((b, h, grow, like_v.shape[3]), like_v.dtype)
        if self.keys is None:
            self.keys, self.values = pad_k, pad_v
        else:
            self.keys = mx.concatenate([self.keys, pad_k], axis=2)
            self.values = mx.concatenate([self.values, pad_v], axis=2)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        lengths = self.rows.lengths
        w = keys.shape[2]
        end = max(lengths) + w
        self._reserve(end, keys, values)
        assert self.keys is not None and self.values is not None
        for i, n in enumerate(lengths):
            self.keys[i:i + 1, :, n:n + w, :] = keys[i:i + 1]
            self.values[i:i + 1, :, n:n + w, :] = values[i:i + 1]
        return self.keys[:, :, :end, :], self.values[:, :, :end, :]

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None,
                  **_: Any) -> mx.array:
        """[B, 1, n, max length + n]: query j of row i sees keys [0, length_i + j]."""
        if window_size is not None:
            raise ValueError("sliding-window layers are not batched")
        lengths = self.rows.offset[:, None, None, None]
        end = max(self.rows.lengths) + n
        keys = mx.arange(end)[None, None, None, :]
        queries = mx.arange(n)[None, None, :, None]
        return keys <= lengths + queries

    # -- rows joining and leaving --

    def append_row(self, single: KVCache, length: int) -> None:
        """Add a row holding the first `length` positions of a one-request cache (called before
        the row's length is added to `rows`)."""
        if single.keys is None or length == 0:  # a one-token prompt: nothing prefilled
            if self.keys is not None:
                self.keys = mx.concatenate([self.keys, mx.zeros_like(self.keys[:1])], axis=0)
                self.values = mx.concatenate([self.values, mx.zeros_like(self.values[:1])],
                                             axis=0)
            return  # (no buffer yet: the first write allocates one for every row)
        k = single.keys[..., :length, :]
        v = single.values[..., :length, :]
        have = 0 if self.keys is None else self.keys.shape[2]
        cap = max(have, ((length + STEP - 1) // STEP) * STEP or STEP)
        if self.keys is not None and cap > have:
            self._reserve(cap, self.keys, self.values)
        pad = [(0, 0), (0, 0), (0, cap - length), (0, 0)]
        k, v = mx.pad(k, pad), mx.pad(v, pad)
        if self.keys is None:
            # Rows that joined before with nothing prefilled (one-token prompts) have no place
            # in a buffer yet: zeros for them, never read (their length is 0), so that row i
            # of the buffer stays row i of the batch.
            empty = len(self.rows.lengths)
            if empty:
                k = mx.concatenate([mx.zeros((empty, *k.shape[1:]), k.dtype), k], axis=0)
                v = mx.concatenate([mx.zeros((empty, *v.shape[1:]), v.dtype), v], axis=0)
            self.keys, self.values = k, v
        else:
            self.keys = mx.concatenate([self.keys, k], axis=0)
            self.values = mx.concatenate([self.values, v], axis=0)

    @classmethod
    def of_singles(cls, rows: RowLengths, singles: list[KVCache],
                   lengths: list[int]) -> RowsKVCache:
        """One layer of a batch whose row i holds the first lengths[i] positions of singles[i]
        (requests prefilling together). Empty rows get zeros, never read (the mask)."""
        layer = cls(rows)
        like = next((c for c, n in zip(singles, lengths, strict=True)
                     if c.keys is not None and n > 0), None)
        if like is None:
            return layer  # nothing held yet: the first write allocates every row's buffer
        assert like.keys is not None and like.values is not None
        cap = ((max(lengths) + STEP - 1) // STEP) * STEP
        keys, values = [], []
        for c, n in zip(singles, lengths, strict=True):
            if c.keys is None or n == 0:
                _, h, _, dk = like.keys.shape
                keys.append(mx.zeros((1, h, cap, dk), like.keys.dtype))
                values.append(mx.zeros((1, h, cap, like.values.shape[3]), like.values.dtype))
                continue
            pad = [(0, 0), (0, 0), (0, cap - n), (0, 0)]
            keys.append(mx.pad(c.keys[..., :n, :], pad))
            values.append(mx.pad(c.values[..., :n, :], pad))  # type: ignore[index]
        layer.keys = mx.concatenate(keys, axis=0)
        layer.values = mx.concatenate(values, axis=0)
        return layer

    def keep_rows(self, kept: list[int]) -> None:
        if self.keys is None:
            return
        if not kept:
            self.keys = self.values = None
            return
        index = mx.array(kept)
        self.keys = self.keys[index]
        self.values = self.values[index]

    def extract(self, row: int, length: int) -> KVCache:
        """Row `row`'s first `length` positions as a one-request cache of its own (copies)."""
        assert self.keys is not None and self.values is not None
        single = KVCache()
        single.keys = mx.array(self.keys[row:row + 1, :, :length, :])
        single.values = mx.array(self.values[row:row + 1, :, :length, :])
        single.offset = length
        return single

    def compact_row(self, row: int, start: int, path: list[int]) -> None:
        """Row `row` verified a token tree written at `start`: move the accepted path's nodes
        right after node 0 (engine/tree.py; the row's length is set by the caller)."""
        moves = compact_positions(start, path)
        if moves is None or self.keys is None or self.values is None:
            return
        dst, src = moves
        idx = mx.array(src)
        span = slice(dst[0], dst[-1] + 1)
        self.keys[row:row + 1, :, span, :] = self.keys[row:row + 1, :, idx, :]
        self.values[row:row + 1, :, span, :] = self.values[row:row + 1, :, idx, :]

    # What generic cache code asks of a cache (checkpoint rules, byte counts).
    def is_trimmable(self) -> bool:
        return False

    @property
    def state(self) -> tuple[Any, Any]:
        return self.keys, self.values
