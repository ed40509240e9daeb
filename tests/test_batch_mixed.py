"""Mixed steps (engine/batching/row_forward.py: RowForward.mixes): a prompt that joins while rows decode
prefills inside their steps, one chunk per step, and the prompts of a burst release their first
tokens forward by forward (narrowest first), not after every prompt is in. Every request still
decodes exactly what it decodes alone (greedy and seeded), the rows keep decoding while a long
prompt goes in, and a request cancelled while its prompt rides leaves within a step."""

from __future__ import annotations

import threading

import pytest

from skulkp2p.engine.batching import scheduler
from skulkp2p.engine.runner.mlx_engine import MlxEngine
from skulkp2p.formats.pipe_format import parse_request
from skulkp2p.runtime.worker import Finished
from tests.helpers.batch import (
    PROMPTS,
    SAMPLINGS,
    SPECULATION,
    drain,
    loaded,
    run_queued,
    solo,
    together,
    worker_run,
)
from tests.helpers.loaded import smollm2_float32

LONG = " ".join(PROMPTS * 3)  # a prompt of many mixed chunks


def _requests(sampling: dict, spec, long_first: bool = False) -> list:
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], LONG]
    if long_first:
        prompts = [LONG, *prompts[:3]]
    return [parse_request({"id": i, "prompt": p, "max_tokens": 24 + 4 * i, "speculation": spec,
                           **sampling, **({"seed": 11 + i} if sampling else {})})
            for i, p in enumerate(prompts)]


def _engine(lm, max_batch: int, chunk: int = 8) -> MlxEngine:
    engine = MlxEngine(lm, 0, memory_tokens=0, max_batch=max_batch)
    assert engine.scheduler is not None
    engine.scheduler.mixed_chunk = chunk
    return engine


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("spec", list(SPECULATION))
def test_long_prompt_rides_in_decode_steps_and_matches_solo(tiny_models, family, sampling, spec,
                                                            monkeypatch):
    monkeypatch.setattr(scheduler, "PACK_MLPS_FROM", 0)  # every ragged step packed, however little
    lm = loaded(tiny_models[family])
    reqs = _requests(SAMPLINGS[sampling], SPECULATION[spec])
    alone = solo(MlxEngine(lm, 0, memory_tokens=0, max_batch=1), reqs)
    engine = _engine(lm, 4)
    sched = engine.scheduler
    batched = together(engine, reqs)
    for a, b in zip(alone, batched, strict=True):
        assert b.tokens == a.tokens
        assert b.text == a.text
        assert b.finish_reason == a.finish_reason
    # The three short prompts prefilled first (one forward) and decoded; the long one's prompt
    # went in as 8-token chunks inside their steps.
    long_prompt = len(lm.tokenizer.encode(LONG)) - 1  # (the last token is the first verify's)
    assert sched.mixed_tokens == long_prompt
    assert sched.mixed_steps == -(-long_prompt // 8)
    assert sched.peak == 4 and not sched.active


def test_first_tokens_leave_before_a_long_prompt_is_in(tiny_models):
    """Four prompts arrive together, the long one first: the short ones' first tokens go out
    before the long prompt's prefill ends (told by the scheduler's count of its tokens that went
    in, read at each first token), and the short rows decode while it goes in."""
    lm = loaded(tiny_models["llama"])
    reqs = _requests({}, "off", long_first=True)
    engine = _engine(lm, 4)
    sched = engine.scheduler
    long_prompt = len(lm.tokenizer.encode(LONG)) - 1
    at_first: dict[int, int] = {}  # request -> long prompt tokens in when its first token left
    produced: dict[int, int] = {}
    seen: list[int] = []
    lock = threading.Lock()

    def go(i: int) -> None:
        gen = engine.generate(reqs[i])
        for _ in gen:
            with lock:
                if i not in at_first:
                    at_first[i] = sched.mixed_tokens
                    # tokens the short rows had produced when the long one got its first
                    produced[i] = len(seen)
                seen.append(i)

    run_queued(sched, go, len(reqs))
    assert len(at_first) == 4
    for i in (1, 2, 3):
        assert at_first[i] < long_prompt  # before the long prompt was in
    assert at_first[0] == long_prompt
    chunks = -(-long_prompt // 8)
    assert produced[0] >= 3 * (chunks - 1)  # the short rows decoded while it went in


def test_rows_wait_for_a_free_row_first_come_first_served(tiny_models):
    """max_batch 2 and four requests: a prompt rides only in a free row; the others prefill on
    their own and wait; every request completes exactly."""
    lm = loaded(tiny_models["llama"])
    reqs = _requests({}, "off")
    alone = solo(MlxEngine(lm, 0, memory_tokens=0, max_batch=1), reqs)
    engine = _engine(lm, 2)
    batched = together(engine, reqs)
    for a, b in zip(alone, batched, strict=True):
        assert b.tokens == a.tokens
    assert engine.scheduler.peak == 2 and not engine.scheduler.active


def test_cancel_while_the_prompt_rides_frees_the_row(tiny_models):
    """A request cancelled while its prompt is going in inside the decoding row's steps leaves
    the batch within a step; the decoding row goes on and decodes what it decodes alone."""

    lm = loaded(tiny_models["llama"])
    long_prompt = " ".join(PROMPTS * 12)
    engine = _engine(lm, 2, chunk=4)
    sched = engine.scheduler
    first = parse_request({"prompt": PROMPTS[0], "max_tokens": 60})
    alone = solo(MlxEngine(lm, 0, memory_tokens=0, max_batch=1), [first])

    async def body(worker):
        a = worker.submit(first)
        event = await a.next(60)  # a decodes
        assert event is not None
        b = worker.submit(parse_request({"prompt": long_prompt, "max_tokens": 5}))
        with sched.cond:
            assert sched.cond.wait_for(lambda: any(r.prefilling for r in sched.active), 60)
            at = sched.steps
            b.cancel()
            # (a cancelled job sends nothing more: its row leaving is what tells)
            assert sched.cond.wait_for(lambda: len(sched.leaves) == 1, 60)
            left = sched.leaves[0]
            assert not any(r.prefilling for r in sched.active)
        tokens, done = await drain(a)
        return at, left, tokens, done

    at, left, tokens, done = worker_run(engine, body)
    assert isinstance(done, Finished) and tokens == alone[0].tokens
    assert sched.mixed_steps > 0
    assert left - at <= 1  # b's row left within a step of the cancel
    assert not sched.active


@pytest.mark.slow
def test_real_model_long_chat_joins_decoding_rows_exactly():
    """SmolLM2-135M: three short chat requests (greedy and seeded) decode while the bench's
    long echo prompt goes in inside their steps; each gives what it gives alone. (12 tokens
    each: the echo prompt's 6 chunks of 64 all ride in the short rows' steps, asserted.)"""
    from skulkp2p.bench.workloads import WORKLOADS
    from skulkp2p.engine.runner.generate import prompt_tokens

    lm = smollm2_float32()
    msgs = [[{"role": "user", "content": "Name three rivers in Europe."}],
            [{"role": "user", "content": "Write a haiku about rain."}],
            [{"role": "user", "content": "Explain what a linked list is."}],
            WORKLOADS["echo"]]
    reqs = [parse_request({"messages": m, "max_tokens": 12, "speculation": "off",
                           **({"temperature": 0.7, "seed": i} if i % 2 else {})})
            for i, m in enumerate(msgs)]
    alone = solo(MlxEngine(lm, 0, memory_tokens=0, max_batch=1), reqs)
    engine = _engine(lm, 4, chunk=64)  # (mixed steps are off by default)
    batched = together(engine, reqs)
    for a, b in zip(alone, batched, strict=True):
        assert b.tokens == a.tokens and b.text == a.text
    # The whole echo prompt (but the token its first verify takes) went in inside the short
    # rows' steps, one 64-token chunk a step: they were still decoding until it was in.
    long_prompt = len(prompt_tokens(lm, reqs[3])) - 1
    assert engine.scheduler.mixed_tokens == long_prompt
    assert engine.scheduler.mixed_steps == -(-long_prompt // 64) > 1
