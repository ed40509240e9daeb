"""The prompt gate, the runtime gate and the depth controller."""

import json

import pytest

from skulkp2p.engine.batching.batch_view import BatchView, StepPacking
from skulkp2p.engine.decode.drafter_seam import DrafterCapabilities
from skulkp2p.engine.decode.loop import DecodeStats, decode
from skulkp2p.engine.decode.sampling import SamplingParams, make_rng
from skulkp2p.engine.drafting.drafter import InnerDrafter
from skulkp2p.engine.drafting.gates import (
    DEFAULT_WIDTH_COSTS,
    REPRICE_EVERY,
    DepthController,
    GatedDrafter,
    LookupThenModel,
    repetition_score,
    step_cost,
    width_cost,
)
from skulkp2p.engine.drafting.prompt_lookup import PromptLookup
from skulkp2p.engine.model.forward import LocalForward
from skulkp2p.engine.model.loaded import load_model
from tests.helpers.procs import run_cli

F32 = DEFAULT_WIDTH_COSTS["float32"]


def test_repetition_score():
    assert repetition_score([1, 2, 3, 4, 5, 6]) == 0.0
    assert repetition_score([1, 2, 3] * 4) >= 0.7


def test_width_cost_interpolates_and_extrapolates():
    assert width_cost(F32, 1) == 1.0
    assert F32[4] < width_cost(F32, 5) < F32[6]
    assert width_cost(F32, 20) > F32[16]


def test_depth_controller_follows_acceptance():
    dc = DepthController(F32, max_depth=8)
    for _ in range(50):
        dc.record(drafted=8, accepted=8)
    k, gain = dc.best_depth(8)
    assert k == 8 and gain > 3
    dc = DepthController(F32, max_depth=8)
    for _ in range(50):
        dc.record(drafted=4, accepted=0)
    assert dc.best_depth(8) == (0, 1.0)  # nothing beats a plain step
    # bf16 costs make wide verifies dear: the same 60% acceptance buys less depth.
    mid_f32, mid_bf16 = DepthController(F32, 8), DepthController(DEFAULT_WIDTH_COSTS["bfloat16"], 8)
    for dc in (mid_f32, mid_bf16):
        for _ in range(40):
            dc.record(drafted=3, accepted=2)
            dc.record(drafted=3, accepted=1)
    assert mid_f32.best_depth(8)[0] >= mid_bf16.best_depth(8)[0]


# A recorded cost table (seconds of a forward of n token rows / one row's) and the shares of
# SmolLM2-135M (scheduler.step_packing: MLPs 0.59, head 0.21 of its weights).
RECORDED = {1: 1.0, 2: 1.1, 4: 1.25, 8: 1.45, 16: 1.9, 32: 2.8}
SMOL = StepPacking(head=0.21, mlps=0.59, mlps_from=8)


def test_step_cost_prices_the_padded_part_at_the_widest_and_the_packed_part_at_the_real():
    # Rows of one width, or no packing: every row at the widest, c(B W).
    assert step_cost(RECORDED, [2, 2, 2, 2], SMOL) == RECORDED[8]
    assert step_cost(RECORDED, [8, 1, 1, 1]) == RECORDED[32]
    # (8, 1, 1, 1): 11 real tokens of 32 padded, 21 padded rows >= 8: the MLPs pack too.
    ragged = step_cost(RECORDED, [8, 1, 1, 1], SMOL)
    assert ragged == pytest.approx(0.2 * RECORDED[32] + 0.8 * width_cost(RECORDED, 11))
    # (4, 4, 1, 1): 6 padded rows, below mlps_from: only the head runs on the real tokens.
    head_only = step_cost(RECORDED, [4, 4, 1, 1], SMOL)
    assert head_only == pytest.approx(0.79 * RECORDED[16] + 0.21 * width_cost(RECORDED, 10))
    assert width_cost(RECORDED, 10) < head_only < RECORDED[16]
    # Packing a ragged step never prices it above the padded step.
    for widths in ([3, 1], [5, 2, 2, 1], [7, 7, 7, 1], [1, 16]):
        assert step_cost(RECORDED, widths, SMOL) <= step_cost(RECORDED, widths)
    with pytest.raises(ValueError, match="at least one row"):
        step_cost(RECORDED, [])


def test_step_packing_refuses_shares_that_are_not_shares():
    with pytest.raises(ValueError, match="sum to at most 1"):
        StepPacking(head=0.6, mlps=0.6)
    with pytest.raises(ValueError, match=">= 0"):
        StepPacking(head=-0.1, mlps=0.5)
    with pytest.raises(ValueError, match="mlps_from"):
        StepPacking(head=0.2, mlps=0.5, mlps_from=-1)


def test_packed_price_lets_the_widest_row_draft_and_charges_rows_under_it():
    """Priced padded, a row among plain rows widens everyone's forward (it needs ~70%
    acceptance in a batch of 4) and a row under a wide one drafts up to its width for free
    whatever its acceptance; priced as the step runs packed, the first pays for its own
    tokens' MLPs and head only (it drafts from ~40%), the second pays for them too (a row that
    is rarely accepted stays plain, one accepted at 30% drafts less deep)."""
    f32 = DEFAULT_WIDTH_COSTS["float32"]
    packed = StepPacking(head=0.21, mlps=0.59, mlps_from=0)
    plain_rows = (1, 1, 1)
    for accept, padded_k, packed_k in ((0.4, 0, 1), (0.6, 0, 2)):
        c = DepthController(f32, 4, prior_accept=accept, prior_weight=1e6)
        assert c.best_depth(4, BatchView(plain_rows, 0))[0] == padded_k
        assert c.best_depth(4, BatchView(plain_rows, 0, packed))[0] == packed_k
    under_wide = (6, 1, 1)
    rare = DepthController(f32, 6, prior_accept=0.05, prior_weight=1e6)
    assert rare.best_depth(6, BatchView(under_wide, 0))[0] == 5  # free up to the widest
    assert rare.best_depth(6, BatchView(under_wide, 0, packed)) == (0, 1.0)
    some = DepthController(f32, 6, prior_accept=0.3, prior_weight=1e6)
    assert some.best_depth(6, BatchView(under_wide, 0))[0] == 5
    assert 0 < some.best_depth(6, BatchView(under_wide, 0, packed))[0] < 5
    # Alone, the packing changes nothing (one row is never ragged).
    assert some.best_depth(6, BatchView((), 0, packed)) == some.best_depth(6)


class WrongDrafter(InnerDrafter):
    """Always proposes a token the model will not pick (its own plain choice plus one)."""
    name = "wrong"

    def propose(self, history, k):
        return [(history[-1] * 7 + 1) % 500] * k, None


@pytest.fixture(scope="module")
def llama(tiny_models):
    return load_model(tiny_models["llama"], "llama")


def test_runtime_gate_turns_off_a_losing_drafter_and_output_stays_exact(llama):
    prompt = llama.tokenizer.encode("The quick brown fox")
    plain = list(decode(LocalForward(llama.model), prompt, SamplingParams(), 60, make_rng(0)))
    gated = GatedDrafter(WrongDrafter(), F32, max_depth=4)
    stats = DecodeStats()
    out = list(decode(LocalForward(llama.model), prompt, SamplingParams(), 60, make_rng(0),
                      gated, 4, stats))
    assert out == plain
    assert not gated.on and gated.events[0]["event"] == "off"
    assert stats.rounds <= 10  # it stopped drafting soon after the evidence came in


def test_lookup_stays_on_for_repetitive_output(llama):
    text = "alpha beta gamma delta " * 12
    prompt = llama.tokenizer.encode(text)
    assert repetition_score(prompt) > 0.5
    gated = GatedDrafter(PromptLookup(), F32, max_depth=6)
    stats = DecodeStats()
    list(decode(LocalForward(llama.model), prompt, SamplingParams(), 40, make_rng(0), gated, 6,
                stats))
    assert stats.drafted > 0


@pytest.mark.process
@pytest.mark.slow
def test_auto_lookup_on_echo_and_beside_the_head_on_novel_smollm2(smollm2_path):
    """The real model with its card (a trained MTP head): on an echo prompt lookup stays on and
    accepts many drafts; on a novel prompt lookup starts on too beside the head (the prompt
    gate applies to lookup alone, or with lookup.edits off) and the head drafts where lookup
    has no match. Greedy output is the same with and without speculation. (48 echo tokens:
    lookup accepts ~40 of them; 24 novel ones: the head drafts in ~10 rounds.)"""
    code = "\n".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n" for i in range(8))
    echo = {"id": "echo", "messages": [{"role": "user", "content":
            "Copy this code exactly, changing nothing:\n```python\n" + code + "```"}],
            "max_tokens": 48}
    from skulkp2p.bench.workloads import WORKLOADS
    novel = {"id": "novel", "messages": WORKLOADS["qa"], "max_tokens": 24}
    plain = {**novel, "id": "plain", "speculation": "off"}
    env = {"SKULKP2P_DATA_DIR": str(smollm2_path.parent.parent)}
    lines = "".join(json.dumps(r) + "\n" for r in (echo, novel, plain))
    proc = run_cli("pipe", "--engine", "mlx", input=lines, env=env)
    assert proc.returncode == 0, proc.stderr
    res = {r["id"]: r for r in map(json.loads, proc.stdout.splitlines())}
    e, n = res["echo"]["speculation"], res["novel"]["speculation"]
    assert e["drafter"] == n["drafter"] == "lookup+mtp" and e["mode"] == "auto"
    assert e["by_drafter"]["lookup"]["accepted"] > 20 and not any(
        ev["event"] == "off" and ev["drafter"] == "lookup" for ev in e["gate_events"])
    # Beside the head no prompt gate: lookup is on from the start (no event switched it on),
    # and the head drafts every round lookup has nothing for.
    assert not any(ev["event"] == "on" and ev["drafter"] == "lookup"
                   for ev in n["gate_events"])
    assert n["by_drafter"]["mtp"]["drafted"] > 0
    assert res["novel"]["tokens"] == res["plain"]["tokens"]


class _ContextDrafter(InnerDrafter):
    """Drafts k copies of one token; says which context its round is (set by the test)."""

    name = "lookup"
    context_priors = {1: 0.95}

    def __init__(self) -> None:
        self.kind = 0

    def context(self, history: list[int]) -> int:
        return self.kind

    def propose(self, history, k):
        return [1] * k, None


def test_gate_keeps_an_estimate_per_context():
    """Rounds of one context (short matches, rejected early) do not cut the depth of another
    (long matches), which starts from its own prior (the drafter's context_priors)."""
    inner = _ContextDrafter()
    gate = GatedDrafter(inner, DEFAULT_WIDTH_COSTS["float32"], 16, prior_accept=0.8)
    first = len(gate.propose([0], 16)[0])
    for _ in range(6):
        drafted = len(gate.propose([0], 16)[0])
        gate.observe(drafted, 1, [1, 2], None)
    short = len(gate.propose([0], 16)[0])
    assert 0 < short < first
    inner.kind = 1
    assert len(gate.propose([0], 16)[0]) == 16  # a fresh estimate from the 0.95 prior
    inner.kind = 0
    assert len(gate.propose([0], 16)[0]) == short


class _HeadLike(InnerDrafter):
    """Drafts one token per round, always rejected; counts what the gate asks of it (an MTP
    head's calls: observe while on, lag while off, catch_up before it drafts again)."""

    name = "head"
    capabilities = DrafterCapabilities(resumes=True)

    def __init__(self) -> None:
        self.lagged = 0
        self.caught_up = 0
        self.proposed = 0

    def propose(self, history, k):
        self.proposed += 1
        return [7] * k, None

    def lag(self, accepted, emitted, forward) -> None:
        self.lagged += 1

    def catch_up(self) -> None:
        self.caught_up += 1


def _priced_off(costs: dict[int, float]) -> tuple[GatedDrafter, _HeadLike]:
    """A head-like drafter whose gate went off: at these costs its first draft cannot pay
    (prior 0.5 at depth 1: 1.5 tokens for c(2) = 2)."""
    inner = _HeadLike()
    gate = GatedDrafter(inner, costs, 1)
    assert gate.propose([0], 1) == ([], None) and not gate.on
    assert gate.can_reprice
    return gate, inner


def test_a_drafter_priced_off_comes_back_when_the_verify_costs_fall():
    """A live cost table (a tensor group's) can price wide verifies high for a burst of load:
    the gate prices the drafter again every REPRICE_EVERY tokens and switches it back on, its
    skipped rows caught up first, once its acceptance pays at the costs of now."""
    costs = {1: 1.0, 2: 2.0, 4: 2.6}
    gate, inner = _priced_off(costs)
    for _ in range(REPRICE_EVERY - 1):
        gate.observe(0, 0, [5], None)
    costs[2] = 1.1  # the burst passed
    assert not gate.on and inner.lagged == REPRICE_EVERY - 1
    gate.observe(0, 0, [5], None)  # the REPRICE_EVERY-th token since it went off
    assert gate.on and inner.caught_up == 1
    assert [e["reason"] for e in gate.events] == ["acceptance below break-even",
                                                  "verify costs fell"]
    drafts, _ = gate.propose([0], 1)
    assert drafts == [7]
    # Rejected again and again, it goes off again on its own measured acceptance.
    for _ in range(20):
        gate.observe(1, 0, [5], None)
        if not gate.propose([0], 1)[0]:
            break
    assert not gate.on and gate.events[-1]["event"] == "off"


def test_a_drafter_priced_off_stays_off_while_the_costs_stand():
    """With costs that do not change (a single node's measured table) the decision cannot
    change: the drafter stays off, asked nothing and never caught up."""
    gate, inner = _priced_off({1: 1.0, 2: 2.0, 4: 2.6})
    for _ in range(10 * REPRICE_EVERY):
        gate.observe(0, 0, [5], None)
        gate.follow(0, [5], None)
    assert not gate.on and inner.caught_up == 0 and inner.proposed == 0
    assert len(gate.events) == 1


def test_a_drafter_without_catch_up_is_not_priced_again():
    """A drafter that cannot be brought back in step (a draft model off for good stops
    running) stays off whatever the costs do."""
    costs = {1: 1.0, 2: 2.0}
    gate = GatedDrafter(WrongDrafter(), costs, 1)
    assert gate.propose([0], 1) == ([], None) and not gate.can_reprice
    costs[2] = 1.0
    for _ in range(3 * REPRICE_EVERY):
        gate.observe(0, 0, [5], None)
    assert not gate.on


class _Guess(InnerDrafter):
    """A model drafter that always guesses one token (as a depth-1 MTP head does)."""

    name = "mtp"

    def __init__(self, token: int) -> None:
        self.token = token

    def propose(self, history, k):
        return [self.token], None


def test_lookup_continues_the_model_drafters_guess():
    """Where lookup has no match of its own, the head's one-token guess is continued by lookup
    when the guess makes a match (gates.LookupThenModel._continued); otherwise it goes alone,
    and with lookup.edits off it always goes alone."""
    from skulkp2p.engine.drafting.gates import LookupThenModel
    from skulkp2p.engine.drafting.suffix import SuffixDrafter

    costs = DEFAULT_WIDTH_COSTS["float32"]
    text = [1, 2, 3, 4, 5, 6, 9, 8, 1]
    for guess, edits, expected in ((2, True, [2, 3, 4]), (7, True, [7]), (2, False, [2])):
        inner = SuffixDrafter(min_match=2, edits=edits)
        inner.prepare(text)
        auto = LookupThenModel(GatedDrafter(inner, costs, 16, prior_accept=0.8),
                               GatedDrafter(_Guess(guess), costs, 1, prior_accept=0.49,
                                            prior_weight=8.0))
        assert auto.propose(text, 16)[0] == expected
        tree = auto.propose_tree(text, 16)
        assert tree is not None and tree.tokens == expected


def test_prompt_gate_applies_to_lookup_alone(tiny_model, monkeypatch):
    """On a novel prompt, lookup starts off when it drafts alone (the prompt gate), and on
    beside a model drafter (the head takes the rounds it has nothing for), unless the card
    turns lookup.edits off (then the gate applies as before)."""
    from skulkp2p.engine.drafting.gates import LookupThenModel
    from skulkp2p.engine.runner.generate import _choose_drafter
    from skulkp2p.formats.pipe_format import parse_request

    req = parse_request({"prompt": "x", "max_tokens": 8})
    prompt = list(range(40, 90))  # nothing repeats: repetition score 0
    head = load_model(tiny_model("llama", mtp=True), "llama")
    auto, _, _ = _choose_drafter(head, req, prompt, make_rng(0))
    assert isinstance(auto, LookupThenModel) and auto.lookup.on
    monkeypatch.setattr(head, "speculation", {**head.speculation, "lookup": {"edits": False}})
    auto, _, _ = _choose_drafter(head, req, prompt, make_rng(0))
    assert not auto.lookup.on
    alone, _, _ = _choose_drafter(load_model(tiny_model("llama"), "llama"), req, prompt,
                               make_rng(0))
    assert alone.name == "lookup" and not alone.on


def test_each_drafters_capabilities_match_what_it_implements():
    """A capability says the drafter has the method behind it, and a drafter with the method
    says so: a gate never calls a default where a drafter does the thing, nor asks one that
    does not."""
    from skulkp2p.engine.decode.drafter_seam import Drafter
    from skulkp2p.engine.drafting.assistant import AssistantDrafter
    from skulkp2p.engine.drafting.draft_model import DraftModelDrafter
    from skulkp2p.engine.drafting.gates import LookupThenModel
    from skulkp2p.engine.drafting.mtp_drafter import MtpDrafter
    from skulkp2p.engine.drafting.suffix import SuffixDrafter

    behind = {"trees": "propose_tree", "branches": "propose_branches", "resumes": "catch_up",
              "prefetches": "prefetch"}
    defaults = (Drafter, InnerDrafter)
    for cls in (PromptLookup, SuffixDrafter, MtpDrafter, DraftModelDrafter, AssistantDrafter,
                GatedDrafter, LookupThenModel):
        for flag, method in behind.items():
            own = getattr(cls, method, None) not in {getattr(d, method, None) for d in defaults}
            assert getattr(cls.capabilities, flag) == own, (cls.__name__, flag)
    assert MtpDrafter.capabilities.shared_in_batch
    assert not SuffixDrafter.capabilities.shared_in_batch


def test_an_inner_drafter_with_propose_alone_takes_the_gates_defaults():
    """A drafter that declares nothing but `propose`: one context with no priors of its own, no
    branches beside its chain, nothing to keep in step or catch up (its gate does not price it
    again), no early draft, no choices at hand, no continuation of another's guess."""
    from skulkp2p.engine.drafting.gates import LookupThenModel

    inner = WrongDrafter()
    assert inner.context([1, 2]) == 0 and not inner.context_priors
    assert inner.propose_branches([1, 2], 3) == (inner.propose([1, 2], 3)[0], [])
    assert inner.offers_draft() and inner.continue_after([1, 2], 3, 4) == []
    assert inner.first_choices(2) == []
    inner.follow(0, [5], None)
    inner.lag(0, [5], None)
    inner.catch_up()
    assert not GatedDrafter(inner, F32, 4).can_reprice
    auto = LookupThenModel(GatedDrafter(_ContextDrafter(), F32, 4), GatedDrafter(inner, F32, 4))
    auto.observe(0, 0, [5], None)
    assert auto.prefetch_calls == 0  # (no early draft to start)



class RowDrafter(InnerDrafter):
    """Drafts as an MTP head does, from the last verified row: nothing past unseen tokens."""
    name = "row"
    capabilities = DrafterCapabilities(drafts_past_unseen=False)

    def propose(self, history, k):
        return [history[-1]] * k, None


def test_past_tokens_a_grammar_forced_only_history_drafters_draft():
    """After tokens no forward has run (a grammar forced them), lookup drafts as always, a
    drafter of the last verified row drafts nothing, and auto (lookup then the model drafter)
    drafts with lookup alone, counting the round as lookup's."""
    history = [5, 6, 7, 8, 5, 6, 7]
    lookup = GatedDrafter(PromptLookup(), F32, max_depth=4)
    assert lookup.propose_past_unseen(history, 2) == lookup.propose(history, 2) == ([8, 5], None)
    row = GatedDrafter(RowDrafter(), F32, max_depth=4)
    assert row.propose(history, 2)[0] and row.propose_past_unseen(history, 2) == ([], None)
    auto = LookupThenModel(GatedDrafter(PromptLookup(), F32, max_depth=4), row)
    assert auto.propose_past_unseen(history, 2) == ([8, 5], None)
    assert auto.propose_past_unseen([1, 2, 3], 2) == ([], None)  # no match: nothing
    assert auto.propose([1, 2, 3], 2)[0] == [3, 3]  # (where the head would draft)
