"""The suffix drafter and the draft memory: the automaton's longest match against a brute-force
search, walks that only propose text that occurred, the memory's bound and LRU, and exactness:
greedy output with the suffix drafter (own text and memory) equals plain, a retried request
drafts from memory and has nearly every draft accepted, and sampled output keeps the target
distribution when the memory holds skewed drafts."""

from __future__ import annotations

import random

import pytest

from skulkp2p.engine.suffix import SuffixAutomaton, SuffixDrafter, SuffixMemory


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


def test_drafter_caps_the_draft_at_the_match_length():
    d = SuffixDrafter()
    d.prepare([5, 6, 7, 8, 9, 10, 11, 5, 6])
    assert d.propose([5, 6, 7, 8, 9, 10, 11, 5, 6], 8)[0] == [7, 8]
    d.observe(0, 0, [7], None)
    assert d.propose([5, 6, 7, 8, 9, 10, 11, 5, 6, 7], 8)[0] == [8, 9, 10]


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
    from skulkp2p.engine.model import load_model

    return load_model(tiny_models["llama"], "llama")


@pytest.mark.parametrize("depth", [1, 3, 6])
def test_suffix_drafter_equals_plain(tiny_models, depth):
    from skulkp2p.engine.decode import DecodeStats, decode
    from skulkp2p.engine.forward import LocalForward
    from skulkp2p.engine.model import load_model
    from skulkp2p.engine.sampling import SamplingParams, make_rng

    for fam in ("llama", "qwen3_5"):
        lm = load_model(tiny_models[fam], fam)
        prompt = lm.tokenizer.encode(ECHO)
        plain = list(decode(LocalForward(lm.model), prompt, SamplingParams(), 48, make_rng(0)))
        stats = DecodeStats()
        spec = list(decode(LocalForward(lm.model), prompt, SamplingParams(), 48, make_rng(0),
                           SuffixDrafter(), depth, stats))
        assert spec == plain, fam
        assert stats.drafted > 0


def _request(content: str, speculation, max_tokens: int = 40):
    from skulkp2p.engine.request import parse_request

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
    from skulkp2p.engine.mlx_engine import MlxEngine

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
    from skulkp2p.engine.mlx_engine import MlxEngine

    saved = llama.speculation
    llama.speculation = {**saved, "lookup": {"memory_tokens": 0}}
    try:
        assert MlxEngine(llama).memory.enabled is False
    finally:
        llama.speculation = saved
    assert MlxEngine(llama).memory.enabled is True


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
    """Sampled output depends on which drafts were offered, so seeded requests never draft from
    memory: the same seed gives the same text on a fresh engine and after other requests."""
    from skulkp2p.engine.mlx_engine import MlxEngine
    from skulkp2p.engine.request import parse_request

    def req():
        return parse_request({"prompt": "Tell me about the sea.", "max_tokens": 24,
                              "temperature": 1.0, "seed": 7,
                              "speculation": {"drafter": "lookup", "depth": 6}})

    engine = MlxEngine(llama, memory_tokens=4096)
    first = _run(engine, req())
    assert _run(engine, req()).tokens == first.tokens == _run(MlxEngine(llama), req()).tokens
