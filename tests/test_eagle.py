"""The EAGLE-style drafting head (engine/model/mtp_head.py, style "eagle"): a random head of that kind
on a tiny model loads from its own tensor names (fc bias, reduced vocabulary) and drafts exactly
(greedy byte-identical at depths 1-3; sampled output keeps the target's distribution); the two
heads shipped for smollm2-135m (its card's EAGLE-3-class head, and the EAGLE-style head for its
ring stages) load as their kinds and decode byte-identically to plain decoding and to mlx-lm's
generate (slow)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import stream_generate

from skulkp2p.engine.decode.loop import DecodeStats, decode
from skulkp2p.engine.decode.sampling import (
    DraftDraws,
    SamplingParams,
    make_rng,
    process_logits,
    target_probs,
)
from skulkp2p.engine.drafting.mtp_drafter import MtpDrafter
from skulkp2p.engine.model.forward import LocalForward
from skulkp2p.engine.model.loaded import load_model
from skulkp2p.engine.model.mtp_conventions import detect_conventions, has_mtp_tensors
from skulkp2p.engine.model.trunk import Trunk
from skulkp2p.models.cards import PACKAGE_CARDS_DIR
from skulkp2p.training import head_fit
from tests.helpers.eagle import TEXT, make_eagle_sidecar
from tests.helpers.eagle import decode_after_text as _decode
from tests.helpers.sampled import ForwardMemo
from tests.helpers.stats import goodness_of_fit, two_sample

ALPHA = 1e-3
SHARPEN = 3.0  # peaked rows, as a trained model has (as tests/test_sampling_exactness.py does)


@pytest.fixture(scope="module")
def eagle_llama(tiny_models, tmp_path_factory):
    base = tiny_models["llama"]
    vocab = int(Trunk(load_model(base, "base").model).embed_tokens.weight.shape[0])
    ids = np.sort(np.random.default_rng(1).choice(vocab, 96, replace=False)).astype(np.int32)
    sidecar = make_eagle_sidecar(base, tmp_path_factory.mktemp("eagle") / "eagle.safetensors",
                                 ids)
    return base, sidecar, ids


def test_eagle_head_loads_as_its_own_kind(eagle_llama):
    base, sidecar, ids = eagle_llama
    names = set(mx.load(str(sidecar)))
    assert {"eagle.fc.weight", "eagle.fc.bias", "eagle.enorm.weight", "eagle.hnorm.weight",
            "eagle.norm.weight", "eagle.vocab_ids"} <= names
    assert any(n.startswith("eagle.layers.0.self_attn.") for n in names)
    lm = load_model(base, "tiny", dtype="float32", sidecar=sidecar)
    assert has_mtp_tensors(base, {}, sidecar)
    conv = detect_conventions(sidecar, {})
    assert conv is not None and conv.style == "eagle" and conv.chain == "after"
    head = lm.mtp
    assert head is not None and head.conventions.style == "eagle"
    assert "bias" in head.proj  # EAGLE's fc has a bias; the other kinds' do not
    np.testing.assert_array_equal(np.array(head.proj.bias),
                                  np.array(mx.load(str(sidecar))["eagle.fc.bias"]
                                           .astype(mx.float32)))
    np.testing.assert_array_equal(np.array(head.vocab_ids), ids)
    # Drafts come from the reduced vocabulary only.
    rng = np.random.default_rng(2)
    hidden = mx.array(rng.standard_normal((5, head.proj.weight.shape[0])).astype(np.float32))
    logits = head(hidden, mx.array(ids[:5]), head.make_cache(), all_logits=True).logits
    assert np.isin(np.array(mx.argmax(logits, -1)), ids).all()


def test_eagle_head_is_greedy_exact(eagle_llama):
    base, sidecar, _ = eagle_llama
    lm = load_model(base, "tiny", dtype="float32", sidecar=sidecar)
    plain = _decode(lm)
    for depth in (1, 2, 3):
        stats = DecodeStats()
        assert _decode(lm, lm.mtp, depth, stats=stats) == plain, f"depth {depth}"
        assert sum(stats.drafted_at) > 0


class _Recording(MtpDrafter):
    """The drafter, keeping every draft it offered."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.offered: list[list[int]] = []

    def propose(self, history, k):
        drafts, q = super().propose(history, k)
        self.offered.append(drafts)
        return drafts, q


def test_context_bias_drafts_seen_tokens_and_stays_exact(eagle_llama):
    """mtp_context_bias: a bonus on the logits of tokens already in the context. A huge one makes
    every draft a token of the context (prompt and verified answer); greedy output is plain
    decoding's at every depth whatever the bonus."""
    base, sidecar, ids = eagle_llama
    lm = load_model(base, "tiny", dtype="float32", sidecar=sidecar)
    plain = _decode(lm)
    prompt = lm.tokenizer.encode(TEXT)
    for depth in (1, 3):
        drafted = {}
        for bias in (0.0, 1e4):
            fwd = LocalForward(lm.model, hidden="after")
            drafter = _Recording(lm.mtp, context_bias=bias)
            out = list(decode(fwd, prompt, SamplingParams(), 24, make_rng(0), drafter, depth))
            assert out == plain, (depth, bias)
            drafted[bias] = drafter.offered
        assert set(prompt) & set(ids.tolist())  # (else the check below would be vacuous)
        firsts = [d[0] for d in drafted[1e4] if d]
        assert firsts and all(t in set(prompt) | set(plain) for t in firsts)
        assert firsts != [d[0] for d in drafted[0.0] if d]  # the bonus changed drafts
    with pytest.raises(ValueError, match="context_bias"):
        MtpDrafter(lm.mtp, context_bias=-1.0)


@pytest.mark.training
def test_second_step_training_rows_are_what_the_drafter_computes(eagle_llama):
    """The training-time test's second step (all positions in one forward, a mask standing in
    for the speculative row) gives, at every position, the state the drafter computes for its
    second draft: verified rows 0..t in the head's cache, then its own output of row t chained
    with the next token at position t+1. Checked against the drafter's code path, in float32."""
    base, sidecar, _ = eagle_llama
    lm = load_model(base, "tiny", dtype="float32", sidecar=sidecar)
    head = lm.mtp
    head.set_dtype(mx.float32)
    rng = np.random.default_rng(4)
    n, width = 9, head.proj.weight.shape[0]
    hidden = mx.array(rng.standard_normal((2, n, width)).astype(np.float32))
    tokens = mx.array(rng.integers(0, 90, (2, n)).astype(np.int32))
    post, post2 = head_fit.two_step_features(head, hidden, tokens)
    assert post2.shape == (2, n - 1, width)
    plain = head.features(hidden, tokens)[1]
    np.testing.assert_allclose(np.array(post), np.array(plain), rtol=1e-4, atol=1e-4)
    for b in range(2):
        for t in range(n - 1):
            cache = head.make_cache()
            out = head(hidden[b, :t + 1], tokens[b, :t + 1], cache)
            chained = out.chain(head.conventions.chain)[-1]
            second = head(chained[None], tokens[b, t + 1:t + 2], cache).post_norm[-1]
            np.testing.assert_allclose(np.array(post2[b, t]), np.array(second),
                                       rtol=1e-4, atol=1e-4, err_msg=f"row {b}, {t}")


@pytest.mark.training
def test_depth2_loss_trains_the_second_step(eagle_llama):
    """With --depth2-weight the loss grows by the second step's cross-entropy, and its
    gradient reaches the head (a weight of 0 is the depth-1 loss exactly)."""
    base, sidecar, ids = eagle_llama
    lm = load_model(base, "tiny", dtype="float32", sidecar=sidecar)
    head = lm.mtp
    head.set_dtype(mx.float32)
    rng = np.random.default_rng(5)
    b, n, width, k = 2, 7, head.proj.weight.shape[0], 3
    args = (mx.array(rng.standard_normal((b, n, width)).astype(np.float32)),
            mx.array(ids[rng.integers(0, len(ids), (b, n))]),
            mx.array(rng.integers(0, len(ids), (b, n, k)).astype(np.int32)),
            mx.array(np.full((b, n, k), 1.0 / k, np.float32)),
            mx.array(rng.standard_normal((b, n, width)).astype(np.float32)),
            mx.array(np.ones((b, n), np.float32)))
    one, ce1 = head_fit.make_loss(0.5)(head, *args)
    zero, _ = head_fit.make_loss(0.5, 0.0)(head, *args)
    two, ce2 = head_fit.make_loss(0.5, 1.0)(head, *args)
    assert float(zero) == float(one)
    assert float(ce1) == pytest.approx(float(ce2), rel=1e-5)  # the reported ce is depth 1's
    assert float(two) > float(one) + 1.0  # a random head's second step costs about ln(K)
    import mlx.nn as nn
    _, grads = nn.value_and_grad(head, head_fit.make_loss(0.5, 1.0))(head, *args)
    _, grads1 = nn.value_and_grad(head, head_fit.make_loss(0.5))(head, *args)
    g2 = np.array(grads["proj"]["weight"])
    g1 = np.array(grads1["proj"]["weight"])
    assert np.abs(g2 - g1).max() > 1e-6


def probs_after(model, history: list[int], params: SamplingParams) -> np.ndarray:
    """The exact distribution plain decoding draws the token after `history` from."""
    f = LocalForward(model)
    f.prefill(history[:-1])
    return target_probs(process_logits(f([history[-1]]), history, params), params)


def _sharpened(lm):
    """Peaked rows, as a trained model has (tests/test_sampling_exactness.py's SHARPEN)."""
    w = lm.model.lm_head.weight
    lm.model.lm_head.weight = (w.astype(mx.float32) * SHARPEN).astype(w.dtype)
    mx.eval(lm.model.parameters())
    return lm


SAMPLED_T1 = SamplingParams(temperature=1.0, top_k=30)


def _two_token_head(base, tmp_path, params: SamplingParams):
    """(sharpened model with a head, the head, prompt, p of the first token): the head's
    vocabulary is the target's likeliest first token and one unlikely one."""
    lm = _sharpened(load_model(base, "tiny", dtype="float32"))
    prompt = lm.tokenizer.encode(TEXT)
    p1 = probs_after(lm.model, prompt, params)
    likely, unlikely = int(np.argmax(p1)), int(np.argsort(p1)[-5])
    sidecar = make_eagle_sidecar(base, tmp_path / "eagle.safetensors",
                                 np.array(sorted({likely, unlikely}), np.int32), seed=3)
    lm = _sharpened(load_model(base, "tiny", dtype="float32", sidecar=sidecar))
    head = lm.mtp
    head.restrict_vocab(head.vocab_ids)  # again: its rows of the sharpened lm_head
    return lm, head, prompt, p1


@pytest.mark.slow
def test_eagle_head_keeps_the_sampled_distribution(tiny_models, tmp_path):
    """Sampled decoding with the head's (deterministic) drafts emits the first two tokens as
    plain sampling does. The head's vocabulary is the target's likeliest next token and one
    unlikely token, so its drafts are accepted in some samples and rejected in others."""
    params = SAMPLED_T1
    lm, head, prompt, p1 = _two_token_head(tiny_models["llama"], tmp_path, params)

    n = 1500

    def first_two(drafter_head, seed0: int) -> tuple[list[tuple[int, ...]], DecodeStats]:
        # The runs repeat a few dozen sequences of forward and head calls (the head's drafts
        # are deterministic): each computed once, by a LocalForward and an MtpDrafter
        # (tests/helpers/sampled.py), so the tokens are the ones those would give.
        if drafter_head:
            memo = ForwardMemo(lambda: LocalForward(lm.model, hidden="after"),
                               lambda: MtpDrafter(drafter_head))
        else:
            memo = ForwardMemo(lambda: LocalForward(lm.model))
        stats, out = DecodeStats(), []
        for i in range(n):
            fwd, drafter = memo.pair() if drafter_head else (memo.forward(), None)
            steps = decode(fwd, prompt, params, 5, make_rng(seed0 + i), drafter,
                           3 if drafter_head else 0, stats)
            out.append((next(steps), next(steps)))
            steps.close()
        return out, stats

    spec, stats = first_two(head, 1_000_000)
    plain, _ = first_two(None, 0)
    drafted, accepted = sum(stats.drafted_at), sum(stats.accepted_at)
    assert 0 < accepted < drafted  # both the accept and the reject paths ran
    assert goodness_of_fit((s[0] for s in spec), p1) > ALPHA
    assert two_sample(spec, plain) > ALPHA


@pytest.mark.slow
def test_eagle_head_drawing_from_its_q_keeps_the_sampled_distribution(tiny_models, tmp_path):
    """An unseeded sampled request's head draws its guesses from its q and hands q to the
    verifier (sampling.DraftDraws): the first two tokens still come as plain sampling's. The
    head's vocabulary is the target's likeliest token and one unlikely one, so q is far from p
    and both min(1, p/q) acceptances and residual draws happen."""
    params = SAMPLED_T1
    lm, head, prompt, p1 = _two_token_head(tiny_models["llama"], tmp_path, params)
    n = 700
    stats, spec = DecodeStats(), []
    draws = DraftDraws(params, make_rng(11))
    for i in range(n):  # (drafts drawn at random: no memo of call sequences to replay)
        steps = decode(LocalForward(lm.model, hidden="after"), prompt, params, 5,
                       make_rng(2_000_000 + i), MtpDrafter(head, draws=draws), 2, stats)
        spec.append((next(steps), next(steps)))
        steps.close()
    memo = ForwardMemo(lambda: LocalForward(lm.model))
    plain = []
    for i in range(n):
        steps = decode(memo.forward(), prompt, params, 5, make_rng(i))
        plain.append((next(steps), next(steps)))
        steps.close()
    drafted, accepted = sum(stats.drafted_at), sum(stats.accepted_at)
    assert 0 < accepted < drafted  # both the accept and the reject paths ran
    assert goodness_of_fit((s[0] for s in spec), p1) > ALPHA
    assert two_sample(spec, plain) > ALPHA


# --- the shipped head for the default model -----------------------------------------------------


class _Confidences(MtpDrafter):
    """The drafter, keeping the head's probability of every first draft token it offered, and
    of its guess at every round (offered or not)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.offered: list[float] = []
        self.guesses: list[float] = []

    def propose(self, history, k):
        self._read_call()
        if self._next is not None and k > 0:
            logits = self._biased(self._next[0])
            self.guesses.append(self.confidence(int(mx.argmax(logits).item())))
        drafts, q = super().propose(history, k)
        if drafts:
            self.offered.append(self.confidence(drafts[0]))
        return drafts, q


def test_min_confidence_drafts_only_sure_guesses_and_stays_exact(eagle_llama):
    """mtp_min_confidence: the head drafts nothing in a round where its own probability of its
    guess is below the threshold; greedy output is plain decoding's whatever the threshold."""
    base, sidecar, _ = eagle_llama
    lm = load_model(base, "tiny", dtype="float32", sidecar=sidecar)
    plain = _decode(lm)
    prompt = lm.tokenizer.encode(TEXT)

    def run(threshold: float, depth: int) -> _Confidences:
        fwd = LocalForward(lm.model, hidden="after")
        drafter = _Confidences(lm.mtp, min_confidence=threshold)
        out = list(decode(fwd, prompt, SamplingParams(), 24, make_rng(0), drafter, depth))
        assert out == plain, (threshold, depth)
        return drafter

    every = run(0.0, 1)
    assert every.unsure == 0 and len(every.offered) == len(every.guesses) > 4
    threshold = float(np.median(every.guesses))
    for depth in (1, 3):
        sure = run(threshold, depth)
        assert sure.unsure > 0 and sure.offered  # some rounds each way (not vacuous)
        assert all(p >= threshold for p in sure.offered)
        assert sure.unsure == sum(p < threshold for p in sure.guesses)
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match="min_confidence"):
            MtpDrafter(lm.mtp, min_confidence=bad)


class _Depths(MtpDrafter):
    """The drafter, keeping every round's asked depth, drafted depth, and the head's
    probability of each draft past the first that it offered."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rounds: list[tuple[int, int, list[float]]] = []

    def _drafts(self, k):
        drafts, rows = super()._drafts(k)
        deeper = [float(mx.softmax(r.astype(mx.float32))[t].item())
                  for r, t in zip(rows[1:], drafts[1:], strict=True)]
        self.rounds.append((k, len(drafts), deeper))
        return drafts, rows


def test_depth_confidence_goes_deeper_only_on_sure_guesses_and_stays_exact(eagle_llama):
    """mtp_depth_confidence: past the first draft the head goes one deeper only while its own
    probability of the deeper guess is at least the threshold; greedy output is plain
    decoding's whatever the threshold, alone and with the first-draft threshold too."""
    base, sidecar, _ = eagle_llama
    lm = load_model(base, "tiny", dtype="float32", sidecar=sidecar)
    plain = _decode(lm)
    prompt = lm.tokenizer.encode(TEXT)

    def run(threshold: float, first: float = 0.0) -> _Depths:
        fwd = LocalForward(lm.model, hidden="after")
        drafter = _Depths(lm.mtp, depth_confidence=threshold, min_confidence=first)
        out = list(decode(fwd, prompt, SamplingParams(), 24, make_rng(0), drafter, 3))
        assert out == plain, (threshold, first)
        return drafter

    deep = run(0.0)
    assert deep.cut == 0 and any(k == 3 for k, _, _ in deep.rounds)
    assert all(n == k for k, n, _ in deep.rounds)
    threshold = float(np.median([p for _, _, ps in deep.rounds for p in ps]))
    sure = run(threshold)
    assert sure.cut > 0 and any(n > 1 for _, n, _ in sure.rounds)  # both ways (not vacuous)
    assert all(p >= threshold for _, _, ps in sure.rounds for p in ps)
    assert sure.cut == sum(0 < n < k for k, n, _ in sure.rounds)
    both = run(threshold, first=threshold)
    assert both.unsure > 0
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match="depth_confidence"):
            MtpDrafter(lm.mtp, depth_confidence=bad)


def test_auto_thresholds_the_head_and_explicit_does_not(eagle_llama):
    """In auto the head drafts with the card's mtp_min_confidence (default MTP_MIN_CONFIDENCE);
    an explicit mtp drafter drafts every round whatever the card says (the caller asked for
    its drafts)."""
    from skulkp2p.engine.runner.generate import MTP_MIN_CONFIDENCE, _choose_drafter, _mtp_in
    from skulkp2p.formats.pipe_format import parse_request

    base, sidecar, _ = eagle_llama
    prompt = [1, 2, 3, 4]

    def head_drafter(lm, speculation) -> MtpDrafter:
        req = parse_request({"prompt": TEXT, "max_tokens": 4, "speculation": speculation})
        drafter, _, _ = _choose_drafter(lm, req, prompt, np.random.default_rng(0))
        return _mtp_in(drafter)

    def threshold(lm, speculation) -> float:
        return head_drafter(lm, speculation).min_confidence

    def depth_threshold(lm, speculation) -> float:
        return head_drafter(lm, speculation).depth_confidence

    lm = load_model(base, "tiny", dtype="float32", sidecar=sidecar)
    assert threshold(lm, "auto") == MTP_MIN_CONFIDENCE
    lm = load_model(base, "tiny", dtype="float32", sidecar=sidecar,
                    speculation={"mtp_min_confidence": 0.3, "mtp_depth_confidence": 0.4})
    assert threshold(lm, "auto") == 0.3
    assert threshold(lm, {"drafter": "mtp", "depth": 2}) == 0.0
    assert depth_threshold(lm, "auto") == 0.4
    assert depth_threshold(lm, {"drafter": "mtp", "depth": 2}) == 0.0


@pytest.mark.slow
def test_shipped_heads_are_greedy_exact_on_smollm2(smollm2_path):
    """The default card's two heads, each with the card's own [speculation] as serving loads
    it: its EAGLE-3-class head (one node) and the EAGLE-style head its ring stages and tensor
    groups draft with (`mtp_stage_sidecar`)."""
    from skulkp2p.engine.runner.loader import head_speculation, resolve_sidecar
    from skulkp2p.formats.pipe_format import parse_request
    from skulkp2p.models.cards import load_card
    from tests.helpers.pipe_result import generate

    card = load_card(PACKAGE_CARDS_DIR / "smollm2-135m.toml")
    # One prompt (a second one took every path this one takes): its answer repeats itself, so
    # in auto both lookup and the head draft, and every drafter's drafts are accepted in some
    # rounds and rejected in others (asserted below).
    messages = [{"role": "user", "content": "Write a short poem about a fox in the snow."}]
    ref: list[int] = []
    for stage, style in ((False, "eagle3"), (True, "eagle")):
        speculation = head_speculation(card.speculation, stage)  # as open_model loads it
        lm = load_model(smollm2_path, "smollm2-135m", dtype="float32",
                        sidecar=resolve_sidecar(speculation["mtp_sidecar"], card.file),
                        speculation=speculation)
        assert lm.mtp is not None and lm.mtp.conventions.style == style
        prompt = lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        if not ref:
            for r in stream_generate(lm.model, lm.tokenizer, mx.array(prompt), max_tokens=64):
                if r.token in lm.tokenizer.eos_token_ids:
                    break
                ref.append(r.token)
            # Compared with mlx-lm's tokens, so with plain decoding's (test_fast_path.py and
            # test_trees.py check ours equal mlx-lm's on SmolLM2 float32).
            assert len(ref) > 10
        # auto drafts with the head at the card's depth (1) beside lookup; explicit, at depth 3.
        for spec in ({"drafter": "mtp", "depth": 3}, "auto"):
            out = generate(lm, parse_request({"messages": messages, "max_tokens": 64,
                                              "speculation": spec}))
            assert out["tokens"] == ref, (style, spec)
            counts = out["speculation"].get("by_drafter") or {"mtp": out["speculation"]}
            assert set(counts) == ({"lookup", "mtp"} if spec == "auto" else {"mtp"}), spec
            for name, c in counts.items():
                assert c["drafted"] > c["accepted"] > 0, (style, spec, name, c)


def test_head_starts_its_draft_early_only_where_lookup_has_none(eagle_llama, monkeypatch):
    """auto (lookup beside the head): after a round that leaves lookup without a match, the
    head's next draft is started asynchronously (MtpDrafter.prefetch, from
    gates.LookupThenModel); after one where lookup will draft, nothing of the head runs. Every
    head draft of the run found its draft started early, the drafts are those of a run
    without the early start (same ops), and greedy output is plain decoding's."""
    from skulkp2p.engine.runner.generate import _choose_drafter
    from skulkp2p.formats.pipe_format import parse_request

    base, sidecar, _ = eagle_llama
    lm = load_model(base, "tiny", dtype="float32", sidecar=sidecar)
    words = "the gate and the river and the gate of the river"
    prompt = lm.tokenizer.encode(TEXT + " " + words + " " + words)
    plain = list(decode(LocalForward(lm.model), prompt, SamplingParams(), 24, make_rng(0)))

    def run(early: bool) -> tuple[list[int], list[tuple[bool, bool, bool, list[int]]],
                                  DecodeStats]:
        if not early:
            monkeypatch.setattr(MtpDrafter, "prefetch", lambda self: None)
        req = parse_request({"prompt": TEXT, "max_tokens": 24})
        auto, depth, hidden = _choose_drafter(lm, req, prompt, np.random.default_rng(0))
        head = auto.model.inner
        # per round: (the head may draft, lookup offers a draft, head's draft started, drafts)
        rounds: list[tuple[bool, bool, bool, list[int]]] = []
        propose = auto.propose_tree

        def recorded(history, k):
            offers = auto.lookup.on and auto.lookup.inner.offers_draft()
            started = head._ahead is not None
            on = auto.model.on
            tree = propose(history, k)
            rounds.append((on, offers, started, [] if tree is None else tree.tokens))
            return tree

        monkeypatch.setattr(auto, "propose_tree", recorded)
        stats = DecodeStats()
        out = list(decode(LocalForward(lm.model, hidden=hidden), prompt, SamplingParams(), 24,
                          make_rng(0), auto, depth, stats))
        monkeypatch.undo()
        return out, rounds, stats

    out, rounds, stats = run(early=True)
    late_out, late_rounds, late_stats = run(early=False)
    assert out == late_out == plain
    assert [r[3] for r in rounds] == [r[3] for r in late_rounds]  # the same drafts
    assert (stats.drafted, stats.accepted) == (late_stats.drafted, late_stats.accepted)
    # Started early exactly after the rounds that left lookup with nothing while the head was
    # on (the first round follows the prefill, not a round); never where lookup drafts.
    for on, offers, started, _ in rounds[1:]:
        assert started == (on and not offers)
    assert not any(started for _, _, started, _ in late_rounds)
    # Not vacuous: lookup drafted some rounds, and the head drafted some from an early start.
    assert any(offers and drafts for _, offers, _, drafts in rounds)
    assert any(started and drafts for _, _, started, drafts in rounds)
