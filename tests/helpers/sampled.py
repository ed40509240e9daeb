"""Material of the statistical sampling tests (tests/test_sampling_exactness.py,
tests/test_tree_sampling.py, tests/test_batch_sampling.py): the exact distributions plain sampling
draws from, computed from the model's own rows, and drafters that propose fixed, skewed drafts."""

from __future__ import annotations

import numpy as np

from skulkp2p.engine.forward import LocalForward
from skulkp2p.engine.sampling import SamplingParams, process_logits, target_probs
from skulkp2p.engine.tree import DraftTree
from tests.helpers.stats import goodness_of_fit


def probs_after(model, history: list[int], params: SamplingParams) -> np.ndarray:
    """The exact distribution plain decoding draws the token after `history` from."""
    f = LocalForward(model)
    f.prefill(history[:-1])
    return target_probs(process_logits(f([history[-1]]), history, params), params)


def exact_joint(model, prompt: list[int], params: SamplingParams) -> dict[tuple, float]:
    """p(t1, t2, t3) of plain sampling over the supports of each step."""
    out = {}
    p1 = probs_after(model, prompt, params)
    for a in np.nonzero(p1)[0].tolist():
        p2 = probs_after(model, prompt + [a], params)
        for b in np.nonzero(p2)[0].tolist():
            p3 = probs_after(model, prompt + [a, b], params)
            for c in np.nonzero(p3)[0].tolist():
                out[(a, b, c)] = p1[a] * p2[b] * p3[c]
    return out


def joint_fit(samples: list[tuple[int, ...]], joint: dict[tuple, float]) -> float:
    """p-value of the samples (tuples of the first tokens) ~ the exact joint."""
    cells = list(joint)
    index = {c: i for i, c in enumerate(cells)}
    outside = [s for s in samples if s not in index]
    assert not outside, f"sequences of zero probability were emitted: {outside[:3]}"
    p = np.array([joint[c] for c in cells])
    return goodness_of_fit((index[s] for s in samples), p / p.sum())


def skewed_sequence(model, prompt: list[int], params: SamplingParams) -> list[int]:
    """Drafts [likely, likely, unlikely]: the first two are accepted often enough for chains to
    happen, the third is the least likely token the target still allows."""
    a = int(np.argmax(probs_after(model, prompt, params)))
    b = int(np.argmax(probs_after(model, prompt + [a], params)))
    p3 = probs_after(model, prompt + [a, b], params)
    c = int(np.argmin(np.where(p3 > 0, p3, np.inf)))
    return [a, b, c]


def fixed_tree(model, prompt: list[int], params: SamplingParams) -> DraftTree:
    """Root children: p's 2nd, 1st and 5th likeliest; under the first, p(. | it)'s 1st and
    3rd; under the second, its 2nd. Not in p's order, so the residual decides often."""
    o1 = np.argsort(-probs_after(model, prompt, params))
    a, b, c = int(o1[1]), int(o1[0]), int(o1[4])
    oa = np.argsort(-probs_after(model, prompt + [a], params))
    ob = np.argsort(-probs_after(model, prompt + [b], params))
    tree = DraftTree([a, b, c], [0, 0, 0], main=1)
    tree.add(1, int(oa[0]))
    tree.add(1, int(oa[2]))
    tree.add(2, int(ob[1]))
    return tree


class FixedDrafter:
    """Proposes the same tokens whatever the history: a maximally skewed deterministic drafter."""

    name = "fixed"

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    def begin(self, prompt, forward) -> None:
        pass

    def propose(self, history, k):
        return list(self.tokens[:k]), None

    def observe(self, drafted, accepted, emitted, forward) -> None:
        pass


class FixedTreeDrafter:
    """Proposes the same tree every round (deterministic nodes, q one-hot)."""

    name = "fixed-tree"

    def __init__(self, tree: DraftTree):
        self.tree = tree

    def begin(self, prompt, forward) -> None:
        pass

    def propose(self, history, k):
        return [], None

    def propose_tree(self, history, k):
        return self.tree if k >= 2 else None

    def observe(self, drafted, accepted, emitted, forward) -> None:
        pass

    def observe_tree(self, tree, path, emitted, forward) -> None:
        pass
