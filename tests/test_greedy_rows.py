"""greedy_tokens (sampling.py) picks each verify row's token from the raw logits when the best
two are far enough apart that the log-probs cannot tie them, else through the exact log-probs:
always the token mlx-lm's greedy sampler picks (argmax of logits - logsumexp)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from skulkp2p.engine.decode.sampling import greedy_token, greedy_tokens, log_probs

V = 49152  # SmolLM2's vocabulary


def exact(rows: mx.array) -> list[int]:
    return [greedy_token(rows[i:i + 1]) for i in range(rows.shape[0])]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("scale", [0.5, 4.0, 30.0])
def test_rows_pick_what_the_log_probs_pick(dtype, scale):
    rng = np.random.default_rng(int(scale * 10))
    rows = mx.array((rng.standard_normal((17, V)) * scale).astype(np.float32)).astype(dtype)
    assert greedy_tokens(rows) == exact(rows)


def test_a_tie_made_by_rounding_takes_the_exact_path():
    """The best logit is one step above another, earlier one; x - logsumexp rounds both to the
    same value, so mlx-lm's argmax takes the earlier index, which the raw argmax would not."""
    ties = 0
    for base in np.linspace(1.0, 30.0, 60, dtype=np.float32):
        x = np.full(V, base - 3, np.float32)
        x[100] = base
        x[7] = np.nextafter(base, np.float32(-np.inf))
        rows = mx.array(np.stack([x, np.roll(x, 1000)]))
        want = mx.argmax(log_probs(rows), axis=-1).tolist()
        ties += want[0] != int(x.argmax())
        assert greedy_tokens(rows) == want == exact(rows)
    assert ties > 0  # the construction did make rounding ties (else this test shows nothing)


def test_non_finite_rows_take_the_exact_path():
    x = np.zeros((3, V), np.float32)
    x[0, 5] = np.inf
    x[1, :] = -np.inf
    x[1, 9] = 0.0
    x[2, 11] = np.nan
    rows = mx.array(x)
    assert greedy_tokens(rows) == mx.argmax(log_probs(rows), axis=-1).tolist()
