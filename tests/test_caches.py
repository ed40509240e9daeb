"""Rollback: after a rejection the caches hold exactly what a fresh plain decode would, for
trimmable KV, sliding-window (rotating) KV across a wrap, and recurrent state."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import RotatingKVCache

from skulkp2p.engine.cache import caches
from skulkp2p.engine.model.forward import LocalForward
from skulkp2p.engine.model.loaded import load_model


def _feed(cache, tokens):
    k = mx.array(tokens, dtype=mx.float32).reshape(1, 1, -1, 1)
    cache.update_and_fetch(k, k)


def _window(cache):
    keys, _ = cache.state[:2]
    return sorted(int(x) for x in keys.reshape(-1)[: min(cache.offset, cache.max_size)].tolist())


def _reference_window(n: int) -> list[int]:
    reference = RotatingKVCache(max_size=8, keep=0)
    for t in range(n):
        _feed(reference, [t])
    return _window(reference)


def test_rotating_cache_that_wraps_during_verify_is_cut_back():
    """A multi-token verify goes through mlx-lm's concatenating update, which keeps the keys in
    time order: cutting the rejected ones off the end is exact, wrapped or not (no snapshot)."""
    cache = [RotatingKVCache(max_size=8, keep=0)]
    _feed(cache[0], list(range(6)))
    verify = [6, 7, 100, 101]  # wraps the window during the verify
    assert not caches.needs_snapshot(cache, len(verify))
    _feed(cache[0], verify)
    caches.trim(cache, 2)  # reject the two drafts
    _feed(cache[0], [8])
    assert _window(cache[0]) == _reference_window(9) == list(range(1, 9))
    _feed(cache[0], [9, 10, 200])  # and again, from a wrapped in-place buffer
    caches.trim(cache, 1)
    _feed(cache[0], [11])
    assert _window(cache[0]) == _reference_window(12)
    _feed(cache[0], [12, 400])
    with pytest.raises(ValueError, match="cannot cut"):  # less than a window would be left
        caches.trim(cache, 2)


def test_rotating_cache_fed_one_token_that_wraps_is_snapshotted():
    """One token at a time a wrapped ring overwrites its oldest entry: that needs a snapshot,
    and restoring it (an offset entry otherwise) gives back the window."""
    cache = [RotatingKVCache(max_size=8, keep=0)]
    _feed(cache[0], list(range(8)))
    assert caches.needs_snapshot(cache, 1)
    snap = caches.snapshot(cache, 1)
    _feed(cache[0], [100])
    caches.restore(cache, snap)
    _feed(cache[0], [8])
    assert _window(cache[0]) == _reference_window(9)
    snap = caches.snapshot(cache, 3)  # a whole verify undone: a cut cannot, so a copy
    assert snap.entries[0][0] == "state"
    _feed(cache[0], [9, 300, 301])
    caches.restore(cache, snap)
    _feed(cache[0], [9])
    assert _window(cache[0]) == _reference_window(10)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_next_logits_after_rejection_equal_fresh_decode(tiny_models, family):
    lm = load_model(tiny_models[family], family)
    prompt = lm.tokenizer.encode("rollback check: the quick brown fox")
    fwd = LocalForward(lm.model)
    fwd.prefill(prompt[:-1])
    fwd([prompt[-1], 11, 12, 13])  # verify three drafts...
    fwd.rollback(keep=2, dropped=2)  # ...keep the pending token and the first draft
    after = fwd([42])
    fresh = LocalForward(lm.model)
    fresh.prefill(prompt[:-1])
    fresh([prompt[-1], 11])
    expected = fresh([42])
    assert mx.array_equal(after, expected).item()
