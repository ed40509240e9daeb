"""Greedy exactness of the one decode loop: plain equals mlx-lm's own generate, and every drafter
depth equals plain, for each tiny family (llama, qwen3, hybrid qwen3_5 with recurrent state)."""

import pytest

from skulkp2p.engine.decode.drafter_seam import Drafter, DrafterCapabilities
from skulkp2p.engine.decode.loop import DecodeStats, decode
from skulkp2p.engine.decode.sampling import SamplingParams, make_rng
from skulkp2p.engine.drafting.prompt_lookup import PromptLookup
from skulkp2p.engine.model.forward import Forward, LocalForward
from skulkp2p.engine.model.loaded import load_model
from skulkp2p.formats.pipe_format import parse_request
from tests.helpers.models import FAMILIES
from tests.helpers.pipe_result import generate
from tests.helpers.reference import mlx_lm_tokens

# Repetitive text so that lookup drafts are both accepted and rejected.
ECHO = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(a,"


@pytest.fixture(scope="module")
def loaded(tiny_models):
    return {fam: load_model(tiny_models[fam], fam) for fam in FAMILIES}




@pytest.mark.parametrize("family", FAMILIES)
def test_plain_equals_mlx_lm_generate(loaded, family):
    lm = loaded[family]
    prompt = lm.tokenizer.encode(ECHO)
    ours = list(decode(LocalForward(lm.model), prompt, SamplingParams(), 40, make_rng(0)))
    assert ours == mlx_lm_tokens(lm, prompt, 40)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_lookup_equals_plain(loaded, family, depth):
    lm = loaded[family]
    prompt = lm.tokenizer.encode(ECHO)
    plain = list(decode(LocalForward(lm.model), prompt, SamplingParams(), 48, make_rng(0)))
    stats = DecodeStats()
    spec = list(decode(LocalForward(lm.model), prompt, SamplingParams(), 48, make_rng(0),
                       PromptLookup(), depth, stats))
    assert spec == plain
    assert stats.drafted > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_request_equals_mlx_lm(loaded, family):
    lm = loaded[family]
    req = parse_request({"messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 24})
    result = generate(lm, req)
    prompt = lm.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True)
    assert result["tokens"] == mlx_lm_tokens(lm, prompt, 24)
    assert result["usage"]["completion_tokens"] == len(result["tokens"])


def test_seeded_sampling_repeats_and_seeds_differ(loaded):
    lm = loaded["llama"]
    body = {"prompt": "Once upon a time", "max_tokens": 30, "temperature": 1.0, "top_p": 0.95,
            "top_k": 50, "repetition_penalty": 1.1}
    a = generate(lm, parse_request({**body, "seed": 7}))["tokens"]
    b = generate(lm, parse_request({**body, "seed": 7}))["tokens"]
    c = generate(lm, parse_request({**body, "seed": 8}))["tokens"]
    assert a == b and a != c


def test_max_tokens_and_finish_reason(loaded):
    lm = loaded["qwen3"]
    r = generate(lm, parse_request({"prompt": "abc", "max_tokens": 5}))
    assert len(r["tokens"]) == 5 and r["finish_reason"] == "length"


class _ProposeOnly(Drafter):
    """A drafter with nothing of the seam but its name and `propose` (the lookup scan's)."""

    name = "propose-only"

    def __init__(self) -> None:
        self.lookup = PromptLookup()

    def propose(self, history, k):
        return self.lookup.propose(history, k)


class _CoreOnly(Forward):
    """A forward with nothing of the seam but its core, over a LocalForward."""

    def __init__(self, model) -> None:
        self.inner = LocalForward(model)

    def prefill(self, tokens):
        self.inner.prefill(tokens)

    def __call__(self, tokens):
        return self.inner(tokens)

    def rollback(self, keep, dropped):
        self.inner.rollback(keep, dropped)

    @property
    def cache(self):
        return self.inner.cache


def test_a_drafter_with_propose_alone_takes_the_declared_defaults(loaded):
    """No capabilities, never quiet, its tree the chain `propose` gives: on a forward that
    verifies trees the loop asks it for chains, runs no quiet stretch, and greedy output is
    plain's."""
    drafter = _ProposeOnly()
    assert drafter.capabilities == DrafterCapabilities() and not drafter.quiet()
    history = [5, 6, 7, 5, 6]
    tree = drafter.propose_tree(history, 3)
    assert tree is not None and tree.is_chain and tree.tokens == drafter.propose(history, 3)[0]
    lm = loaded["llama"]
    forward = LocalForward(lm.model)
    assert forward.trees
    prompt = lm.tokenizer.encode(ECHO)
    stats = DecodeStats()
    out = list(decode(forward, prompt, SamplingParams(), 40, make_rng(0), drafter, 3, stats))
    assert out == list(decode(LocalForward(lm.model), prompt, SamplingParams(), 40, make_rng(0)))
    assert stats.drafted > 0 and stats.tree_rounds == 0 and stats.pipelined == 0


def test_a_forward_with_the_core_alone_runs_the_round_loop(loaded):
    """A forward that declares only prefill, __call__, rollback and its caches verifies chains
    only, has no lazy steps (the loop runs its round loop: plain greedy is not pipelined), holds
    nothing elsewhere and restores nothing; greedy output is still mlx-lm's."""
    lm = loaded["llama"]
    prompt = lm.tokenizer.encode(ECHO)
    forward = _CoreOnly(lm.model)
    assert not forward.trees and not forward.may_run_ahead()
    assert forward.restore([], prompt[:3], prompt[:4]) == 0 and forward.keep_in_group([1]) == 0
    with pytest.raises(ValueError):
        forward.verify_tree([1, 2], [-1, 0])
    stats = DecodeStats()
    out = list(decode(forward, prompt, SamplingParams(), 40, make_rng(0), stats=stats))
    assert out == mlx_lm_tokens(lm, prompt, 40) and stats.pipelined == 0
    ahead = DecodeStats()
    list(decode(LocalForward(lm.model), prompt, SamplingParams(), 40, make_rng(0), stats=ahead))
    assert ahead.pipelined > 0


def test_every_forward_declares_the_whole_seam():
    """The loop and the request call every method of the Forward protocol without asking: each
    implementation has them all, its own or the protocol's defaults (a ring's and a tensor
    group's forwards declare theirs: their modules import mlx lazily). (Its data members,
    `cache`, `trees`, `hidden`, `last_hidden`, may be set per instance.)"""
    from skulkp2p.engine.batching.row_forward import RowForward
    from skulkp2p.engine.parallel.ring.traversal import RingForward
    from skulkp2p.engine.parallel.tensor.group import TensorForward

    seam = {name for name, value in vars(Forward).items()
            if callable(value) and (not name.startswith("_") or name == "__call__")}
    assert {"may_run_ahead", "lazy_step", "verify_tree", "keep_in_group", "close"} <= seam
    for cls in (LocalForward, RowForward, RingForward, TensorForward):
        missing = sorted(name for name in seam if not hasattr(cls, name))
        assert not missing, f"{cls.__name__} lacks {missing}"

