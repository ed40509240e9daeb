"""Token-tree test material shared by tests/test_trees.py, tests/test_ring_trees.py and
tests/test_tree_sampling.py: a text whose contexts continue several ways, a fixed tree, a width
table where every branch pays, a tree drafter over the suffix drafter, and a card's speculation with
trees on."""

from __future__ import annotations

from skulkp2p.engine.drafting.gates import GatedDrafter
from skulkp2p.engine.drafting.suffix import SuffixDrafter

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




# On the reference BLAS a product's row does not depend on how many rows are multiplied with
# it, so a tree's rows are bit for bit its paths' rows. OpenBLAS (what the agents and the
# suite run) picks its kernels and blocking by the row count: the same row
# rounds differently in a 7-row tree and a 3-row chain (differences ~1e-7 on the tiny models'
# logits). There, a row must pick the same token and agree to ROW_TOLERANCE; a wrong mask or
# position moves logits by far more (a broken tree position: argmax 2 against 9690).
ROW_TOLERANCE = 1e-4


def same_rows(a, b) -> str | None:
    """None when logits rows `a` and `b` agree as this process's BLAS allows (above), else why
    not."""
    import mlx.core as mx

    from skulkp2p.engine.cpu import blas

    if mx.array_equal(a, b):
        return None
    if blas.fast_path_report()["blas"] != "openblas":
        return "differ (bit for bit expected on the reference BLAS)"
    diff = float(mx.abs(a - b).max())
    if not bool(mx.all(mx.argmax(a, axis=-1) == mx.argmax(b, axis=-1))):
        return f"pick another token (max difference {diff:.3g})"
    if diff > ROW_TOLERANCE:
        return f"differ by {diff:.3g} > {ROW_TOLERANCE}"
    return None
