"""Token choice: greedy exactly as mlx-lm computes it, and the sampling distribution.

Greedy takes argmax of log-probabilities computed in the model's dtype (logits - logsumexp), row by
row, because that rounding creates ties which argmax over raw float32 logits would break
differently; plain decoding and every verify row use this one function.

Sampling builds the full target distribution p as a float64 numpy vector, with mlx-lm's semantics
(top-p, min-p, top-k filter the untempered log-probabilities, then temperature scales the
survivors), so that speculative acceptance can use exactly the distribution the plain sampler draws
from. Draws come from a per-request numpy Generator, so concurrent requests never share RNG state.

A draw is an exponential race (the Gumbel-max trick without its logarithms): one standard
exponential E_i per vocabulary entry, and the token is argmax p_i / E_i, which is p-distributed.
Every emitted token takes the next vector of the Generator's exponentials, so a drafter can read
the vectors ahead and draw its guess with them from its own distribution q (`Coupling`): the two
draws agree with probability sum_i 1 / sum_j max(p_j / p_i, q_j / q_i), whatever order the tokens
have, where an inverse-CDF draw in token-id order loses agreement to mass q misplaces below a
token (the shipped head kept 42.5% of its first drafts at temperature 0.7 this way, against 37.5%
through a shared uniform: docs/measurements/drafting.md, "Coupled guesses").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import mlx.core as mx
import numpy as np

from skulkp2p.engine.request import SamplingParams

__all__ = ["Coupling", "DraftDraws", "SamplingParams", "as_floats", "as_token", "as_tokens",
           "draw_with", "greedy_token", "greedy_tokens", "log_probs", "make_rng", "peek_noise",
           "process_logits", "sample_from", "target_probs"]


def process_logits(row: mx.array, history: list[int], params: SamplingParams) -> mx.array:
    """Logits processors, applied to one row [1, V] with the tokens that precede it.

    Repetition penalty is sign-aware and looks at the last `repetition_context` tokens, as mlx-lm's.
    """
    penalty = params.repetition_penalty
    if penalty is None or penalty == 1.0 or not history:
        return row
    recent = mx.array(history[-params.repetition_context:])
    selected = row[:, recent]
    selected = mx.where(selected < 0, selected * penalty, selected / penalty)
    row = mx.array(row)  # do not write into the forward's output buffer
    row[:, recent] = selected
    return row


def log_probs(row: mx.array) -> mx.array:
    return row - mx.logsumexp(row, axis=-1, keepdims=True)


def as_token(a: mx.array) -> int:
    """The token id in a one-element integer array (mlx types `item()` as any scalar)."""
    return cast(int, a.item())


def as_tokens(a: mx.array) -> list[int]:
    """The token ids in a 1-d integer array (mlx types `tolist()` as any nesting)."""
    return cast(list[int], a.tolist())


def as_floats(a: mx.array) -> list[float]:
    """The values of a 1-d floating array (mlx types `tolist()` as any nesting)."""
    return cast(list[float], a.tolist())


def greedy_token(row: mx.array) -> int:
    """argmax of log-probabilities in the model's dtype, as mlx-lm's greedy sampler sees them."""
    return as_token(mx.argmax(log_probs(row), axis=-1))


# Relative rounding step (machine epsilon) of the dtypes log-probabilities are computed in.
_EPS = {mx.float32: 2.0 ** -23, mx.float16: 2.0 ** -10, mx.bfloat16: 2.0 ** -7}


def greedy_tokens(rows: mx.array) -> list[int]:
    """greedy_token of each row of [w, V] (each row's log-probs reduced over that row alone).

    Computing log-probs costs an exp per vocabulary entry (on a CPU, several ms for a verify's
    rows: more than the rest of the round's Python). It can only change the argmax through a
    tie that rounding makes between the best logit and one very close to it: log-probs are
    x - c with x_max <= c <= x_max + log V, so x_max - x_j = g rounds to a strict inequality
    whenever g > eps * (2 (log V + 1) + g). Rows whose two best logits are that far apart take
    the raw argmax (the same token); any other row (a near tie, a non-finite value) makes the
    rows go through the exact log-probs."""
    eps = _EPS.get(rows.dtype)
    if eps is not None and rows.ndim == 2 and rows.shape[1] > 1:
        x = np.array(rows if rows.dtype == mx.float32 else rows.astype(mx.float32))
        at = np.arange(x.shape[0])
        top = x.argmax(axis=-1)
        best = x[at, top]
        x[at, top] = -np.inf
        gap = best - x.max(axis=-1)
        bound = eps * (2.0 * (np.log(x.shape[1]) + 1.0) + gap)
        if np.all(np.isfinite(best)) and np.all(gap > bound):
            return cast(list[int], top.tolist())
    return as_tokens(mx.argmax(log_probs(rows), axis=-1))


def target_probs(row: mx.array, params: SamplingParams) -> np.ndarray:
    """The distribution the sampler draws from for one processed row, as float64 [V]."""
    lp = np.array(log_probs(row).astype(mx.float32), dtype=np.float64).reshape(-1)
    keep = np.ones(lp.shape, dtype=bool)
    if 0.0 < params.top_p < 1.0:
        # Keep the smallest set of most likely tokens whose mass reaches top_p (ties kept).
        order = np.sort(lp)
        probs = np.exp(order)
        mass_above = np.cumsum(probs[::-1])[::-1] - probs
        dropped = int(np.count_nonzero(mass_above >= params.top_p * probs.sum()))
        keep &= lp >= order[min(dropped, len(order) - 1)]
    if params.min_p > 0.0:
        keep &= lp >= lp.max() + np.log(params.min_p)
    if 0 < params.top_k < lp.shape[0]:
        top = np.argpartition(-lp, params.top_k - 1)[: params.top_k]
        mask = np.zeros(lp.shape, dtype=bool)
        mask[top] = True
        keep &= mask
    scaled = np.where(keep, lp / params.temperature, -np.inf)
    scaled -= scaled.max()
    p = np.exp(scaled)
    return p / p.sum()


_TINY = np.finfo(np.float64).tiny


def sample_from(p: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from p: the exponential race over the Generator's next len(p) exponentials."""
    return draw_with(p, rng.standard_exponential(len(p)))


def draw_with(p: np.ndarray, noise: np.ndarray) -> int:
    """The token the race of p against these exponentials (one per entry) names:
    argmax p_i / E_i, the entry whose Exp(p_i) clock (E_i / p_i) rings first."""
    # (an exponential of exactly 0 has probability 2^-53; it must not make 0 / 0)
    return int(np.argmax(p / np.maximum(noise, _TINY)))


def peek_noise(rng: np.random.Generator, k: int, width: int) -> np.ndarray:
    """The next k draws' exponentials [k, width] (what k calls of sample_from over a width-long
    p take, in order), leaving the Generator where it was."""
    state = rng.bit_generator.state
    try:
        return rng.standard_exponential((k, width))
    finally:
        rng.bit_generator.state = state


@dataclass(frozen=True)
class Coupling:
    """A sampled request's sampler as a deterministic drafter may read it: the sampling
    parameters and the request's Generator, whose next exponentials decide the next emitted
    tokens (one vector each, in order). Reading ahead never draws: the text is plain sampling's
    whatever the drafter guesses."""
    params: SamplingParams
    rng: np.random.Generator

    def noise(self, k: int, width: int) -> np.ndarray:
        """The exponentials of the next k emitted tokens' draws over a width-entry vocabulary."""
        return peek_noise(self.rng, k, width)

    def guess(self, logits: mx.array, noise: np.ndarray) -> int:
        """The drafter's token for one position: its own distribution (the sampler's filters
        and temperature over `logits`) raced against the exponentials the target's draw of
        that position will use."""
        return draw_with(target_probs(logits.reshape(1, -1), self.params), noise)


@dataclass(frozen=True)
class DraftDraws:
    """A drafter's own draws from its distribution q, with its own Generator, for a sampled
    request whose text need not be reproducible (no seed): the verifier is given q and accepts
    with min(1, p/q), which keeps Σ min(p, q) of the drafts where a deterministic draft keeps
    p(draft)."""
    params: SamplingParams
    rng: np.random.Generator

    def draw(self, logits: mx.array) -> tuple[int, np.ndarray]:
        """(token, q): q the sampler's filters and temperature over `logits`, the token drawn
        from it."""
        q = target_probs(logits.reshape(1, -1), self.params)
        return sample_from(q, self.rng), q


def make_rng(seed: int | None) -> np.random.Generator:
    return np.random.default_rng(seed)
