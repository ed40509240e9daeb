"""Coupled guesses on sampled requests (sampling.Coupling): a deterministic drafter reads the
request's next exponentials ahead and races its guesses with them. The loop must spend exactly
one vector of exponentials per emitted token, in order, for those to be the ones the target's
draws use: a drafter that knows the target's own distribution is then always right. The MTP head
races each guess from its own distribution with them, and the text stays plain sampling's."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from skulkp2p.engine.decode.drafter_seam import Drafter
from skulkp2p.engine.decode.loop import DecodeStats, decode
from skulkp2p.engine.decode.sampling import (
    Coupling,
    DraftDraws,
    SamplingParams,
    draw_with,
    make_rng,
    peek_noise,
    process_logits,
    sample_from,
    target_probs,
)
from skulkp2p.engine.drafting.mtp_drafter import COUPLED_SHARPEN, MtpDrafter
from skulkp2p.engine.model.forward import LocalForward
from skulkp2p.engine.model.loaded import load_model
from skulkp2p.engine.model.trunk import Trunk
from tests.helpers.eagle import TEXT, make_eagle_sidecar
from tests.helpers.stats import goodness_of_fit

SAMPLED = SamplingParams(temperature=0.8, top_k=40, seed=7)


def test_peeking_draws_nothing_and_names_the_next_draws():
    rng = make_rng(3)
    ahead = peek_noise(rng, 5, 50)
    assert ahead.tolist() == peek_noise(rng, 5, 50).tolist()  # the Generator did not move
    p = np.random.default_rng(0).dirichlet(np.ones(50))
    assert [draw_with(p, e) for e in ahead] == [sample_from(p, rng) for _ in range(5)]


def test_a_draw_is_distributed_as_p():
    p = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04, 0.0])
    rng = make_rng(11)
    # (goodness_of_fit also fails outright on a draw of the entry of probability 0)
    assert goodness_of_fit([sample_from(p, rng) for _ in range(20_000)], p) > 1e-4


def _race_agreement(p: np.ndarray, q: np.ndarray) -> float:
    """The chance that races of p and of q over the same exponentials name the same token."""
    return float(sum(1.0 / np.sum(np.maximum(p / p[i], q / q[i]))
                     for i in range(len(p)) if p[i] > 0 and q[i] > 0))


def test_a_coupled_guess_agrees_as_the_race_says_whatever_the_token_order():
    # q a smoothed p with its mass in the lower ids: an inverse CDF in token-id order shifts
    # every interval and agrees less than the race, which does not see the order
    p = np.array([0.05, 0.1, 0.5, 0.2, 0.15])
    q = np.array([0.15, 0.15, 0.4, 0.15, 0.15])
    want = _race_agreement(p, q)
    n = 20_000
    noise = make_rng(5).standard_exponential((n, len(p)))
    for order in (np.arange(len(p)), np.array([4, 2, 0, 3, 1])):
        agree = np.mean([draw_with(p[order], e) == draw_with(q[order], e) for e in noise])
        assert abs(agree - want) < 5 * np.sqrt(want * (1 - want) / n), (order, agree, want)
    cp, cq = np.cumsum(p), np.cumsum(q)  # a shared uniform names i where both intervals hold it
    inverse_cdf = np.sum(np.clip(np.minimum(cp, cq) - np.maximum(cp - p, cq - q), 0.0, None))
    assert want > inverse_cdf + 0.02  # (what the race buys over a shared uniform here)


class TargetCopy(Drafter):
    """Guesses with the target's own distribution (the model run on the whole history) at the
    uniforms the coupling reads ahead: right every time if, and only if, the loop draws each
    emitted token with the next uniform."""

    name = "target-copy"

    def __init__(self, model, coupling: Coupling):
        self.model, self.coupling = model, coupling

    def propose(self, history, k):
        drafts: list[int] = []
        noise = None
        for depth in range(k):
            tokens = history + drafts
            row = self.model(mx.array([tokens]))[:, -1, :]
            p = target_probs(process_logits(row, tokens, self.coupling.params),
                             self.coupling.params)
            if noise is None:
                noise = self.coupling.noise(k, len(p))
            drafts.append(draw_with(p, noise[depth]))
        return drafts, None


def test_the_loop_draws_each_emitted_token_with_the_next_uniform(tiny_models):
    lm = load_model(tiny_models["llama"], "tiny", dtype="float32")
    prompt = lm.tokenizer.encode(TEXT)
    plain = list(decode(LocalForward(lm.model), prompt, SAMPLED, 20, make_rng(SAMPLED.seed)))
    rng = make_rng(SAMPLED.seed)
    stats = DecodeStats()
    out = list(decode(LocalForward(lm.model), prompt, SAMPLED, 20, rng,
                      TargetCopy(lm.model, Coupling(SAMPLED, rng)), 3, stats))
    assert out == plain
    drafted, accepted = sum(stats.drafted_at), sum(stats.accepted_at)
    # (exponentials out of step would make the guesses right about one time in the support's size)
    assert drafted >= 10 and accepted == drafted, (accepted, drafted)


class Recording(MtpDrafter):
    """The head's logits rows and the exponentials its coupling read, per round."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rounds: list[tuple[list[int], list[mx.array], np.ndarray | None]] = []

    def _drafts(self, k):
        drafts, rows = super()._drafts(k)
        # (peeking draws nothing, so after the head's round it reads what the round read)
        ahead = (None if self.coupling is None or not rows
                 else self.coupling.noise(k, rows[0].shape[-1]))
        self.rounds.append((drafts, rows, ahead))
        return drafts, rows


@pytest.fixture(scope="module")
def eagle_llama(tiny_models, tmp_path_factory):
    base = tiny_models["llama"]
    vocab = int(Trunk(load_model(base, "base").model).embed_tokens.weight.shape[0])
    ids = np.sort(np.random.default_rng(1).choice(vocab, 96, replace=False)).astype(np.int32)
    return base, make_eagle_sidecar(base, tmp_path_factory.mktemp("eagle") / "e.safetensors", ids)


def test_the_head_races_its_guesses_with_the_targets_exponentials(eagle_llama):
    base, sidecar = eagle_llama
    lm = load_model(base, "tiny", dtype="float32", sidecar=sidecar)
    prompt = lm.tokenizer.encode(TEXT)
    plain = list(decode(LocalForward(lm.model), prompt, SAMPLED, 24, make_rng(SAMPLED.seed)))

    def run(coupled: bool) -> Recording:
        rng = make_rng(SAMPLED.seed)
        drafter = Recording(lm.mtp, coupling=Coupling(SAMPLED, rng) if coupled else None)
        out = list(decode(LocalForward(lm.model, hidden="after"), prompt, SAMPLED, 24, rng,
                          drafter, 3))
        assert out == plain, coupled
        return drafter

    coupled = run(True)
    assert len(coupled.rounds) >= 6
    argmax_differs = 0
    for drafts, rows, ahead in coupled.rounds:
        if not drafts:
            continue
        assert ahead is not None
        for token, row, e in zip(drafts, rows, ahead, strict=False):
            assert token == draw_with(target_probs(row.reshape(1, -1) * COUPLED_SHARPEN,
                                                   SAMPLED), e)
            argmax_differs += token != int(mx.argmax(row).item())
    assert argmax_differs > 0  # (the guesses are draws, not the argmax under another name)
    alone = run(False)
    for drafts, rows, ahead in alone.rounds:
        assert ahead is None
        assert drafts == [int(mx.argmax(r).item()) for r in rows]


# --- unseeded: the head's guesses drawn from its q, q handed to the verifier --------------------


def test_drawn_guesses_hand_their_q_and_threshold_on_the_heads_top(eagle_llama):
    base, sidecar = eagle_llama
    lm = load_model(base, "tiny", dtype="float32", sidecar=sidecar)
    prompt = lm.tokenizer.encode(TEXT)
    unseeded = SamplingParams(temperature=0.8, top_k=40)

    class Handed(Recording):
        def propose(self, history, k):
            drafts, q = super().propose(history, k)
            self.handed.append((drafts, q))
            return drafts, q

    drafter = Handed(lm.mtp, draws=DraftDraws(unseeded, make_rng(5)))
    drafter.handed = []
    assert not drafter.capabilities.branches  # (a tree's nodes are deterministic)
    out = list(decode(LocalForward(lm.model, hidden="after"), prompt, unseeded, 24, make_rng(6),
                      drafter, 3))
    assert len(out) == 24 and len(drafter.handed) >= 6
    for (drafts, rows, _), (handed, q) in zip(drafter.rounds, drafter.handed, strict=True):
        assert handed == drafts and q is not None and len(q) == len(drafts)
        for token, row, qi in zip(drafts, rows, q, strict=True):
            np.testing.assert_array_equal(qi, target_probs(row.reshape(1, -1), unseeded))
            assert qi[token] > 0.0
    row = drafter.rounds[0][1][0]
    top = float(mx.softmax(row.astype(mx.float32))[int(mx.argmax(row).item())].item())
    assert drafter._sureness(row, int(np.argmin(np.array(row)))) == pytest.approx(top)
    with pytest.raises(ValueError, match="not both"):
        MtpDrafter(lm.mtp, coupling=Coupling(SAMPLED, make_rng(0)),
                   draws=DraftDraws(unseeded, make_rng(0)))


def test_requests_get_the_heads_mode_their_sampling_asks_for(eagle_llama):
    from skulkp2p.engine.runner.generate import _choose_drafter, _mtp_in
    from skulkp2p.formats.pipe_format import parse_request

    base, sidecar = eagle_llama
    lm = load_model(base, "tiny", dtype="float32", sidecar=sidecar)
    for body, mode in (({}, None), ({"temperature": 0.7, "seed": 3}, "coupled"),
                       ({"temperature": 0.7}, "draws")):
        for speculation in ("auto", {"drafter": "mtp"}):
            req = parse_request({"prompt": TEXT, "max_tokens": 4, "speculation": speculation,
                                 **body})
            rng = make_rng(req.sampling.seed)
            drafter = _mtp_in(_choose_drafter(lm, req, [1, 2, 3], rng)[0])
            assert drafter is not None
            got = ("coupled" if drafter.coupling is not None
                   else "draws" if drafter.draws is not None else None)
            assert got == mode, (body, speculation)
            if drafter.coupling is not None:
                assert drafter.coupling.rng is rng  # the request's own sampler
