"""The batch's per-row KV buffers (engine/cache/batch_cache.py) at the level of one layer: where a
step writes each row's keys, and what a sliding-window layer keeps. The end-to-end exactness of
batched requests against solo ones is tests/test_batch.py and tests/test_batch_rowstate.py."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from skulkp2p.engine.cache.batch_cache import STEP, RowLengths, RowsKVCache


def _keys(rows: int, width: int, base: float) -> mx.array:
    """[rows, 1, width, 2] keys whose values name their row and column (to see where they land)."""
    r = mx.arange(rows)[:, None, None, None]
    j = mx.arange(width)[None, None, :, None]
    return (base + 100 * r + j + mx.zeros((rows, 1, width, 2))).astype(mx.float32)


def test_a_step_writes_each_row_at_its_own_length():
    rows = RowLengths()
    rows.set([0, 0, 0])
    layer = RowsKVCache(rows)
    layer.update_and_fetch(_keys(3, 5, 0), _keys(3, 5, 0))  # equal lengths: one slice
    rows.set([5, 2, 4])  # rows kept different counts of their drafts
    k = _keys(3, 3, 1000)
    fetched, values = layer.update_and_fetch(k, -k)
    assert fetched.shape[2] == 5 + 3
    for i, n in enumerate([5, 2, 4]):
        got = fetched[i, 0, :, 0].tolist()
        want = [100 * i + j for j in range(5)][:n] + [1000 + 100 * i + j for j in range(3)]
        assert got[:n + 3] == want
        assert values[i, 0, n:n + 3, 0].tolist() == [-(1000 + 100 * i + j) for j in range(3)]
    # The next step's width differs: its write index is built anew, not the last step's.
    rows.set([6, 4, 7])
    fetched, _ = layer.update_and_fetch(_keys(3, 1, 5000), _keys(3, 1, 5000))
    assert [fetched[i, 0, n, 0].item() for i, n in enumerate([6, 4, 7])] == [5000, 5100, 5200]


def _single(length: int) -> KVCache:
    """A one-request cache whose key at position p is p (value -p)."""
    single = KVCache()
    k = mx.arange(length, dtype=mx.float32)[None, None, :, None] + mx.zeros((1, 1, length, 2))
    single.update_and_fetch(k, -k)
    return single


def test_a_window_row_joins_with_its_window_and_drops_what_it_no_longer_sees():
    window = 8
    rows = RowLengths()
    layer = RowsKVCache(rows, window=window)
    for n in (300, 20):  # rows join holding their last window (and one position more)
        layer.append_row(_single(n), n)
        rows.set([*rows.lengths, n])
    assert layer.base == [300 - window, 20 - window]
    layer.trim()  # nothing old enough to drop yet
    assert layer.trims == 0
    # Row 1 runs on to 20 + STEP + 5 (row 0 stays): each step writes position p as key p.
    for n in range(20, 20 + STEP + 5):
        mask = layer.make_mask(1, window_size=window)
        k = mx.array([300.0, float(n)])[:, None, None, None] + mx.zeros((2, 1, 1, 2))
        fetched, _ = layer.update_and_fetch(k, -k)
        # What each row's query sees is exactly its last window of positions.
        for i, at in enumerate((300, n)):
            seen = [fetched[i, 0, c, 0].item() for c in range(fetched.shape[2])
                    if mask[i, 0, 0, c].item()]
            assert seen == [float(p) for p in range(at - window + 1, at + 1)]
        rows.set([300, n + 1])
        layer.trim()
    # dropped once row 1 held STEP positions past its window: STEP of them at once
    assert layer.trims == 1 and layer.base == [300 - window, 20 - window + STEP]
    assert layer.keys.shape[2] == STEP  # shrunk to what the rows hold
    one = layer.extract(1, 20 + STEP + 5)  # a rotating cache of the window, in time order
    assert one.keys[0, 0, :, 0].tolist() == [float(p) for p in range(20 + STEP + 5 - window,
                                                                      20 + STEP + 5)]
    layer.keep_rows([1])  # row 0 leaves: its base goes with it
    assert layer.base == [20 - window + STEP]
