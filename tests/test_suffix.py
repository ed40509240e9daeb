"""The suffix drafter and the draft memory: the automaton's longest match against a brute-force
search, walks that only propose text that occurred, the memory's bound and LRU, and exactness:
greedy output with the suffix drafter (own text and memory) equals plain, a retried request
drafts from memory and has nearly every draft accepted, and sampled output keeps the target
distribution when the memory holds skewed drafts."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from skulkp2p.engine.drafting.suffix import MIN_CAP, SuffixAutomaton, SuffixDrafter, SuffixMemory
from tests.helpers.loaded import smollm2_float32


def _longest_earlier_suffix(t: list[int]) -> int:
    n = len(t)
    for size in range(n - 1, 0, -1):
        suffix = t[n - size:]
        if any(t[s:s + size] == suffix for s in range(n - size)):
            return size
    return 0


def _occurs(seq: list[int], text: list[int]) -> bool:
    return any(text[j:j + len(seq)] == seq for j in range(len(text) - len(seq) + 1))


def test_automaton_finds_the_longest_match_and_walks_only_seen_text():
    rng = random.Random(1)
    for _ in range(200):
        alphabet = rng.randint(1, 4)
        text = [rng.randrange(alphabet) for _ in range(rng.randint(1, 50))]
        sam = SuffixAutomaton()
        for i, c in enumerate(text):
            sam.extend(c)
            assert sam.match_len == _longest_earlier_suffix(text[:i + 1])
            walk = sam.walk(sam.match, 6)
            if sam.match_len:
                assert walk, text[:i + 1]
                assert _occurs(text[i + 1 - sam.match_len:i + 1] + walk, text[:i + 1])


def test_walk_prefers_the_continuation_that_followed_most_often():
    sam = SuffixAutomaton()
    # "a b" is followed by x three times, then once by y (the most recent).
    for t in [1, 2, 7, 9, 1, 2, 7, 9, 1, 2, 7, 9, 1, 2, 8, 9, 1, 2]:
        sam.extend(t)
    assert sam.match_len >= 2
    assert sam.walk(sam.match, 1) == [7]


def test_drafter_caps_the_draft_at_the_match_length_or_min_cap():
    assert MIN_CAP == 4
    text = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 5, 6]
    d = SuffixDrafter()
    d.prepare(text)
    # a match of 2 drafts MIN_CAP tokens (it drafted 2 before: a 2-token match was followed by
    # 4 more copyable tokens at most of the code-edit bench's such points)
    assert d.propose(text, 8)[0] == [7, 8, 9, 10]
    assert d.propose(text, 3)[0] == [7, 8, 9]
    d = SuffixDrafter()  # (no copy under way: the copy cursor is test_cursor_...'s)
    d.prepare(text + [7, 8, 9])
    assert d.propose(text + [7, 8, 9], 8)[0] == [10, 11, 12, 13, 14]  # a match of 5: 5


def test_cursor_resumes_the_copy_after_an_edit():
    """After an edit (a token its source does not have), the copy resumes at the source's
    occurrence of the text's last 2 tokens nearest the cursor, not at their most recent
    occurrence elsewhere (which the automaton's walk takes)."""
    source = [10, 11, 12, 13, 3, 4, 5, 6, 7, 8]
    elsewhere = [20, 3, 4, 60, 61, 62]
    prompt = source + elsewhere + [10, 11, 12]
    d = SuffixDrafter(min_match=2)
    d.prepare(prompt)
    assert d.propose(prompt, 4)[0] == [13, 3, 4, 5]  # the copy of `source` begins
    d.observe(4, 1, [13, 99], None)  # the edit: 99 where the source has 3
    d.observe(0, 0, [3, 4], None)  # the copy resumes
    text = prompt + [13, 99, 3, 4]
    assert d.sam.match_len == 2  # "3 4": the automaton alone drafts what followed it last
    assert d.sam.walk(d.sam.match, 4) == [60, 61, 62, 10]
    assert d.propose(text, 4)[0] == [5, 6, 7, 8] and d.from_cursor == 4
    # With no copy under way (no cursor), the longest match's latest occurrence as before.
    fresh = SuffixDrafter(min_match=2)
    fresh.prepare(text)
    assert fresh.propose(text, 4)[0] == [60, 61, 62, 10]


def test_continue_after_extends_another_drafters_guess_into_a_copy():
    text = [1, 2, 3, 4, 5, 6, 9, 8, 1]
    d = SuffixDrafter(min_match=2)
    d.prepare(text)
    assert d.propose(text, 4)[0] == []  # its own match is 1 token: below min_match
    assert d.continue_after(text, 2, 4) == [3, 4]  # "1 2" occurs: CONTINUE_CAP tokens of it
    assert d.continue_after(text, 7, 4) == []  # "1 7" does not
    assert SuffixDrafter(min_match=2, edits=False).continue_after(text, 2, 4) == []


def test_long_matches_are_their_own_context():
    d = SuffixDrafter()
    text = list(range(100, 120)) + [1, 2] + list(range(100, 118))
    d.prepare(text)
    assert d.sam.match_len >= 16 and d.context(text) == 1
    short = [1, 2, 3, 9, 1, 2]
    d = SuffixDrafter()
    d.prepare(short)
    assert d.context(short) == 0


def test_memory_is_bounded_lru_and_never_matches_across_entries():
    mem = SuffixMemory(110)  # over it, entries go until 3/4 of it (82) is left
    mem.add(list(range(0, 40)))
    mem.add(list(range(100, 140)))
    mem.add(list(range(0, 40)))  # a repeat: moves to most recent, stored once
    assert len(mem) == 2 and mem.tokens == 80
    mem.add(list(range(200, 240)))  # over the bound: the least recently used entry goes
    assert mem.tokens <= 110 and len(mem) == 2
    d = SuffixDrafter(memory=mem)
    d.prepare([7, 101, 102])
    assert d.propose([7, 101, 102], 4)[0] == []  # evicted
    d = SuffixDrafter(memory=mem)
    d.prepare([7, 37, 38, 39])
    assert d.propose([7, 37, 38, 39], 4)[0] == []  # the entry's end is not followed by the next
    d = SuffixDrafter(memory=mem)
    d.prepare([7, 5, 6, 7])
    assert d.propose([7, 5, 6, 7], 3)[0] == [8, 9, 10] and d.from_memory == 3
    assert SuffixMemory(0).enabled is False


def test_own_text_wins_over_memory_unless_memory_matches_longer():
    mem = SuffixMemory(1000)
    mem.add([1, 2, 3, 4, 50, 51, 52])
    d = SuffixDrafter(memory=mem)
    prompt = [3, 4, 60, 61, 1, 2, 3, 4]  # own match "3 4" (2), memory "1 2 3 4" (4)
    d.prepare(prompt)
    assert d.propose(prompt, 3)[0] == [50, 51, 52]
    d = SuffixDrafter(memory=mem)
    prompt = [1, 2, 3, 4, 70, 71, 1, 2, 3, 4]  # own match of 4 ties memory: own wins
    d.prepare(prompt)
    assert d.propose(prompt, 2)[0] == [70, 71]


# --- exactness on tiny models -------------------------------------------------------------------

ECHO = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(a,"


@pytest.fixture(scope="module")
def llama(tiny_models):
    from skulkp2p.engine.model.loaded import load_model

    return load_model(tiny_models["llama"], "llama")


@pytest.fixture(scope="module")
def echo_plain(tiny_models, llama):
    """Per family: the model (default dtype), the ECHO prompt and its plain greedy 48 tokens
    (the same for every depth below: computed once)."""
    from skulkp2p.engine.decode.loop import decode
    from skulkp2p.engine.decode.sampling import SamplingParams, make_rng
    from skulkp2p.engine.model.forward import LocalForward
    from skulkp2p.engine.model.loaded import load_model

    out = {}
    for fam, lm in (("llama", llama), ("qwen3_5", load_model(tiny_models["qwen3_5"], "qwen3_5"))):
        prompt = lm.tokenizer.encode(ECHO)
        out[fam] = (lm, prompt, list(decode(LocalForward(lm.model), prompt, SamplingParams(),
                                            48, make_rng(0))))
    return out


@pytest.mark.parametrize("depth", [1, 3, 6])
def test_suffix_drafter_equals_plain(echo_plain, depth):
    from skulkp2p.engine.decode.loop import DecodeStats, decode
    from skulkp2p.engine.decode.sampling import SamplingParams, make_rng
    from skulkp2p.engine.model.forward import LocalForward

    for fam in ("llama", "qwen3_5"):
        lm, prompt, plain = echo_plain[fam]
        stats = DecodeStats()
        spec = list(decode(LocalForward(lm.model), prompt, SamplingParams(), 48, make_rng(0),
                           SuffixDrafter(), depth, stats))
        assert spec == plain, fam
        assert stats.drafted > 0


@pytest.mark.slow
def test_smollm2_code_edit_cursor_and_long_matches_exact(smollm2_path):
    """The bench's code-edit request on SmolLM2-135M with the gated suffix drafter: the copy
    cursor and the long-match context both draft there, and greedy output equals mlx-lm's
    generate (so plain decoding's: tests/test_trees.py and test_fast_path.py check ours equals
    mlx-lm's on SmolLM2; a plain decode here too cost a third of this test). (160 tokens: the
    first long-match round comes ~145 tokens in, where the model repeats its own docstring.)"""
    from skulkp2p.bench.arms.mlx_arms import engine_request
    from skulkp2p.bench.workloads import WORKLOADS
    from skulkp2p.engine.decode.loop import DecodeStats, decode
    from skulkp2p.engine.decode.sampling import SamplingParams, make_rng
    from skulkp2p.engine.drafting.gates import DEFAULT_WIDTH_COSTS, GatedDrafter
    from skulkp2p.engine.model.forward import LocalForward
    from skulkp2p.engine.runner.generate import prompt_tokens
    from tests.helpers.reference import mlx_lm_tokens

    lm = smollm2_float32()
    prompt = prompt_tokens(lm, engine_request(WORKLOADS["code-edit"], 160, "auto"))
    reference = mlx_lm_tokens(lm, prompt, 160)
    inner = SuffixDrafter(min_match=2)
    gated = GatedDrafter(inner, DEFAULT_WIDTH_COSTS["float32"], 16, prior_accept=0.8)
    contexts = []
    context = inner.context
    inner.context = lambda history: contexts.append(context(history)) or contexts[-1]
    stats = DecodeStats()
    spec = list(decode(LocalForward(lm.model), prompt, SamplingParams(), 160, make_rng(0),
                       gated, 16, stats))
    assert spec == reference
    assert inner.from_cursor > 0 and 1 in contexts
    assert 0 < stats.accepted < stats.drafted  # drafts accepted and rejected


def _request(content: str, speculation, max_tokens: int = 40):
    from skulkp2p.formats.pipe_format import parse_request

    return parse_request({"messages": [{"role": "user", "content": content}],
                          "max_tokens": max_tokens, "temperature": 0,
                          "speculation": speculation})


def _run(engine, req):
    generation = engine.generate(req)
    for _ in generation:
        pass
    return generation.result


@pytest.mark.parametrize("speculation", ["auto", {"drafter": "lookup", "depth": 6}])
def test_a_retried_request_drafts_from_memory_and_stays_exact(llama, speculation):
    from skulkp2p.engine.runner.mlx_engine import MlxEngine

    engine = MlxEngine(llama, memory_tokens=4096)
    plain = _run(engine, _request("Tell me about the sea.", "off"))
    first = _run(engine, _request("Tell me about the sea.", speculation))
    again = _run(engine, _request("Tell me about the sea.", speculation))
    assert first.tokens == again.tokens == plain.tokens
    assert engine.memory.hits >= 1
    spec = again.speculation
    assert spec.drafted >= len(plain.tokens) // 2, spec
    assert spec.accepted >= 0.9 * spec.drafted, spec
    # Without memory the same retry has (much) less to draft from.
    off = MlxEngine(llama, memory_tokens=0)
    _run(off, _request("Tell me about the sea.", speculation))
    alone = _run(off, _request("Tell me about the sea.", speculation))
    assert alone.tokens == plain.tokens and off.memory.hits == 0
    assert alone.speculation.accepted < spec.accepted


def test_card_field_turns_memory_off(llama):
    from skulkp2p.engine.runner.mlx_engine import MlxEngine

    saved = llama.speculation
    llama.speculation = {**saved, "lookup": {"memory_tokens": 0}}
    try:
        assert MlxEngine(llama).memory.enabled is False
    finally:
        llama.speculation = saved
    assert MlxEngine(llama).memory.enabled is True


@pytest.mark.process
@pytest.mark.parametrize("memory", [None, "0"])
def test_pipe_retry_drafts_from_memory_unless_the_flag_turns_it_off(tiny_models, memory):
    import json

    from tests.helpers.procs import run_cli

    line = json.dumps({"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0,
                       "speculation": {"drafter": "lookup", "depth": 6}})
    extra = [] if memory is None else ["--draft-memory-tokens", memory]
    proc = run_cli("pipe", "--model", str(tiny_models["llama"]), *extra,
                   input=line + "\n" + line + "\n", timeout=120)
    assert proc.returncode == 0, proc.stderr
    first, again = (json.loads(x) for x in proc.stdout.splitlines())
    assert first["text"] == again["text"]
    if memory is None:
        assert again["speculation"]["accepted"] >= 20
    else:
        assert again["speculation"]["accepted"] == first["speculation"]["accepted"]


def test_a_seeded_sampled_request_is_the_same_whatever_ran_before(llama):
    """A seeded sampled request drafts from memory (its drafts are deterministic, so plain
    sampling's own draw decides every token): the same seed gives the same text on a fresh
    engine, after itself (drafting its earlier output from memory) and with speculation off."""
    from skulkp2p.engine.runner.mlx_engine import MlxEngine
    from skulkp2p.formats.pipe_format import parse_request

    def req(spec=None):
        return parse_request({"prompt": "Tell me about the sea.", "max_tokens": 24,
                              "temperature": 1.0, "seed": 7,
                              "speculation": spec or {"drafter": "lookup", "depth": 6}})

    engine = MlxEngine(llama, memory_tokens=4096)
    first = _run(engine, req())
    again = _run(engine, req())
    assert again.tokens == first.tokens == _run(MlxEngine(llama), req()).tokens
    assert again.tokens == _run(MlxEngine(llama), req("off")).tokens
    assert again.speculation.accepted > first.speculation.accepted  # from memory


def test_memory_shares_what_it_finished_and_takes_in_what_is_offered():
    a, b = SuffixMemory(1000), SuffixMemory(1000)
    a.add([1, 2, 3, 4])
    a.add([5, 6, 7], shared=False)  # taken in from elsewhere: not offered again
    out = a.take_finished()
    assert out == [[1, 2, 3, 4]] and a.take_finished() == []
    b.offer(out)
    assert len(b) == 0 and b.stats()["received"] == 1  # taken in at the next request
    assert b.absorb() == 1 and len(b) == 1 and b.take_finished() == []
    off = SuffixMemory(0)  # the draft memory turned off: nothing in, nothing out
    off.offer(out)
    assert off.absorb() == 0 and off.take_finished() == []


def test_what_one_replica_finished_drafts_on_another_and_memory_off_shares_nothing(llama):
    """Two engines of one model as two replicas: what the first finished (decoded plain),
    handed over as the data plane does, is what the second drafts its retry from, counted as
    drafted from received memory, with the same tokens as plain. With the draft memory off
    (`--draft-memory-tokens 0`) an engine has no memory to share: nothing goes out or comes in
    (node/stages.py shares through `info().draft_memory` only)."""
    from skulkp2p.node.engines import mlx_engine
    from skulkp2p.node.stages import LocalPlacements

    a, b = mlx_engine(llama, memory_tokens=4096), mlx_engine(llama, memory_tokens=4096)
    plain = _run(a, _request("Describe a lighthouse at dusk.", "off", 24))
    sent, got = a.info().draft_memory, b.info().draft_memory
    assert sent is not None and got is not None
    got.offer(sent.take_finished())
    retry = _run(b, _request("Describe a lighthouse at dusk.", {"drafter": "lookup",
                                                                 "depth": 6}, 24))
    assert retry.tokens == plain.tokens
    stats = got.stats()
    assert stats["received"] == 1
    assert stats["drafted_received_tokens"] == stats["drafted_tokens"] > 0, stats
    assert retry.speculation.accepted > 0

    off = mlx_engine(llama, memory_tokens=0)
    assert off.info().draft_memory is None
    local = LocalPlacements(None, "llama", "llama", lambda spec: off)
    local.workers["llama"] = SimpleNamespace(engine=off)
    local._took_draft_memory("llama", [list(plain.tokens)])  # a frame in: nowhere to go
    _run(off, _request("Describe a lighthouse at dusk.", {"drafter": "lookup", "depth": 6}, 24))
    assert off.memory.take_finished() == [] and off.memory.stats()["received"] == 0
