"""Sampling exactness of speculative decoding, tested statistically.

Speculative sampling must emit tokens distributed exactly as plain sampling does (Leviathan et
al. 2023): accept draft x with min(1, p(x)/q(x)), on rejection draw from norm(max(0, p - q)).
A skewed drafter is the hard case, so every test here uses one.

* Unit level: `verify_one` on a fixed target row, with a deterministic draft (q one-hot on a
  token of modest p) and a stochastic draft whose q is far from p (reversed preferences, half
  its mass outside p's support). The emitted tokens must follow p = target_probs(row) under
  temperature 0.8 + top-p 0.9 + top-k 20, under min-p, and on a row with a repetition penalty
  applied first. N = 20,000 draws each, chi-square goodness of fit.
* End to end through `decode()`: a tiny llama target with fixed skewed drafts at depth 3 (and a
  draft model sampling from a different distribution at depth 2), with top-k 30 and with a
  repetition penalty; the pairs of first two emitted tokens of speculative decoding against
  those of plain decoding (`decode()` without a drafter) over thousands of seeds, two-sample
  chi-square; the first token also against the exact target distribution. A synthetic bigram
  target with strong self-transitions checks that the repetition penalty of a verify row
  includes the earlier drafts of the same round: its first token, first two and third token
  against the exact distributions of plain decoding, computed from its table.
* Cost: the thousands of short runs on the tiny llama repeat a few dozen sequences of forward
  calls (the same prompt, the same drafts, a handful of emitted tokens). A ForwardMemo
  (tests/helpers/sampled.py) computes each sequence once and hands the same arrays to every
  run that repeats it, so the samples are the ones a forward per run gives, bit for bit.

False-alarm rate: every statistical assertion rejects at alpha = 1e-3 (p-values from an exact
chi-square tail, below), and the passing tests make 17 of them, so a correct implementation fails
with probability at most about 1.7% over the choice of seeds (checked: on 2,000 simulated null
replications the binned tests rejected 0.75-0.85% at alpha = 0.01). All seeds are fixed, so
given the code the outcome is deterministic: a change that only reorders random draws can flip a
test with that small probability, a real bias flips it for sure.

Power: the tests must not pass vacuously, so the same tests are run on deliberately wrong
verifiers (always accept the draft; resample from p instead of the residual on rejection; a
penalty window that forgets the round's earlier drafts) and must reject them. With 20,000 draws
the unit test detects moving 2 points of probability between two tokens of p ~ 0.1
(noncentrality ~160 against critical values of 45-73) essentially always; the wrong rules
above are rejected end to end with p-values below 1e-15 from a few hundred samples.

Bins: a goodness-of-fit bin per outcome expected at least 5 times, the rest lumped; a two-sample
bin per outcome seen at least 5 * total / min(n_a, n_b) times in the pooled sample (so every
expected cell count is >= 5), the rest lumped. Bins are chosen from pooled counts only, which
keeps the two-sample test valid.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable

import mlx.core as mx
import numpy as np
import pytest

from skulkp2p.engine.decode import loop as decode_module
from skulkp2p.engine.decode.loop import decode, verify_one
from skulkp2p.engine.decode.sampling import (
    SamplingParams,
    make_rng,
    process_logits,
    sample_from,
    target_probs,
)
from skulkp2p.engine.drafting.draft_model import DraftModelDrafter
from skulkp2p.engine.model.forward import Forward, LocalForward
from skulkp2p.engine.model.loaded import LoadedModel, load_model
from tests.helpers.prefilled import CopiedPrefillForward, PrefilledForward
from tests.helpers.sampled import (
    FixedDrafter,
    ForwardMemo,
    draws_from,
    joint_fit,
    probs_after,
    skewed_sequence,
)
from tests.helpers.stats import chi2_sf, goodness_of_fit, two_sample

ALPHA = 1e-3

# --- statistics -----------------------------------------------------------------------------


@pytest.mark.parametrize("df,quantile", [(1, 10.828), (2, 13.816), (5, 20.515), (10, 29.588),
                                         (30, 59.703), (100, 149.449)])
def test_chi2_tail_matches_tables(df, quantile):
    # 0.999 quantiles of chi-square from standard tables.
    assert chi2_sf(quantile, df) == pytest.approx(1e-3, rel=2e-3)
    assert chi2_sf(df - 1.0, df) > 0.3 and chi2_sf(0.0, df) == 1.0


def test_tests_hold_their_level_on_exact_samples():
    """Sanity of the binning: direct draws from p pass; the tests are not biased against it."""
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.full(40, 0.3))
    draws = rng.choice(40, size=20_000, p=p)
    assert goodness_of_fit(draws, p) > ALPHA
    assert two_sample(draws[:10_000].tolist(), draws[10_000:].tolist()) > ALPHA


# --- unit level: verify_one -----------------------------------------------------------------

Verifier = Callable[..., tuple[int, bool]]

UNIT_CASES = {
    "temp0.8-topp0.9-topk20": (SamplingParams(temperature=0.8, top_p=0.9, top_k=20), []),
    "minp0.1": (SamplingParams(temperature=1.0, min_p=0.1), []),
    # History holding the row's strongest tokens, so the penalty reshapes p substantially.
    "penalty1.5-topk40": (SamplingParams(temperature=1.0, top_k=40, repetition_penalty=1.5),
                          "top"),
}
N_UNIT = 20_000


def _unit_row(case: str) -> tuple[mx.array, SamplingParams, np.ndarray]:
    """A fixed bf16 logits row (as a model emits them) processed as the loop does; and p."""
    params, history = UNIT_CASES[case]
    raw = np.random.default_rng(1234).normal(0.0, 2.0, 512).astype(np.float32)
    row = mx.array(raw)[None].astype(mx.bfloat16)
    if history == "top":
        order = np.argsort(-raw)
        history = [int(t) for t in order[[0, 2, 4, 5, 9]]] + [7, 8, 9]
    row = process_logits(row, history, params)
    return row, params, target_probs(row, params)


def _skewed_q(p: np.ndarray) -> np.ndarray:
    """Far from p: half its mass on ten tokens p excludes, half on p's support with reversed
    preferences (the rarest token of p gets the most)."""
    q = np.zeros_like(p)
    support = np.nonzero(p)[0]
    q[support] = 1.0 / p[support]
    q *= 0.5 / q.sum()
    outside = np.nonzero(p == 0)[0][:10]
    q[outside] = 0.05
    return q


def _emitted(case: str, draft_kind: str, n: int, verifier: Verifier = verify_one,
             seed: int = 0) -> tuple[list[int], np.ndarray]:
    row, params, p = _unit_row(case)
    rng, draft_rng = make_rng(seed), make_rng(seed + 1)
    out = []
    if draft_kind == "one-hot":
        # A deterministic drafter on the token whose p is closest to 0.1.
        draft = int(np.argmin(np.abs(p - 0.1)))
        assert 0.03 < p[draft] < 0.3
        for _ in range(n):
            out.append(verifier(row, draft, None, params, rng)[0])
    else:
        q = _skewed_q(p)
        for draft in draws_from(q, draft_rng, n).tolist():
            out.append(verifier(row, draft, q, params, rng)[0])
    return out, p


@pytest.mark.parametrize("draft_kind", ["one-hot", "skewed-q"])
@pytest.mark.parametrize("case", list(UNIT_CASES))
def test_verify_one_emits_p(case, draft_kind):
    emitted, p = _emitted(case, draft_kind, N_UNIT)
    assert goodness_of_fit(emitted, p) > ALPHA


def _always_accept(row, draft, q, params, rng):
    return draft, True


def _resample_from_p(row, draft, q, params, rng):
    """The classic mistake: on rejection draw from p itself instead of the residual."""
    p = target_probs(row, params)
    q_draft = 1.0 if q is None else q[draft]
    if rng.random() * q_draft < p[draft]:
        return draft, True
    return sample_from(p, rng), False


@pytest.mark.parametrize("draft_kind", ["one-hot", "skewed-q"])
@pytest.mark.parametrize("wrong", [_always_accept, _resample_from_p],
                         ids=["always-accept", "resample-from-p"])
def test_unit_test_rejects_wrong_rules(draft_kind, wrong):
    emitted, p = _emitted("temp0.8-topp0.9-topk20", draft_kind, N_UNIT // 4, verifier=wrong)
    if wrong is _always_accept and draft_kind == "skewed-q":
        # Half the drafts are tokens p excludes: the zero-probability check catches it outright.
        with pytest.raises(AssertionError, match="zero probability"):
            goodness_of_fit(emitted, p)
        return
    assert goodness_of_fit(emitted, p) < ALPHA


# --- end to end through decode() -------------------------------------------------------------

# Random weights give near-uniform rows; scaling lm_head gives the peaked rows of a trained model,
# where drafts are often accepted and multi-token acceptances actually occur.
SHARPEN = 3.0
N_E2E = 2000
DEPTH = 3


@pytest.fixture(scope="module")
def sharp_llama(tiny_models) -> LoadedModel:
    lm = load_model(tiny_models["llama"], "llama-sharp")
    w = lm.model.lm_head.weight
    lm.model.lm_head.weight = (w.astype(mx.float32) * SHARPEN).astype(w.dtype)
    mx.eval(lm.model.parameters())
    return lm


def _first_tokens(forward_factory: Callable[[], object], prompt: list[int],
                  params: SamplingParams, n: int, seed0: int,
                  drafter_factory: Callable[[int], object] | None = None, depth: int = 0,
                  take: int = 3) -> list[tuple[int, ...]]:
    out = []
    for i in range(n):
        drafter = drafter_factory(i) if drafter_factory is not None else None
        # max_tokens leaves room for a full-depth first round; only `take` tokens are read.
        steps = decode(forward_factory(), prompt, params, take + depth + 1, make_rng(seed0 + i),
                       drafter, depth)
        out.append(tuple(itertools.islice(steps, take)))
        steps.close()
    return out


@pytest.fixture(scope="module")
def forwards(sharp_llama) -> ForwardMemo:
    """The target's forwards for every end-to-end run on sharp_llama: each distinct sequence of
    forward calls is computed once (tests/helpers/sampled.py), the logits are the ones a
    PrefilledForward gives, so the samples are too."""
    return ForwardMemo(lambda: PrefilledForward(sharp_llama.model))


@pytest.fixture(scope="module")
def plain_samples(forwards):
    """Plain sampled decoding, memoised per (prompt, params): shared by several tests."""
    cache: dict = {}

    def get(prompt: list[int], params: SamplingParams) -> list[tuple[int, ...]]:
        key = (tuple(prompt), params)
        if key not in cache:
            cache[key] = _first_tokens(forwards.forward, prompt, params, N_E2E, seed0=0,
                                       take=2)
        return cache[key]

    return get


TOPK = SamplingParams(temperature=1.0, top_k=30)
PENALTY = SamplingParams(temperature=1.0, top_k=30, repetition_penalty=1.3)


def _prompt(lm: LoadedModel, params: SamplingParams) -> list[int]:
    base = lm.tokenizer.encode("The morning train")
    if params.repetition_penalty is None:
        return base
    # Extend with the model's own greedy continuation, so that the tokens it likes next are in
    # the penalty window and the penalty reshapes p (by ~0.19 in total variation here).
    greedy = decode(LocalForward(lm.model), base, SamplingParams(), 10, make_rng(0))
    return base + list(greedy)


def _spec_samples(forwards: ForwardMemo, prompt: list[int], params: SamplingParams,
                  drafter_factory: Callable[[int], object], depth: int,
                  n: int = N_E2E) -> list[tuple[int, ...]]:
    return _first_tokens(forwards.forward, prompt, params, n, seed0=1_000_000,
                         drafter_factory=drafter_factory, depth=depth, take=2)


def _check_against_plain(spec: list[tuple[int, ...]], plain: list[tuple[int, ...]],
                         p1: np.ndarray) -> None:
    assert goodness_of_fit((s[0] for s in spec), p1) > ALPHA
    assert two_sample([s[:2] for s in spec], [s[:2] for s in plain]) > ALPHA
    if len(spec[0]) > 2:  # the third token's marginal, where samples are cheap
        assert two_sample([s[2] for s in spec], [s[2] for s in plain]) > ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("params", [TOPK, PENALTY], ids=["topk30", "topk30-penalty1.3"])
def test_fixed_skewed_drafts_match_plain(sharp_llama, forwards, plain_samples, params):
    lm = sharp_llama
    prompt = _prompt(lm, params)
    drafts = skewed_sequence(lm.model, prompt, params)
    spec = _spec_samples(forwards, prompt, params, lambda i: FixedDrafter(drafts), DEPTH)
    # The drafts were accepted in some samples and rejected in others, at both positions.
    first_two = Counter(s[:2] for s in spec)
    assert 0.1 * N_E2E < sum(v for k, v in first_two.items() if k[0] == drafts[0]) < 0.9 * N_E2E
    assert first_two[tuple(drafts[:2])] > 0.02 * N_E2E
    _check_against_plain(spec, plain_samples(prompt, params), probs_after(lm.model, prompt,
                                                                           params))


@pytest.mark.slow
def test_draft_model_with_skewed_q_matches_plain(sharp_llama, forwards, plain_samples):
    """A stochastic drafter whose q (temperature 1.6, top-k 60) is far from p (temperature 1,
    top-k 30): half of q's support lies where p is zero."""
    lm = sharp_llama
    prompt = _prompt(lm, TOPK)
    q_params = SamplingParams(temperature=1.6, top_k=60)
    # The draft model's own forwards: the same computation as a PrefilledForward's (prefill
    # reused), each distinct call sequence computed once (its first call is every run's).
    draft_forwards = ForwardMemo(lambda: PrefilledForward(lm.model))

    def drafter(i: int) -> DraftModelDrafter:
        d = DraftModelDrafter(lm, q_params, make_rng(2_000_000 + i))
        d.forward = draft_forwards.forward()
        return d

    spec = _spec_samples(forwards, prompt, TOPK, drafter, 2, n=N_E2E * 3 // 4)  # + 2 draft calls
    _check_against_plain(spec, plain_samples(prompt, TOPK), probs_after(lm.model, prompt, TOPK))


@pytest.mark.slow
@pytest.mark.parametrize("wrong", [_always_accept, _resample_from_p],
                         ids=["always-accept", "resample-from-p"])
def test_end_to_end_test_rejects_wrong_rules(sharp_llama, forwards, plain_samples, monkeypatch,
                                             wrong):
    lm = sharp_llama
    prompt = _prompt(lm, TOPK)
    drafts = skewed_sequence(lm.model, prompt, TOPK)
    monkeypatch.setattr(decode_module, "verify_one", wrong)
    spec = _spec_samples(forwards, prompt, TOPK, lambda i: FixedDrafter(drafts), DEPTH,
                         n=N_E2E // 3)
    assert two_sample([s[:2] for s in spec], [s[:2] for s in plain_samples(prompt, TOPK)]) < ALPHA


# --- the penalty window inside a verify round --------------------------------------------------


BIGRAM_V = 64
# Tested against the exact distributions (bigram_exact), which carry no sampling noise of their
# own: a bias moves the chi-square of 3,000 runs against them as much as that of 6,000 runs
# against 6,000 plain ones (n m / (n + m) = 3,000), the two-sample test this replaces. Measured:
# the forgetful window is rejected at 6e-120 here, at 6e-89 there.
N_BIGRAM = 3000


class BigramForward(Forward):
    """A synthetic target whose next-token logits depend on the last token only, with strong
    self-transitions: a token just emitted is likely again unless the penalty holds it back. So
    the row after an accepted draft x differs sharply depending on whether x is in the window.
    `round_base` is the history length when the current verify round began. It holds no
    caches; every other part of the seam is its default."""

    cache: list = []

    def __init__(self, table: mx.array, prompt_len: int):
        self.table = table
        self.length = prompt_len - 1  # tokens whose rows have been computed
        self.round_base = prompt_len

    def prefill(self, tokens: list[int]) -> None:
        self.length = len(tokens)

    def __call__(self, tokens: list[int]) -> mx.array:
        self.round_base = self.length + 1  # history already holds the pending token
        self.length += len(tokens)
        return self.table[mx.array(tokens)]

    def rollback(self, keep: int, dropped: int) -> None:
        self.length -= dropped


BIGRAM_PROMPT = [10, 11, 12, 13, 14]
BIGRAM_X = 40  # the prompt's likely successor, itself likely to repeat


def _bigram_table() -> mx.array:
    rng = np.random.default_rng(77)
    table = rng.normal(0.0, 1.0, (BIGRAM_V, BIGRAM_V)) + 4.5 * np.eye(BIGRAM_V)
    # p(x | prompt) ~ 0.6; p(x | ..., x) ~ 0.6 with x outside the window, ~ 0.35 inside it.
    table[BIGRAM_PROMPT[-1], BIGRAM_X] = 5.5
    return mx.array(table.astype(np.float32))


def _bigram_samples(params: SamplingParams, n: int, seed0: int, drafts: list[int] | None,
                    forgetful: bool = False) -> list[tuple[int, ...]]:
    table = _bigram_table()
    forwards: list[BigramForward] = []

    def factory() -> BigramForward:
        forwards.append(BigramForward(table, len(BIGRAM_PROMPT)))
        return forwards[-1]

    if not forgetful:
        return _first_tokens(factory, BIGRAM_PROMPT, params, n, seed0,
                             (lambda i: FixedDrafter(drafts)) if drafts else None, DEPTH)
    # The bug this guards against: rows of a verify round penalised with the history from
    # before the round, i.e. without the drafts accepted earlier in the same round.
    real = decode_module.process_logits

    def forgetful_process(row, history, params_):
        return real(row, history[:forwards[-1].round_base], params_)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decode_module, "process_logits", forgetful_process)
        return _first_tokens(factory, BIGRAM_PROMPT, params, n, seed0,
                             lambda i: FixedDrafter(drafts), DEPTH)


BIGRAM_PARAMS = SamplingParams(temperature=1.0, top_k=30, repetition_penalty=1.3)


@pytest.fixture(scope="module")
def bigram_exact() -> tuple[np.ndarray, dict[tuple, float], np.ndarray]:
    """What plain decoding draws from, exactly: p(t1), p(t1, t2) and the marginal p(t3), each
    row the table's row of the last token processed with the whole history before it (the
    bigram target has no other state)."""
    table = _bigram_table()

    def after(history: list[int]) -> np.ndarray:
        row = table[history[-1]][None]
        return target_probs(process_logits(row, history, BIGRAM_PARAMS), BIGRAM_PARAMS)

    p1 = after(BIGRAM_PROMPT)
    joint: dict[tuple, float] = {}
    p3 = np.zeros(BIGRAM_V)
    for a in np.nonzero(p1)[0].tolist():
        p2 = after(BIGRAM_PROMPT + [a])
        for b in np.nonzero(p2)[0].tolist():
            joint[(a, b)] = p1[a] * p2[b]
            p3 += joint[(a, b)] * after(BIGRAM_PROMPT + [a, b])
    return p1, joint, p3


def _bigram_drafts() -> list[int]:
    # Accepting x puts it in the window of the next row, which must then hold x back.
    return [BIGRAM_X] * DEPTH


@pytest.mark.process
def test_penalty_window_includes_the_rounds_drafts(bigram_exact):
    p1, joint, p3 = bigram_exact
    drafts = _bigram_drafts()
    spec = _bigram_samples(BIGRAM_PARAMS, N_BIGRAM, 1_000_000, drafts)
    assert sum(s[:2] == tuple(drafts[:2]) for s in spec) > 0.1 * N_BIGRAM  # chains happen
    assert goodness_of_fit((s[0] for s in spec), p1) > ALPHA
    assert joint_fit([s[:2] for s in spec], joint) > ALPHA
    assert goodness_of_fit((s[2] for s in spec), p3) > ALPHA


@pytest.mark.process
def test_penalty_test_rejects_a_forgetful_window(bigram_exact):
    _, joint, _ = bigram_exact
    drafts = _bigram_drafts()
    spec = _bigram_samples(BIGRAM_PARAMS, N_BIGRAM, 1_000_000, drafts, forgetful=True)
    pairs = [s[:2] for s in spec]
    # A pair of zero probability would reject outright (joint_fit fails on it); here the
    # p-value does, at about 6e-120.
    assert any(pair not in joint for pair in pairs) or joint_fit(pairs, joint) < ALPHA


@pytest.mark.slow
def test_sampled_output_keeps_the_target_distribution_with_memory_drafts(sharp_llama, forwards,
                                                                         plain_samples):
    """The memory holds the prompt followed by skewed tokens (a likely, a likely, then the least
    likely token the target allows), so the suffix drafter drafts them; sampled output must
    still be distributed as plain sampling's (the chi-square tests above)."""
    from skulkp2p.engine.drafting.suffix import SuffixDrafter, SuffixMemory

    lm = sharp_llama
    params = TOPK
    prompt = _prompt(lm, params)
    drafts = skewed_sequence(lm.model, prompt, params)
    mem = SuffixMemory(1000)
    mem.add(prompt + drafts)

    def drafter(i: int) -> SuffixDrafter:
        return SuffixDrafter(memory=mem)

    spec = _spec_samples(forwards, prompt, params, drafter, DEPTH)
    assert mem.hits > 0.5 * N_E2E
    _check_against_plain(spec, plain_samples(prompt, params),
                         probs_after(lm.model, prompt, params))


# --- the Gemma 4 assistant (engine/drafting/assistant.py) -----------------------------------------------


N_ASSISTANT = 600


@pytest.mark.slow
def test_gemma4_assistant_sampling_matches_plain(tmp_path_factory):
    """The assistant drafts 3 tokens a round from its own q (temperature 1 over the whole
    vocabulary), reading the target's live cache; the first token must follow p exactly and the
    first two must be distributed as plain decoding's. A target with a sharpened final norm
    keeps p concentrated enough for the bins; drafts are accepted at positions 1 and 2 (about
    27% and 7% of offers measured here), so the residual draws past a first acceptance run."""
    from mlx_lm import load as mlx_load

    from skulkp2p.engine.decode.loop import DecodeStats
    from skulkp2p.engine.drafting.assistant import AssistantDrafter, load_assistant
    from tests.helpers import tiny_gemma4

    base = tmp_path_factory.mktemp("gemma4-sampling")
    model, tokenizer = mlx_load(str(tiny_gemma4.make_target(base / "target")))
    model.set_dtype(mx.float32)
    model.model.norm.weight = model.model.norm.weight * 2.0
    assistant = load_assistant(tiny_gemma4.make_assistant(base / "assistant", "dense"), model,
                               mx.float32)
    params = SamplingParams(temperature=1.0)
    prompt = tokenizer.encode("The morning train")
    stats = DecodeStats()

    def drafter(i: int) -> AssistantDrafter:
        return AssistantDrafter(assistant, params, make_rng(3_000_000 + i))

    def run(forward, factory, seed0):
        out = []
        for i in range(N_ASSISTANT):
            d = factory(i) if factory else None
            steps = decode(forward(), prompt, params, 2 + 3 + 1, make_rng(seed0 + i), d,
                           3 if d else 0, stats)
            out.append(tuple(itertools.islice(steps, 2)))
            steps.close()
        return out

    # The assistant reads the target's live caches: a real forward for every speculative run
    # (from copies of the prompt's prefilled caches: the same samples, measured, at ~2/3 of
    # the cost).
    spec = run(lambda: CopiedPrefillForward(model, hidden="after"), drafter, 1_000_000)
    assert stats.accepted_at[0] > 0.1 * N_ASSISTANT and stats.accepted_at[1] > 0
    # Plain runs repeat a few call sequences: each computed once (tests/helpers/sampled.py).
    plain = run(ForwardMemo(lambda: LocalForward(model)).forward, None, 0)
    p1 = probs_after(model, prompt, params)
    assert goodness_of_fit((s[0] for s in spec), p1) > ALPHA
    assert two_sample(spec, plain) > ALPHA
