"""The batch's per-row KV buffers (engine/batch_cache.py) at the level of one layer: where a
step writes each row's keys, and what a sliding-window layer keeps. The end-to-end exactness of
batched requests against solo ones is tests/test_batch.py and tests/test_batch_rowstate.py."""

from __future__ import annotations

import mlx.core as mx

from skulkp2p.engine.batch_cache import RowLengths, RowsKVCache


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
