"""Placement: smallest fitting ring, proportional contiguous layer split, clear errors."""

from __future__ import annotations

import dataclasses
import random

import pytest

from skulkp2p.cluster.placement import (
    AUTO_REPLICAS,
    ModelSpec,
    NodeOffer,
    Placement,
    PlacementError,
    Request,
    member_need,
    parse_replicas,
    place_model,
    plan,
    split_layers,
)

MB = 1_000_000
# 30 layers, 300 MB of weights, no KV to speak of: easy arithmetic (10 MB x 1.3 per layer).
SPEC = ModelSpec("m", layers=30, size_bytes=300 * MB, context_length=1, hidden_size=64,
                 kv_heads=1)


def nodes(**mem_mb):
    return [NodeOffer(n, m * MB) for n, m in mem_mb.items()]


def test_split_is_contiguous_proportional_and_at_least_one_each():
    assert split_layers(30, [1, 1, 1]) == [(0, 10), (10, 20), (20, 30)]
    assert split_layers(30, [2, 1]) == [(0, 20), (20, 30)]
    assert split_layers(4, [1000, 1, 1]) == [(0, 2), (2, 3), (3, 4)]
    rng = random.Random(0)
    for _ in range(500):
        layers = rng.randint(1, 80)
        k = rng.randint(1, min(layers, 8))
        w = [rng.randint(1, 10**9) for _ in range(k)]
        ranges = split_layers(layers, w)
        assert ranges[0][0] == 0 and ranges[-1][1] == layers
        assert all(a < b for a, b in ranges)
        assert all(ranges[i][1] == ranges[i + 1][0] for i in range(k - 1))
        total = sum(w)
        for (a, b), wi in zip(ranges, w, strict=True):  # within one layer of its quota
            assert abs((b - a) - layers * wi / total) < 1 + 1e-9 or b - a == 1
    with pytest.raises(ValueError):
        split_layers(2, [1, 1, 1])


def test_need_counts_overhead_kv_and_dtype():
    spec = ModelSpec("x", layers=10, size_bytes=100 * MB, context_length=1000, hidden_size=576,
                     kv_heads=3)
    kv = 2 * 3 * 64 * 1000 * 2  # K and V, 3 heads of 64, 1000 tokens, bf16
    assert spec.kv_bytes_per_layer() == kv
    assert member_need(spec, 10) == pytest.approx(130 * MB + 10 * kv, abs=1)
    assert member_need(spec, 5, "float32") == pytest.approx(2 * (65 * MB + 5 * kv), abs=1)


def test_smallest_fitting_ring_wins_over_more_memory():
    # a alone fits (390 MB needed); b+c have more in total but are two hops.
    got = place_model(SPEC, nodes(a=400, b=300, c=300))
    assert got.ring == ("a",) and got.layers == ((0, 30),)


def test_ties_go_to_more_free_memory():
    got = place_model(SPEC, nodes(a=400, b=500, c=450))
    assert got.ring == ("b",)
    # two-node rings: {b, c} has the most memory of all fitting pairs
    got = place_model(SPEC, nodes(a=150, b=250, c=240, d=100))
    assert got.ring == ("b", "c") and len(got.layers) == 2


def test_ring_layers_proportional_to_memory():
    got = place_model(SPEC, nodes(a=100, b=150, c=200))  # 390 MB needed: all three
    assert got.ring == ("c", "b", "a")  # most memory first
    sizes = [b - a for a, b in got.layers]
    assert sizes == [13, 10, 7]  # 13.3, 10, 6.7 by largest remainder
    assert all(need <= mem * MB for need, mem in zip(got.needs, (200, 150, 100), strict=True))


def test_not_fitting_error_names_need_and_supply():
    with pytest.raises(PlacementError) as e:
        place_model(SPEC, nodes(a=100, b=100))
    msg = str(e.value)
    assert "model m does not fit" in msg and "needs 390 MB" in msg and "200 MB" in msg
    assert "2 nodes" in msg and e.value.needs >= 390 * MB and e.value.available == 200 * MB


def test_explicit_ring_in_given_order():
    got = place_model(SPEC, nodes(a=400, b=400, c=400), ring=["c", "a"])
    assert got.ring == ("c", "a") and got.explicit
    with pytest.raises(PlacementError, match="not alive"):
        place_model(SPEC, nodes(a=400), ring=["zz"])
    with pytest.raises(PlacementError, match="named nodes offer"):
        place_model(SPEC, nodes(a=100, b=400), ring=["a"])


def test_float32_nodes_need_twice_the_memory():
    both = [NodeOffer("a", 500 * MB, "float32"), NodeOffer("b", 500 * MB, "float32")]
    got = place_model(SPEC, both)  # 780 MB in float32: two nodes
    assert len(got.ring) == 2


def test_plan_is_deterministic_and_accounts_memory_across_models():
    small = ModelSpec("s", layers=10, size_bytes=200 * MB, context_length=1, hidden_size=64,
                      kv_heads=1)
    offers = nodes(a=400, b=300)
    reqs = [Request(SPEC), Request(small)]
    r1 = plan(reqs, offers)
    r2 = plan(list(reversed(reqs)), list(reversed(offers)))
    assert r1 == r2
    assert r1["m"].ring == ("a",)  # placed first (by id): takes a
    assert r1["s"].ring == ("b",)  # 260 MB left only on b


def test_plan_keeps_previous_and_replaces_lost_ones():
    offers = nodes(a=400, b=420, c=400)
    first = plan([Request(SPEC)], offers)
    assert first["m"].ring == ("b",)
    # b gains a rival with more memory: the placement stays where it is (no churn)
    again = plan([Request(SPEC)], offers + nodes(d=900), previous=first)
    assert again["m"].ring == ("b",)
    # b is gone: placed again on what is left
    lost = plan([Request(SPEC)], nodes(a=400, c=401), previous=first)
    assert lost["m"].ring == ("c",)
    # a suspect node keeps its placement but gets no new ones
    kept = plan([Request(SPEC)], offers, previous=first, eligible=["a", "c"])
    assert kept["m"].ring == ("b",)
    fresh = plan([Request(SPEC)], offers, eligible=["a", "c"])
    assert fresh["m"].ring in (("a",), ("c",))


def test_plan_reports_errors_per_model():
    result = plan([Request(SPEC)], nodes(a=10))
    assert isinstance(result["m"], PlacementError)


def test_spec_from_dict_validates():
    assert ModelSpec.from_dict(SPEC.to_dict()) == SPEC
    for bad in ({}, {"id": "x", "layers": 0, "size_bytes": 1}, {"id": "x", "layers": "3"},
                {"id": 3, "layers": 1, "size_bytes": 1}):
        with pytest.raises((ValueError, TypeError, KeyError)):
            ModelSpec.from_dict(bad)


def test_many_nodes_stay_fast():
    offers = [NodeOffer(f"n{i:02d}", (50 + i) * MB) for i in range(40)]
    got = place_model(SPEC, offers)
    assert 2 <= len(got.ring) <= 10


def test_served_card_needs_kv_for_every_parallel_slot():
    """A llama-server child allocates -c = slots x slot context up front: placement counts all
    of it (the card's [runtime] max_batch slots, else the default 4), not one context."""
    import dataclasses

    from skulkp2p.models.cards import PACKAGE_CARDS_DIR, SERVED_DEFAULT_SLOTS, load_card

    card = load_card(PACKAGE_CARDS_DIR / "smollm2-135m-gguf.toml")
    assert card.engine == "llama_server"
    spec = ModelSpec.from_card(card)
    assert spec.kv_tokens == SERVED_DEFAULT_SLOTS * card.served_slot_context
    one = dataclasses.replace(spec, kv_tokens=card.served_slot_context)
    assert spec.kv_bytes_per_layer() == SERVED_DEFAULT_SLOTS * one.kv_bytes_per_layer()
    assert member_need(spec, spec.layers) > member_need(one, spec.layers)
    two = ModelSpec.from_card(dataclasses.replace(card, runtime={**card.runtime, "max_batch": 2}))
    assert two.kv_tokens == 2 * card.served_slot_context
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    # An MLX card's KV is its context (rows grow as they decode): no slot count.
    assert ModelSpec.from_card(load_card(PACKAGE_CARDS_DIR / "smollm2-135m.toml")).kv_tokens == 0
    with pytest.raises(ValueError, match="kv_tokens"):
        ModelSpec.from_dict({**SPEC.to_dict(), "kv_tokens": -1})


# ---------------------------------------------------------------- replicas

def _rings(p):
    return [r.ring for r in p.copies()]


def test_replicas_are_whole_copies_on_other_nodes_and_deterministic():
    two = dataclasses.replace(SPEC, replicas=2)
    offers = nodes(a=400, b=420, c=410)
    got = plan([Request(two)], offers)["m"]
    assert _rings(got) == [("b",), ("c",)]  # most free memory first, then the next
    assert got.replicas[0].layers == ((0, 30),) and got.replicas[0].spec is None
    assert got.entries == ("b", "c") and got.replica_for("c").ring == ("c",)
    assert plan([Request(two)], list(reversed(offers)))["m"] == got
    # The wire form comes back whole (replicas included)
    assert Placement.from_dict(got.to_dict()) == got
    # More than fit: as many as there is room for, not an error
    four = dataclasses.replace(SPEC, replicas=4)
    assert len(plan([Request(four)], offers)["m"].copies()) == 3
    # A replica too large for one node is a ring of several, apart from the first
    big = plan([Request(two)], nodes(a=400, b=200, c=200))["m"]
    assert _rings(big) == [("a",), ("b", "c")]


def test_replicas_stay_put_and_a_lost_one_is_replaced_alone():
    two = dataclasses.replace(SPEC, replicas=2)
    offers = nodes(a=400, b=420, c=410)
    first = plan([Request(two)], offers)
    # a new, larger node changes nothing
    assert plan([Request(two)], offers + nodes(d=900), previous=first)["m"] == first["m"]
    # the first replica's node is gone: the other stays (now first), one is placed anew
    lost = plan([Request(two)], nodes(a=400, c=410), previous=first)["m"]
    assert _rings(lost) == [("c",), ("a",)]
    assert lost.copies()[0].layers == first["m"].replicas[0].layers
    # asking for fewer keeps the first ones
    one = plan([Request(SPEC)], offers, previous=first)["m"]
    assert _rings(one) == [("b",)]
    # asking for more adds without moving the others
    three = plan([Request(dataclasses.replace(SPEC, replicas=3))], offers, previous=first)["m"]
    assert _rings(three) == [("b",), ("c",), ("a",)]


def test_auto_replicas_go_to_every_asking_node_that_fits():
    auto = dataclasses.replace(SPEC, replicas=AUTO_REPLICAS)
    offers = nodes(a=400, b=420, c=410, d=100)
    got = plan([Request(auto, askers=("a", "c", "d"))], offers)["m"]
    # first where placement puts it (b), then each asker that fits it alone (d does not)
    assert _rings(got) == [("b",), ("a",), ("c",)]


def test_first_replicas_of_every_model_before_extra_ones():
    two = dataclasses.replace(SPEC, replicas=2)
    other = dataclasses.replace(SPEC, id="n")
    got = plan([Request(two), Request(other)], nodes(a=400, b=400))
    assert _rings(got["m"]) == [("a",)] and _rings(got["n"]) == [("b",)]


def test_replicas_parse_from_cards_and_requests():
    assert parse_replicas(3) == 3 and parse_replicas("auto") == AUTO_REPLICAS
    for bad in (0, -1, True, "2", 65):
        with pytest.raises(ValueError, match="replicas"):
            parse_replicas(bad)
    spec = dataclasses.replace(SPEC, replicas=AUTO_REPLICAS)
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ValueError, match="replicas"):
        ModelSpec.from_dict({**SPEC.to_dict(), "replicas": 99})
