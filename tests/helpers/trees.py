"""Token-tree test material shared by tests/test_trees.py, tests/test_ring_trees.py and
tests/test_tree_sampling.py: a text whose contexts continue several ways, a fixed tree, a width
table where every branch pays, a tree drafter over the suffix drafter, and a card's speculation with
trees on."""

from __future__ import annotations

from skulkp2p.engine.gates import GatedDrafter
from skulkp2p.engine.suffix import SuffixDrafter

# Code whose contexts are followed by different continuations, so that the suffix drafter has
# branches to offer (the same line opening continues three ways).
CODE = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
        "def mul(a, b):\n    return a * b\n\ndef add(a, b):\n    return a")

# A tree over the pending token 0: 1 <- 0, 2 <- 1, 3 <- 0, 4 <- 3, 5 <- 2, 6 <- 3.
TOKENS = [7, 11, 12, 13, 14, 15, 16]
PARENTS = [-1, 0, 1, 0, 3, 2, 3]

# A width cost table where any width costs one step: every branch the drafter offers pays, so
# the loop verifies trees in most rounds (the exactness tests want many trees, not speed).
FREE_WIDTH = {1: 1.0, 2: 1.0, 64: 1.0}


def tree_drafter(**kw) -> GatedDrafter:
    return GatedDrafter(SuffixDrafter(), FREE_WIDTH, 8, prior_accept=0.8, trees=True, **kw)


def trees_on(lm) -> dict:
    """The card's speculation with `[speculation.lookup] trees = true` (off by default)."""
    return {**lm.speculation, "lookup": {**lm.speculation.get("lookup", {}), "trees": True}}


