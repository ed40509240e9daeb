"""Pipeline rings: stages hold only their layers; a ring of 2 or 3 stages decodes exactly what a
single node decodes (plain, prompt lookup, MTP; dense and hybrid recurrent-state models; greedy
and seeded sampling); stale and unknown frames are dropped."""

from __future__ import annotations

from pathlib import Path

import pytest

from skulkp2p.engine.decode import DecodeStats, decode
from skulkp2p.engine.drafters import PromptLookup
from skulkp2p.engine.forward import LocalForward
from skulkp2p.engine.generate import load_model
from skulkp2p.engine.mtp import MtpDrafter
from skulkp2p.engine.ring import (
    InProcessLink,
    RingError,
    RingForward,
    StageWorker,
    header,
)
from skulkp2p.engine.sampling import SamplingParams, make_rng
from skulkp2p.engine.stage import StageModel, StageSpan, param_bytes
from tools.make_tiny_model import make_tiny_model

ECHO = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(a,"
SPLITS = {2: [(0, 2), (2, 4)], 3: [(0, 1), (1, 3), (3, 4)]}
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("ring")
    return {"llama": make_tiny_model("llama", base / "llama", seed=0, mtp=True),
            "qwen3_5": make_tiny_model("qwen3_5", base / "qwen3_5", seed=0)}


_loaded: dict = {}


def full(path: Path):
    if (path, None) not in _loaded:
        _loaded[(path, None)] = load_model(path, path.name, dtype="float32")
    return _loaded[(path, None)]


def stages(path: Path, n: int):
    key = (path, n)
    if key not in _loaded:
        total = len(full(path).model.layers)
        spans = [StageSpan(a, b if b < 4 else total, total) for a, b in SPLITS[n]]
        _loaded[key] = [load_model(path, path.name, dtype="float32", span=s) for s in spans]
    return _loaded[key]


def ring_forward(parts, hidden=None, request="r1", term=3) -> RingForward:
    workers = [StageWorker(StageModel(p.model, p.span), term) for p in parts[:-1]]
    last = parts[-1]
    return RingForward(StageModel(last.model, last.span), InProcessLink(workers), term=term,
                       instance="i1", request=request, hidden=hidden, prefill_step=7)


def run(fwd, lm, drafter=None, depth=0, params=None, seed=0, stats=None):
    prompt = lm.tokenizer.encode(ECHO)
    return list(decode(fwd, prompt, params or SamplingParams(), MAX_TOKENS, make_rng(seed),
                       drafter, depth, stats))


def test_stage_holds_only_its_layers(models):
    path = models["llama"]
    whole = full(path)
    total = len(whole.model.layers)
    parts = stages(path, 3)
    layer_keys = {p.span: {k.split(".")[2] for k, _ in _flat(p.model) if ".layers." in k}
                  for p in parts}
    for p in parts:
        assert layer_keys[p.span] == {str(i) for i in range(p.span.end - p.span.start)}
        assert len(p.model.layers) == p.span.end - p.span.start
        names = {k for k, _ in _flat(p.model)}
        assert any("embed_tokens" in k for k in names) == (p.span.first or p.span.last)
        assert any(k.endswith("norm.weight") and ".layers." not in k for k in names) == \
            p.span.last
        assert (p.mtp is not None) == p.span.last
    held = [param_bytes(p.model) for p in parts]
    # The middle stage (2 layers, no embedding, no head) holds far less than the whole model.
    assert held[1] < param_bytes(whole.model) / 2
    assert sum(held) < param_bytes(whole.model) * 1.6  # the last stage re-holds the embedding
    assert total == 4


def _flat(model):
    from mlx.utils import tree_flatten
    return tree_flatten(model.parameters())


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_ring_plain_and_lookup_equal_single_node(models, family, n):
    lm = full(models[family])
    plain = run(LocalForward(lm.model), lm)
    parts = stages(models[family], n)
    assert run(ring_forward(parts), lm) == plain
    stats = DecodeStats()
    assert run(ring_forward(parts), lm, PromptLookup(), 4, stats=stats) == plain
    assert stats.drafted > 0 and 0 < stats.accepted < stats.drafted  # rollbacks happened


@pytest.mark.parametrize("n", [2, 3])
def test_ring_mtp_equals_single_node(models, n):
    lm = full(models["llama"])
    plain = run(LocalForward(lm.model), lm)
    parts = stages(models["llama"], n)
    head = parts[-1].mtp
    stats = DecodeStats()
    got = run(ring_forward(parts, hidden=head.conventions.hidden), lm, MtpDrafter(head), 2,
              stats=stats)
    assert got == plain
    assert stats.drafted > 0


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_ring_seeded_sampling_equals_single_node(models, family):
    lm = full(models[family])
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=5)
    single = run(LocalForward(lm.model), lm, PromptLookup(), 3, params=params, seed=5)
    ring = run(ring_forward(stages(models[family], 2)), lm, PromptLookup(), 3, params=params,
               seed=5)
    assert ring == single


def test_stale_term_and_unknown_request_are_dropped(models):
    parts = stages(models["llama"], 2)
    worker = StageWorker(StageModel(parts[0].model, parts[0].span), term=4)
    ok = {**header(4, "i", "a", 0, "prefill"), "x": [1, 2, 3], "rollback": None}
    assert worker.handle({**ok, "term": 3}) is None  # stale term
    assert worker.handle({**ok, "request": "b", "step": 1}) is None  # unknown request
    assert worker.handle(ok)["step"] == 0
    assert worker.handle(ok) is None  # replayed step
    assert worker.handle({**ok, "step": 1, "instance": "other"}) is None  # another sender
    assert worker.handle({**ok, "x": "junk", "step": 1}) is None  # bad payload
    assert worker.dropped == 5
    fwd = ring_forward(parts, term=9)
    fwd.link.workers[0].term = 8  # the stage moved on to another placement
    with pytest.raises(RingError):
        fwd.prefill([1, 2, 3])


def test_card_gate_turns_speculation_off_on_rings(models):
    from skulkp2p.engine.generate import _choose_drafter
    from skulkp2p.engine.request import parse_request

    req = parse_request({"prompt": ECHO, "speculation": {"drafter": "mtp"}})
    last = stages(models["llama"], 2)[-1]
    assert _choose_drafter(last, req, [1, 2])[0] is not None
    gated = type(last)(**{**last.__dict__, "speculation": {"speculative_multi_node": False}})
    assert _choose_drafter(gated, req, [1, 2]) == (None, 0, None)
    single = full(models["llama"])
    solo = type(single)(**{**single.__dict__, "speculation": {"speculative_multi_node": False}})
    assert _choose_drafter(solo, req, [1, 2])[0] is not None
