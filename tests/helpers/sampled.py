"""Material of the statistical sampling tests (tests/test_sampling_exactness.py,
tests/test_tree_sampling.py, tests/test_batch_sampling.py, tests/test_eagle.py): the exact
distributions plain sampling draws from, computed from the model's own rows, drafters that
propose fixed, skewed drafts, and a forward that computes each distinct call sequence once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from skulkp2p.engine.cache import caches
from skulkp2p.engine.decode.drafter_seam import Drafter, DrafterCapabilities
from skulkp2p.engine.decode.sampling import (
    SamplingParams,
    draw_with,
    process_logits,
    target_probs,
)
from skulkp2p.engine.model.forward import Forward, LocalForward
from skulkp2p.engine.model.tree import DraftTree
from tests.helpers.stats import goodness_of_fit


def draws_from(p: np.ndarray, rng: np.random.Generator, n: int) -> np.ndarray:
    """n draws from p: the tokens n calls of sampling.sample_from(p, rng) give, in one go (the
    same exponentials: an [n, V] block is what n calls of V give, raced the same way). For the
    draft tokens of the unit tests; the verifier still draws its own."""
    return np.array([draw_with(p, e) for e in rng.standard_exponential((n, len(p)))],
                    dtype=np.int64)


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


class FixedDrafter(Drafter):
    """Proposes the same tokens whatever the history: a maximally skewed deterministic drafter."""

    name = "fixed"

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    def propose(self, history, k):
        return list(self.tokens[:k]), None


class FixedTreeDrafter(Drafter):
    """Proposes the same tree every round (deterministic nodes, q one-hot)."""

    name = "fixed-tree"
    capabilities = DrafterCapabilities(trees=True)

    def __init__(self, tree: DraftTree):
        self.tree = tree

    def propose(self, history, k):
        return [], None

    def propose_tree(self, history, k):
        return self.tree if k >= 2 else None

    def observe_tree(self, tree, path, emitted, forward) -> None:
        pass


class ForwardMemo:
    """The outputs of forwards built by `make`, by the sequence of calls made on them since they
    were built (prefill, calls, rollbacks, tree verifies, kept paths, resets, trims): a
    forward's outputs are a deterministic function of that sequence, and the thousands of short
    seeded decodes of a statistical test repeat a few dozen sequences (the same prompt, the
    same drafts, a handful of emitted tokens), so each is computed once. `forward()` hands out
    a MemoForward.

    With `make_drafter`, `pair()` hands out a MemoForward and a MemoDrafter whose calls (begin,
    propose, observe) are part of the same sequence: for a DETERMINISTIC drafter (its drafts a
    function of those calls and the forward's outputs, no random draws), e.g. an MTP head."""

    def __init__(self, make: Callable[[], Any], make_drafter: Callable[[], Any] | None = None):
        self.make = make
        self.make_drafter = make_drafter
        if make_drafter is not None:
            # MemoDrafter offers chains only, and is never quiet: the loop takes the drafter's
            # own path only where the drafter has neither trees nor quiet stretches.
            drafter = make_drafter()
            assert not drafter.capabilities.trees and not drafter.quiet()
        probe = make()
        self.hidden = probe.hidden
        self.trees = probe.trees
        # (node, call) -> (child node, (output, last_hidden)); node 0: a fresh forward (and
        # drafter)
        self.nodes: dict[tuple[int, tuple], tuple[int, tuple[Any, Any]]] = {}
        self.computed = 0  # calls run for real (replays included)

    def forward(self) -> MemoForward:
        return MemoForward(self)

    def pair(self) -> tuple[MemoForward, MemoDrafter]:
        assert self.make_drafter is not None
        forward = MemoForward(self)
        return forward, MemoDrafter(forward)


class MemoForward(Forward):
    """A forward (engine/model/forward.py's seam, trees included) that answers a call sequence seen
    before from its ForwardMemo: the same logits and hidden rows, bit for bit, as the forward
    would compute (they are the arrays it computed the first time). On the first call of an
    unseen sequence it builds a real forward (and drafter), replays the calls so far on it and
    runs on it from then on. No lazy steps (the seam's default): sampled decoding never
    pipelines (loop._may_pipeline)."""

    def __init__(self, memo: ForwardMemo):
        self.memo = memo
        self.hidden = memo.hidden
        self._trees = memo.trees
        self.last_hidden = None
        self._node = 0
        self._calls: list[tuple] = []
        self._real: Any = None
        self._real_drafter: Any = None

    def _run(self, call: tuple) -> Any:
        key = (self._node, call)
        known = self.memo.nodes.get(key)
        if known is not None and self._real is None:
            self._node, (out, self.last_hidden) = known
            self._calls.append(call)
            return out
        if self._real is None:
            self._real = self.memo.make()
            if self.memo.make_drafter is not None:
                self._real_drafter = self.memo.make_drafter()
            for past in self._calls:
                self._apply(past)
        result = (self._apply(call), self._real.last_hidden)
        if known is None:
            known = (len(self.memo.nodes) + 1, result)
            self.memo.nodes[key] = known
        self._node = known[0]
        self._calls.append(call)
        out, self.last_hidden = result
        return out

    def _apply(self, call: tuple) -> Any:
        self.memo.computed += 1
        kind, args = call[0], call[1:]
        f, d = self._real, self._real_drafter
        if kind == "begin":
            return d.begin(list(args[0]), f)
        if kind == "propose":
            return d.propose(list(args[0]), args[1])
        if kind == "observe":
            return d.observe(args[0], args[1], list(args[2]), f)
        if kind == "reset":
            return f.reset()
        if kind == "trim":
            return caches.trim(f.cache, args[0])
        if kind == "prefill":
            return f.prefill(list(args[0]))
        if kind == "call":
            return f(list(args[0]))
        if kind == "rollback":
            return f.rollback(*args)
        if kind == "tree":
            return f.verify_tree(list(args[0]), list(args[1]))
        assert kind == "path", kind
        return f.keep_path(list(args[0]))

    def prefill(self, tokens: list[int]) -> None:
        self._run(("prefill", tuple(tokens)))

    def __call__(self, tokens: list[int]):
        return self._run(("call", tuple(tokens)))

    def rollback(self, keep: int, dropped: int) -> None:
        self._run(("rollback", keep, dropped))

    def verify_tree(self, tokens: list[int], parents: list[int]):
        return self._run(("tree", tuple(tokens), tuple(parents)))

    def keep_path(self, path: list[int]) -> None:
        self._run(("path", tuple(path)))

    def reset(self) -> None:
        self._run(("reset",))

    @property
    def trees(self) -> bool:
        return self._trees

    @property
    def cache(self) -> list[_Trim]:
        """Stands in for the caches where a drafter trims them (caches.trim, as
        DraftModelDrafter rewinds): a trim is one more call of the sequence. Anything else
        asked of it fails loudly."""
        return [_Trim(self)]


class _Trim:
    def __init__(self, forward: MemoForward):
        self.forward = forward

    def trim(self, n: int) -> int:
        self.forward._run(("trim", n))
        return n


class MemoDrafter(Drafter):
    """The drafter of a ForwardMemo.pair(): its calls go into its forward's call sequence, its
    drafts are the ones the real (deterministic) drafter gave there. Chains only."""

    name = "memo"

    def __init__(self, forward: MemoForward):
        self.forward = forward

    def begin(self, prompt: list[int], forward: Any) -> None:
        assert forward is self.forward
        self.forward._run(("begin", tuple(prompt)))

    def propose(self, history: list[int], k: int) -> tuple[list[int], Any]:
        drafts, q = self.forward._run(("propose", tuple(history), k))
        assert q is None, "a drafter with draft distributions draws at random: not memoisable"
        return list(drafts), q

    def observe(self, drafted: int, accepted: int, emitted: list[int], forward: Any) -> None:
        self.forward._run(("observe", drafted, accepted, tuple(emitted)))
