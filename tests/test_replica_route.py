"""Routing among a model's replicas (node/replica_route.py): the prompt's key chain, the
choice by longest held prefix within a load bound, the recent-key record. Pure functions."""

from __future__ import annotations

import pytest

from skulkp2p.node.replica_route import (
    PROMPT_BLOCK_CHARS,
    AffinityRecord,
    ReplicaView,
    affinity_chain,
    choose_replica,
    response_key,
)

U1 = {"role": "user", "content": "hello"}
A1 = {"role": "assistant", "content": "hi there"}
U2 = {"role": "user", "content": "tell me more"}


def chat(*messages):
    return affinity_chain("m", "/v1/chat/completions", {"model": "m", "messages": list(messages)})


def test_chain_shares_the_prefix_of_a_conversation():
    one, two = chat(U1), chat(U1, A1, U2)
    assert len(one) == 1 and len(two) == 3 and two[0] == one[0]
    assert chat(U2)[0] != one[0]  # another first message: nothing shared
    # key order inside a message does not matter; the model does
    assert chat({"content": "hello", "role": "user"}) == one
    assert affinity_chain("other", "/v1/chat/completions", {"messages": [U1]}) != one
    # Anthropic: the system prompt leads
    sys_chain = affinity_chain("m", "/v1/messages", {"system": "be brief", "messages": [U1]})
    assert len(sys_chain) == 2 and sys_chain[1] != one[0]
    # a plain prompt: blocks of characters, a longer prompt shares the first ones
    short = affinity_chain("m", "/v1/completions", {"prompt": "x" * PROMPT_BLOCK_CHARS})
    long = affinity_chain("m", "/v1/completions", {"prompt": "x" * PROMPT_BLOCK_CHARS + "y"})
    assert long[:1] == short and len(long) == 2
    # unreadable bodies key nothing
    assert affinity_chain("m", "/v1/chat/completions", None) == []
    assert affinity_chain("m", "/v1/chat/completions", {"messages": "no"}) == []


def test_responses_continue_where_the_response_was_stored():
    chain = affinity_chain("m", "/v1/responses",
                           {"previous_response_id": "resp_1", "input": "and then?"})
    assert chain[0] == response_key("m", "resp_1") and len(chain) == 2
    fresh = affinity_chain("m", "/v1/responses", {"input": [U1]})
    assert len(fresh) == 1


def test_longest_held_prefix_wins_within_the_load_bound():
    conv = chat(U1, A1, U2)
    a = ReplicaView("a", load=1, keys=frozenset(conv[:1]))
    b = ReplicaView("b", load=0, keys=frozenset())
    assert choose_replica(conv, [a, b]).node == "a"  # one more request than b: still a
    busy = ReplicaView("a", load=2, keys=a.keys)
    assert choose_replica(conv, [busy, b]).node == "b"  # past the bound: the least loaded
    assert choose_replica(conv, [busy, b], slack=2).node == "a"
    # the longer held prefix wins over a shorter one
    c = ReplicaView("c", load=0, keys=frozenset(conv[:2]))
    assert choose_replica(conv, [a, b, c]).node == "c"
    # equal matches: the less loaded
    d = ReplicaView("d", load=0, keys=frozenset(conv[:1]))
    assert choose_replica(conv, [a, d]).node == "d"


def test_no_match_goes_to_the_least_loaded_taking_turns():
    views = [ReplicaView("b", 0), ReplicaView("a", 0), ReplicaView("c", 3)]
    assert [choose_replica([], views, t).node for t in range(4)] == ["a", "b", "a", "b"]
    assert choose_replica(chat(U1), [ReplicaView("a", 2), ReplicaView("b", 1)]).node == "b"
    with pytest.raises(ValueError):
        choose_replica([], [])


def test_record_is_bounded_least_recently_used_out_first():
    rec = AffinityRecord(limit=3)
    rec.record("m", ["k1", "k2", "k3"])
    rec.record("m", ["k1"])  # used again: now the newest
    rec.record("m", ["k4"])
    assert rec.keys("m") == {"k1", "k3", "k4"}
    assert rec.gossip() == {"m": ["k3", "k1", "k4"]}
    v = rec.version
    rec.record("m", [])
    assert rec.version == v
    rec.forget("m")
    assert rec.gossip() == {} and rec.version == v + 1
