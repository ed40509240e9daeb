"""The batch's MTP/EAGLE head drafts in one head forward per depth (engine/batching/head_batch.py):
each row gets the drafts its own head gives it served alone, every request's output stays
exactly its solo output, rows join, roll back and leave the head batch (a head switched off
leaves, the prefix cache takes a row's head rows out of it), and a batched head forward runs
only once no row can still hand a call in.

The drafts are compared by the history they were proposed at (a solo run and a batched run
of a greedy request propose at the same histories). The batched head's floats are not bitwise
the solo head's (padding; and the trunk's batched hidden rows differ by ~1e-5), so drafts could
differ where the head's top two logits are that close: on these tiny models none do."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from skulkp2p.engine.batching.scheduler import BatchScheduler
from skulkp2p.engine.drafting.mtp_drafter import MtpDrafter
from skulkp2p.engine.model.forward import LocalForward
from skulkp2p.engine.model.loaded import load_model
from skulkp2p.engine.model.trunk import Trunk
from skulkp2p.engine.runner.mlx_engine import MlxEngine
from skulkp2p.formats.pipe_format import parse_request
from tests.helpers.batch import PROMPTS, SAMPLINGS, loaded, requests, solo, together
from tests.helpers.eagle import make_eagle_sidecar
from tests.helpers.loaded import smollm2_float32

# (family, head): the checkpoint's own MTP head in each naming, and a trained-style EAGLE head.
HEADS = [("llama", "qwen"), ("qwen3", "deepseek"), ("qwen3", "mimo"), ("llama", "eagle"),
         ("qwen3", "eagle"), ("llama", "eagle3")]
_heads: dict[tuple[str, str], object] = {}


def _head_model(tiny_model, tmp_path_factory, family: str, style: str):
    key = (family, style)
    if key not in _heads:
        if style in ("eagle", "eagle3"):
            base = tiny_model(family)
            vocab = int(Trunk(load_model(base, "base").model).embed_tokens.weight.shape[0])
            ids = np.sort(np.random.default_rng(1).choice(vocab, 96, replace=False)
                          ).astype(np.int32)
            sidecar = make_eagle_sidecar(
                base, tmp_path_factory.mktemp("head-batch") / "eagle.safetensors", ids,
                kind=style)
            _heads[key] = load_model(base, family, dtype="float32", sidecar=sidecar)
        else:
            _heads[key] = loaded(tiny_model(family, mtp=True, mtp_style=style))
    return _heads[key]


def _batched_equal_to_solo(lm, reqs) -> tuple[MlxEngine, list]:
    """Serve reqs alone, then together in a batch of 4: every output must be its solo output.
    Returns the batching engine and the batched results."""
    alone = solo(MlxEngine(lm, 0, memory_tokens=0, max_batch=1), reqs)
    engine = MlxEngine(lm, 0, memory_tokens=0, max_batch=4)
    batched = together(engine, reqs)
    for a, b in zip(alone, batched, strict=True):
        assert b.tokens == a.tokens and b.text == a.text
    return engine, batched


class DraftLog:
    """The drafts each MtpDrafter proposed, by the history they were proposed at (a recording
    wrapper around the real `propose`)."""

    def __init__(self, monkeypatch):
        self.drafts: dict[tuple[int, ...], list[int]] = {}
        propose = MtpDrafter.propose

        def recorded(drafter, history, k):
            out = propose(drafter, history, k)
            self.drafts[tuple(history)] = list(out[0])
            return out
        monkeypatch.setattr(MtpDrafter, "propose", recorded)

    def take(self) -> dict[tuple[int, ...], list[int]]:
        out, self.drafts = self.drafts, {}
        return out


@pytest.mark.parametrize(("family", "style"), HEADS)
def test_batched_head_gives_each_row_its_solo_drafts(tiny_model, tmp_path_factory, monkeypatch,
                                                      family, style):
    lm = _head_model(tiny_model, tmp_path_factory, family, style)
    log = DraftLog(monkeypatch)
    reqs = requests(SAMPLINGS["greedy"], {"drafter": "mtp", "depth": 3})
    alone = solo(MlxEngine(lm, 0, memory_tokens=0, max_batch=1), reqs)
    solo_drafts = log.take()
    engine = MlxEngine(lm, 0, memory_tokens=0, max_batch=4)
    batched = together(engine, reqs)
    batch_drafts = log.take()
    for a, b in zip(alone, batched, strict=True):
        assert b.tokens == a.tokens and b.text == a.text
        assert b.speculation.drafted == a.speculation.drafted > 0
    assert batch_drafts.keys() == solo_drafts.keys()
    differ = [h for h in solo_drafts if solo_drafts[h] != batch_drafts[h]]
    assert not differ, f"{len(differ)} of {len(solo_drafts)} rounds drafted differently"
    (head,) = engine.scheduler.heads.values()
    # Rows drafted together: at most one head forward per depth of a round, not one per row.
    assert head.peak == 4 and head.calls >= 2 * head.forwards
    assert not head.members and not head.pending  # every row left with its request


def test_context_bias_applies_to_batched_drafts(tiny_model, tmp_path_factory, monkeypatch):
    """The card's mtp_context_bias decides the drafts in a batch too: the batch's forward takes
    each row's unbiased argmax, which the bias must override. With a huge bonus every batched
    draft is the row's solo (biased) draft, every first draft a token of its context (where its
    context meets the draft vocabulary), and outputs stay exact."""
    lm = _head_model(tiny_model, tmp_path_factory, "llama", "eagle")
    monkeypatch.setitem(lm.speculation, "mtp_context_bias", 1e4)
    log = DraftLog(monkeypatch)
    reqs = requests(SAMPLINGS["greedy"], {"drafter": "mtp", "depth": 3})
    alone = solo(MlxEngine(lm, 0, memory_tokens=0, max_batch=1), reqs)
    solo_drafts = log.take()
    batched = together(MlxEngine(lm, 0, memory_tokens=0, max_batch=4), reqs)
    batch_drafts = log.take()
    for a, b in zip(alone, batched, strict=True):
        assert b.tokens == a.tokens and b.text == a.text
    assert batch_drafts == solo_drafts
    vocab = set(lm.mtp.vocab_ids.tolist())  # (a head drafts only from its draft vocabulary)
    firsts = [(h, d[0]) for h, d in batch_drafts.items() if d and set(h) & vocab]
    assert firsts and all(t in h for h, t in firsts)


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_batched_head_auto_and_trees_match_solo(tiny_model, tmp_path_factory, sampling):
    """Speculation auto (lookup beside the head) and head trees, greedy and seeded: outputs
    exactly the solo ones."""
    lm = _head_model(tiny_model, tmp_path_factory, "llama", "eagle")
    reqs = [*requests(SAMPLINGS[sampling], "auto", 2),
            *requests(SAMPLINGS[sampling], {"drafter": "mtp", "depth": 2}, 4)[2:]]
    engine, batched = _batched_equal_to_solo(lm, reqs)
    (head,) = engine.scheduler.heads.values()
    assert head.peak >= 2 and not head.members


def test_a_head_switched_off_mid_batch_leaves_it(tiny_model, tmp_path_factory, monkeypatch):
    """Seeded requests whose gates ignore the batch (what a request gets whose drafts are drawn
    from a q: patched in here, as this model drafts with a head) draft in the batch as alone, and
    the gate switches two heads off mid-batch: they leave the head batch, outputs still solo's."""
    from skulkp2p.engine.runner import generate

    monkeypatch.setattr(generate, "drafts_sampled", lambda loaded, spec: True)
    lm = _head_model(tiny_model, tmp_path_factory, "llama", "eagle")
    # (a random head is never sure of its guesses: without the threshold it drafts in auto)
    monkeypatch.setitem(lm.speculation, "mtp_min_confidence", 0.0)
    reqs = [*requests(SAMPLINGS["seeded"], "auto", 2),
            *requests(SAMPLINGS["seeded"], {"drafter": "mtp", "depth": 2}, 4)[2:]]
    engine, batched = _batched_equal_to_solo(lm, reqs)
    (head,) = engine.scheduler.heads.values()
    assert head.peak >= 2 and not head.members
    assert sum(e["event"] == "off" for r in batched for e in r.speculation.gate_events) >= 1


def test_prefix_cache_takes_the_head_rows_out_of_the_batch(tiny_model, tmp_path_factory):
    """A request whose head drafted in the batch is kept in the prefix cache with its head rows
    (copied out of the head batch); the next turn restores them and decodes what a cold solo
    engine decodes, drafting as much."""
    lm = _head_model(tiny_model, tmp_path_factory, "llama", "qwen")
    spec = {"drafter": "mtp", "depth": 2}
    cold = MlxEngine(lm, 0, memory_tokens=0, max_batch=1)
    engine = MlxEngine(lm, 64, memory_tokens=0, max_batch=4)
    first = parse_request({"prompt": PROMPTS[0], "max_tokens": 12, "speculation": spec})
    r1 = together(engine, [first, *requests({}, spec, 3)[1:]])[0]
    follow = parse_request({"prompt": PROMPTS[0] + r1.text + " again", "max_tokens": 12,
                            "speculation": spec})
    batched = together(engine, [follow, *requests({}, spec, 3)[1:]])
    want = solo(cold, [follow])[0]
    assert batched[0].usage.cached_tokens > 0
    assert batched[0].tokens == want.tokens
    assert batched[0].speculation.drafted == want.speculation.drafted
    assert engine.scheduler.heads and all(not h.members for h in engine.scheduler.heads.values())


def _filled(head, trunk_hidden: mx.array, tokens: list[int], n: int) -> KVCache:
    cache = head.make_cache()
    head(trunk_hidden[:n], mx.array(tokens[1:n + 1]), cache)
    return cache


def _copy(cache: KVCache) -> KVCache:
    out = KVCache()
    out.keys, out.values, out.offset = mx.array(cache.keys), mx.array(cache.values), cache.offset
    return out


def test_head_rows_forward_matches_each_rows_solo_call(tiny_model, tmp_path_factory):
    """HeadRows on its own: rows of different lengths join; calls of different widths (the
    verified rows of a round) and a depth-2 call run together, a row without a call riding
    along; each call's logits and argmax are the row's solo head call's; a trim and a leave;
    the rows extracted equal the solo caches. The barrier: a forward runs only once every
    active row has a call pending or its trunk tokens handed in."""
    lm = _head_model(tiny_model, tmp_path_factory, "llama", "qwen")
    head = lm.mtp
    tokens = [int(t) for t in np.random.default_rng(0).integers(3, 200, 40)]
    fwd = LocalForward(lm.model, hidden=head.conventions.hidden)
    fwd.prefill(tokens)
    trunk = fwd.last_hidden  # [40, H]
    sched = BatchScheduler(lm.model, 4)
    with sched.cond:  # (HeadRows is called with the model's lock held)
        _check_head_rows(sched, head, trunk, tokens)


def _check_head_rows(sched: BatchScheduler, head, trunk: mx.array, tokens: list[int]) -> None:
    rows = sched.head_rows(head)
    members = [sched.forward(head.conventions.hidden) for _ in range(4)]
    sched.active.extend(members)  # (rows of the trunk batch, as far as the barrier looks)
    lengths = [10, 17, 5, 23]
    solo_caches = [_filled(head, trunk, tokens, n) for n in lengths]
    for m, c in zip(members, solo_caches, strict=True):
        rows.join(m, _copy(c))
    assert rows.rows.lengths == lengths

    def check(calls: dict[int, tuple[mx.array, list[int]]]) -> None:
        handed = {i: rows.hand_in(members[i], h, t) for i, (h, t) in calls.items()}
        if len(calls) < len(members):  # a row may still hand a call in: nothing ran yet
            assert rows.forwards == forwards[0] and not any(c.done for c in handed.values())
            for i, m in enumerate(members):  # the others hand their trunk tokens in
                if i not in calls:
                    m.submitted = [1]
            sched.heads_if_ready()
        forwards[0] += 1  # (every row called: the last hand-in ran the forward)
        assert rows.forwards == forwards[0]
        for i, (h, t) in calls.items():
            logits, _, token = rows.result(members[i], handed[i])
            want = head(h, mx.array(t), solo_caches[i])
            np.testing.assert_allclose(np.array(logits), np.array(want.logits[-1]),
                                       rtol=1e-4, atol=1e-4)
            assert token == int(mx.argmax(want.logits[-1]).item())
        for m in members:
            m.submitted = None

    forwards = [0]
    # A round's verified rows (1 + accepted each), row 2 without a call.
    check({0: (trunk[10:12], tokens[11:13]), 1: (trunk[17:18], tokens[18:19]),
           3: (trunk[23:26], tokens[24:27])})
    # Depth 2 for rows 0 and 3 (their own chained state and draft), then their rollback.
    check({0: (trunk[5:6], [7]), 3: (trunk[6:7], [9])})
    rows.trim(members[0], 1)
    rows.trim(members[3], 1)
    for i in (0, 3):
        solo_caches[i].trim(1)
    assert rows.rows.lengths == [12, 18, 5, 26]
    rows.leave(members[1])
    del members[1], solo_caches[1]
    sched.active.remove(sched.active[1])
    check({0: (trunk[12:13], tokens[13:14]), 1: (trunk[5:8], tokens[6:9]),
           2: (trunk[26:27], tokens[27:28])})
    for m, c in zip(members, solo_caches, strict=True):
        out = rows.extract(m)
        assert out.offset == c.offset
        np.testing.assert_allclose(np.array(out.keys), np.array(c.keys[..., :c.offset, :]),
                                   rtol=1e-4, atol=1e-4)


def test_head_rows_refuse_bad_calls(tiny_model, tmp_path_factory):
    lm = _head_model(tiny_model, tmp_path_factory, "llama", "qwen")
    head = lm.mtp
    sched = BatchScheduler(lm.model, 2)
    rows = sched.head_rows(head)
    member = sched.forward(head.conventions.hidden)
    sched.lock.acquire()  # (HeadRows is called with the model's lock held; no other thread)
    with pytest.raises(ValueError, match="holding rows"):
        rows.join(member, head.make_cache())
    hidden = mx.zeros((3, int(Trunk(lm.model).body.norm.weight.shape[0])))
    cache = head.make_cache()
    head(hidden, mx.array([4, 5, 6]), cache)
    rows.join(member, cache)
    with pytest.raises(RuntimeError, match="twice"):
        rows.join(member, cache)
    with pytest.raises(ValueError, match="2 hidden rows for 1 tokens"):
        rows.hand_in(member, hidden[:2], [4])
    with pytest.raises(ValueError, match="trim 5 head rows of a row holding 3"):
        rows.trim(member, 5)


@pytest.mark.slow
def test_real_eagle_head_rows_draft_together(smollm2_path: Path):
    """SmolLM2-135M with its shipped EAGLE head, speculation auto, four requests: every output
    is its solo output and the head's rows drafted together. (16 tokens each: the head's
    drafts are accepted and rejected, asserted.)"""
    lm = smollm2_float32()
    questions = ["Name three rivers in Europe.", "What is a prime number?",
                 "Write a haiku about rain.", "Explain what a linked list is."]
    reqs = [parse_request({"messages": [{"role": "user", "content": q}], "max_tokens": 16,
                           "speculation": {"drafter": "mtp", "depth": 2}}) for q in questions]
    engine, batched = _batched_equal_to_solo(lm, reqs)
    (head,) = engine.scheduler.heads.values()
    assert head.peak == 4
    drafted = sum(r.speculation.drafted for r in batched)
    assert 0 < sum(r.speculation.accepted for r in batched) < drafted


def test_gate_prices_a_batched_heads_drafts_as_one_forward():
    """A head at a quarter of a trunk step per draft (acceptance 0.45) does not pay among 3
    other drafting rows when each row's head runs on its own (4 d k), but does when the rows
    draft in one forward per depth (d k c(4)); alone both price it alike. The gate of a
    drafter that says it drafts in the batch's forward prices it so once its row is a batch
    row (and not for a seeded sampled request, whose gate ignores the batch)."""
    from skulkp2p.engine.batching.batch_view import SOLO, BatchView
    from skulkp2p.engine.batching.row_forward import RowForward
    from skulkp2p.engine.drafting.drafter import InnerDrafter
    from skulkp2p.engine.drafting.gates import DEFAULT_WIDTH_COSTS, DepthController, GatedDrafter

    costs = DEFAULT_WIDTH_COSTS["float32"]
    drafting = BatchView((1,) * 3, drafting=3)
    per_row = DepthController(costs, 4, prior_accept=0.45, prior_weight=1e6, draft_cost=0.25)
    shared = DepthController(costs, 4, prior_accept=0.45, prior_weight=1e6, draft_cost=0.25,
                             shared_drafts=True)
    assert per_row.best_depth(4, drafting)[0] == 0
    assert shared.best_depth(4, drafting)[0] == 1
    assert per_row.best_depth(4, SOLO) == shared.best_depth(4, SOLO)

    class Head(InnerDrafter):
        name = "mtp"
        capabilities = MtpDrafter.capabilities

        def propose(self, history, k):
            return [], None

    class Row(RowForward):  # what a batch row shows a gate
        def __init__(self):
            self.drafts = False

        def batch_view(self):
            return drafting

    gated = GatedDrafter(Head(), costs, 4)
    gated.begin([1, 2], Row())
    assert gated.controller.shared_drafts
    seeded = GatedDrafter(Head(), costs, 4, weigh_batch=False)
    seeded.begin([1, 2], Row())
    assert not seeded.controller.shared_drafts
