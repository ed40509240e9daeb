"""Rollback: after a rejection the caches hold exactly what a fresh plain decode would, for
trimmable KV, sliding-window (rotating) KV across a wrap, and recurrent state."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import RotatingKVCache

from skulkp2p.engine import caches
from skulkp2p.engine.forward import LocalForward
from skulkp2p.engine.model import load_model


def _feed(cache, tokens):
    k = mx.array(tokens, dtype=mx.float32).reshape(1, 1, -1, 1)
    cache.update_and_fetch(k, k)


def _window(cache):
    keys, _ = cache.state[:2]
    return sorted(int(x) for x in keys.reshape(-1)[: min(cache.offset, cache.max_size)].tolist())


def test_rotating_cache_that_wraps_during_verify_is_snapshotted():
    cache = [RotatingKVCache(max_size=8, keep=0)]
    _feed(cache[0], list(range(6)))
    verify = [6, 7, 100, 101]  # wraps the window during the verify
    assert caches.needs_snapshot(cache, len(verify))
    snap = caches.snapshot(cache, len(verify))
    _feed(cache[0], verify)
    caches.restore(cache, snap)  # reject the two drafts, then re-run what was kept
    _feed(cache[0], [6, 7])
    _feed(cache[0], [8])
    reference = RotatingKVCache(max_size=8, keep=0)
    for t in range(9):
        _feed(reference, [t])
    assert _window(cache[0]) == _window(reference) == list(range(1, 9))


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
