"""The prefix cache (engine/cache/prefix_cache.py): a request that reuses an earlier request's caches
decodes exactly what a cold engine decodes (tokens and text, greedy and seeded sampling), for
attention-only and hybrid recurrent-state models, with the MTP head's own cache (same drafts),
and on pipeline rings (each stage restores its own entries; a stage that misses makes the ring
prefill everything). Also: longest-prefix lookup, trimming, LRU eviction in bytes, and that a
request never changes the entry it reused."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from skulkp2p.engine.cache.prefix_cache import MB, PrefixCache
from skulkp2p.engine.decode.loop import decode
from skulkp2p.engine.decode.sampling import SamplingParams, make_rng
from skulkp2p.engine.drafting.prompt_lookup import PromptLookup
from skulkp2p.engine.model.forward import LocalForward
from skulkp2p.engine.model.loaded import load_model
from skulkp2p.engine.model.stage import StageModel, StageSpan
from skulkp2p.engine.parallel.ring.traversal import InProcessLink, RingForward, StageWorker
from skulkp2p.engine.runner.generate import prompt_tokens, stream
from skulkp2p.engine.runner.mlx_engine import MlxEngine
from skulkp2p.formats.openai_chat import usage_json
from skulkp2p.formats.pipe_format import parse_request, result_json
from tests.helpers.tiny_model import make_tiny_model

FAMILIES = ("llama", "qwen3", "qwen3_5")
DOC = ("def area(w, h):\n    return w * h\n\n" * 12
       + "The survey counted birds along the river every spring. " * 14)
SAMPLINGS = {"greedy": {"temperature": 0}, "sampled": {"temperature": 0.8, "top_p": 0.95,
                                                       "seed": 11}}
MAX_TOKENS = 16


_models: dict[Path, object] = {}


def _loaded(path: Path, name: str):
    if path not in _models:
        _models[path] = load_model(path, name, dtype="float32")
    return _models[path]


@pytest.fixture(scope="module")
def mtp_models(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("prefix-mtp")
    return {fam: make_tiny_model(fam, base / fam, seed=0, mtp=True)
            for fam in ("llama", "qwen3_5")}


def run_ids(lm, cache: PrefixCache | None, prompt: list[int], **body):
    """One request on `prompt` (token ids) through the engine's own stream."""
    req = parse_request({"prompt": "-", "max_tokens": MAX_TOKENS, **body})
    steps = stream(lm, req, None, cache, prompt=prompt)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def spec_of(result):
    s = result.speculation
    return None if s is None else (s.drafter, s.drafted, s.accepted, s.acceptance_per_position)


def conversation(lm) -> dict[str, list[int]]:
    enc = lm.tokenizer.encode
    a = enc(DOC + "\nQuestion: what does area return?\nAnswer:")
    b = enc(DOC + "\nQuestion: where were the birds counted?\nAnswer:")
    return {"a": a, "b": b, "more": enc(" Thanks. One more question: why spring?\nAnswer:")}


def check_conversation(lm, body: dict, trims: bool):
    """Turn 1, turn 2 (turn 1's prompt and answer and more), another question on the same
    document, and turn 1 again: each equals a cold run, and says how much came from the cache."""
    cache = PrefixCache(64 * MB)
    p = conversation(lm)
    r1 = run_ids(lm, cache, p["a"], **body)  # an empty cache: this is a cold run
    assert r1.usage.cached_tokens == 0
    turn2 = p["a"] + r1.tokens + p["more"]
    r2 = run_ids(lm, cache, turn2, **body)
    cold2 = run_ids(lm, None, turn2, **body)
    assert (r2.tokens, r2.text) == (cold2.tokens, cold2.text)
    assert spec_of(r2) == spec_of(cold2)
    if r1.finish_reason == "length":  # the entry kept at the end of turn 1 holds all of it
        assert r2.usage.cached_tokens == len(p["a"]) + len(r1.tokens) - 1
    else:
        assert r2.usage.cached_tokens >= len(p["a"]) - 1
    rb = run_ids(lm, cache, p["b"], **body)
    coldb = run_ids(lm, None, p["b"], **body)
    assert (rb.tokens, rb.text, spec_of(rb)) == (coldb.tokens, coldb.text, spec_of(coldb))
    common = next(i for i, (x, y) in enumerate(zip(p["a"], p["b"], strict=False)) if x != y)
    # Caches that trim serve the shared document; recurrent state only its own boundaries.
    assert (rb.usage.cached_tokens >= common - 2) if trims else rb.usage.cached_tokens == 0
    again = run_ids(lm, cache, p["a"], **body)
    assert (again.tokens, again.text, spec_of(again)) == (r1.tokens, r1.text, spec_of(r1))
    assert again.usage.cached_tokens >= len(p["a"]) - 2
    return cache


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("spec", ["off", "lookup"])
@pytest.mark.parametrize("family", FAMILIES)
def test_hits_decode_what_a_cold_engine_decodes(tiny_models, family, spec, sampling):
    lm = _loaded(tiny_models[family], family)
    speculation = "off" if spec == "off" else {"drafter": "lookup", "depth": 3}
    cache = check_conversation(lm, {"speculation": speculation, **SAMPLINGS[sampling]},
                               trims=family != "qwen3_5")
    assert cache.hits == (3 if family != "qwen3_5" else 2)


@pytest.mark.slow
@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("spec", ["mtp", "auto"])
@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_mtp_head_cache_is_restored_too(mtp_models, family, spec, sampling):
    """With the MTP head drafting, a hit drafts exactly what a cold run drafts (same rounds,
    drafts and acceptance per position): the head's own cache came back with the trunk's."""
    lm = _loaded(mtp_models[family], family)
    speculation = "auto" if spec == "auto" else {"drafter": "mtp", "depth": 2}
    check_conversation(lm, {"speculation": speculation, **SAMPLINGS[sampling]},
                       trims=family != "qwen3_5")


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_engine_reports_cached_tokens_on_a_chat(tiny_models, family):
    """Through the MlxEngine (chat template, the engine's own cache): turn 2 of a chat reuses
    turn 1 and decodes what a cold engine decodes; 0 MB turns the cache off."""
    lm = _loaded(tiny_models[family], family)
    warm, cold = MlxEngine(lm, prefix_cache_mb=32), MlxEngine(lm, prefix_cache_mb=0)
    assert cold.prefix_cache is None

    def ask(engine, messages):
        g = engine.generate(parse_request({"messages": messages, "max_tokens": 12}))
        for _ in g:
            pass
        return g.result

    turn1 = [{"role": "system", "content": DOC}, {"role": "user", "content": "Summarise."}]
    r1 = ask(warm, turn1)
    n1 = len(prompt_tokens(lm, parse_request({"messages": turn1})))
    turn2 = turn1 + [{"role": "assistant", "content": r1.text},
                     {"role": "user", "content": "Shorter, please."}]
    r2, c2 = ask(warm, turn2), ask(cold, turn2)
    assert (r2.tokens, r2.text) == (c2.tokens, c2.text)
    assert r2.usage.cached_tokens >= n1 - 1 and c2.usage.cached_tokens == 0
    assert result_json(r2, 1, "m")["usage"]["cached_tokens"] == r2.usage.cached_tokens
    assert usage_json(r2.usage)["prompt_tokens_details"] == {
        "cached_tokens": r2.usage.cached_tokens}
    assert warm.info().detail["prefix_cache"]["hits"] == 1


# --- the cache itself -------------------------------------------------------------------


def filled(lm, tokens: list[int]) -> list:
    """The caches after the model ran every token but the last (what an entry holds)."""
    fwd = LocalForward(lm.model)
    fwd.prefill(tokens[:-1])
    return fwd.cache


def test_longest_prefix_trimming_and_lru_in_bytes(tiny_models):
    lm = _loaded(tiny_models["llama"], "llama")
    rng = np.random.default_rng(0)
    doc = [int(t) for t in rng.integers(3, 500, 300)]
    a, b = doc + [7, 8, 9], doc[:200]
    cache = PrefixCache(64 * MB)
    assert cache.store(a, filled(lm, a)) and cache.nbytes > 0
    # A prompt that extends the key restores all the entry holds; one that leaves it at 250
    # gets it trimmed to 249 positions; a prompt equal to the key leaves its last token.
    assert cache.fetch(a + [1, 2]).length == len(a) - 1
    hit = cache.fetch(doc[:250] + [1, 2, 3])
    assert hit.length == 249 and all(c.offset == 249 for c in hit.caches)
    assert cache.fetch(a).length == len(a) - 1
    assert cache.fetch([1, 2, 3]) is None and cache.misses == 1
    # A longer trimmable entry makes its prefixes redundant (trimmed, it serves them).
    cache.store(b, filled(lm, b))
    assert len(cache) == 2
    cache.store(a + [5, 6], filled(lm, a + [5, 6]))
    assert len(cache) == 1 and cache.fetch(b + [9]).length == len(b) - 1
    # Least recently used out first, counted in bytes: room for two entries, not three.
    x, y, z = ([int(t) for t in rng.integers(3, 500, 150)] for _ in range(3))
    size = PrefixCache(64 * MB)
    size.store(x, filled(lm, x))
    small = PrefixCache(2 * size.nbytes + size.nbytes // 2)
    for key in (x, y):
        assert small.store(key, filled(lm, key))
    assert small.fetch(x + [1]) is not None  # x used last: y is the least recently used
    small.store(z, filled(lm, z))
    assert len(small) == 2 and small.nbytes <= small.max_bytes
    assert small.fetch(y + [1]) is None
    assert small.fetch(x + [1]) is not None and small.fetch(z + [1]) is not None
    # An entry bigger than the whole cache is not kept; 0 MB is no cache at all.
    assert not PrefixCache(size.nbytes // 2).store(x, filled(lm, x))
    with pytest.raises(ValueError):
        PrefixCache(0)


def test_caches_that_cannot_trim_serve_their_own_boundary_only(tiny_models):
    lm = _loaded(tiny_models["qwen3_5"], "qwen3_5")
    rng = np.random.default_rng(1)
    a = [int(t) for t in rng.integers(3, 500, 120)]
    cache = PrefixCache(64 * MB)
    cache.store(a, filled(lm, a))
    assert cache.fetch(a + [3, 4]).length == len(a) - 1
    assert cache.fetch(a[:100] + [3, 4]) is None  # recurrent state cannot go back to 99
    # A ring stage asks for an exact length: the boundary, or nothing.
    assert cache.fetch(a, want=len(a) - 1) is not None
    assert cache.fetch(a[:50], want=49) is None


def test_an_entry_never_changes_when_a_request_reuses_it(tiny_models):
    lm = _loaded(tiny_models["qwen3_5"], "qwen3_5")
    prompt = lm.tokenizer.encode(DOC)
    cache = PrefixCache(64 * MB)
    cache.store(prompt, filled(lm, prompt))

    def arrays(hit):
        out = []
        for c in hit.caches:
            state = (c.keys[..., :c.offset, :], c.values[..., :c.offset, :]) if hasattr(
                c, "keys") else [x for x in c.state[0] if x is not None]
            out += [np.array(x) for x in state]
        return out

    before = arrays(cache.fetch(prompt + [5]))
    for _ in range(2):  # decode on restored caches: appends, snapshots, rollbacks
        hit = cache.fetch(prompt + [5])
        fwd = LocalForward(lm.model)
        fwd.restore(hit.caches, prompt[:hit.length], prompt[:hit.length + 1])
        out = list(decode(fwd, prompt + [5], SamplingParams(), 24, make_rng(0), PromptLookup(),
                          4, cached=hit.length))
        assert len(out) == 24
    after = arrays(cache.fetch(prompt + [5]))
    assert all(np.array_equal(x, y) for x, y in zip(before, after, strict=True))


def test_mtp_rows_limit_what_an_mtp_request_restores(mtp_models):
    """An entry whose head stopped following (fewer MTP rows than positions) serves MTP
    requests up to its rows where the caches trim, and not at all where they cannot."""
    for family, trims in (("llama", True), ("qwen3_5", False)):
        lm = _loaded(mtp_models[family], family)
        head = lm.mtp
        rng = np.random.default_rng(2)
        a = [int(t) for t in rng.integers(3, 500, 80)]
        fwd = LocalForward(lm.model, hidden=head.conventions.hidden)
        fwd.prefill(a[:-1])
        mtp_cache = head.make_cache()
        head(fwd.last_hidden[:60], mx.array(a[1:61]), mtp_cache)  # rows 0..59 of 79
        cache = PrefixCache(64 * MB)
        cache.store(a, fwd.cache, mtp_cache, fwd.last_hidden[59])
        assert cache.fetch(a + [1]).length == len(a) - 1  # a plain request: all of it
        hit = cache.fetch(a + [1], mtp=True)
        if trims:
            assert hit.length == 60 and hit.mtp.offset == 59 and hit.mtp_hidden is not None
        else:
            assert hit is None


# --- rings --------------------------------------------------------------------------------


def ring_engine(path: Path, family: str, mb: float = 64) -> tuple[MlxEngine, list]:
    """A 3-stage in-process ring (frames through the wire codec); every stage with its own
    prefix cache."""
    spans = [StageSpan(0, 1, 4), StageSpan(1, 3, 4), StageSpan(3, 4, 4)]
    parts = [load_model(path, family, dtype="float32", span=s) for s in spans]
    workers = [StageWorker(StageModel(p.model, p.span), 1,
                           PrefixCache(int(mb * MB)) if mb else None) for p in parts[:-1]]
    link = InProcessLink(workers)
    last = parts[-1]
    n = iter(range(10 ** 6))
    last.make_forward = lambda req, hidden, interrupt: RingForward(
        StageModel(last.model, last.span), link, term=1, instance="i", request=f"r{next(n)}",
        hidden=hidden, interrupt=interrupt, prefill_step=64)
    return MlxEngine(last, prefix_cache_mb=mb), workers


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_ring_stages_restore_their_own_entries(mtp_models, family):
    lm = _loaded(mtp_models[family], family)
    engine, workers = ring_engine(mtp_models[family], family)
    cold_ring, _ = ring_engine(mtp_models[family], family, mb=0)
    p = conversation(lm)
    for body in ({"speculation": "off"}, {"speculation": {"drafter": "mtp", "depth": 2}},
                 {"speculation": {"drafter": "lookup", "depth": 3}, **SAMPLINGS["sampled"]}):
        for w in workers:
            w.prefix_cache.clear()
        engine.prefix_cache.clear()
        r1 = run_ids(engine.loaded, engine.prefix_cache, p["a"], **body)
        turn2 = p["a"] + r1.tokens + p["more"]
        r2 = run_ids(engine.loaded, engine.prefix_cache, turn2, **body)
        want = run_ids(cold_ring.loaded, None, turn2, **body)
        if body.get("temperature", 0) == 0:  # greedy: a single node decodes the same
            assert want.tokens == run_ids(lm, None, turn2, **body).tokens
        assert (r2.tokens, r2.text, spec_of(r2)) == (want.tokens, want.text, spec_of(want))
        assert r2.usage.cached_tokens >= len(p["a"]) - 1
        assert all(w.prefix_cache.hits >= 1 for w in workers)
        # A stage that lost its entries says so: the ring prefills everything, same answer.
        workers[1].prefix_cache.clear()
        miss = run_ids(engine.loaded, engine.prefix_cache, turn2, **body)
        assert miss.usage.cached_tokens == 0
        assert (miss.tokens, miss.text) == (want.tokens, want.text)
        assert all(not w.sessions for w in workers)  # every request's session ended
