"""A sampled request served as a ROW OF A BATCH emits the target distribution, drafted with a
chain and with a token tree (tests/test_sampling_exactness.py and tests/test_tree_sampling.py
check the same rules through decode() alone; the batch's rows share that code but were only
checked by seeded equality with their solo runs).

Every request goes through the engine (`MlxEngine.generate`: the batching scheduler's rows,
engine/batching/scheduler.py) on a tiny llama (float32, lm_head sharpened so that drafts are often
accepted). Two other requests decode all the while, each restarted when it ends: a greedy one with
the suffix drafter on a code prompt, and a sampled one with top-p and a repetition penalty on
another prompt; so every measured request joins a batch whose other rows have other prompts,
other params and other widths, and which rows come and go around it. The measured requests run
six at a time, each with its own seed, and are drafted by a fixed skewed drafter (the engine's
drafter choice is replaced for them only): depth-3 chains [likely, likely, unlikely], or the
fixed depth-2 tree of tests/helpers/sampled.py. Their first three tokens (N runs) are tested
against the exact joint distribution of plain sampling computed from the model's own rows
(temperature 1, top-k 8: 512 sequences), chi-square at alpha = 1e-3.

Power: with the residual draw of `verify_one` replaced by a draw from p (chains), or the tree
rule replaced by one that never updates the residual (trees), these tests reject with p-values of
6e-78 (chains) and 3e-38 (trees) (checked by temporary patches when this test was written; the
permanent power tests live beside the decode()-only ones). Each test takes 15-20 s here.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import pytest

from skulkp2p.engine.decode.sampling import SamplingParams
from skulkp2p.engine.model.loaded import LoadedModel, load_model
from skulkp2p.engine.runner import generate
from skulkp2p.engine.runner.mlx_engine import MlxEngine
from skulkp2p.formats.pipe_format import parse_request
from tests.helpers.sampled import (
    FixedDrafter,
    FixedTreeDrafter,
    exact_joint,
    fixed_tree,
    joint_fit,
    skewed_sequence,
)

ALPHA = 1e-3
SHARPEN = 3.0
N = 1200
TARGETS = 6  # measured requests in flight at once
PARAMS = SamplingParams(temperature=1.0, top_k=8)
PROMPT = "The morning train"
OTHERS = [  # the other rows: restarted whenever they end, until the measured runs are done
    {"prompt": "def f(x):\n    return x\n\ndef g(x):\n    return", "max_tokens": 48,
     "speculation": {"drafter": "lookup", "depth": 3}},
    {"prompt": "a b c d e f g h a b c d", "max_tokens": 40, "temperature": 0.7, "top_p": 0.9,
     "repetition_penalty": 1.2, "speculation": "off"},
]


@pytest.fixture(scope="module")
def sharp_llama(tiny_models) -> LoadedModel:
    lm = load_model(tiny_models["llama"], "llama-sharp-batch", dtype="float32")
    lm.model.lm_head.weight = lm.model.lm_head.weight * SHARPEN
    mx.eval(lm.model.parameters())
    return lm


def _measured(i: int) -> dict:
    return {"id": f"measured-{i}", "prompt": PROMPT, "max_tokens": 4, "seed": 50_000 + i,
            "temperature": PARAMS.temperature, "top_k": PARAMS.top_k, "speculation": "auto"}


def _served_in_a_batch(lm: LoadedModel, monkeypatch, drafter, depth: int, n: int
                       ) -> tuple[list[tuple[int, ...]], list]:
    """The first three tokens of n measured requests, each a row of a batch (see the module's
    docstring). Asserts every measured request joined the batch and drafted."""
    chosen = generate._choose_drafter

    def choose(loaded, req, prompt, rng, memory=None):
        if str(req.id).startswith("measured-"):
            return drafter, depth, None
        return chosen(loaded, req, prompt, rng, memory)

    monkeypatch.setattr(generate, "_choose_drafter", choose)
    engine = MlxEngine(lm, prefix_cache_mb=0, memory_tokens=0, max_batch=TARGETS + len(OTHERS))
    sched = engine.scheduler
    assert sched is not None
    rows: list[tuple[str, object]] = []  # (the thread's name, its row)
    make_row = sched.forward

    def recorded(*args, **kw):
        row = make_row(*args, **kw)
        rows.append((threading.current_thread().name, row))
        return row

    monkeypatch.setattr(sched, "forward", recorded)
    done = threading.Event()
    errors: list[BaseException] = []
    results: list = [None] * n

    def other(body: dict) -> None:
        try:
            for run in range(10_000):
                if done.is_set():
                    return
                seed = {"seed": run} if "temperature" in body else {}
                list(engine.generate(parse_request({**body, **seed})))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def measured(first: int) -> None:
        try:
            for i in range(first, n, TARGETS):
                gen = engine.generate(parse_request(_measured(i)))
                list(gen)
                results[i] = gen.result
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    others = [threading.Thread(target=other, args=(b,), name=f"other-{j}")
              for j, b in enumerate(OTHERS)]
    for t in others:
        t.start()
    with sched.cond:  # the other rows are in the batch before the first measured request
        assert sched.cond.wait_for(lambda: len(sched.active) == len(OTHERS) or bool(errors),
                                   timeout=60), "the other rows never joined"
    workers = [threading.Thread(target=measured, args=(k,), name=f"measured-{k}")
               for k in range(TARGETS)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(600)
    done.set()
    for t in others:
        t.join(120)
    assert not any(t.is_alive() for t in workers + others), "a request hung"
    assert not errors, errors
    measured_rows = [row for name, row in rows if name.startswith("measured-")]
    assert len(measured_rows) == n
    assert all(row.joined for row in measured_rows), "a measured request decoded alone"
    assert sched.peak >= 3  # a measured row beside both other rows in one forward
    assert all(r.speculation.drafted > 0 for r in results)
    assert all(len(r.tokens) >= 3 for r in results)  # (EOS is outside the support: checked)
    return [tuple(r.tokens[:3]) for r in results], results


@pytest.fixture(scope="module")
def case(sharp_llama):
    from skulkp2p.engine.runner.generate import prompt_tokens

    prompt = prompt_tokens(sharp_llama, parse_request(_measured(0)))
    joint = exact_joint(sharp_llama.model, prompt, PARAMS)
    eos = set(sharp_llama.tokenizer.eos_token_ids)
    assert not any(eos & set(seq) for seq in joint)  # a run always yields three tokens
    return prompt, joint


@pytest.mark.slow
def test_sampled_chain_in_a_batch_matches_the_exact_joint(sharp_llama, case, monkeypatch):
    prompt, joint = case
    drafts = skewed_sequence(sharp_llama.model, prompt, PARAMS)
    samples, _ = _served_in_a_batch(sharp_llama, monkeypatch, FixedDrafter(drafts), 3, N)
    # the drafts were accepted in some runs and rejected in others, and whole chains were kept
    firsts = sum(s[0] == drafts[0] for s in samples)
    assert 0.1 * N < firsts < 0.9 * N
    assert sum(s[:2] == tuple(drafts[:2]) for s in samples) > 0.02 * N
    assert joint_fit(samples, joint) > ALPHA


@pytest.mark.slow
def test_sampled_tree_in_a_batch_matches_the_exact_joint(sharp_llama, case, monkeypatch):
    prompt, joint = case
    tree = fixed_tree(sharp_llama.model, prompt, PARAMS)
    samples, results = _served_in_a_batch(sharp_llama, monkeypatch, FixedTreeDrafter(tree), 2,
                                          N)
    assert all(r.speculation.tree_rounds > 0 for r in results)
    # each root child and a depth-2 node were taken in a fair share of the runs
    firsts = [s[0] for s in samples]
    for child in tree.tokens[:3]:
        assert firsts.count(child) > 0.01 * N
    assert sum(s[:2] == (tree.tokens[0], tree.tokens[3]) for s in samples) > 0.02 * N
    assert joint_fit(samples, joint) > ALPHA
