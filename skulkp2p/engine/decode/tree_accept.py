"""Which path of a verified token tree a request keeps: the exact multi-draft rule.

Greedy requests keep the children the target's own choices name (tree.greedy_walk; with a
repetition penalty each node's row is processed with its path first). Sampled requests whose
node's children are all deterministic (the suffix drafter's branches, an MTP head's top-k: q
one-hot) draw the node's token exactly as plain decoding does (the same race over the next
exponentials, over p, the target distribution at the node with the request's own temperature,
top-p/top-k/min-p and repetition penalty over the history along the path) and follow the child
that names it, if any. The emitted token is p-distributed and child t is kept with probability
p(t), and the draw is the one plain decoding makes, so a seeded request's output does not depend
on what was drafted (decode.verify_one is the same rule for a chain). Children with draft
distributions q_c use recursive rejection sampling (SpecInfer, Miao et al. 2023; "multi-draft
speculative sampling"): try the children in order; child c is accepted with
min(1, p(c) / q_c(c)), and on rejection p <- norm(max(p - q_c, 0)) before the next child; when
every child is rejected the token is drawn from the last residual. The emitted token is
distributed exactly as p (by induction over the children: each rejection leaves the
distribution of what is emitted next equal to the residual), though not coupled to plain's draw.

Stochastic children (q not one-hot) are exact only when each was drawn from its q given the
earlier ones; the drafters here give trees of deterministic nodes and chains with q.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from skulkp2p.engine.decode.sampling import (
    SamplingParams,
    greedy_token,
    process_logits,
    sample_from,
    target_probs,
)


def draw_child(p: np.ndarray, tokens: list[int], rng: np.random.Generator
               ) -> tuple[int | None, int]:
    """Deterministic children (q one-hot): (index of the child whose token plain decoding's own
    draw from p names, or None; that token). One draw, as plain decoding's."""
    token = sample_from(p, rng)
    return (tokens.index(token) if token in tokens else None), token


def accept_child(p: np.ndarray, tokens: list[int], qs: list[np.ndarray | None],
                 rng: np.random.Generator) -> tuple[int | None, np.ndarray]:
    """Recursive rejection sampling over one node's children (tokens[i] drafted with qs[i],
    None for one-hot): (index of the accepted child or None, the distribution to draw the
    node's own token from when none was accepted)."""
    residual = p
    for i, (token, q) in enumerate(zip(tokens, qs, strict=True)):
        if q is None:
            if rng.random() < residual[token]:
                return i, residual
            nxt = residual.copy()
            nxt[token] = 0.0
        else:
            if rng.random() * q[token] < residual[token]:  # u < p/q without dividing by 0
                return i, residual
            nxt = np.maximum(residual - q, 0.0)
        total = nxt.sum()
        if total <= 0.0:  # p == q on the support: a rejection of measure zero; keep p
            continue
        residual = nxt / total
    return None, residual


def children_of(parents: list[int]) -> dict[int, list[int]]:
    """Node -> its children's node indices, in index order (the order they are tried in)."""
    out: dict[int, list[int]] = {}
    for j in range(1, len(parents)):
        out.setdefault(parents[j], []).append(j)
    return out


def walk_tree(logits: mx.array, tokens: list[int], parents: list[int],
              qs: list[np.ndarray | None] | None, history: list[int],
              params: SamplingParams, rng: np.random.Generator) -> tuple[list[int], int]:
    """The accepted path (node indices, root excluded) and the token the target emits after
    it, for a tree of nodes 0..N (`tokens`, `parents` as tree.py; `qs[j - 1]` node j's draft
    distribution or None) whose verify gave `logits` [>= N + 1, V]. `history` ends with the
    pending token (node 0); node j's row is processed with history + the path to j."""
    children = children_of(parents)
    path: list[int] = []
    node = 0
    while True:
        row = process_logits(logits[node:node + 1], history + [tokens[j] for j in path], params)
        kids = children.get(node, [])
        if params.greedy:
            token = greedy_token(row)
            nxt = next((c for c in kids if tokens[c] == token), None)
            if nxt is None:
                return path, token
            path.append(nxt)
            node = nxt
            continue
        p = target_probs(row, params)
        if not kids:
            return path, sample_from(p, rng)
        kid_qs = [None if qs is None else qs[c - 1] for c in kids]
        if all(q is None for q in kid_qs):  # deterministic children: plain's own draw decides
            pick, token = draw_child(p, [tokens[c] for c in kids], rng)
            if pick is None:
                return path, token
            path.append(kids[pick])
            node = kids[pick]
            continue
        pick, residual = accept_child(p, [tokens[c] for c in kids], kid_qs, rng)
        if pick is None:
            return path, sample_from(residual, rng)
        path.append(kids[pick])
        node = kids[pick]
