"""Token trees verified in one forward (engine/model/tree.py): the tree forward against forwards of
each node's path alone, KV compaction against a cache built from the accepted path only, and
greedy decoding with trees on byte-identical to plain decoding and to mlx-lm's generate, per
attention-only family (tiny llama, qwen2, qwen3; SmolLM2-135M in a slow test). Hybrid
recurrent models (qwen3_5) refuse trees and keep chains."""

from __future__ import annotations

import copy
import threading

import mlx.core as mx
import numpy as np
import pytest

from skulkp2p.engine.batching.batch_view import StepPacking
from skulkp2p.engine.decode.loop import DecodeStats, decode
from skulkp2p.engine.decode.sampling import SamplingParams, make_rng
from skulkp2p.engine.drafting.drafter import Branch
from skulkp2p.engine.drafting.gates import DEFAULT_WIDTH_COSTS, build_tree
from skulkp2p.engine.model.forward import LocalForward
from skulkp2p.engine.model.loaded import load_model
from skulkp2p.engine.model.tree import DraftTree, greedy_walk, tree_capable, tree_inputs
from skulkp2p.engine.runner.mlx_engine import MlxEngine
from skulkp2p.formats.pipe_format import parse_request
from tests.helpers.loaded import smollm2_float32
from tests.helpers.reference import mlx_lm_tokens
from tests.helpers.trees import (
    CODE,
    FREE_WIDTH,
    PARENTS,
    TOKENS,
    same_rows,
    tree_drafter,
    trees_on,
)

TREE_FAMILIES = ("llama", "qwen2", "qwen3")

@pytest.fixture(scope="module")
def models(tiny_model):
    return {fam: load_model(tiny_model(fam), fam, dtype="float32")
            for fam in (*TREE_FAMILIES, "qwen3_5")}


def _path(node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(TOKENS[node])
        node = PARENTS[node]
    return out[::-1]


def _prefilled(lm, prompt):
    f = LocalForward(lm.model)
    f.prefill(prompt)
    return f


def _copied(lm, f: LocalForward) -> LocalForward:
    """A forward that goes on from copies of `f`'s caches (buffers, offsets), `f` untouched."""
    g = LocalForward(lm.model)
    g.local.adopt(copy.deepcopy(f.cache))
    return g


def test_tree_inputs_mask_and_positions():
    t = tree_inputs([3], [PARENTS], len(PARENTS))
    mask = np.array(t.mask)[0, 0]
    assert mask.shape == (7, 10)
    assert mask[:, :3].all()  # every node sees the cached prefix
    # node 5's ancestors are 2, 1, 0: keys 3 + {0, 1, 2, 5}
    assert np.flatnonzero(mask[5, 3:]).tolist() == [0, 1, 2, 5]
    assert np.flatnonzero(mask[6, 3:]).tolist() == [0, 3, 6]
    assert np.array(t.positions).tolist() == [3, 4, 5, 4, 5, 6, 5]


def test_greedy_walk_follows_the_target():
    # The target's choice at each node: at 0 token 13 (node 3), at 3 token 16 (node 6), then 99.
    chosen = [13, 0, 0, 16, 0, 0, 99]
    assert greedy_walk(PARENTS, TOKENS, chosen) == ([3, 6], 99)
    assert greedy_walk(PARENTS, TOKENS, [5, 0, 0, 0, 0, 0, 0]) == ([], 5)


def test_draft_tree_rejects_a_parent_after_its_child():
    with pytest.raises(ValueError, match="parent"):
        DraftTree.chain([1, 2]).add(5, 3)


@pytest.mark.parametrize("family", TREE_FAMILIES)
def test_tree_forward_rows_equal_each_path_alone(models, family):
    """Row j of the tree forward is the last row of a forward over node j's path alone (as a
    chain verify, and step by step). Bit for bit on the reference BLAS; on OpenBLAS the same
    token and within helpers.trees.ROW_TOLERANCE (same_rows); the SmolLM2 test below says how
    close on a real one."""
    lm = models[family]
    prompt = list(range(5, 40))
    f = _prefilled(lm, prompt)
    assert f.trees
    rows = f.verify_tree(TOKENS, PARENTS)
    for j in range(len(TOKENS)):
        chain = _prefilled(lm, prompt)(_path(j))[-1]
        why = same_rows(rows[j], chain)
        assert why is None, f"node {j}: tree row and its chain's {why}"
        step = _prefilled(lm, prompt)
        for t in _path(j):
            last = step([t])[-1]
        why = same_rows(rows[j], last)
        assert why is None, f"node {j}: tree row and single steps' {why}"


@pytest.mark.parametrize("family", TREE_FAMILIES)
@pytest.mark.parametrize("path", [[3, 6], [1, 2, 5], [3], [], [1, 2]])
@pytest.mark.usefixtures("mlx_lm_functions")
def test_compaction_equals_cache_of_the_path_alone(models, family, path):
    # (With numpy's verify attention and SwiGLU on float32 CPU nodes, within rounding:
    # test_numpy_verify.)
    lm = models[family]
    prompt = list(range(5, 40))
    f = _prefilled(lm, prompt)
    f.verify_tree(TOKENS, PARENTS)
    f.keep_path(path)
    g = _prefilled(lm, prompt)
    g([TOKENS[0], *[TOKENS[j] for j in path]])
    for a, b in zip(f.cache, g.cache, strict=True):
        assert a.offset == b.offset == len(prompt) + 1 + len(path)
        assert mx.array_equal(a.keys[..., :a.offset, :], b.keys[..., :b.offset, :])
        assert mx.array_equal(a.values[..., :a.offset, :], b.values[..., :b.offset, :])
    # ... and decoding goes on from it exactly as from the path's cache
    assert mx.array_equal(f([3, 4]), g([3, 4]))


@pytest.mark.parametrize("family", TREE_FAMILIES)
def test_greedy_with_trees_equals_plain_and_mlx_lm(models, family):
    lm = models[family]
    prompt = lm.tokenizer.encode(CODE)
    plain = list(decode(LocalForward(lm.model), prompt, SamplingParams(), 64, make_rng(0)))
    assert plain == mlx_lm_tokens(lm, prompt, 64)
    stats = DecodeStats()
    drafter = tree_drafter()
    spec = list(decode(LocalForward(lm.model), prompt, SamplingParams(), 64, make_rng(0),
                       drafter, 8, stats))
    assert spec == plain
    assert stats.tree_rounds > 0 and drafter.side_offered > 0
    assert stats.drafted >= stats.accepted


def test_hybrid_model_keeps_chains(models):
    """qwen3_5 (recurrent layers) verifies no trees: the forward says so, refuses one, and
    the loop drafts chains for a tree drafter there, exactly as plain."""
    lm = models["qwen3_5"]
    assert not tree_capable(lm.model)
    f = _prefilled(lm, list(range(5, 20)))
    assert not f.trees
    with pytest.raises(ValueError, match="chains only"):
        f.verify_tree(TOKENS, PARENTS)
    prompt = lm.tokenizer.encode(CODE)
    plain = list(decode(LocalForward(lm.model), prompt, SamplingParams(), 40, make_rng(0)))
    stats = DecodeStats()
    spec = list(decode(LocalForward(lm.model), prompt, SamplingParams(), 40, make_rng(0),
                       tree_drafter(), 8, stats))
    assert spec == plain and stats.tree_rounds == 0 and stats.drafted > 0


def test_build_tree_adds_branches_only_where_they_pay():
    main = [1, 2, 3, 4]
    branches = [Branch(0, [9, 8], 0.5), Branch(2, [7], 0.5)]
    free = build_tree(main, branches, [0.5] * 4, 0.5, FREE_WIDTH)
    assert free.tokens == [1, 2, 3, 4, 9, 8, 7] and free.parents == [0, 1, 2, 3, 0, 5, 2]
    assert free.main == 4 and free.side == [5, 7]
    # at the measured CPU costs, branches beside a chain that is almost always right do not pay
    sure = build_tree(main, branches, [0.99] * 4, 0.5, DEFAULT_WIDTH_COSTS["float32"])
    assert sure.is_chain
    # nor does anything when each extra row costs as much as a step
    linear = {1: 1.0, 2: 2.0, 64: 64.0}
    assert build_tree(main, branches, [0.5] * 4, 0.5, linear).is_chain


def test_build_tree_in_a_packed_batch_prices_a_branch_as_the_step_runs():
    """Among 3 plain rows a branch widens every row's forward when the step is priced padded,
    and only its own MLPs and head when priced packed: there it pays; alone, packing changes
    nothing (one row is never ragged)."""
    main = [1, 2, 3, 4]
    branches = [Branch(0, [7, 8, 9], 0.5), Branch(1, [5], 0.5)]
    f32 = DEFAULT_WIDTH_COSTS["float32"]
    packing = StepPacking(head=0.21, mlps=0.59)
    assert build_tree(main, branches, [0.6] * 4, 0.5, f32, rows=4).is_chain
    packed = build_tree(main, branches, [0.6] * 4, 0.5, f32, rows=4, packing=packing)
    assert not packed.is_chain and packed.tokens[:4] == main
    alone = build_tree(main, branches, [0.6] * 4, 0.5, f32)
    assert alone.tokens == build_tree(main, branches, [0.6] * 4, 0.5, f32,
                                      packing=packing).tokens


def _engine_tokens(engine: MlxEngine, reqs: list, together: bool) -> list[list[int]]:
    results: list = [None] * len(reqs)

    def go(i: int) -> None:
        gen = engine.generate(reqs[i])
        list(gen)
        results[i] = gen.result

    if not together:
        for i in range(len(reqs)):
            go(i)
    else:
        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(reqs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
    return [r.tokens for r in results]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_trees_in_a_batch_equal_plain(models, family, monkeypatch):
    """Rows of a batch verify their trees in the batched forward (other rows are chains or
    plain steps in it); every request's tokens are plain decoding's."""
    lm = models[family]
    monkeypatch.setattr(lm, "width_costs", FREE_WIDTH)  # every branch pays: many trees
    monkeypatch.setattr(lm, "speculation", trees_on(lm))
    prompts = [CODE, CODE.replace("add", "div"), "a b c d a b c d a b", CODE[:60]]
    reqs = [parse_request({"id": i, "prompt": p, "max_tokens": 24 + 8 * i,
                           "speculation": "off" if i == 3 else "auto"})
            for i, p in enumerate(prompts)]
    plain = [parse_request({"id": i, "prompt": p, "max_tokens": 24 + 8 * i,
                            "speculation": "off"}) for i, p in enumerate(prompts)]
    engine = MlxEngine(lm, prefix_cache_mb=0, memory_tokens=0, max_batch=4)
    expected = _engine_tokens(engine, plain, together=False)
    got = _engine_tokens(engine, reqs, together=True)
    assert got == expected
    assert engine.scheduler is not None and engine.scheduler.peak > 1


@pytest.mark.slow
def test_smollm2_trees_exact(smollm2_path):
    """On SmolLM2-135M (float32 OpenBLAS): a tree forward's rows against each path alone (how
    close: a chain verify of k + 1 rows is itself not bit-identical to k + 1 single steps on
    this backend), and greedy decoding with trees equal to plain and to mlx-lm's generate.
    (32 tokens: 4 rounds, 3 of them trees with 11 side branches offered beside their chains;
    tree rounds, side branches and drafts both accepted and rejected are asserted.)"""
    lm = smollm2_float32()
    prompt = lm.tokenizer.encode(CODE * 3)
    # The prompt is prefilled once; every forward below starts from a copy of these caches
    # (what a prefill of its own would hold: the same ops), and each node's single steps go on
    # from a copy of its parent's (the steps of its path up to it are its parent's).
    prefilled = _prefilled(lm, prompt)
    f = _copied(lm, prefilled)
    tokens = [prompt[-1], *TOKENS[1:]]
    rows = f.verify_tree(tokens, PARENTS)
    worst_tree = worst_chain = 0.0
    stepped: list[LocalForward] = []  # node j: the prompt, then its path's single steps
    for j in range(len(tokens)):
        path = [tokens[0]] + [t for t in _path(j)[1:]]
        chain = _copied(lm, prefilled)(path)[-1]
        step = _copied(lm, prefilled if PARENTS[j] < 0 else stepped[PARENTS[j]])
        last = step([tokens[j]])[-1]
        stepped.append(step)
        worst_tree = max(worst_tree, float(mx.abs(rows[j] - last).max()))
        worst_chain = max(worst_chain, float(mx.abs(chain - last).max()))
        assert int(mx.argmax(rows[j])) == int(mx.argmax(last))
    print(f"tree row vs single steps: {worst_tree:.2e}; chain verify vs single steps: "
          f"{worst_chain:.2e}")
    assert worst_tree <= max(4 * worst_chain, 1e-4)
    plain = list(decode(LocalForward(lm.model), prompt, SamplingParams(), 32, make_rng(0)))
    assert plain == mlx_lm_tokens(lm, prompt, 32)
    stats = DecodeStats()
    drafter = tree_drafter()
    spec = list(decode(LocalForward(lm.model), prompt, SamplingParams(), 32, make_rng(0),
                       drafter, 8, stats))
    assert spec == plain and stats.tree_rounds > 0 and drafter.side_offered > 0
    assert 0 < stats.accepted < stats.drafted  # drafts accepted and rejected


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_lookup_tree_with_mtp_branch_equals_plain(tiny_model, family, monkeypatch):
    """auto beside an MTP head: lookup's tree carries the head's first choices as branches
    (gates.LookupThenModel.propose_tree); the head follows the accepted path's rows; greedy
    output equals plain."""
    lm = load_model(tiny_model(family, mtp=True), family, dtype="float32")
    assert lm.mtp is not None
    monkeypatch.setattr(lm, "width_costs", FREE_WIDTH)
    monkeypatch.setattr(lm, "speculation", trees_on(lm))
    engine = MlxEngine(lm, prefix_cache_mb=0, memory_tokens=0, max_batch=1)

    def run(spec):
        gen = engine.generate(parse_request({"prompt": CODE, "max_tokens": 48,
                                             "speculation": spec}))
        list(gen)
        return gen.result

    plain, auto = run("off"), run("auto")
    assert auto.tokens == plain.tokens
    assert auto.speculation.tree_rounds > 0
