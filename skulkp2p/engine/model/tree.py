"""Token trees verified in ONE forward: the tree's shape, its attention mask and positions, the
greedy walk that picks the accepted path, and KV compaction to that path.

A round's tree has node 0 = the pending token and draft nodes 1..N, each with a parent of a
lower index (so every path runs through increasing indices). In the verify forward node j sees
the cached prefix, its ancestors and itself, and sits at position `offset + depth(j)`: its row is
what a forward over its own path alone computes (up to float rounding). Then the cache keeps the
prefix, node 0 and the accepted path's nodes in order, so that it equals a cache built by running
only that path.

RoPE with one position per token: mx.fast.rope takes one offset per batch row, so the stage
lays the tree's tokens out as rows of one token each for the rotation (`TreeRope`) and back; the
attention itself runs on the tree as one sequence, with the mask handed to the model through the
cache's `make_mask` (mlx-lm asks the cache for its mask: `TreeView`). Only families whose layers
hold plain KV caches and rotate with `self_attn.rope(x, offset=cache.offset)` take trees
(`tree_capable`); recurrent (qwen3_5) and sliding-window (gemma) families keep chains.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from skulkp2p.engine.cache.caches import compact_positions
from skulkp2p.engine.model.swapped import swapped

if TYPE_CHECKING:
    from mlx_lm.models.cache import KVCache

# Families whose attention is verified to rotate with `self_attn.rope(x, offset=cache.offset)`
# and to take its mask from the cache (mlx-lm's llama, qwen2, qwen3; SmolLM2 is llama).
TREE_FAMILIES = ("llama", "qwen2", "qwen3")


@dataclass
class DraftTree:
    """Draft nodes 1..N after the pending token (node 0): `tokens[i]` is node i + 1's token and
    `parents[i]` its parent's node index (0 for a child of the pending token, else < i + 1).
    `main` is the depth of the drafter's own chain (nodes 1..main), the rest are side branches.
    `q`: each node's draft distribution (a sampling drafter's chain), None where every node is
    deterministic (q one-hot on its token; sampled verification needs it: tree_accept.py)."""
    tokens: list[int]
    parents: list[int]
    main: int = 0
    side: list[int] = field(default_factory=list)  # node index where each side branch starts
    q: list[np.ndarray | None] | None = None

    @classmethod
    def chain(cls, tokens: list[int], q: Sequence[np.ndarray | None] | None = None
              ) -> DraftTree:
        return cls(list(tokens), list(range(len(tokens))), len(tokens),
                   q=None if q is None else list(q))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(p == i for i, p in enumerate(self.parents))

    def add(self, parent: int, token: int) -> int:
        """Append a node under `parent`; its node index."""
        if not 0 <= parent <= len(self.tokens):
            raise ValueError(f"parent {parent} is not a node of a tree of {len(self)} drafts")
        self.tokens.append(token)
        self.parents.append(parent)
        if self.q is not None:
            self.q.append(None)  # nodes added here are deterministic
        return len(self.tokens)

    def depths(self) -> list[int]:
        """Depth of nodes 0..N (node 0, the pending token, at 0)."""
        out = [0]
        for p in self.parents:
            out.append(out[p] + 1)
        return out

    def all_parents(self) -> list[int]:
        """Parents of nodes 0..N (-1 for node 0): what the forward takes."""
        return [-1, *self.parents]


def validate_parents(parents: list[int]) -> None:
    if not parents or parents[0] != -1:
        raise ValueError("a tree's node 0 (the pending token) has parent -1")
    for j, p in enumerate(parents[1:], start=1):
        if not 0 <= p < j:
            raise ValueError(f"node {j} has parent {p}: parents must come before their children")


def depths_of(parents: list[int]) -> list[int]:
    out = [0] * len(parents)
    for j in range(1, len(parents)):
        out[j] = out[parents[j]] + 1
    return out


def ancestors(parents: list[int]) -> np.ndarray:
    """[n, n] bool: a[j, i] when node i is node j or one of its ancestors."""
    n = len(parents)
    a = np.zeros((n, n), dtype=bool)
    for j in range(n):
        p = parents[j]
        if p >= 0:
            a[j] = a[p]
        a[j, j] = True
    return a


@dataclass
class TreeInputs:
    """What a tree forward needs besides its tokens: the mask [B, 1, W, max(len) + W] (row i's
    query j sees keys [0, len_i) and its ancestors at len_i + ancestor) and one position per
    token, row-major [B * W]."""
    mask: mx.array
    positions: mx.array


def tree_inputs(lengths: list[int], rows: list[list[int]], width: int) -> TreeInputs:
    """Mask and positions for B rows, row i holding lengths[i] cached tokens and a tree with
    parents rows[i] (a chain is a tree too), padded to `width` tokens (padding tokens see the
    prefix and themselves only; their rows are never read)."""
    end = max(lengths) + width
    mask = np.zeros((len(rows), 1, width, end), dtype=bool)
    pos = np.zeros((len(rows), width), dtype=np.int32)
    for i, (n, parents) in enumerate(zip(lengths, rows, strict=True)):
        w = len(parents)
        mask[i, 0, :, :n] = True
        mask[i, 0, :w, n:n + w] = ancestors(parents)
        pos[i, :w] = n + np.asarray(depths_of(parents), dtype=np.int32)
        for j in range(w, width):
            mask[i, 0, j, n + j] = True
            pos[i, j] = n + j
    return TreeInputs(mx.array(mask), mx.array(pos.reshape(-1)))


class TreeRope(nn.Module):
    """A layer's rotary embedding at one position per token: the tokens go through the model's
    own rope as B * W rows of one token, each with its offset (mx.fast.rope takes one per row)."""

    def __init__(self, inner: nn.Module, positions: mx.array):
        super().__init__()
        self.inner = inner
        self.positions = positions

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        b, h, w, d = x.shape
        rows = x.transpose(0, 2, 1, 3).reshape(b * w, h, 1, d)
        out = self.inner(rows, offset=self.positions)
        return out.reshape(b, w, h, d).transpose(0, 2, 1, 3)


class KVLayer(Protocol):
    """A layer's KV cache as a tree forward writes it: mlx-lm's KVCache (one request) or a
    batch's rows (engine/cache/batch_cache.py: an offset per row)."""

    @property
    def offset(self) -> int | mx.array: ...

    def update_and_fetch(self, keys: mx.array, values: mx.array
                         ) -> tuple[mx.array, mx.array]: ...


class TreeView:
    """A layer's cache during a tree forward: writes and offsets go to the cache, the mask is
    the tree's (mlx-lm builds its attention mask with `cache.make_mask`)."""

    def __init__(self, inner: KVLayer, mask: mx.array):
        self.inner = inner
        self.mask = mask

    @property
    def offset(self) -> int | mx.array:
        return self.inner.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self.inner.update_and_fetch(keys, values)

    def make_mask(self, n: int, **_: object) -> mx.array:
        return self.mask


def tree_ropes(layers: list[nn.Module], positions: mx.array
               ) -> contextlib.AbstractContextManager[None]:
    """Every layer rotates at the tree's positions for the duration of one forward."""
    return swapped([layer.self_attn for layer in layers], "rope",
                   lambda rope: TreeRope(rope, positions))


def tree_capable(model: nn.Module) -> bool:
    """Whether this model verifies trees: an attention-only family of TREE_FAMILIES whose every
    layer holds a plain KV cache and a rope of its own."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from skulkp2p.engine.model.trunk import Trunk

    text = Trunk(model).text
    family = getattr(getattr(text, "args", None), "model_type", None)
    if family not in TREE_FAMILIES:
        return False
    layers = Trunk(model).body.layers
    return (all(type(c) is KVCache for c in make_prompt_cache(model))
            and all(hasattr(getattr(la, "self_attn", None), "rope") for la in layers))


def greedy_walk(tree_parents: list[int], tree_tokens: list[int],
                chosen: list[int]) -> tuple[list[int], int]:
    """The accepted path (node indices, root excluded) and the verifier's own next token.

    `tree_tokens`/`tree_parents` cover nodes 0..N; `chosen[j]` is the target's greedy token at
    node j. From the root, the child whose token is the target's choice is accepted (at most one
    child per token: a drafter never offers the same token twice under one parent)."""
    children: dict[int, dict[int, int]] = {}
    for j in range(1, len(tree_parents)):
        children.setdefault(tree_parents[j], {}).setdefault(tree_tokens[j], j)
    path: list[int] = []
    node = 0
    while True:
        nxt = children.get(node, {}).get(chosen[node])
        if nxt is None:
            return path, chosen[node]
        path.append(nxt)
        node = nxt


def check_path(parents: list[int] | None, path: list[int]) -> None:
    """`path` is a root-down path of the tree with these parents (nodes 0..N): each node's
    parent is the one before it (node 0 before the first). ValueError otherwise, or when there
    is no tree (`parents` None) to keep a path of."""
    if parents is None:
        raise ValueError("no tree verified since the last kept path: nothing to keep")
    prev = 0
    for node in path:
        if not 0 < node < len(parents) or parents[node] != prev:
            raise ValueError(f"path {path} is not a path of the tree from its root")
        prev = node


def compact_kv(entry: KVCache, start: int, path: list[int]) -> None:
    """One layer's plain KV cache after a tree of w tokens written at `start`: keep node 0 and
    the path's nodes in order (a gather along the sequence axis), drop the rest."""
    moves = compact_positions(start, path)
    if moves is not None:
        dst, src = moves
        idx = mx.array(src)
        # Sources lie at or after their destinations: the gather reads before the write lands.
        entry.keys[..., dst[0]:dst[-1] + 1, :] = entry.keys[..., idx, :]
        entry.values[..., dst[0]:dst[-1] + 1, :] = entry.values[..., idx, :]
    entry.offset = start + 1 + len(path)
