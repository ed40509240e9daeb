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

Sliding-window layers (Gemma's `RotatingKVCache`) keep each row's last window of keys and the
mask shows query j of row i only the keys in (length_i + j - window, length_i + j]: the keys a
rotating cache would still hold, so a rollback is a length going down for them too. Row i's
buffer column 0 holds position `base_i`; before a step (`trim`, called by the scheduler) the
rows whose base lags more than STEP positions behind length_i - window drop what is older (one
gather per buffer, every window layer alike, so one mask fits them all): a long-running batch
holds at most window + 2 STEP positions per row, not its whole history. The positions a step
sees, and those it may roll back to, are never dropped: a step's rollbacks go back at most to
where it started, and the base stays at least a window behind that. Recurrent layers (qwen3_5's gated-delta state,
`RowsArraysCache`) hold one state per row, stacked; a step keeps the states from before it, so
that a row whose verify was partly rejected gets its own state back (`restore_row`).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from skulkp2p.engine.cache.caches import compact_positions

# Buffers grow by this many positions (as mlx-lm's KVCache does).
STEP = 256


class RowLengths:
    """The tokens each row holds, shared by every layer's cache."""

    def __init__(self) -> None:
        self.lengths: list[int] = []
        self._offset: mx.array | None = None
        # This step's write index per (width, rows' bases): built once, used by every layer.
        self._write: dict[tuple[int, tuple[int, ...]], mx.array | None] = {}

    @property
    def offset(self) -> mx.array:
        if self._offset is None:
            self._offset = mx.array(self.lengths, dtype=mx.int32)
        return self._offset

    def set(self, lengths: list[int]) -> None:
        self.lengths = list(lengths)
        self._offset = None
        self._write = {}

    def write_index(self, width: int, bases: list[int]) -> mx.array | None:
        """Where a step of `width` tokens writes each row's keys in a buffer whose row i starts
        at position bases[i]: [B, 1, width, 1] columns (length_i - base_i + j), built once per
        step for every layer alike; None when every row writes at the same column (one slice
        takes them all)."""
        key = (width, tuple(bases))
        if key not in self._write:
            at = [n - b for n, b in zip(self.lengths, bases, strict=True)]
            self._write[key] = None if len(set(at)) <= 1 else (
                mx.array(at, dtype=mx.int32)[:, None]
                + mx.arange(width, dtype=mx.int32)[None, :])[:, None, :, None]
        return self._write[key]


class RowsKVCache:
    """One layer's keys and values for the rows of a batch, [B, H, capacity, D] each."""

    def __init__(self, rows: RowLengths, window: int | None = None):
        self.rows = rows
        self.window = window  # a sliding-window layer's window (its rotating cache's max_size)
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.width = 0  # tokens per row in the current step (set before the forward)
        # Row i's buffer column 0 is position base[i] (a window layer drops older positions:
        # `trim`; always 0 without a window).
        self.base: list[int] = []
        self.trims = 0  # times this layer dropped positions (tests)

    @classmethod
    def like(cls, rows: RowLengths, template: KVCache | RotatingKVCache) -> RowsKVCache:
        """The rows' layer for a layer whose one-request cache is `template`."""
        if type(template) is RotatingKVCache:
            return cls(rows, template.max_size)
        return cls(rows)

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
        if self.keys is None or self.values is None:  # (set together)
            self.keys, self.values = pad_k, pad_v
        else:
            self.keys = mx.concatenate([self.keys, pad_k], axis=2)
            self.values = mx.concatenate([self.values, pad_v], axis=2)

    def _span(self, n: int) -> tuple[int, int]:
        """The buffer columns [start, end) a step of n tokens reads: from the first one any
        row's first query sees through the window to the last one any row writes."""
        lengths = self.rows.lengths
        bases = self.base or [0] * len(lengths)
        end = max(x - b for x, b in zip(lengths, bases, strict=True)) + n
        if self.window is None:
            return 0, end
        start = min(max(0, x - self.window + 1) - b
                    for x, b in zip(lengths, bases, strict=True))
        return max(0, start), end

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        lengths = self.rows.lengths
        w = keys.shape[2]
        if self.keys is None and not self.base:  # rows given by their lengths alone
            self.base = [0] * len(lengths)
        if len(self.base) != len(lengths):
            raise RuntimeError(f"{len(self.base)} rows' bases for {len(lengths)} rows")
        start, end = self._span(w)
        self._reserve(end, keys, values)
        assert self.keys is not None and self.values is not None
        # One scatter per buffer for all rows (not a slice update per row and layer: that was
        # 2 B graph nodes per layer per step, built under the scheduler's lock).
        index = self.rows.write_index(w, self.base)
        if index is None:  # every row writes at the same column
            n = lengths[0] - self.base[0]
            self.keys[:, :, n:n + w, :] = keys
            self.values[:, :, n:n + w, :] = values
        else:
            self.keys = mx.put_along_axis(self.keys, index, keys.astype(self.keys.dtype), axis=2)
            self.values = mx.put_along_axis(self.values, index,
                                            values.astype(self.values.dtype), axis=2)
        return self.keys[:, :, start:end, :], self.values[:, :, start:end, :]

    def trim(self) -> None:
        """Before a step (no row waits to roll back): a window layer whose rows hold more than
        STEP positions no query can see any more drops them, each row down to the window before
        its length (one extra position: what a rotating cache of the window holds, so `extract`
        stays whole), and the buffer shrinks to what the rows then hold."""
        if self.window is None or self.keys is None or self.values is None:
            return
        lengths = self.rows.lengths
        drop = [max(0, n - self.window - b) for n, b in zip(lengths, self.base, strict=True)]
        if max(drop, default=0) < STEP:
            return
        self.base = [b + d for b, d in zip(self.base, drop, strict=True)]
        held = max(n - b for n, b in zip(lengths, self.base, strict=True))
        cap = max(STEP, ((held + STEP - 1) // STEP) * STEP)
        last = self.keys.shape[2] - 1
        index = mx.minimum(mx.arange(cap, dtype=mx.int32)[None, :]
                           + mx.array(drop, dtype=mx.int32)[:, None], last)[:, None, :, None]
        self.keys = mx.take_along_axis(self.keys, index, axis=2)
        self.values = mx.take_along_axis(self.values, index, axis=2)
        self.trims += 1

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None,
                  **_: object) -> mx.array:
        """[B, 1, n, max length + n]: query j of row i sees keys [0, length_i + j], only the
        last `window_size` of them in a sliding-window layer (the model passes its window)."""
        if window_size is not None and self.window is not None and window_size != self.window:
            raise ValueError(f"a mask for a window of {window_size} asked of a cache whose "
                             f"window is {self.window}")
        lengths = self.rows.offset[:, None, None, None]
        if window_size is None:
            window_size = self.window
        # The columns update_and_fetch hands out; in a window layer they start where the
        # earliest query's window does: attention runs over the windows, not the whole history.
        start, end = self._span(n)
        keys = mx.arange(start, end)[None, None, None, :]
        if any(self.base):  # row i's column c is position base_i + c
            keys = keys + mx.array(self.base, dtype=mx.int32)[:, None, None, None]
        queries = lengths + mx.arange(n)[None, None, :, None]
        mask = keys <= queries
        if window_size is not None:
            mask = mask & (keys > queries - window_size)
        return mask

    # -- rows joining and leaving --

    def append_row(self, single: KVCache, length: int) -> None:
        """Add a row holding the first `length` positions of a one-request cache (called before
        the row's length is added to `rows`)."""
        if single.keys is None or length == 0:  # a one-token prompt: nothing prefilled
            self.base.append(0)
            if self.keys is not None and self.values is not None:  # (set together)
                self.keys = mx.concatenate([self.keys, mx.zeros_like(self.keys[:1])], axis=0)
                self.values = mx.concatenate([self.values, mx.zeros_like(self.values[:1])],
                                             axis=0)
            return  # (no buffer yet: the first write allocates one for every row)
        base = self._join_base(length)
        k, v = held_keys(single, length)
        k, v = k[:, :, base:, :], v[:, :, base:, :]
        held = length - base
        have = 0 if self.keys is None else self.keys.shape[2]
        cap = max(have, ((held + STEP - 1) // STEP) * STEP or STEP)
        if self.keys is not None and self.values is not None and cap > have:
            self._reserve(cap, self.keys, self.values)
        pad = [(0, 0), (0, 0), (0, cap - held), (0, 0)]
        k, v = mx.pad(k, pad), mx.pad(v, pad)
        if self.keys is None or self.values is None:  # (set together)
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
        self.base.append(base)

    def _join_base(self, length: int) -> int:
        """Where a row joining at `length` starts: a window layer takes only the window before
        it (and the one position more that `trim` keeps)."""
        return 0 if self.window is None else max(0, length - self.window)

    @classmethod
    def of_singles(cls, rows: RowLengths, singles: list[KVCache | RotatingKVCache],
                   lengths: list[int]) -> RowsKVCache:
        """One layer of a batch whose row i holds the first lengths[i] positions of singles[i]
        (requests prefilling together). Empty rows get zeros, never read (the mask)."""
        layer = cls.like(rows, singles[0])
        like = next((c for c, n in zip(singles, lengths, strict=True)
                     if c.keys is not None and n > 0), None)
        if like is None:
            layer.base = [0] * len(singles)
            return layer  # nothing held yet: the first write allocates every row's buffer
        assert like.keys is not None and like.values is not None
        layer.base = [0 if c.keys is None or n == 0 else layer._join_base(n)
                      for c, n in zip(singles, lengths, strict=True)]
        cap = ((max(n - b for n, b in zip(lengths, layer.base, strict=True)) + STEP - 1)
               // STEP) * STEP
        keys, values = [], []
        for c, n, b in zip(singles, lengths, layer.base, strict=True):
            if c.keys is None or n == 0:
                _, h, _, dk = like.keys.shape
                keys.append(mx.zeros((1, h, cap, dk), like.keys.dtype))
                values.append(mx.zeros((1, h, cap, like.values.shape[3]), like.values.dtype))
                continue
            pad = [(0, 0), (0, 0), (0, cap - (n - b)), (0, 0)]
            k, v = held_keys(c, n)
            k, v = k[:, :, b:, :], v[:, :, b:, :]
            keys.append(mx.pad(k, pad))
            values.append(mx.pad(v, pad))
        layer.keys = mx.concatenate(keys, axis=0)
        layer.values = mx.concatenate(values, axis=0)
        return layer

    def keep_rows(self, kept: list[int]) -> None:
        self.base = [self.base[i] for i in kept]
        if self.keys is None or self.values is None:  # (set together)
            return
        if not kept:
            self.keys = self.values = None
            return
        index = mx.array(kept)
        self.keys = self.keys[index]
        self.values = self.values[index]

    def extract(self, row: int, length: int) -> KVCache | RotatingKVCache:
        """Row `row`'s first `length` positions as a one-request cache of its own (copies); a
        sliding-window layer's as a rotating cache holding the last window of them in time
        order (what mlx-lm's updates and caches.py's cuts expect of one)."""
        if self.window is not None:
            rotating = RotatingKVCache(self.window)
            if self.keys is None or self.values is None or length == 0:
                return rotating
            start = max(0, length - self.window)
            first, last = start - self.base[row], length - self.base[row]
            if first < 0:
                raise RuntimeError(f"row {row} read from position {start}, but it holds "
                                   f"positions from {self.base[row]} on")
            rotating.keys = mx.array(self.keys[row:row + 1, :, first:last, :])
            rotating.values = mx.array(self.values[row:row + 1, :, first:last, :])
            rotating.offset = length
            rotating._idx = length - start  # noqa: SLF001 - the buffer is full, in time order
            return rotating
        single = KVCache()
        if self.keys is None or length == 0:
            return single
        assert self.values is not None
        single.keys = mx.array(self.keys[row:row + 1, :, :length, :])
        single.values = mx.array(self.values[row:row + 1, :, :length, :])
        single.offset = length
        return single

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.keys, self.values) if a is not None]

    def restore_row(self, row: int) -> None:
        """Nothing to do: the row's length going down forgets its keys."""

    def compact_row(self, row: int, start: int, path: list[int]) -> None:
        """Row `row` verified a token tree written at `start`: move the accepted path's nodes
        right after node 0 (engine/model/tree.py; the row's length is set by the caller)."""
        moves = compact_positions(start, path)
        if moves is None or self.keys is None or self.values is None:
            return
        dst, src = moves
        base = self.base[row]
        idx = mx.array([p - base for p in src])
        span = slice(dst[0] - base, dst[-1] + 1 - base)
        self.keys[row:row + 1, :, span, :] = self.keys[row:row + 1, :, idx, :]
        self.values[row:row + 1, :, span, :] = self.values[row:row + 1, :, idx, :]

    # What generic cache code asks of a cache (checkpoint rules, byte counts).
    def is_trimmable(self) -> bool:
        return False

    @property
    def state(self) -> tuple[mx.array | None, mx.array | None]:
        return self.keys, self.values


def held_keys(single: KVCache | RotatingKVCache, length: int) -> tuple[mx.array, mx.array]:
    """The first `length` positions of a one-request cache, [1, H, length, D] each, at their
    absolute positions: a rotating cache holds only the last window of them (in its own order):
    the positions before are zeros, which the window's mask never shows."""
    if type(single) is not RotatingKVCache:
        return single.keys[..., :length, :], single.values[..., :length, :]
    if length != single.offset:
        raise ValueError(f"a rotating cache at {single.offset} read at {length}")
    keys = single._temporal_order(single.keys)  # noqa: SLF001
    values = single._temporal_order(single.values)  # noqa: SLF001
    held = min(keys.shape[2], length)  # positions [length - held, length)
    keys, values = keys[..., keys.shape[2] - held:, :], values[..., values.shape[2] - held:, :]
    if held < length:
        pad = [(0, 0), (0, 0), (length - held, 0), (0, 0)]
        keys, values = mx.pad(keys, pad), mx.pad(values, pad)
    return keys, values



class RowsArraysCache(ArraysCache):
    """One recurrent layer's state for the rows of a batch: each of its arrays stacked over
    rows ([B, ...]), as mlx-lm's `ArraysCache` holds a batch. A step whose rows have different
    widths sets `lengths` (mlx-lm's own: the layer masks the padded positions out of the state,
    and keeps its convolution window at each row's last real token). The arrays from before the
    step are kept: the layer replaces its arrays rather than writing into them, so keeping them
    is a reference, not a copy, and a row's rollback takes its own slice back from them."""

    # mlx-lm's attributes (one entry per array of the layer's state; the rows' widths): it
    # leaves them unannotated, and mypy infers list[None] and None from their first values
    cache: list[mx.array | None]  # type: ignore[assignment]
    lengths: mx.array | None  # type: ignore[assignment]

    def __init__(self, size: int):
        super().__init__(size)
        self.before: list[mx.array | None] = [None] * size
        self.count = 0  # rows (a state stays None until a row has run a token)

    def begin_step(self, widths: list[int]) -> None:
        self.before = list(self.cache)
        w = max(widths)
        self.lengths = None if all(x == w for x in widths) else mx.array(widths)

    def end_step(self) -> None:
        self.lengths = None

    def restore_row(self, row: int) -> None:
        """Row `row`'s state back to what it was before the last step."""
        for e, (now, then) in enumerate(zip(self.cache, self.before, strict=True)):
            if now is None:
                continue
            if then is None:  # the row had no state yet: zeros, as a fresh cache starts
                then = mx.zeros_like(now)
            pick = (mx.arange(now.shape[0]) == row).reshape(-1, *([1] * (now.ndim - 1)))
            self.cache[e] = mx.where(pick, then, now)

    def _stack(self, rows: list[list[mx.array | None]]) -> list[mx.array | None]:
        out: list[mx.array | None] = []
        for e in range(len(self.cache)):
            like = next((r[e] for r in rows if r[e] is not None), None)
            if like is None:
                out.append(None)
                continue
            out.append(mx.concatenate([a if (a := r[e]) is not None else mx.zeros_like(like)
                                       for r in rows], axis=0))
        return out

    def _rows(self, which: list[mx.array | None], n: int) -> list[list[mx.array | None]]:
        return [[None if a is None else a[i:i + 1] for a in which] for i in range(n)]

    def append_row(self, single: ArraysCache, length: int = 0) -> None:
        """Add a row holding a one-request cache's state (called before the row's length is
        added to the batch's lengths)."""
        new: list[mx.array | None] = list(single.cache)
        self.cache = self._stack(self._rows(self.cache, self.count) + [new])
        self.before = self._stack(self._rows(self.before, self.count) + [new])
        self.count += 1

    @classmethod
    def of_singles(cls, rows: RowLengths, singles: list[ArraysCache],
                   lengths: list[int]) -> RowsArraysCache:
        layer = cls(len(singles[0].cache))
        states: list[list[mx.array | None]] = [list(c.cache) for c in singles]
        layer.cache = layer._stack(states)
        layer.count = len(singles)
        return layer

    def keep_rows(self, kept: list[int]) -> None:
        index = mx.array(kept) if kept else None
        self.cache = [None if a is None or index is None else a[index] for a in self.cache]
        self.before = [None if a is None or index is None else a[index] for a in self.before]
        self.count = len(kept)

    def extract(self, row: int, length: int = 0) -> ArraysCache:
        """Row `row`'s state as a one-request cache of its own (copies)."""
        single = ArraysCache(len(self.cache))
        # (mlx-lm leaves ArraysCache.cache unannotated: mypy infers list[None] from [None] * n)
        single.cache = [None if a is None else mx.array(a[row:row + 1])  # type: ignore[misc]
                        for a in self.cache]
        return single

    def arrays(self) -> list[mx.array]:
        return [a for a in (*self.cache, *self.before) if a is not None]
