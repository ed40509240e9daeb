"""Sampled requests with token trees (engine/decode/tree_accept.py), tested statistically, and the MTP
head's top-k branches beside its chain (MtpDrafter.propose_branches), tested for greedy
exactness.

* Unit level: `accept_child` over three one-hot children of a fixed p (temperature 0.8 + top-p
  + top-k as the loop processes a row), and over three children drawn independently from a
  skewed q (SpecInfer's case); then a draw from the residual when all are rejected. The emitted
  token must follow p: N = 20,000 draws, chi-square goodness of fit.
* End to end through `decode()`: a tiny llama (float32, lm_head sharpened so that drafts are
  often accepted) with a fixed tree of depth 2 (three children at the root, two under the
  first, one under the second, deliberately not in p's order) verified in one tree forward;
  the first THREE emitted tokens of N seeded runs against the exact joint distribution of plain
  sampling, computed from the model's own rows (p(t1) p(t2 | t1) p(t3 | t1, t2) over the
  top-k support), with top-k 8 and with a repetition penalty (which must see the path). The
  runs repeat a few dozen sequences of forward calls: a ForwardMemo (tests/helpers/sampled.py)
  computes each once, so the samples are the ones a forward per run gives, bit for bit.
* Power: the same tests on a rule that accepts each child with its own p(t) and skips the
  residual update must fail (unit: p below 1e-10 from 5,000 draws; end to end: about 1e-9
  from 1,000 runs, against alpha = 1e-3).

False alarms: every assertion rejects at alpha = 1e-3 (tests/helpers/stats.py, exact chi-square
tail); the 6 statistical assertions that should pass fail together with probability at most
about 0.6% over the seeds. Seeds are fixed, so the outcome is deterministic given the code.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

import mlx.core as mx
import numpy as np
import pytest

from skulkp2p.engine.decode import tree_accept
from skulkp2p.engine.decode.loop import DecodeStats, decode
from skulkp2p.engine.decode.sampling import (
    SamplingParams,
    make_rng,
    sample_from,
    target_probs,
)
from skulkp2p.engine.decode.tree_accept import accept_child
from skulkp2p.engine.drafting.gates import GatedDrafter
from skulkp2p.engine.drafting.suffix import SuffixDrafter
from skulkp2p.engine.model.forward import LocalForward
from skulkp2p.engine.model.loaded import LoadedModel, load_model
from skulkp2p.engine.model.tree import DraftTree
from skulkp2p.engine.runner.mlx_engine import MlxEngine
from skulkp2p.formats.pipe_format import parse_request
from tests.helpers.prefilled import PrefilledForward
from tests.helpers.sampled import (
    FixedDrafter,
    FixedTreeDrafter,
    ForwardMemo,
    draws_from,
    exact_joint,
    fixed_tree,
    joint_fit,
)
from tests.helpers.stats import goodness_of_fit
from tests.helpers.trees import CODE, FREE_WIDTH, tree_drafter, trees_on

ALPHA = 1e-3
N_UNIT = 20_000
N_E2E = 3000
SHARPEN = 3.0


def _no_residual(p, tokens, qs, rng):
    """A wrong rule: each child accepted with its own p(t), p never updated on rejection (the
    first child is exact, later ones are taken too rarely)."""
    for i, token in enumerate(tokens):
        if rng.random() < p[token]:
            return i, p
    rest = p.copy()
    rest[tokens] = 0.0
    return None, rest / rest.sum()


# --- unit level --------------------------------------------------------------------------------


def _unit_p() -> np.ndarray:
    raw = np.random.default_rng(4321).normal(0.0, 2.0, 256).astype(np.float32)
    row = mx.array(raw)[None]
    return target_probs(row, SamplingParams(temperature=0.8, top_p=0.95, top_k=24))


def _unit_draws(kind: str, rule=accept_child, n: int = N_UNIT) -> tuple[list[int], np.ndarray]:
    p = _unit_p()
    rng, draft_rng = make_rng(0), make_rng(1)
    order = np.argsort(-p)
    out = []
    if kind == "one-hot":
        # the 2nd, 1st and 4th likeliest tokens, in that order (not p's order)
        tokens = [int(order[1]), int(order[0]), int(order[3])]
        qs = [None, None, None]
    else:
        # q far from p: reversed preferences on p's support, a third of its mass outside it
        q = np.zeros_like(p)
        support = np.nonzero(p)[0]
        q[support] = 1.0 / p[support]
        q *= (2 / 3) / q.sum()
        q[np.nonzero(p == 0)[0][:10]] = (1 / 3) / 10
        qs = [q, q, q]
        drafted = draws_from(q, draft_rng, 3 * n).reshape(n, 3).tolist()
    for i in range(n):
        if kind != "one-hot":
            tokens = drafted[i]
        pick, residual = rule(p, tokens, qs, rng)
        out.append(tokens[pick] if pick is not None else sample_from(residual, rng))
    return out, p


@pytest.mark.parametrize("kind", ["one-hot", "skewed-q"])
def test_accept_child_emits_p(kind):
    emitted, p = _unit_draws(kind)
    assert goodness_of_fit(emitted, p) > ALPHA


def test_unit_test_rejects_a_rule_without_the_residual():
    emitted, p = _unit_draws("one-hot", rule=_no_residual, n=N_UNIT // 4)
    assert goodness_of_fit(emitted, p) < 1e-10


def _no_residual_draw(p, tokens, rng):
    """The same wrong rule in draw_child's shape (deterministic children)."""
    pick, rest = _no_residual(p, tokens, [None] * len(tokens), rng)
    return pick, (tokens[pick] if pick is not None else sample_from(rest, rng))


def test_one_child_is_the_chain_rule():
    """A node with one child draws what decode.verify_one draws, uniform for uniform, and both
    emit the token plain decoding's draw gives (the coupling that makes seeded sampled output
    independent of the drafts)."""
    from skulkp2p.engine.decode.loop import verify_one

    raw = np.random.default_rng(5).normal(0.0, 2.0, 64).astype(np.float32)
    row = mx.array(raw)[None]
    params = SamplingParams(temperature=0.9)
    p = target_probs(row, params)
    accepted = 0
    for seed in range(200):
        draft = seed % 64 if seed % 2 else int(np.argmax(p))
        a, b, c = make_rng(seed), make_rng(seed), make_rng(seed)
        token, ok = verify_one(row, draft, None, params, a)
        pick, drawn = tree_accept.draw_child(p, [draft], b)
        assert (ok, token) == (pick == 0, drawn) == (drawn == draft, sample_from(p, c))
        accepted += ok
    assert 0 < accepted < 200


def test_draw_child_emits_p_and_takes_each_child_with_its_p():
    p = _unit_p()
    order = np.argsort(-p)
    tokens = [int(order[1]), int(order[0]), int(order[3])]
    rng = make_rng(0)
    draws = [tree_accept.draw_child(p, tokens, rng) for _ in range(N_UNIT)]
    assert all(pick is None or tokens[pick] == t for pick, t in draws)
    assert goodness_of_fit([t for _, t in draws], p) > ALPHA
    taken = [pick for pick, _ in draws]
    for i, t in enumerate(tokens):  # each child kept in a share p(t) of the draws
        assert abs(taken.count(i) / N_UNIT - p[t]) < 5 * np.sqrt(p[t] * (1 - p[t]) / N_UNIT)


# --- end to end through decode() -------------------------------------------------------------


@pytest.fixture(scope="module")
def sharp_llama(tiny_models) -> LoadedModel:
    lm = load_model(tiny_models["llama"], "llama-sharp-trees", dtype="float32")
    lm.model.lm_head.weight = lm.model.lm_head.weight * SHARPEN
    mx.eval(lm.model.parameters())
    return lm


TOPK = SamplingParams(temperature=1.0, top_k=8)
PENALTY = SamplingParams(temperature=1.0, top_k=8, repetition_penalty=1.5)


def _prompt(lm: LoadedModel, params: SamplingParams) -> list[int]:
    base = lm.tokenizer.encode("The morning train")
    if params.repetition_penalty is None:
        return base
    # the model's own greedy continuation in the window: the penalty reshapes what it likes
    return base + list(decode(LocalForward(lm.model), base, SamplingParams(), 6, make_rng(0)))


def _tree_samples(lm: LoadedModel, prompt: list[int], params: SamplingParams,
                  tree: DraftTree, n: int, forward: Callable[[], object] | None = None
                  ) -> tuple[list[tuple[int, ...]], DecodeStats]:
    """The first three tokens of n seeded runs; `forward` makes each run's forward (default a
    PrefilledForward; the statistical tests pass their case's ForwardMemo, which gives the
    same logits and so the same samples, computing each distinct call sequence once)."""
    forward = forward or (lambda: PrefilledForward(lm.model))
    stats = DecodeStats()
    out = []
    for i in range(n):
        steps = decode(forward(), prompt, params, 6, make_rng(10_000 + i),
                       FixedTreeDrafter(tree), 2, stats)
        out.append(tuple(itertools.islice(steps, 3)))
        steps.close()
    return out, stats


@pytest.fixture(scope="module")
def cases(sharp_llama):
    """Per params: the prompt, the fixed tree, the exact joint, and the forwards' memo (one per
    module: the power test's runs repeat most of the exact test's call sequences)."""
    memo = {}
    forwards = ForwardMemo(lambda: PrefilledForward(sharp_llama.model))

    def get(params):
        if params not in memo:
            prompt = _prompt(sharp_llama, params)
            memo[params] = (prompt, fixed_tree(sharp_llama.model, prompt, params),
                            exact_joint(sharp_llama.model, prompt, params), forwards.forward)
        return memo[params]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("params", [TOPK, PENALTY], ids=["topk8", "topk8-penalty1.5"])
def test_sampled_tree_matches_theexact_joint(sharp_llama, cases, params):
    prompt, tree, joint, forward = cases(params)
    samples, stats = _tree_samples(sharp_llama, prompt, params, tree, N_E2E, forward)
    # every round of the first three tokens' was a tree; each root child and a depth-2 node
    # were taken in a fair share of the runs, so every child's rule was exercised
    assert stats.tree_rounds >= N_E2E
    firsts = [s[0] for s in samples]
    for child in tree.tokens[:3]:
        assert firsts.count(child) > 0.01 * N_E2E
    assert sum(s[:2] == (tree.tokens[0], tree.tokens[3]) for s in samples) > 0.02 * N_E2E
    assert joint_fit(samples, joint) > ALPHA


@pytest.mark.slow
def test_end_to_end_test_rejects_a_rule_without_the_residual(sharp_llama, cases, monkeypatch):
    prompt, tree, joint, forward = cases(TOPK)
    monkeypatch.setattr(tree_accept, "draw_child", _no_residual_draw)  # its nodes are one-hot
    samples, _ = _tree_samples(sharp_llama, prompt, TOPK, tree, N_E2E // 3, forward)
    assert joint_fit(samples, joint) < ALPHA  # (about 1e-9 from these 1,000 runs)


def test_sampled_tree_round_is_seeded(sharp_llama, cases):
    prompt, tree, _, _ = cases(TOPK)
    a, stats = _tree_samples(sharp_llama, prompt, TOPK, tree, 20)
    b, _ = _tree_samples(sharp_llama, prompt, TOPK, tree, 20)
    assert a == b and stats.tree_rounds >= 20 and len(set(a)) > 1


# --- through the engine: the suffix drafter's trees, alone and in a batch ---------------------


def test_sampled_requests_take_trees(tiny_models):
    lm = load_model(tiny_models["llama"], "llama", dtype="float32")
    prompt = lm.tokenizer.encode(CODE)
    stats = DecodeStats()
    params = SamplingParams(temperature=0.8)
    out = list(decode(LocalForward(lm.model), prompt, params, 40, make_rng(3), tree_drafter(),
                      8, stats))
    assert len(out) == 40 and stats.tree_rounds > 0


def test_greedy_with_a_repetition_penalty_takes_trees_exactly(tiny_models):
    """Greedy with a logits processor walks the tree node by node (each row processed with
    its own path): the same tokens as plain decoding with that penalty."""
    lm = load_model(tiny_models["llama"], "llama", dtype="float32")
    prompt = lm.tokenizer.encode(CODE)
    params = SamplingParams(repetition_penalty=1.3)
    plain = list(decode(LocalForward(lm.model), prompt, params, 48, make_rng(0)))
    stats = DecodeStats()
    out = list(decode(LocalForward(lm.model), prompt, params, 48, make_rng(0), tree_drafter(),
                      8, stats))
    assert out == plain and stats.tree_rounds > 0


SEEDED = SamplingParams(temperature=0.9, top_p=0.95, repetition_penalty=1.1)


@pytest.fixture(scope="module")
def seeded_plain(sharp_llama) -> list[list[int]]:
    """Plain sampled decoding of CODE with seeds 0-5 (SEEDED): what every drafting below must
    reproduce, computed once for all of them."""
    prompt = sharp_llama.tokenizer.encode(CODE)
    return [list(decode(LocalForward(sharp_llama.model), prompt, SEEDED, 40, make_rng(seed)))
            for seed in range(6)]


@pytest.mark.slow
@pytest.mark.parametrize("drafting", ["suffix-chains", "suffix-trees", "skewed-fixed-chain"])
def test_seeded_sampled_output_does_not_depend_on_the_drafts(sharp_llama, seeded_plain,
                                                             drafting):
    """With deterministic drafts a sampled request emits the tokens plain sampling with the same
    seed emits, draft or no draft, accepted or not: the output of a seeded request does not
    depend on the drafter, the gates' timing or the placement."""
    lm = sharp_llama
    prompt = lm.tokenizer.encode(CODE)
    params = SEEDED
    stats = DecodeStats()
    first = seeded_plain[0][:6]  # seed 0's opening, drafted every round of every seed
    for seed, plain in enumerate(seeded_plain):
        if drafting == "skewed-fixed-chain":
            drafter = FixedDrafter(first)
        else:
            drafter = tree_drafter() if drafting == "suffix-trees" else GatedDrafter(
                SuffixDrafter(), FREE_WIDTH, 8, prior_accept=0.8)
        out = list(decode(LocalForward(lm.model), prompt, params, 40, make_rng(seed), drafter,
                          4, stats))
        assert out == plain, (drafting, seed)
    assert stats.drafted > stats.accepted > 0
    assert (stats.tree_rounds > 0) == (drafting == "suffix-trees")


def _run(engine: MlxEngine, bodies: list[dict], together: bool):
    results: list = [None] * len(bodies)

    def go(i: int) -> None:
        gen = engine.generate(parse_request(bodies[i]))
        list(gen)
        results[i] = gen.result

    if together:
        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
    else:
        for i in range(len(bodies)):
            go(i)
    return results


def test_seeded_sampled_trees_alone_and_in_a_batch(tiny_models, monkeypatch):
    """A seeded sampled request with trees gives the same text twice, and the same in a batch
    of four (rows verify trees in the batched forward) as alone."""
    lm = load_model(tiny_models["llama"], "llama", dtype="float32")
    monkeypatch.setattr(lm, "width_costs", FREE_WIDTH)  # every branch pays: many trees
    monkeypatch.setattr(lm, "speculation", trees_on(lm))
    prompts = [CODE, CODE.replace("add", "div"), "a b c d a b c d a b", CODE[:60]]
    bodies = [{"id": i, "prompt": p, "max_tokens": 32, "temperature": 0.7, "seed": 11 + i,
               "speculation": "auto"} for i, p in enumerate(prompts)]
    engine = MlxEngine(lm, prefix_cache_mb=0, memory_tokens=0, max_batch=4)
    first = _run(engine, bodies, together=False)
    again = _run(engine, bodies, together=False)
    batched = _run(engine, bodies, together=True)
    assert [r.tokens for r in first] == [r.tokens for r in again] == [r.tokens for r in batched]
    assert sum(r.speculation.tree_rounds for r in first) > 0
    assert sum(r.speculation.tree_rounds for r in batched) > 0
    assert engine.scheduler is not None and engine.scheduler.peak > 1
