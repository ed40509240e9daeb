"""Gemma 4 on pipeline rings: the tiny gemma4_text target (KV-shared layers, per-layer inputs,
sliding and full attention) decodes on 2- and 3-stage rings exactly what one node and mlx-lm
decode, and its assistant drafts on the ring's last stage exactly what it drafts on one node
(placement keeps the layers it reads there: `last_stage_from`)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from skulkp2p.cluster.placement import (
    ModelSpec,
    NodeOffer,
    PlacementError,
    place_model,
    split_with_tail,
    tail_start_of,
)
from skulkp2p.engine.decode.loop import DecodeStats, decode
from skulkp2p.engine.decode.sampling import SamplingParams, make_rng
from skulkp2p.engine.drafting.assistant import AssistantDrafter, AssistantError, load_assistant
from skulkp2p.engine.drafting.prompt_lookup import PromptLookup
from skulkp2p.engine.model.forward import LocalForward
from skulkp2p.engine.model.loaded import load_model
from skulkp2p.engine.model.stage import StageModel, StageSpan
from skulkp2p.engine.parallel.ring.traversal import InProcessLink, RingForward, StageWorker
from skulkp2p.models.cards import CardError, parse_card
from tests.helpers import tiny_gemma4
from tests.helpers.gemma_cards import write_gemma_card

PROMPT = "The river was high after the rain, and the"
TOKENS = 48  # three sliding windows: the rotating caches wrap and are cut back on rejection
LAYERS = tiny_gemma4.NUM_LAYERS
TAIL = 2  # layers 2 (last owning full) and 3 (last owning sliding): the shared 4, 5 read them
SPLITS = {2: [(0, 2), (2, 6)], 3: [(0, 1), (1, 2), (2, 6)]}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("gemma4-rings")
    return {"target": tiny_gemma4.make_target(base / "gemma4-tiny"),
            "ordered": tiny_gemma4.make_assistant(base / "assistant-ordered", "ordered"),
            "dense": tiny_gemma4.make_assistant(base / "assistant-dense", "dense")}


_loaded: dict = {}


def whole(path: Path):
    if path not in _loaded:
        _loaded[path] = load_model(path, "gemma4-tiny", dtype="float32")
    return _loaded[path]


def parts(path: Path, n: int):
    if (path, n) not in _loaded:
        _loaded[(path, n)] = [load_model(path, "gemma4-tiny", dtype="float32",
                                         span=StageSpan(a, b, LAYERS),
                                         speculation={"drafter": "assistant"})
                              for a, b in SPLITS[n]]
    return _loaded[(path, n)]


def ring(stages, hidden=None) -> tuple[RingForward, InProcessLink]:
    link = InProcessLink([StageWorker(StageModel(p.model, p.span), 1) for p in stages[:-1]])
    last = stages[-1]
    return RingForward(StageModel(last.model, last.span), link, term=1, instance="i",
                       request="r", hidden=hidden, prefill_step=7), link


def run(fwd, prompt, drafter=None, depth=0, stats=None, params=None, seed=0) -> list[int]:
    return list(decode(fwd, prompt, params or SamplingParams(), TOKENS, make_rng(seed), drafter,
                       depth, stats))


class Recording(AssistantDrafter):
    """Keeps every round's history and drafts."""

    def __init__(self, *args):
        super().__init__(*args)
        self.rounds: list[tuple[list[int], list[int]]] = []

    def propose(self, history, k):
        drafts, q = super().propose(history, k)
        self.rounds.append((list(history), list(drafts)))
        return drafts, q


@pytest.mark.parametrize("n", [2, 3])
def test_ring_greedy_equals_one_node_and_mlx_lm(gemma, n):
    lm = whole(gemma["target"])
    prompt = lm.tokenizer.encode(PROMPT)
    plain = run(LocalForward(lm.model), prompt)
    steps = generate_step(mx.array(prompt), lm.model)
    assert plain == [int(t) for t, _ in (next(steps) for _ in range(TOKENS))]
    assert run(ring(parts(gemma["target"], n))[0], prompt) == plain
    stats = DecodeStats()  # rejected lookup drafts roll every stage back
    assert run(ring(parts(gemma["target"], n))[0], prompt, PromptLookup(), 4, stats) == plain
    assert stats.drafted > 0


def test_ring_seeded_sampling_equals_one_node(gemma):
    lm = whole(gemma["target"])
    prompt = lm.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=3)
    single = run(LocalForward(lm.model), prompt, PromptLookup(), 3, params=params, seed=3)
    assert run(ring(parts(gemma["target"], 2))[0], prompt, PromptLookup(), 3,
               params=params, seed=3) == single


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ordered", "dense"])
@pytest.mark.parametrize("n", [2, 3])
def test_assistant_on_the_ring_drafts_what_it_drafts_on_one_node(gemma, kind, n):
    lm = whole(gemma["target"])
    prompt = lm.tokenizer.encode(PROMPT)
    plain = run(LocalForward(lm.model), prompt)
    local = Recording(load_assistant(gemma[kind], lm.model, mx.float32), SamplingParams(),
                      np.random.default_rng(0))
    assert run(LocalForward(lm.model, hidden="after"), prompt, local, 3) == plain
    stages = parts(gemma["target"], n)
    last = stages[-1]
    assistant = load_assistant(gemma[kind], last.model, mx.float32, first_layer=last.span.start)
    on_ring = Recording(assistant, SamplingParams(), np.random.default_rng(0))
    stats = DecodeStats()
    fwd, link = ring(stages, hidden="after")
    assert run(fwd, prompt, on_ring, 3, stats) == plain
    assert stats.drafted >= (TOKENS // 4) * 3
    assert on_ring.rounds == local.rounds  # same histories, same drafts, every round


def test_assistant_sampled_on_the_ring_equals_one_node(gemma):
    lm = whole(gemma["target"])
    prompt = lm.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0.8, seed=7)
    local = AssistantDrafter(load_assistant(gemma["dense"], lm.model, mx.float32), params,
                             np.random.default_rng(1))
    single = run(LocalForward(lm.model, hidden="after"), prompt, local, 2, params=params, seed=7)
    last = parts(gemma["target"], 2)[-1]
    remote = AssistantDrafter(load_assistant(gemma["dense"], last.model, mx.float32,
                                             first_layer=last.span.start), params,
                              np.random.default_rng(1))
    got = run(ring(parts(gemma["target"], 2), hidden="after")[0], prompt, remote, 2,
              params=params, seed=7)
    assert got == single


def test_a_cut_between_a_shared_layer_and_its_source_is_refused(gemma):
    with pytest.raises(ValueError, match="source layer 2 is on another stage"):
        load_model(gemma["target"], "g", dtype="float32", span=StageSpan(3, LAYERS, LAYERS))


def test_the_assistant_refuses_a_stage_without_its_layers(gemma):
    first = parts(gemma["target"], 2)[0]
    with pytest.raises(AssistantError, match="reads layers 2 and 3"):
        load_assistant(gemma["dense"], first.model, mx.float32, first_layer=3)


def test_later_stages_hold_no_per_layer_tables(gemma):
    from mlx.utils import tree_flatten
    for p in parts(gemma["target"], 3):
        names = {k for k, _ in tree_flatten(p.model.parameters())}
        assert any("embed_tokens_per_layer" in k for k in names) == p.span.first


def test_tail_start_from_config_and_model(gemma):
    config = json.loads((gemma["target"] / "config.json").read_text())
    assert tail_start_of(config) == TAIL
    assert tail_start_of({"model_type": "llama", "num_hidden_layers": 4}) == 0
    # Without shared layers the assistant's two layers still pin the tail.
    no_shared = {**config, "num_kv_shared_layers": 0}
    assert tail_start_of(no_shared) == 4  # last owning full 5, last owning sliding 4


def test_placement_keeps_the_tail_on_the_last_stage():
    assert split_with_tail(6, [5, 1], TAIL) == [(0, 2), (2, 6)]
    assert split_with_tail(6, [1, 1, 1], TAIL) == [(0, 1), (1, 2), (2, 6)]
    assert split_with_tail(6, [1, 1, 1, 1], TAIL) is None
    assert split_with_tail(6, [1, 1, 1], 0) == [(0, 2), (2, 4), (4, 6)]
    spec = ModelSpec("g", LAYERS, 6_000_000, 64, 64, 2, tail_start=TAIL)
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    small = [NodeOffer("a", 5_000_000), NodeOffer("b", 6_000_000), NodeOffer("c", 9_000_000)]
    got = place_model(spec, small)
    assert got.layers[-1][0] <= TAIL and got.layers[-1][1] == LAYERS
    assert got.ring[-1] == "c"  # the tail goes to the node with the most room
    named = place_model(spec, small, ring=["a", "b", "c"])
    assert named.layers == ((0, 1), (1, 2), (2, 6))
    with pytest.raises(PlacementError, match="at most 3 nodes"):
        place_model(spec, small + [NodeOffer("d", 9_000_000)], ring=["a", "b", "c", "d"])
    with pytest.raises(ValueError, match="tail_start"):
        ModelSpec.from_dict({**spec.to_dict(), "tail_start": LAYERS})


def _card(**placement) -> dict:
    return {"id": "g", "family": "gemma4_text", "format": "mlx",
            "source": {"kind": "local", "path": "/nowhere"}, "layers": LAYERS,
            "hidden_size": 64, "kv_heads": 2, "context_length": 64, "size_bytes": 1000,
            "placement": placement}


def test_card_field_last_stage_from(tmp_path):
    card = parse_card(_card(last_stage_from=TAIL), tmp_path / "g.toml")
    assert ModelSpec.from_card(card).tail_start == TAIL
    for bad in (0, LAYERS):
        with pytest.raises(CardError, match="placement.last_stage_from"):
            parse_card(_card(last_stage_from=bad), tmp_path / "g.toml")


# ------------------------------------------------------------------------------------------
# Real processes: two `join` nodes on 127.0.0.x serving a card that pairs the tiny target with
# its assistant; the ring is placed with POST /v1/cluster/place.

ARMS = {"plain": {"speculation": "off"},
        "assistant": {"speculation": {"drafter": "assistant"}},
        "sampled": {"temperature": 0.8, "seed": 5, "speculation": {"drafter": "assistant"}},
        "auto": {}}


def _ask(c, http: str, arm: str) -> dict:
    from tests.helpers.http_client import call
    body = {"model": "gemma-tiny", "prompt": PROMPT, "max_tokens": 40, **ARMS[arm]}
    got: dict = {}

    def answered() -> bool:
        try:
            status, _, out = call(http, "POST", "/v1/cluster/generate", body, timeout=60)
        except OSError:
            return False
        if status == 200 and "re-placed" not in str(out.get("error")):
            got.update(out)
            return True
        return False  # 503 while a placement loads
    c.wait(answered, 60, f"an answer to {arm}")
    return got


@pytest.mark.cluster
@pytest.mark.slow
def test_a_ring_of_processes_runs_the_assistant_exactly(gemma, tmp_path):
    from tests.helpers.http_client import call, status_of
    from tests.helpers.procs import ProcCluster, loopback_ips_usable
    if not loopback_ips_usable():
        pytest.skip("needs the 127.0.0.0/8 loopback range (Linux)")
    cards = tmp_path / "cards"
    write_gemma_card(cards, "gemma-tiny", gemma["target"], gemma["ordered"], block_size=3,
                     last_stage_from=2)
    c = ProcCluster(tmp_path, env={"SKULKP2P_CARDS_DIR": str(cards),
                                   "SKULKP2P_RING_TIMEOUT": "20"})
    try:
        for i in range(2):
            c.start_join(i, "gemma-tiny", args=["--memory-limit", "2GB",
                                                "--timers", "probe=0.2,suspect=1,election=1"])
        c.wait(lambda: (s := c.agreed([0, 1])) and s["placements"], 90, "a placement")
        c.wait(lambda: all(status_of(n.http) == 200 for n in c.nodes.values()), 90, "health")
        http = c.nodes[0].http
        single = {arm: _ask(c, http, arm) for arm in ARMS}
        assert single["assistant"]["tokens"] == single["plain"]["tokens"]
        status, _, out = call(http, "POST", "/v1/cluster/place",
                              {"model": "gemma-tiny", "nodes": ["n0", "n1"]})
        assert status == 200, out
        # The tail [2, 6) stays on the last stage (a plain split would cut at 3).
        assert out["placement"]["layers"] == [[0, 2], [2, 6]]
        c.wait(lambda: (s := c.agreed([0, 1])) and any(
            p["ring"] == ["n0", "n1"] for p in s["placements"]), 30, "the ring")
        for arm in ARMS:
            got = _ask(c, http, arm)
            assert got["tokens"] == single[arm]["tokens"], (arm, got)
            if arm in ("assistant", "sampled"):
                assert got["speculation"]["drafter"] == "assistant"
                assert got["speculation"]["drafted"] > 0
    finally:
        c.close()


def test_a_tensor_groups_loop_member_loads_no_assistant_and_says_why(gemma, tmp_path):
    from skulkp2p.engine.request import RequestError
    from skulkp2p.engine.runner.generate import _choose_drafter
    from skulkp2p.engine.runner.loader import open_model
    from skulkp2p.formats.pipe_format import parse_request
    from skulkp2p.models.store import ModelStore
    card = parse_card({**_card(), "placement": {},
                       "source": {"kind": "local", "path": str(gemma["target"])},
                       "speculation": {"drafter": "assistant",
                                       "assistant_model": str(gemma["ordered"])}},
                      tmp_path / "g.toml")
    store = ModelStore(tmp_path / "data", cards={"g": card})
    assert open_model(store, "g", "float32").assistant is not None
    head = open_model(store, "g", "float32", head_only=True)  # holds none of the layers
    assert head.assistant is None
    req = parse_request({"prompt": PROMPT, "speculation": {"drafter": "assistant"}})
    with pytest.raises(RequestError, match="not on a tensor-parallel group"):
        _choose_drafter(head, req, [1, 2], np.random.default_rng(0))
