"""Quiet stretches (decode._pipelined with a drafter): where the drafter has nothing to offer,
greedy steps run pipelined (step n+1 built while step n is handed out) instead of one
synchronous one-token round each; the drafter still observes every token, with the step's own
hidden row, and is asked after every token; when it drafts, the step built ahead is taken back.
Checked against the round loop (a forward without lazy steps) and mlx-lm: the same tokens, the
same drafter calls and hidden rows, and caches that end bit for bit where the round loop's end."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from skulkp2p.engine.decode.drafter_seam import Drafter
from skulkp2p.engine.decode.loop import DecodeStats, decode
from skulkp2p.engine.decode.sampling import SamplingParams, make_rng
from skulkp2p.engine.drafting.gates import DEFAULT_WIDTH_COSTS, GatedDrafter
from skulkp2p.engine.drafting.suffix import SuffixDrafter
from skulkp2p.engine.model.forward import LocalForward
from skulkp2p.engine.runner.mlx_engine import MlxEngine
from skulkp2p.formats.pipe_format import parse_request
from tests.helpers.pipelined import ECHO, TRIMMABLE, RoundLoopForward
from tests.helpers.pipelined import loaded as _loaded
from tests.helpers.reference import mlx_lm_tokens


class EveryNth(Drafter):
    """A drafter that says it is quiet and drafts only when the history's length is a multiple of `every` (quiet
    otherwise), a suffix drafter's draft or, where it has none, a guess; it records every call
    it gets (and the hidden rows it was shown), so two runs can be compared call by call."""

    name = "every-nth"

    def __init__(self, every: int):
        self.every = every
        self.suffix = SuffixDrafter()
        self.calls: list[tuple] = []
        self.rows: list[np.ndarray] = []

    def quiet(self) -> bool:
        return True  # (so that every quiet round starts a stretch: the take-back is tested)

    def begin(self, prompt, forward) -> None:
        self.suffix.begin(prompt, forward)

    def propose(self, history, k):
        self.calls.append(("propose", len(history), k))
        if len(history) % self.every:
            return [], None
        draft, _ = self.suffix.propose(history, k)
        return (draft or [history[-1]] * k), None

    def observe(self, drafted, accepted, emitted, forward) -> None:
        self.calls.append(("observe", drafted, accepted, tuple(emitted)))
        self.suffix.observe(drafted, accepted, emitted, forward)
        if forward.last_hidden is not None:
            self.rows.append(np.array(forward.last_hidden[:accepted + 1]))


def _run(forward, prompt, n, drafter, *, depth=4, history=None, take=None):
    stats = DecodeStats()
    steps = decode(forward, prompt, SamplingParams(), n, make_rng(0), drafter, depth, stats,
                   history=history)
    out = []
    for token in steps:
        out.append(token)
        if take is not None and len(out) == take:
            break
    steps.close()
    return out, stats


@pytest.mark.parametrize("family", TRIMMABLE)
@pytest.mark.parametrize("every", [3, 1000])
def test_quiet_stretches_equal_the_round_loop_and_mlx_lm(tiny_models, family, every):
    """Drafting now and then (every 3rd length) and never (1000): the tokens are plain
    greedy's and mlx-lm's, the drafter sees the same calls in the same order as in the round
    loop, the hidden rows it is shown are bit for bit the round loop's, and every quiet token
    ran pipelined (steps built ahead of a draft taken back)."""
    lm = _loaded(tiny_models[family])
    prompt = lm.tokenizer.encode(ECHO)
    piped_drafter, loop_drafter = EveryNth(every), EveryNth(every)
    piped, stats = _run(LocalForward(lm.model, hidden="after"), prompt, 40, piped_drafter)
    loop, loop_stats = _run(RoundLoopForward(lm.model, hidden="after"), prompt, 40,
                            loop_drafter)
    assert piped == loop == mlx_lm_tokens(lm, prompt, 40)
    assert piped_drafter.calls == loop_drafter.calls
    assert len(piped_drafter.rows) == len(loop_drafter.rows)
    for a, b in zip(piped_drafter.rows, loop_drafter.rows, strict=True):
        assert np.array_equal(a, b)
    assert loop_stats.pipelined == 0 and (stats.rounds, stats.accepted) == (
        loop_stats.rounds, loop_stats.accepted)
    quiet = len(piped) - stats.rounds - stats.accepted  # tokens no drafted round emitted
    assert stats.pipelined == quiet > 0
    if every == 1000:
        assert stats.rounds == 0 and stats.taken_back == 0
    else:
        assert stats.rounds > 0 and stats.taken_back > 0


@pytest.mark.parametrize("family", TRIMMABLE)
@pytest.mark.parametrize("take", [1, 5, 17, 40])
def test_closed_early_caches_end_where_the_round_loop_ends(tiny_models, family, take):
    """Closed after `take` tokens (a stop string, EOS) in or after a quiet stretch, with the
    caller keeping the caches (the prefix cache): they hold every token handed out but the
    last, bit for bit the round loop's."""
    lm = _loaded(tiny_models[family])
    prompt = lm.tokenizer.encode(ECHO)
    history: list[int] = []
    forward = LocalForward(lm.model)
    out, stats = _run(forward, prompt, 40, EveryNth(4), history=history, take=take)
    assert history[len(prompt):len(prompt) + take] == out
    assert stats.pipelined > 0 or take == 1  # (the first round drafts)
    loop_forward = RoundLoopForward(lm.model)
    loop_history: list[int] = []
    _run(loop_forward, prompt, 40, EveryNth(4), history=loop_history, take=take)
    # The round loop hands out a round's tokens one by one; closed mid-round its history
    # holds the whole round. Compare the positions both hold.
    n = min(len(history), len(loop_history)) - 1
    assert history[:n + 1] == loop_history[:n + 1]
    assert {c.offset for c in forward.cache} == {len(history) - 1}
    for a, b in zip(forward.cache, loop_forward.cache, strict=True):
        assert mx.array_equal(a.keys[..., :n, :], b.keys[..., :n, :]).item()
        assert mx.array_equal(a.values[..., :n, :], b.values[..., :n, :]).item()


def test_gated_lookup_off_runs_pipelined_through_the_engine(tiny_models):
    """A lone request on a batching engine whose lookup starts off (a novel prompt) decodes
    its quiet stretch pipelined, the same text as speculation off, and leaves no step in
    flight (another request could not start otherwise)."""
    lm = _loaded(tiny_models["llama"])
    engine = MlxEngine(lm, 0, memory_tokens=0, max_batch=4)
    body = {"prompt": "Tell me about rivers and the sea in spring.", "max_tokens": 32}
    results = []
    for speculation in ("off", "auto"):
        gen = engine.generate(parse_request({**body, "speculation": speculation}))
        for _ in gen:
            pass
        results.append(gen.result)
    off, auto = results
    assert auto.tokens == off.tokens
    assert auto.speculation is not None and auto.speculation.rounds == 0
    assert engine.scheduler.lazy_steps >= 2 * len(off.tokens) - 2
    assert engine.scheduler.ahead is None


def test_gated_drafter_switched_off_goes_quiet(tiny_models):
    """A gated suffix drafter that starts off stays quiet: every token pipelined, the tokens
    plain greedy's."""
    lm = _loaded(tiny_models["qwen3"])
    prompt = lm.tokenizer.encode("A short and novel question about weather?")
    gated = GatedDrafter(SuffixDrafter(), DEFAULT_WIDTH_COSTS["float32"], 8, start_on=False,
                         can_return=True)
    out, stats = _run(LocalForward(lm.model), prompt, 30, gated, depth=8)
    plain, _ = _run(LocalForward(lm.model), prompt, 30, None, depth=0)
    assert out == plain
    assert stats.pipelined == len(out) - stats.rounds - stats.accepted


def test_a_drafter_on_without_a_match_keeps_one_token_rounds(tiny_models):
    """A gated drafter that is on but finds no match this round is not quiet (it likely drafts
    next round, and a step built ahead would be taken back, a whole step lost): the loop runs
    its one-token rounds, nothing pipelined, the tokens plain greedy's."""
    lm = _loaded(tiny_models["llama"])
    prompt = lm.tokenizer.encode(ECHO)
    gated = GatedDrafter(SuffixDrafter(min_match=10_000), DEFAULT_WIDTH_COSTS["float32"], 8)
    out, stats = _run(LocalForward(lm.model), prompt, 20, gated, depth=8)
    plain, _ = _run(LocalForward(lm.model), prompt, 20, None, depth=0)
    assert out == plain and gated.on and not gated.quiet()
    assert stats.pipelined == 0 and stats.rounds == 0
