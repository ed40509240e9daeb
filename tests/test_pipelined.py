"""Pipelined plain greedy (decode._pipelined with no drafter: step n+1 built while step n
evaluates, as mlx-lm's generate_step) with the prefix cache on and in the batch scheduler: the
same tokens as the round loop and mlx-lm; closed early, the caches end where the round loop's
would (the step built ahead taken back), so the prefix-cache entry kept after it serves the next
turn exactly; a request alone on a batching engine runs pipelined on its own caches and joins
the batch when another request arrives, both decoding what they decode alone."""

from __future__ import annotations

import threading

import mlx.core as mx
import pytest

from skulkp2p.engine.cache.prefix_cache import MB, PrefixCache
from skulkp2p.engine.decode.loop import DecodeStats, decode
from skulkp2p.engine.decode.sampling import SamplingParams, make_rng
from skulkp2p.engine.model.forward import LocalForward
from skulkp2p.engine.runner.generate import stream
from skulkp2p.engine.runner.mlx_engine import MlxEngine
from skulkp2p.formats.pipe_format import parse_request
from tests.helpers.pipelined import ECHO, TRIMMABLE, RoundLoopForward
from tests.helpers.pipelined import loaded as _loaded
from tests.helpers.reference import mlx_lm_tokens


def run_decode(forward, prompt, n, *, history=None, cached=0, take=None):
    """Tokens of a greedy decode of up to n tokens, consuming `take` of them then closing."""
    stats = DecodeStats()
    steps = decode(forward, prompt, SamplingParams(), n, make_rng(0), stats=stats,
                   history=history, cached=cached)
    out = []
    for token in steps:
        out.append(token)
        if take is not None and len(out) == take:
            break
    steps.close()
    return out, stats


@pytest.mark.parametrize("family", TRIMMABLE)
def test_pipelined_with_history_equals_round_loop_and_mlx_lm(tiny_models, family):
    lm = _loaded(tiny_models[family])
    prompt = lm.tokenizer.encode(ECHO)
    history: list[int] = []
    piped, stats = run_decode(LocalForward(lm.model), prompt, 40, history=history)
    loop, loop_stats = run_decode(RoundLoopForward(lm.model), prompt, 40, history=[])
    assert stats.pipelined == 40 and loop_stats.pipelined == 0
    assert piped == loop == mlx_lm_tokens(lm, prompt, 40)
    assert history == prompt + piped


@pytest.mark.parametrize("family", TRIMMABLE)
@pytest.mark.parametrize("take", [1, 7, 40])
def test_closed_early_the_caches_end_where_the_round_loop_ends(tiny_models, family, take):
    """Closed after `take` tokens (a stop string, EOS, a client gone): the caches hold every
    token handed out but the last, bit for bit the round loop's, and the entry kept from them
    serves the next turn: it decodes exactly what a cold run decodes."""
    lm = _loaded(tiny_models[family])
    prompt = lm.tokenizer.encode(ECHO)
    history: list[int] = []
    forward = LocalForward(lm.model)
    out, stats = run_decode(forward, prompt, 40, history=history, take=take)
    assert stats.pipelined == take and history == prompt + out
    assert {c.offset for c in forward.cache} == {len(history) - 1}
    loop_forward = RoundLoopForward(lm.model)
    run_decode(loop_forward, prompt, 40, history=[], take=take)
    for a, b in zip(forward.cache, loop_forward.cache, strict=True):
        n = len(history) - 1
        assert mx.array_equal(a.keys[..., :n, :], b.keys[..., :n, :]).item()
        assert mx.array_equal(a.values[..., :n, :], b.values[..., :n, :]).item()

    cache = PrefixCache(64 * MB)
    assert cache.store(history, forward.cache)
    turn2 = history + lm.tokenizer.encode(" and then", add_special_tokens=False)
    hit = cache.fetch(turn2)
    assert hit is not None and hit.length == len(history) - 1
    warm = LocalForward(lm.model)
    warm.restore(hit.caches, turn2[:hit.length], turn2[:hit.length + 1])
    again: list[int] = []
    resumed, resumed_stats = run_decode(warm, turn2, 24, history=again, cached=hit.length)
    cold, _ = run_decode(LocalForward(lm.model), turn2, 24)
    assert resumed == cold and resumed_stats.pipelined == 24


def _ask(engine: MlxEngine, body: dict):
    gen = engine.generate(parse_request({"max_tokens": 24, "speculation": "off", **body}))
    for _ in gen:
        pass
    return gen.result


def _stream_ids(lm, cache, ids: list[int], max_tokens: int):
    """One greedy request on token ids through the engine's stream, with `cache` (or none)."""
    steps = stream(lm, parse_request({"prompt": "-", "max_tokens": max_tokens}), None, cache,
                   prompt=ids)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


@pytest.mark.parametrize("max_batch", [1, 4])
def test_engine_next_turn_after_a_stopped_pipelined_request(tiny_models, max_batch):
    """Through the MlxEngine with its prefix cache (alone on the model: pipelined, on a batching
    engine too), a request stopped early by a stop string keeps its caches, and the next turn
    restores all of it and decodes what a cold run decodes."""
    lm = _loaded(tiny_models["llama"])
    full = _ask(MlxEngine(lm, 0, memory_tokens=0, max_batch=1), {"prompt": ECHO})
    stop = full.text[len(full.text) // 2:][:3]
    assert stop.strip() and len(full.tokens) == 24
    warm = MlxEngine(lm, 64, memory_tokens=0, max_batch=max_batch)
    r1 = _ask(warm, {"prompt": ECHO, "stop": stop})
    assert r1.finish_reason == "stop" and len(r1.tokens) < 24
    assert r1.tokens == full.tokens[:len(r1.tokens)]
    prompt = lm.tokenizer.encode(ECHO)
    turn2 = prompt + r1.tokens + lm.tokenizer.encode(" and then", add_special_tokens=False)
    hit = _stream_ids(lm, warm.prefix_cache, turn2, 16)
    cold = _stream_ids(lm, None, turn2, 16)
    assert (hit.tokens, hit.text) == (cold.tokens, cold.text)
    # The entry kept at the end of turn 1 holds all of it: nothing of it is prefilled again.
    assert hit.usage.cached_tokens == len(prompt) + len(r1.tokens) - 1
    if max_batch > 1:
        sched = warm.scheduler
        assert sched.lazy_steps > 0 and sched.peak == 0  # alone: never in the batch


@pytest.mark.parametrize("speculation", ["off", "lookup"])
def test_a_lone_row_joins_the_batch_when_another_arrives(tiny_models, speculation):
    """A runs alone on its own caches (plain: pipelined, a step in flight between tokens;
    lookup: verify rounds as on a LocalForward); B arrives while A is paused between two
    tokens: B waits until A has no step in flight, A joins the batch at its next forward, and
    both decode exactly what they decode alone."""
    lm = _loaded(tiny_models["llama"])
    spec = "off" if speculation == "off" else {"drafter": "lookup", "depth": 3}
    reqs = [parse_request({"prompt": ECHO, "max_tokens": 40, "speculation": spec}),
            parse_request({"prompt": "the river the river the bird", "max_tokens": 12,
                           "speculation": spec})]
    alone = []
    for req in reqs:
        gen = MlxEngine(lm, 0, memory_tokens=0, max_batch=1).generate(req)
        list(gen)
        alone.append(gen.result)
    engine = MlxEngine(lm, 0, memory_tokens=0, max_batch=4)
    sched = engine.scheduler
    paused, go = threading.Event(), threading.Event()
    results: list = [None, None]
    errors: list[BaseException] = []

    def run_a() -> None:
        try:
            gen = engine.generate(reqs[0])
            for n, _ in enumerate(gen, start=1):
                if n == 3:
                    paused.set()
                    assert go.wait(60)
            results[0] = gen.result
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def run_b() -> None:
        try:
            gen = engine.generate(reqs[1])
            list(gen)
            results[1] = gen.result
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    a = threading.Thread(target=run_a)
    a.start()
    assert paused.wait(60)
    if speculation == "off":
        assert sched.ahead is not None and sched.lazy_steps >= 3 and not sched.active
    else:
        assert sched.ahead is None and sched.solo_steps >= 1 and not sched.active
    b = threading.Thread(target=run_b)
    with sched.lock:  # B queues for the model while A is paused between tokens
        b.start()
        assert sched.lock.wait_queued(2, timeout=30), "B never queued"
    go.set()
    for t in (a, b):
        t.join(120)
        assert not t.is_alive(), "a request hung"
    assert not errors, errors
    for got, want in zip(results, alone, strict=True):
        assert (got.tokens, got.text) == (want.tokens, want.text)
        if speculation != "off":
            assert got.speculation.drafted == want.speculation.drafted
    if speculation != "off":
        assert results[0].speculation.drafted > 0
    assert sched.peak == 2  # A left its own caches for the batch, beside B
    assert sched.ahead is None and not sched.active and sched.requests == 0
