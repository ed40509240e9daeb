"""Continuous batching of the families whose layers are not all plain KV caches: qwen3_5's
gated-delta layers (a recurrent state per row, restored per row after a rejected verify and the
kept tokens run again) and Gemma 4's sliding-window layers (every row's history, the window in
the mask). Each request decodes exactly what it decodes alone (tokens and text; greedy and
seeded sampling; speculation off, lookup, the family's own drafter), whatever else runs.

The helpers (requests overlapping deterministically, solo runs): tests/helpers/batch.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache

from skulkp2p.engine.cache.batch_cache import RowLengths, RowsArraysCache, RowsKVCache
from skulkp2p.engine.drafting.assistant import load_assistant
from skulkp2p.engine.model.loaded import load_model
from skulkp2p.engine.runner.mlx_engine import MlxEngine
from skulkp2p.formats.pipe_format import parse_request
from tests.helpers import tiny_gemma4
from tests.helpers.batch import PROMPTS, SAMPLINGS, SPECULATION, loaded, requests, solo, together

FAMILIES = ("qwen3_5", "gemma4_text")
WINDOW = 16  # the tiny Gemma 4's sliding window (tests/helpers/tiny_gemma4.py)

_loaded = loaded


@pytest.fixture(scope="module")
def gemma_assistant(tmp_path_factory) -> Path:
    return tiny_gemma4.make_assistant(tmp_path_factory.mktemp("rowstate") / "assistant",
                                      "ordered")


def _same(alone: list, batched: list) -> None:
    for a, b in zip(alone, batched, strict=True):
        assert b.tokens == a.tokens
        assert b.text == a.text
        assert b.finish_reason == a.finish_reason
        assert (b.speculation is None) == (a.speculation is None)
        if a.speculation is not None:
            assert (b.speculation.drafted, b.speculation.accepted) == (
                a.speculation.drafted, a.speculation.accepted)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("spec", list(SPECULATION))
def test_row_state_families_batch_and_match_solo(tiny_model, family, sampling, spec):
    lm = _loaded(tiny_model(family))
    reqs = requests(SAMPLINGS[sampling], SPECULATION[spec])
    alone = solo(MlxEngine(lm, 0, memory_tokens=0, max_batch=1), reqs)
    engine = MlxEngine(lm, 0, memory_tokens=0, max_batch=4)
    assert engine.max_concurrent == 4
    batched = together(engine, reqs)
    _same(alone, batched)
    sched = engine.scheduler
    assert sched.peak == 4 and not sched.active
    if family == "gemma4_text":  # the rows ran past the window: the mask had to cut it
        assert max(r.usage.prompt_tokens + r.usage.completion_tokens for r in batched) > \
            2 * WINDOW
    if spec == "lookup":
        assert sum(r.speculation.drafted for r in batched) > 0 and sched.ragged > 0
        if family == "qwen3_5":
            # Rejected drafts restored a row's recurrent state and ran its kept tokens again,
            # never more than a verify holds (depth 3 + the pending token).
            assert sched.replays > 0 and 0 < sched.replay_peak <= 4


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_qwen3_5_mtp_rows_match_solo(tiny_model, sampling):
    """Each row drafts with its own MTP head, reading its row's hidden states; the random head's
    drafts are nearly all rejected, so nearly every round restores and replays."""
    lm = _loaded(tiny_model("qwen3_5", mtp=True))
    reqs = requests(SAMPLINGS[sampling], {"drafter": "mtp", "depth": 2})
    alone = solo(MlxEngine(lm, 0, memory_tokens=0, max_batch=1), reqs)
    engine = MlxEngine(lm, 0, memory_tokens=0, max_batch=4)
    batched = together(engine, reqs)
    _same(alone, batched)
    assert sum(r.speculation.drafted for r in batched) > 0
    sched = engine.scheduler
    assert sched.peak == 4 and sched.replays > 0 and sched.replay_peak <= 3


@pytest.mark.slow
@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_gemma4_assistant_rows_match_solo(tiny_model, gemma_assistant, sampling):
    """Each row's assistant reads its row's caches (a rotating cache rebuilt from the row)."""
    base = _loaded(tiny_model("gemma4_text"))
    lm = dataclasses.replace(base, assistant=load_assistant(gemma_assistant, base.model,
                                                            mx.float32, block_size=3))
    reqs = requests(SAMPLINGS[sampling], {"drafter": "assistant"})
    alone = solo(MlxEngine(lm, 0, memory_tokens=0, max_batch=1), reqs)
    engine = MlxEngine(lm, 0, memory_tokens=0, max_batch=4)
    batched = together(engine, reqs)
    _same(alone, batched)
    assert sum(r.speculation.drafted for r in batched) > 0
    assert engine.scheduler.peak == 4


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_row_state_prompts_prefilled_together_and_prefix_cache(tiny_model, family, sampling):
    """Prompts longer than the window prefill together in chunks of 8 (ragged rows: recurrent
    state masked past each row's tokens, rotating caches taken out of and back into rows); a
    prefix-cache hit starts one row further on; the next turn hits the entry a batched row left
    (recurrent state kept at the prompt's end, copies of the row at the request's end)."""
    base = _loaded(tiny_model(family))
    lm = dataclasses.replace(base, runtime={**base.runtime, "prefill_step": 8})
    prompts = [PROMPTS[0] + " four five six seven eight", " ".join(PROMPTS),
               PROMPTS[2] + " " + PROMPTS[3], PROMPTS[1]]
    params = SAMPLINGS[sampling]
    reqs = [parse_request({"prompt": p, "max_tokens": 12, **params,
                           "speculation": {"drafter": "lookup", "depth": 3},
                           **({"seed": 3 + i} if params else {})})
            for i, p in enumerate(prompts)]
    cold = MlxEngine(lm, 0, memory_tokens=0, max_batch=1)
    alone = solo(cold, reqs)
    engine = MlxEngine(lm, 64, memory_tokens=0, max_batch=4)
    solo(engine, [parse_request({"prompt": prompts[0], "max_tokens": 2})])
    batched = together(engine, reqs)
    _same(alone, batched)
    assert batched[0].usage.cached_tokens > 0
    assert engine.scheduler.prefill_peak >= 2  # prompts ran in one forward
    follow = parse_request({"prompt": prompts[1] + batched[1].text + " again",
                            "max_tokens": 12})
    again = together(engine, [follow, *requests({}, "off", 2)])
    assert again[0].usage.cached_tokens > 0
    assert again[0].tokens == solo(cold, [follow])[0].tokens


def test_a_row_takes_back_only_its_own_recurrent_state():
    rows = RowsArraysCache(2)
    for i in range(3):
        single = ArraysCache(2)
        single[0] = mx.full((1, 2, 3), float(i))
        single[1] = mx.full((1, 4), float(10 + i))
        rows.append_row(single)
    rows.begin_step([1, 1, 1])
    rows[0] = rows[0] + 100  # what a step does: the layer puts new arrays in
    rows[1] = rows[1] + 100
    rows.restore_row(1)
    assert rows[0][:, 0, 0].tolist() == [100.0, 1.0, 102.0]
    assert rows[1][:, 0].tolist() == [110.0, 11.0, 112.0]
    rows.keep_rows([0, 2])  # a row leaves: the states from before the step follow the rows
    rows.restore_row(1)
    assert rows[0][:, 0, 0].tolist() == [100.0, 2.0]
    assert rows[1][:, 0].tolist() == [110.0, 12.0]


def test_sliding_window_mask_shows_each_row_its_own_window():
    rows = RowLengths()
    rows.set([3, 6])
    mask = RowsKVCache(rows, window=4).make_mask(2, window_size=4)
    # Row 0's queries sit at positions 3 and 4, row 1's at 6 and 7: each sees its last 4 keys.
    assert mask[0, 0].tolist() == [[i <= 3 for i in range(8)], [1 <= i <= 4 for i in range(8)]]
    assert mask[1, 0].tolist() == [[3 <= i <= 6 for i in range(8)],
                                   [4 <= i <= 7 for i in range(8)]]
    # Once every row is past the window, the keys handed out (and masked) start where the
    # earliest window does: position 3 here, column 0 of the mask.
    rows.set([6, 9])
    layer = RowsKVCache(rows, window=4)
    mask = layer.make_mask(2, window_size=4)
    assert mask.shape == (2, 1, 2, 11 - 3)
    assert mask[0, 0].tolist() == [[3 <= i <= 6 for i in range(3, 11)],
                                   [4 <= i <= 7 for i in range(3, 11)]]
    keys = mx.zeros((2, 1, 2, 8))
    fetched, _ = layer.update_and_fetch(keys, keys)
    assert fetched.shape[2] == 11 - 3


def test_a_model_loaded_on_one_thread_decodes_on_another(tiny_model, gemma_assistant):
    """An agent loads its model on one thread and runs requests on others. MLX binds a lazy
    array to the stream of the thread that built it, so everything the model and its assistant
    hold must be evaluated at load, not only their parameters: Gemma's rope keeps `_freqs`
    outside them, and a request thread then failed with "There is no Stream(cpu, 1) in current
    thread" (a real `join` did, tests/test_gemma4_rings.py)."""
    import threading

    mx.eval(mx.ones(2) + 1)  # this thread has a stream of its own, as an agent's main thread
    loaded: dict = {}
    results: dict = {}

    def load() -> None:
        lm = load_model(tiny_model("gemma4_text"), "gemma4-tiny", dtype="float32")
        lm = dataclasses.replace(lm, assistant=load_assistant(gemma_assistant, lm.model,
                                                              mx.float32))
        loaded["engine"] = MlxEngine(lm, 64, max_batch=4)

    def run(speculation) -> None:
        try:
            gen = loaded["engine"].generate(parse_request(
                {"prompt": PROMPTS[0], "max_tokens": 6, "speculation": speculation}))
            list(gen)
            results[str(speculation)] = gen.result.tokens
        except Exception as e:  # noqa: BLE001 - asserted below
            results[str(speculation)] = e

    for target, args in ((load, ()), (run, ("off",)), (run, ({"drafter": "assistant"},))):
        thread = threading.Thread(target=target, args=args)
        thread.start()
        thread.join(120)
        assert not thread.is_alive()
    assert all(isinstance(tokens, list) and len(tokens) == 6 for tokens in results.values()), \
        results


@pytest.mark.slow
@pytest.mark.parametrize("spec", list(SPECULATION))
def test_sliding_window_rows_keep_only_their_window(tiny_model, spec):
    """A batch that runs long: each sliding-window row drops the positions no query can see any
    more (RowsKVCache.trim), so its buffer stays about a window wide, not its whole history, and
    every request still decodes exactly what it decodes alone (rollbacks of rejected drafts
    included). One prompt is long: its row joins holding only its last window."""
    from skulkp2p.engine.cache.batch_cache import STEP

    lm = _loaded(tiny_model("gemma4_text"))
    long_prompt = " ".join(["the river runs by the old mill and the bird sings"] * 40)
    prompts = [(long_prompt, 40), (PROMPTS[0], STEP + 4 * WINDOW), (PROMPTS[1], STEP + 60)]
    reqs = [parse_request({"id": i, "prompt": p, "max_tokens": n, "speculation":
                           SPECULATION[spec], "temperature": 0.8, "seed": 7 + i})
            for i, (p, n) in enumerate(prompts)]
    alone = solo(MlxEngine(lm, 0, memory_tokens=0, max_batch=1), reqs)
    engine = MlxEngine(lm, 0, memory_tokens=0, max_batch=3)
    sched = engine.scheduler
    held: list[int] = []  # the widest window buffer before each step, and its rows' lengths
    step = sched._step

    def watched() -> None:
        step()
        held.extend(layer.keys.shape[2] for layer in sched.window_layers
                    if layer.keys is not None)
    sched._step = watched
    batched = together(engine, reqs)
    _same(alone, batched)
    assert alone[0].usage.prompt_tokens > STEP + WINDOW  # (the long row joined past a STEP)
    longest = max(r.usage.prompt_tokens + r.usage.completion_tokens for r in batched[1:])
    assert longest > STEP + 2 * WINDOW, "no row ran long enough to drop positions"
    assert sched.window_layers and all(layer.trims > 0 for layer in sched.window_layers)
    # Never more than the window, the slack trim allows and a buffer's step of growth; without
    # trimming the long prompt's row alone would have made it its whole length.
    assert max(held) <= WINDOW + 2 * STEP < alone[0].usage.prompt_tokens + 40
