"""Tensor-parallel placements: the split (KV-head groups, MLP columns), placement of groups,
and groups of real rank processes on loopback forming an `mx.distributed` ring: speculative
output equals plain output on the same group (greedy, byte for byte, every shardable tiny family
and the real model), a killed or frozen rank ends the call with a clear error in bounded time."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from skulkp2p.api.errors import engine_error
from skulkp2p.cluster.placement import (
    ModelSpec,
    NodeOffer,
    Placement,
    PlacementError,
    Request,
    place_model,
    plan,
)
from skulkp2p.engine.drafting.call_costs import LiveWidthCosts
from skulkp2p.engine.model.loaded import load_model
from skulkp2p.engine.parallel.tensor.group import RankProcess, TensorError
from skulkp2p.engine.parallel.tensor.shard import ShardError, plan_shards
from skulkp2p.formats.pipe_format import parse_request
from skulkp2p.runtime.worker import TensorGroupFailed
from tests.helpers.procs import free_port
from tests.helpers.tensor_group import ECHO, Group, generate

ARMS = {"plain": "off", "lookup": {"drafter": "lookup", "depth": 4}}

# ---------------------------------------------------------------- the split


def test_kv_head_groups_split_unevenly_when_they_must():
    # SmolLM2-135M: 9 query heads over 3 KV heads, 1536 MLP columns, on 2 members.
    a, b = plan_shards(9, 3, 1536, 2)  # without the shapes: columns follow the heads
    assert (a.kv_heads, a.q_heads, a.columns) == ((0, 2), (0, 6), (0, 1024))
    assert (b.kv_heads, b.q_heads, b.columns) == ((2, 3), (6, 9), (1024, 1536))
    # With them, the MLP columns even out the parameters: 2 heads + 683 columns against
    # 1 head + 853 columns, 1.77M parameters a layer each.
    a, b = plan_shards(9, 3, 1536, 2, hidden=576, head_dim=64)
    assert (a.columns, b.columns) == ((0, 683), (683, 1536))

    def params(p):
        heads = (p.kv_heads[1] - p.kv_heads[0]) * 4 * 64 * 576
        return 2 * heads + 3 * 576 * (p.columns[1] - p.columns[0])
    assert abs(params(a) - params(b)) < 0.01 * params(a)
    even = plan_shards(4, 2, 128, 2)
    assert [p.columns for p in even] == [(0, 64), (64, 128)]
    with pytest.raises(ShardError, match="3 KV heads"):
        plan_shards(9, 3, 1536, 4)


# ---------------------------------------------------------------- placement

SPEC = ModelSpec("m", layers=4, size_bytes=1_000_000_000, context_length=1024, hidden_size=512,
                 kv_heads=4, parallel="tensor")


def test_tensor_placement_gives_each_member_a_slice_of_every_layer():
    nodes = [NodeOffer("a", 800_000_000), NodeOffer("b", 800_000_000),
             NodeOffer("c", 800_000_000)]
    p = place_model(SPEC, nodes)
    assert p.parallel == "tensor" and len(p.ring) == 2  # 1.3 GB does not fit one 0.8 GB node
    assert p.layers == ((0, 4), (0, 4))
    assert p.entry == p.ring[0]  # the group's first member runs the decode loop
    assert all(n < 800_000_000 for n in p.needs)
    back = Placement.from_dict(p.to_dict())
    assert back.parallel == "tensor" and back.entry == p.ring[0]
    # The same model as a pipeline ring: the last member serves it.
    ring = place_model(ModelSpec.from_dict({**SPEC.to_dict(), "parallel": "pipeline"}), nodes)
    assert ring.parallel == "pipeline" and ring.entry == ring.ring[-1]
    assert "parallel" in p.to_dict() and p.to_dict()["parallel"] == "tensor"


def test_tensor_placement_errors_are_clear():
    one = [NodeOffer("a", 10**12)]
    with pytest.raises(PlacementError, match="at least 2 nodes"):
        place_model(SPEC, one)
    many = [NodeOffer(n, 10**12) for n in "abcde"]
    with pytest.raises(PlacementError, match="at most 4 members"):
        place_model(SPEC, many, ring=list("abcde"))
    with pytest.raises(PlacementError, match="at least 2 nodes"):
        place_model(SPEC, many, ring=["a"])
    with pytest.raises(ValueError, match="parallel"):
        ModelSpec.from_dict({**SPEC.to_dict(), "parallel": "diagonal"})


def test_asking_for_tensor_re_places_a_ring():
    nodes = [NodeOffer(n, 10**12) for n in "ab"]
    pipeline = ModelSpec.from_dict({**SPEC.to_dict(), "parallel": ""})
    first = plan([Request(pipeline, ("a", "b"))], nodes)["m"]
    assert first.parallel == "pipeline"
    again = plan([Request(SPEC, ("a", "b"))], nodes, previous={"m": first})["m"]
    assert again.parallel == "tensor" and again.ring == ("a", "b")


def test_card_field_parallel(tmp_path):
    from skulkp2p.models.cards import PACKAGE_CARDS_DIR, CardError, load_card

    base = PACKAGE_CARDS_DIR / "smollm2-135m.toml"
    text = base.read_text()
    assert "\n[placement]\n" in text  # the field joins the card's own table
    good = tmp_path / "good.toml"
    good.write_text(text.replace("\n[placement]\n", '\n[placement]\nparallel = "tensor"\n'))
    card = load_card(good)
    assert ModelSpec.from_card(card).parallel == "tensor"
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace("\n[placement]\n", '\n[placement]\nparallel = "sideways"\n'))
    with pytest.raises(CardError, match="placement.parallel"):
        load_card(bad)
    assert ModelSpec.from_card(load_card(base)).parallel == ""  # auto: a pipeline ring


# ---------------------------------------------------------------- groups of rank processes


@pytest.fixture(scope="module")
def models(tiny_model) -> dict[str, Path]:
    return {"llama": tiny_model("llama", seed=0, mtp=True), "qwen3": tiny_model("qwen3"),
            "qwen3_5": tiny_model("qwen3_5")}


@pytest.fixture(scope="module")
def llama_group(models):
    """One group of 2 rank processes on the tiny llama (with its MTP head) for the tests here
    that decode on a healthy group (each request starts the ranks' caches afresh), started
    once and killed by pid after the module. Its ranks keep a prefix cache (64 MB), which only
    the head's restore and store calls reach (a request given an index: the prefix-cache test);
    a request without one never touches it. A test that changes the head (its width table)
    puts it back; the tests that kill or freeze a rank start groups of their own."""
    group = Group(models["llama"], 2, prefix_cache_mb=64)
    try:
        yield group
    finally:
        group.close()


@pytest.mark.process
@pytest.mark.parametrize("family,n", [("llama", 2), ("qwen3", 2)])
def test_group_speculative_equals_plain(models, family, n, request):
    shared = family == "llama"  # (the module's llama group: 2 ranks)
    group = request.getfixturevalue("llama_group") if shared else Group(models[family], n)
    reads, forwards = group.ranks[0].shared_reads, len(group.forwards)
    try:
        single = load_model(models[family], family, dtype="float32")
        # Each rank holds about 1/n of the layers' weights and of the head's rows, and no
        # embedding.
        whole = sum(v.nbytes for layer in single.model.model.layers for _, v in _flat(layer))
        whole += single.model.model.embed_tokens.weight.nbytes  # tied: the head
        for ready in group.ready:
            assert ready["param_bytes"] < whole / n * 1.2
        plain = generate(group.head, "off")
        assert len(plain.tokens) == 40
        for arm, speculation in ARMS.items():
            got = generate(group.head, speculation)
            assert got.tokens == plain.tokens, arm
            assert got.text == plain.text
        lookup = generate(group.head, ARMS["lookup"])
        assert lookup.speculation.drafted > 0 and lookup.speculation.accepted > 0
        # A verify of w rows is one call to the group, whatever w is, and the ranks computed
        # every call's logits (the head is vocabulary-split).
        fwd = group.forwards[-1]
        assert fwd.calls < fwd.rows
        assert fwd.split_calls == fwd.logit_calls > 0
        # ... through the shared memory, not the pipe (every call so far, on every forward)
        assert group.ranks[0].shared_reads - reads == sum(
            f.split_calls for f in group.forwards[forwards:]) > 0
        if family == "llama":  # the MTP head drafts on the member that runs the loop
            mtp = generate(group.head, {"drafter": "mtp", "depth": 2})
            assert mtp.tokens == plain.tokens and mtp.speculation.drafted > 0
        # Seeded sampling repeats on the group.
        seeded = [generate(group.head, ARMS["lookup"], temperature=0.8, seed=5).tokens
                  for _ in range(2)]
        assert seeded[0] == seeded[1]
        # Against one node the sums run in another order: report, do not require.
        ref = generate(single, "off")
        print(f"\n{family} on {n} ranks: greedy equals one node's: {ref.tokens == plain.tokens}")
    finally:
        if not shared:
            group.close()


@pytest.mark.process
def test_group_holds_a_schema_with_and_without_drafts(llama_group, models):
    """Structured outputs on a tensor group: the loop on the member that runs it masks every
    verified row, so the output fits the schema, and greedy with drafts (lookup, the MTP head)
    is constrained plain decoding token for token, as on one node."""
    import json

    import jsonschema

    schema = {"type": "object", "properties": {
        "ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["ok", "color", "n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
    plain = generate(llama_group.head, "off", max_tokens=48, response_format=fmt)
    jsonschema.validate(json.loads(plain.text), schema)
    for speculation in (ARMS["lookup"], {"drafter": "mtp", "depth": 2}):
        got = generate(llama_group.head, speculation, max_tokens=48, response_format=fmt)
        assert got.tokens == plain.tokens, speculation
        assert got.speculation.drafted > 0, speculation  # (forced tokens at least)


def test_vocabulary_split_head_gives_the_whole_heads_logits(models):
    """Every member's rows of the head, padded and stacked as an all-gather stacks them, put
    back together are the whole head's logits, for splits even and uneven."""
    import mlx.core as mx

    from skulkp2p.engine.model.trunk import Trunk
    from skulkp2p.engine.parallel.tensor.shard import head_slice

    single = load_model(models["llama"], "llama", dtype="float32")
    trunk = Trunk(single.model)
    h = mx.random.normal((5, trunk.embed_tokens.weight.shape[1]), key=mx.random.key(3))
    whole = trunk.head(trunk.norm(h))
    vocab = whole.shape[1]
    for n in (1, 2, 3, 7):
        parts = [head_slice(single.model, r, n) for r in range(n)]
        assert parts[0].spans[-1][1] == vocab and len({p.logits(h).shape for p in parts}) == 1
        got = parts[0].assemble(mx.concatenate([p.logits(h) for p in parts], axis=0), 5)
        assert got.shape == whole.shape
        assert mx.allclose(got, whole, atol=1e-5).item(), n
        assert mx.array_equal(mx.argmax(got, axis=1), mx.argmax(whole, axis=1)).item()


@pytest.mark.process
def test_a_call_too_wide_for_its_logits_to_travel_gets_this_members_head(llama_group,
                                                                          monkeypatch):
    """Past SPLIT_LOGITS_MAX_BYTES the ranks send hidden rows only and the loop's member
    applies its own head: the same greedy text."""
    import skulkp2p.engine.parallel.tensor.group as tensor

    group = llama_group
    split = generate(group.head, ARMS["lookup"], max_tokens=16)
    assert group.forwards[-1].split_calls > 0
    monkeypatch.setattr(tensor, "SPLIT_LOGITS_MAX_BYTES", 0)
    local = generate(group.head, ARMS["lookup"], max_tokens=16)
    fwd = group.forwards[-1]
    assert fwd.split_calls == 0 and fwd.logit_calls > 0
    assert local.tokens == split.tokens


def _flat(module):
    from mlx.utils import tree_flatten

    return tree_flatten(module.parameters())


@pytest.mark.process
def test_hybrid_recurrent_model_is_refused_clearly(models):
    addrs = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    ranks = [RankProcess(models["qwen3_5"], r, addrs, "float32") for r in range(2)]
    try:
        with pytest.raises(TensorError, match="recurrent linear-attention layers"):
            ranks[0].wait_ready(60)
    finally:
        for r in ranks:
            r.kill()


@pytest.mark.process
def test_killed_rank_ends_the_call_at_once(models):
    group = Group(models["llama"], 2)
    try:
        generate(group.head, "off", max_tokens=4)
        group.ranks[1].kill()
        t0 = time.monotonic()
        with pytest.raises(TensorError, match="broke mid-request") as raised:
            generate(group.head, "off", max_tokens=4)
        assert time.monotonic() - t0 < group.timeout  # the peer's socket closed: not a timeout
        assert not group.ranks[0].alive()  # the group is over: rank 0 ended too
        # What a client gets for it (the worker wraps the engine's error, the API maps it):
        # a 503 to retry with its own code, naming the model and the cause; never a 500.
        err = engine_error(TensorGroupFailed("llama", raised.value))
        assert (err.status, err.code, err.type) == (503, "tensor_group_failed",
                                                    "service_unavailable")
        assert err.headers == [("Retry-After", "1")]
        assert err.message.startswith("model llama: its tensor-parallel group broke (")
        assert "broke mid-request" in err.message and err.message.endswith("retry")
    finally:
        group.close()


@pytest.mark.process
def test_frozen_rank_ends_the_call_in_bounded_time(models):
    group = Group(models["llama"], 2, timeout=3.0)
    try:
        generate(group.head, "off", max_tokens=4)
        os.kill(group.ranks[1].pid, signal.SIGSTOP)  # its sockets stay open
        t0 = time.monotonic()
        with pytest.raises(TensorError, match="no answer from the group within 3 s"):
            generate(group.head, "off", max_tokens=4)
        took = time.monotonic() - t0
        assert took < 10, took
        assert not group.ranks[0].alive()  # killed by pid: its collective was stuck for good
    finally:
        os.kill(group.ranks[1].pid, signal.SIGCONT)
        group.close()


@pytest.mark.process
@pytest.mark.slow
def test_real_model_speculative_equals_plain_on_two_ranks(smollm2_path):
    """SmolLM2-135M has 3 KV heads: two members hold 2 and 1 of them. (24 tokens an arm: both
    speculative arms have drafts accepted and rejected, asserted.)"""
    group = Group(smollm2_path, 2, timeout=60)
    try:
        sizes = [r["param_bytes"] for r in group.ready]
        # Uneven KV-head groups, even shares: the MLP columns make up for the heads; what MLX
        # really holds (active memory) is the shares, not the whole tensors they were cut from.
        assert abs(sizes[0] - sizes[1]) < 0.01 * sizes[0], sizes
        for r in group.ready:
            assert r["active_bytes"] < r["param_bytes"] * 1.05
        plain = generate(group.head, "off", max_tokens=24)
        for arm in ("lookup", "auto"):
            got = generate(group.head, ARMS.get(arm, arm), max_tokens=24)
            assert got.tokens == plain.tokens, arm
            assert 0 < got.speculation.accepted < got.speculation.drafted, arm
    finally:
        group.close()


def test_drafter_cost_is_relative_to_the_whole_model_on_the_loop_member(models):
    """The loop's member holds no layers; the MTP head's cost per draft must still be weighed
    against a step of the whole model (else the gate switches the head off at once)."""
    from skulkp2p.engine.runner.generate import _relative_cost

    path = models["llama"]
    head = load_model(path, "llama", dtype="float32", head_only=True)
    whole = load_model(path, "llama", dtype="float32")
    assert head.mtp is not None and not head.model.model.layers
    assert head.whole_params == sum(v.size for _, v in _flat(whole.model))
    assert _relative_cost(head.mtp, head) == pytest.approx(_relative_cost(whole.mtp, whole))


def test_drafter_cost_is_relative_to_the_whole_model_on_a_rings_last_stage(models):
    """Likewise on a pipeline ring: the last stage holds a few layers, yet a draft saves a step
    of every stage's layers."""
    from skulkp2p.engine.model.stage import StageSpan
    from skulkp2p.engine.runner.generate import _relative_cost

    path = models["llama"]
    whole = load_model(path, "llama", dtype="float32")
    total = len(whole.model.model.layers)
    last = load_model(path, "llama", dtype="float32", span=StageSpan(total - 1, total, total))
    assert last.mtp is not None and len(last.model.model.layers) == 1
    assert last.whole_params == sum(v.size for _, v in _flat(whole.model))
    assert _relative_cost(last.mtp, last) == pytest.approx(_relative_cost(whole.mtp, whole))


@pytest.mark.process
def test_prefix_cache_on_a_group_decodes_what_a_cold_group_does(llama_group):
    """Each rank keeps its own slice of every entry; the loop's member keeps the index, decides
    the hit and tells the ranks which entry to adopt. A hit decodes exactly what a cold group
    decodes (plain, lookup and the MTP head), a follow-up turn hits the entry stored at the
    end of the turn before, and an entry the ranks lack falls back to a whole prefill. (12
    tokens a turn, 8 a follow-up: the drafting arms draft in both, asserted.)"""
    from skulkp2p.engine.cache.prefix_cache import MB, PrefixCache
    from skulkp2p.engine.runner.generate import prompt_tokens

    group = llama_group
    head = group.head
    prompt = prompt_tokens(head, parse_request({"prompt": ECHO}))
    arms = {**ARMS, "mtp": {"drafter": "mtp", "depth": 2}}
    cold = {arm: generate(head, spec, max_tokens=12) for arm, spec in arms.items()}
    cold_rows = group.forwards[-1].rows
    for arm, spec in arms.items():
        index = PrefixCache(64 * MB)
        first = generate(head, spec, max_tokens=12, prefix_cache=index)
        assert first.tokens == cold[arm].tokens, arm
        assert len(index) == 1 and index.nbytes > 0  # the ranks' slices, counted here
        again = generate(head, spec, max_tokens=12, prefix_cache=index)
        assert index.hits == 1 and index.reused_tokens >= len(prompt) - 2, arm
        assert again.tokens == cold[arm].tokens, arm
        assert again.text == cold[arm].text
        assert group.forwards[-1].rows < cold_rows - len(prompt) // 2  # no whole prefill
        # The next turn: this prompt, the answer, and more; against a cold group.
        turn = prompt + list(first.tokens) + prompt[1:9]
        follow = generate(head, spec, max_tokens=8, prefix_cache=index, prompt=turn)
        assert index.hits == 2 and index.reused_tokens >= 2 * len(prompt), arm
        assert follow.tokens == generate(head, spec, max_tokens=8, prompt=turn).tokens, arm
        if arm != "plain":
            assert again.speculation.drafted > 0 and follow.speculation.drafted > 0, arm
    # An entry in the index that the ranks do not hold: they all start empty, and the
    # prompt is prefilled whole.
    index = PrefixCache(64 * MB)
    other = list(reversed(prompt))
    assert index.store(other[:12], [], elsewhere_bytes=1)
    missed = generate(head, "off", max_tokens=12, prefix_cache=index,
                      prompt=other[:12] + prompt)
    assert index.hits == 1
    assert group.forwards[-1].rows >= len(prompt) + 11
    assert missed.tokens == generate(head, "off", max_tokens=12,
                                     prompt=other[:12] + prompt).tokens


def test_width_times_never_fall_with_width():
    from skulkp2p.engine.drafting.width_costs import non_decreasing

    assert non_decreasing({1: 2.0, 2: 5.0, 4: 3.0, 8: 4.0}) == {1: 2.0, 2: 3.0, 4: 3.0, 8: 4.0}


@pytest.mark.process
def test_group_measures_its_own_verify_width_costs(llama_group):
    """The group's width table is measured through the TensorForward (what the decode loop
    pays per call), every width the controller interpolates between; the requests after the
    measurement decode as before it (its calls leave nothing behind in the ranks' caches)."""
    from skulkp2p.engine.drafting.width_costs import GROUP_WIDTHS, relative_costs
    from skulkp2p.engine.parallel.tensor.group import measure_group_widths

    group = llama_group
    table = group.head.width_costs
    try:
        before = generate(group.head, ARMS["lookup"], max_tokens=24)
        seconds = measure_group_widths(group.head.model, group.head.tokenizer, group.ranks[0])
        assert sorted(seconds) == list(GROUP_WIDTHS)
        assert all(s > 0 for s in seconds.values())
        costs = relative_costs(seconds)
        assert costs[1] == 1.0
        widths = sorted(costs)  # noise capped: a wider verify never costs less
        assert all(costs[a] <= costs[b] for a, b in zip(widths, widths[1:], strict=False))
        print(f"\ngroup width costs (tiny llama, 2 ranks): {costs}")
        group.head.width_costs = costs
        after = generate(group.head, ARMS["lookup"], max_tokens=24)
        assert after.tokens == before.tokens
    finally:
        group.head.width_costs = table  # (the module's group: as the other tests found it)


@pytest.mark.process
def test_group_times_its_verify_calls_into_its_live_width_table(llama_group):
    """Seeded by the group's probe, the table then holds every verify call the requests make
    (not the prefill's), by width; greedy output is the same with it as without (depth never
    changes greedy tokens), plain and speculative."""
    from skulkp2p.engine.parallel.tensor.group import measure_group_widths

    group = llama_group
    table = group.head.width_costs
    try:
        plain_static = generate(group.head, "off", max_tokens=24)
        spec_static = generate(group.head, ARMS["lookup"], max_tokens=24)
        seconds = measure_group_widths(group.head.model, group.head.tokenizer, group.ranks[0])
        live = group.head.width_costs = LiveWidthCosts(seconds)
        assert dict(live) == {w: round(s / seconds[1], 4) for w, s in seconds.items()}
        for speculation, static in (("off", plain_static), (ARMS["lookup"], spec_static)):
            before = live.calls()
            got = generate(group.head, speculation, max_tokens=24)
            assert got.tokens == static.tokens and got.text == static.text
            assert got.tokens == plain_static.tokens
            fwd = group.forwards[-1]
            seen = {w: n - before.get(w, 0) for w, n in live.calls().items()}
            prefill_rows = got.usage.prompt_tokens - 1
            prefill_calls = -(-prefill_rows // 16)  # the group's prefill_step
            assert sum(seen.values()) == fwd.calls - prefill_calls
            assert sum(w * n for w, n in seen.items()) == fwd.rows - prefill_rows
            if speculation == "off":
                assert set(seen) == {1}
            else:
                assert got.speculation.drafted > 0 and max(seen) > 1
        assert all(s > 0 for s in live.seconds().values())
    finally:
        group.head.width_costs = table  # (the module's group: as the other tests found it)
