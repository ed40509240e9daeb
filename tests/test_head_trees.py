"""The MTP / EAGLE head's top-k beside its chain (MtpDrafter.propose_branches): at each depth
where the head's own second choice is close to its first, that token is offered as a side
branch, and gates.build_tree keeps those that pay. Greedy output with head trees (a width table
where every branch pays, so most rounds are trees) equals plain decoding and mlx-lm's generate,
with the tiny MTP heads of tests/test_mtp.py and a random EAGLE head as tests/test_eagle.py's;
branches at depth >= 2 are verified, not only at depth 1."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from skulkp2p.engine.decode.loop import DecodeStats, decode
from skulkp2p.engine.decode.sampling import SamplingParams, make_rng
from skulkp2p.engine.drafting.gates import GatedDrafter
from skulkp2p.engine.drafting.mtp_drafter import HEAD_BRANCH_CLOSE, MtpDrafter
from skulkp2p.engine.model.forward import LocalForward
from skulkp2p.engine.model.loaded import LoadedModel, load_model
from skulkp2p.engine.model.trunk import Trunk
from skulkp2p.engine.runner.mlx_engine import MlxEngine
from skulkp2p.formats.pipe_format import parse_request
from tests.helpers.eagle import make_eagle_sidecar
from tests.helpers.reference import mlx_lm_tokens
from tests.helpers.trees import FREE_WIDTH, trees_on

TEXT = "The river was high after the rain. It carried branches, leaves and once a gate"
MAX_TOKENS = 40
DEPTH = 4
GREEDY = SamplingParams()




class Recording(GatedDrafter):
    """Keeps every tree it proposed (to see where the head's branches sat)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.trees_seen = []

    def propose_tree(self, history, k, extra=None):
        tree = super().propose_tree(history, k, extra)
        if tree is not None and not tree.is_chain:
            self.trees_seen.append(tree)
        return tree


def _head_trees(lm: LoadedModel, params: SamplingParams = GREEDY, seed: int = 0):
    head = lm.mtp
    drafter = Recording(MtpDrafter(head), FREE_WIDTH, head.conventions.max_depth,
                        prior_accept=0.5, trees=True)
    stats = DecodeStats()
    fwd = LocalForward(lm.model, hidden=head.conventions.hidden)
    out = list(decode(fwd, lm.tokenizer.encode(TEXT), params, MAX_TOKENS, make_rng(seed),
                      drafter, DEPTH, stats))
    return out, stats, drafter


@pytest.fixture(scope="module")
def heads(tiny_model, tiny_models, tmp_path_factory):
    out = {}
    for family in ("llama", "qwen3"):
        lm = load_model(tiny_model(family, mtp=True, mtp_style="qwen"), family,
                        dtype="float32")
        out[f"{family}-mtp"] = lm
    base = tiny_models["llama"]
    vocab = int(Trunk(load_model(base, "base").model).embed_tokens.weight.shape[0])
    ids = np.sort(np.random.default_rng(1).choice(vocab, 96, replace=False)).astype(np.int32)
    sidecar = make_eagle_sidecar(base, tmp_path_factory.mktemp("eagle") / "eagle.safetensors",
                                 ids)
    out["llama-eagle"] = load_model(base, "tiny", dtype="float32", sidecar=sidecar)
    return out


def test_propose_branches_is_the_chain_and_its_close_second_choices(heads):
    lm = heads["llama-mtp"]
    prompt = lm.tokenizer.encode(TEXT)

    def fresh() -> MtpDrafter:
        d = MtpDrafter(lm.mtp)
        fwd = LocalForward(lm.model, hidden=lm.mtp.conventions.hidden)
        fwd.prefill(prompt[:-1])
        d.begin(prompt, fwd)
        return d

    chain, _ = fresh().propose(prompt, DEPTH)
    main, branches = fresh().propose_branches(prompt, DEPTH)
    _, rows = fresh()._drafts(DEPTH)  # the head's logits at each depth, from the same state
    assert main == chain and len(main) == min(DEPTH, lm.mtp.conventions.max_depth)
    want = []
    for depth, row in enumerate(rows):
        p = np.array(mx.softmax(row.astype(mx.float32), axis=-1))
        q = p.copy()
        q[main[depth]] = -1.0
        second = int(q.argmax())
        if p[second] >= HEAD_BRANCH_CLOSE * p[main[depth]]:
            want.append((depth, second))
    assert [(b.depth, b.tokens[0]) for b in branches] == want
    assert all(len(b.tokens) == 1 and b.tokens[0] != main[b.depth] for b in branches)


@pytest.mark.parametrize("name", ["llama-mtp", "qwen3-mtp", "llama-eagle"])
def test_greedy_with_head_trees_equals_plain_and_mlx_lm(heads, name):
    lm = heads[name]
    prompt = lm.tokenizer.encode(TEXT)
    plain = list(decode(LocalForward(lm.model), prompt, SamplingParams(), MAX_TOKENS,
                        make_rng(0)))
    assert plain == mlx_lm_tokens(lm, prompt, MAX_TOKENS)
    out, stats, drafter = _head_trees(lm)
    assert out == plain
    assert stats.tree_rounds > 0
    # the head branched below its first token too (its top-k at each depth, not only depth 1)
    depths = {t.depths()[n] for t in drafter.trees_seen for n in t.side}
    assert max(depths) >= 2, depths


def test_sampled_head_trees_are_seeded(heads):
    lm = heads["llama-mtp"]
    params = SamplingParams(temperature=0.8)
    a, stats, _ = _head_trees(lm, params, seed=5)
    b, _, _ = _head_trees(lm, params, seed=5)
    assert a == b and len(a) == MAX_TOKENS and stats.tree_rounds > 0


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_auto_with_head_trees_equals_plain(heads, family, monkeypatch):
    """auto beside an MTP head with trees on (the card's field): where lookup has nothing the
    head drafts a tree of its own; the engine's greedy output equals plain."""
    lm = heads[f"{family}-mtp"]
    monkeypatch.setattr(lm, "width_costs", FREE_WIDTH)
    monkeypatch.setattr(lm, "speculation", trees_on(lm))
    engine = MlxEngine(lm, prefix_cache_mb=0, memory_tokens=0, max_batch=1)

    def run(spec):
        gen = engine.generate(parse_request({"prompt": TEXT, "max_tokens": MAX_TOKENS,
                                             "speculation": spec}))
        list(gen)
        return gen.result

    plain, auto = run("off"), run("auto")
    assert auto.tokens == plain.tokens
    assert auto.speculation.tree_rounds > 0
