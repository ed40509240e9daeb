"""Chi-square tests for sampling exactness (tests/test_sampling_exactness.py explains the
levels, the bins and the power): a goodness-of-fit p-value against an exact distribution and a
two-sample p-value, with an exact chi-square tail."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Hashable, Iterable

import numpy as np


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df): the regularised upper incomplete gamma Q(df/2, x/2)
    (series below a + 1, Lentz continued fraction above; Numerical Recipes 6.2)."""
    a, z = df / 2.0, x / 2.0
    if z <= 0.0:
        return 1.0
    log_front = -z + a * math.log(z) - math.lgamma(a)
    if z < a + 1.0:
        term = total = 1.0 / a
        n = a
        for _ in range(10_000):
            n += 1.0
            term *= z / n
            total += term
            if abs(term) < abs(total) * 1e-16:
                break
        return max(0.0, 1.0 - total * math.exp(log_front))
    tiny = 1e-300
    b = z + 1.0 - a
    c = 1.0 / tiny
    d = 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-16:
            break
    return math.exp(log_front) * h


def _merge_small(obs: list[np.ndarray], exp: list[np.ndarray], rest_obs: np.ndarray,
                 rest_exp: np.ndarray, enough: Callable[[np.ndarray], bool]) -> None:
    """Append the lumped remainder as a bin, or fold it into the smallest bin when too small."""
    if not rest_exp.any():
        return
    if enough(rest_exp) or not exp:
        obs.append(rest_obs)
        exp.append(rest_exp)
        return
    i = min(range(len(exp)), key=lambda j: float(np.sum(exp[j])))
    obs[i] = obs[i] + rest_obs
    exp[i] = exp[i] + rest_exp


def goodness_of_fit(samples: Iterable[int], p: np.ndarray) -> float:
    """p-value of samples ~ p. A sample of a zero-probability token fails outright."""
    counts = np.bincount(np.fromiter(samples, dtype=np.int64), minlength=len(p)).astype(float)
    impossible = np.nonzero((p == 0) & (counts > 0))[0]
    assert not len(impossible), f"tokens of zero probability were emitted: {impossible.tolist()}"
    expected = counts.sum() * p
    big = expected >= 5.0
    obs = [counts[i:i + 1] for i in np.nonzero(big)[0]]
    exp = [expected[i:i + 1] for i in np.nonzero(big)[0]]
    _merge_small(obs, exp, np.array([counts[~big].sum()]), np.array([expected[~big].sum()]),
                 lambda e: float(e.sum()) >= 5.0)
    o, e = np.concatenate(obs), np.concatenate(exp)
    return chi2_sf(float(((o - e) ** 2 / e).sum()), len(o) - 1)


def two_sample(a: Iterable[Hashable], b: Iterable[Hashable]) -> float:
    """p-value of 'a and b come from the same distribution' (chi-square on a 2 x bins table)."""
    ca, cb = Counter(a), Counter(b)
    na, nb = sum(ca.values()), sum(cb.values())
    total = na + nb
    floor = 5.0 * total / min(na, nb)  # pooled count that gives every cell an expectation >= 5
    keys = sorted(set(ca) | set(cb), key=repr)
    pooled = {k: ca[k] + cb[k] for k in keys}
    big = [k for k in keys if pooled[k] >= floor]
    small = [k for k in keys if pooled[k] < floor]
    obs = [np.array([ca[k], cb[k]], dtype=float) for k in big]
    exp = [np.array([na, nb]) * pooled[k] / total for k in big]
    rest = np.array([sum(ca[k] for k in small), sum(cb[k] for k in small)], dtype=float)
    _merge_small(obs, exp, rest, np.array([na, nb]) * rest.sum() / total,
                 lambda e: float(e.min()) >= 5.0)
    if len(obs) < 2:
        return 1.0
    o, e = np.stack(obs), np.stack(exp)
    return chi2_sf(float(((o - e) ** 2 / e).sum()), len(o) - 1)
