"""Draft-model drafter: greedy output equals plain decoding whatever the draft, a model drafting
for itself is always accepted (which proves its cache follows the history), and a draft with
another tokenizer is refused.

Drafts used: the target itself, the same family with another seed (almost never accepted), and a
blend of 90% target and 10% other-seed weights (accepted often but not always, so every round
shape occurs: full acceptance, rejection at each position, rollback of fed drafts).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map

from skulkp2p.engine.decode.loop import DecodeStats, decode
from skulkp2p.engine.decode.sampling import SamplingParams, make_rng
from skulkp2p.engine.drafting.draft_model import DraftModelDrafter, check_compatible, vocab_size
from skulkp2p.engine.model.forward import LocalForward
from skulkp2p.engine.model.loaded import LoadedModel, load_model
from skulkp2p.engine.request import RequestError
from tests.helpers.models import FAMILIES

ECHO = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(a,"
MAX_TOKENS = 40


def _blend(target_path: Path, other: LoadedModel, weight: float) -> LoadedModel:
    """The target's weights moved `weight` of the way toward another model's."""
    lm = load_model(target_path, f"blend-{weight}")

    def mix(a: mx.array, b: mx.array) -> mx.array:
        return ((1 - weight) * a.astype(mx.float32) + weight * b.astype(mx.float32)).astype(a.dtype)

    lm.model.update(tree_map(mix, lm.model.parameters(), other.model.parameters()))
    mx.eval(lm.model.parameters())
    return lm


@pytest.fixture(scope="module")
def models(tiny_models, tiny_model) -> dict[str, LoadedModel]:
    out: dict[str, LoadedModel] = {}
    for fam in FAMILIES:
        out[fam] = load_model(tiny_models[fam], fam)
        other = load_model(tiny_model(fam, seed=1), f"{fam}-seed1")
        out[f"{fam}-seed1"] = other
        out[f"{fam}-blend"] = _blend(tiny_models[fam], other, 0.1)
    return out


def _run(target: LoadedModel, draft: LoadedModel | None, params: SamplingParams, depth: int,
         seed: int = 0) -> tuple[list[int], DecodeStats, DraftModelDrafter | None]:
    prompt = target.tokenizer.encode(ECHO)
    stats = DecodeStats()
    drafter = (DraftModelDrafter.for_target(target, draft, params, make_rng(seed + 1))
               if draft is not None else None)
    out = list(decode(LocalForward(target.model), prompt, params, MAX_TOKENS, make_rng(seed),
                      drafter, depth, stats))
    return out, stats, drafter


def test_vocab_size(models):
    for fam in FAMILIES:
        assert vocab_size(models[fam].model) == 512


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("draft", ["self", "seed1", "blend"])
@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_greedy_equals_plain(models, family, draft, depth):
    target = models[family]
    plain, _, _ = _run(target, None, SamplingParams(), 0)
    drafter_model = target if draft == "self" else models[f"{family}-{draft}"]
    spec, stats, drafter = _run(target, drafter_model, SamplingParams(), depth)
    assert spec == plain
    assert stats.drafted > 0
    if draft == "self":
        assert stats.accepted == stats.drafted
    if draft == "blend" and depth > 1:
        assert 0 < stats.accepted < stats.drafted
    # Every history token goes through the draft model once; only rejected drafts that had
    # been fed (at most one per rejected draft) are extra.
    n_prompt = len(target.tokenizer.encode(ECHO))
    assert drafter.fed_tokens <= n_prompt + MAX_TOKENS - 1 + stats.drafted - stats.accepted


def test_cross_family_draft(models):
    target = models["llama"]
    plain, _, _ = _run(target, None, SamplingParams(), 0)
    spec, stats, _ = _run(target, models["qwen3-blend"], SamplingParams(), 3)
    assert spec == plain and stats.drafted > 0


@pytest.mark.parametrize("target_family", ["llama", "qwen3_5"])
def test_recurrent_draft_uses_checkpoints(models, target_family):
    """A gated-delta draft cannot trim: it restores its checkpoint and re-feeds what was kept."""
    target = models[target_family]
    plain, _, _ = _run(target, None, SamplingParams(), 0)
    spec, stats, drafter = _run(target, models["qwen3_5-blend"], SamplingParams(), 3)
    assert spec == plain
    assert not drafter.exact_trim and drafter.restores > 0 and drafter.rebuilds == 0
    if target_family == "qwen3_5":
        spec, stats, drafter = _run(target, target, SamplingParams(), 3)
        assert spec == plain and stats.accepted == stats.drafted


class _Recording(DraftModelDrafter):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.log: list[tuple[list[int], list[int]]] = []

    def propose(self, history, k):
        drafts, q = super().propose(history, k)
        self.log.append((list(history), drafts))
        return drafts, q


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_proposals_match_a_fresh_draft_decode(models, family):
    """After any mix of acceptances and rejections the drafter proposes exactly what the draft
    model, run from scratch over the same history, would (trim path and checkpoint path)."""
    target, draft = models[family], models[f"{family}-blend"]
    prompt = target.tokenizer.encode(ECHO)
    drafter = _Recording(draft, SamplingParams(), make_rng(1))
    stats = DecodeStats()
    list(decode(LocalForward(target.model), prompt, SamplingParams(), MAX_TOKENS, make_rng(0),
                drafter, 3, stats))
    assert 0 < stats.accepted < stats.drafted
    for history, drafts in drafter.log:
        fresh = list(decode(LocalForward(draft.model), history, SamplingParams(), len(drafts),
                            make_rng(0)))
        assert drafts == fresh


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_catch_up_and_divergent_history(models, family):
    """Histories the loop does not produce today but a depth controller pausing the drafter, or
    another caller, would: a long unseen tail (chunked catch-up), a rewritten tail (rewind past
    the drafts; a checkpointed cache rebuilds), and a plain extension."""
    draft = models[f"{family}-blend"]
    prompt = draft.tokenizer.encode(ECHO)
    cont = list(decode(LocalForward(draft.model), prompt, SamplingParams(), 100, make_rng(0)))
    drafter = DraftModelDrafter(draft, SamplingParams(), make_rng(1))
    drafter.begin(prompt, None)
    h1 = prompt + cont
    h2 = h1[:-30] + [(7 * i) % 500 + 3 for i in range(12)]
    h3 = h2 + [42]
    for history in (h1, h2, h3):
        fresh = list(decode(LocalForward(draft.model), history, SamplingParams(), 3, make_rng(0)))
        assert drafter.propose(history, 3)[0] == fresh
    assert drafter.rebuilds == (0 if drafter.exact_trim else 1)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=30),
    SamplingParams(temperature=0.7, top_p=0.9, min_p=0.02, repetition_penalty=1.2),
], ids=["topk", "topp-minp-penalty"])
def test_sampled_self_draft_is_always_accepted(models, params):
    """q equals p bit for bit when the draft is the target: min(1, p/q) = 1 for every draft. This
    also checks that the drafter applies the penalty with the same history as the verifier."""
    target = models["llama"]
    for depth in (1, 3):
        _, stats, _ = _run(target, target, params, depth, seed=depth)
        assert stats.drafted > 0 and stats.accepted == stats.drafted


def test_sampled_q_is_the_draw_distribution(models):
    draft = models["llama-blend"]
    params = SamplingParams(temperature=0.9, top_k=20)
    drafter = DraftModelDrafter(draft, params, make_rng(3))
    prompt = draft.tokenizer.encode(ECHO)
    drafter.begin(prompt, None)
    drafts, qs = drafter.propose(prompt, 4)
    assert len(drafts) == 4 and qs is not None and len(qs) == 4
    for token, q in zip(drafts, qs, strict=True):
        assert q.dtype == np.float64 and q.shape == (512,)
        assert abs(q.sum() - 1.0) < 1e-9 and q[token] > 0
        assert np.count_nonzero(q) <= 20


def test_q_is_padded_or_cut_to_the_target_width(models):
    draft = models["llama-blend"]
    prompt = draft.tokenizer.encode(ECHO)
    params = SamplingParams(temperature=1.0)
    wide = DraftModelDrafter(draft, params, make_rng(0), target_vocab=640)
    wide.begin(prompt, None)
    drafts, qs = wide.propose(prompt, 3)
    for q in qs:
        assert q.shape == (640,) and not q[512:].any() and abs(q.sum() - 1.0) < 1e-9
    narrow = DraftModelDrafter(draft, params, make_rng(0), target_vocab=300)
    narrow.begin(prompt, None)
    for _ in range(5):
        drafts, qs = narrow.propose(prompt, 3)
        assert all(t < 300 for t in drafts) and all(q.shape == (300,) for q in qs)


def _swapped_tokenizer_copy(src: Path, dst: Path) -> Path:
    """The same model with two ordinary token strings swapped in tokenizer.json."""
    shutil.copytree(src, dst)
    path = dst / "tokenizer.json"
    tok = json.loads(path.read_text(encoding="utf-8"))
    vocab = tok["model"]["vocab"]
    by_id = {i: s for s, i in vocab.items()}
    a, b = by_id[300], by_id[301]
    vocab[a], vocab[b] = 301, 300
    path.write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    return dst


def test_draft_with_another_tokenizer_is_refused(models, tiny_models, tmp_path):
    other = load_model(_swapped_tokenizer_copy(tiny_models["llama"], tmp_path / "swapped"), "sw")
    target = models["llama"]
    assert other.tokenizer.get_vocab() != target.tokenizer.get_vocab()
    with pytest.raises(RequestError) as err:
        DraftModelDrafter.for_target(target, other, SamplingParams(), make_rng(0))
    assert err.value.param == "speculation"
    assert "draft model sw has a different tokenizer" in err.value.message
    assert "2 of 512" in err.value.message


def _fake_tokenizer(vocab: dict[str, int], eos: set[int]) -> SimpleNamespace:
    return SimpleNamespace(get_vocab=lambda: dict(vocab), eos_token_ids=set(eos))


def test_compatibility_rules():
    vocab = {f"t{i}": i for i in range(500)}
    same = _fake_tokenizer(vocab, {2})
    check_compatible(same, _fake_tokenizer(vocab, {2}), 512, 512)
    # Padded embeddings of either width are fine when the tokenizers are identical.
    check_compatible(same, _fake_tokenizer(vocab, {2}), 640, 512)
    check_compatible(same, _fake_tokenizer(vocab, {2}), 512, 640)
    bad = [
        (_fake_tokenizer(vocab, {2, 0}), 512, 512, "end-of-sequence"),
        (_fake_tokenizer({**vocab, "extra": 500}, {2}), 512, 512, "different tokenizer"),
        (_fake_tokenizer({**vocab, "t7": 8, "t8": 7}, {2}), 512, 512, "different tokenizer"),
        (_fake_tokenizer(vocab, {2}), 512, 400, "400"),
    ]
    for draft, t_vocab, d_vocab, words in bad:
        with pytest.raises(RequestError) as err:
            check_compatible(same, draft, t_vocab, d_vocab)
        assert err.value.param == "speculation" and words in err.value.message
