"""When speculation pays, and how deep: the prompt gate, the runtime gate, the depth controller.

A verify of w tokens costs c(w) times a single-token step (measured per machine and dtype; see
`bench --widths`). With per-position acceptance a_1..a_k (a_i: chance that draft i is accepted
given the ones before it were), a round of depth k emits E(k) = 1 + a_1 + a_1 a_2 + ... tokens
for c(k+1), so the controller picks the k that maximises E(k) / c(k+1), and k = 0 (plain) when no
depth beats a plain step. The runtime gate turns a drafter off once the measured acceptance says
it cannot pay; lookup may come back when the output turns repetitive, and lookup or an MTP head
when the verify costs fall (a tensor group's live table) so far that the acceptance pays again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from skulkp2p.engine.batching.batch_view import SOLO, BatchView, StepPacking
from skulkp2p.engine.batching.row_forward import RowForward
from skulkp2p.engine.decode.drafter_seam import Drafter, DrafterCapabilities
from skulkp2p.engine.drafting.drafter import Branch, InnerDrafter
from skulkp2p.engine.json_types import JSONObject, JSONValue
from skulkp2p.engine.model.tree import DraftTree

if TYPE_CHECKING:
    from skulkp2p.engine.model.forward import Forward

log = logging.getLogger("skulkp2p.spec")

# Cost of a verify of w tokens relative to one on a 2-core x86 CPU for SmolLM2-135M (where it
# was measured: docs/architecture.md). Used until `bench --widths` has measured this machine.
DEFAULT_WIDTH_COSTS = {
    "float32": {1: 1.0, 2: 1.15, 3: 1.3, 4: 1.35, 6: 1.5, 8: 1.6, 12: 1.75, 16: 1.9},
    "bfloat16": {1: 1.0, 2: 1.3, 3: 2.0, 4: 2.1, 6: 3.0, 8: 2.8, 12: 3.9, 16: 4.9},
}


def width_cost(costs: Mapping[int, float], w: int) -> float:
    """c(w), linearly interpolated between measured widths, extrapolated past the widest."""
    if w in costs:
        return costs[w]
    ws = sorted(costs)
    if w > ws[-1]:
        slope = (costs[ws[-1]] - costs[ws[-2]]) / (ws[-1] - ws[-2]) if len(ws) > 1 else 1.0
        return costs[ws[-1]] + slope * (w - ws[-1])
    return float(np.interp(w, ws, [costs[x] for x in ws]))


def repetition_score(tokens: list[int], n: int = 3) -> float:
    """Share of n-grams that already occurred earlier in the sequence."""
    if len(tokens) <= n:
        return 0.0
    seen: set[tuple[int, ...]] = set()
    repeated = 0
    total = len(tokens) - n + 1
    for i in range(total):
        gram = tuple(tokens[i:i + n])
        repeated += gram in seen
        seen.add(gram)
    return repeated / total


def step_cost(costs: Mapping[int, float], widths: Sequence[int],
              packing: StepPacking | None = None) -> float:
    """Cost of one batched forward over rows of these widths, relative to one token row.

    Padded (no `packing`): every row runs the widest width, c(B W). Packed: the packed share s
    of the work runs on the N real tokens and the rest on the B W padded positions,
    (1 - s) c(B W) + s c(N): the table prices each part by the token rows it multiplies."""
    if not widths:
        raise ValueError("a step needs at least one row")
    padded = len(widths) * max(widths)
    real = sum(widths)
    full = width_cost(costs, padded)
    if packing is None or real == padded:
        return full
    share = packing.head + (packing.mlps if padded - real >= packing.mlps_from else 0.0)
    return (1.0 - share) * full + share * width_cost(costs, real)


@dataclass
class DepthController:
    """Per-position acceptance estimates (Beta prior + counts) and the best depth given costs."""
    costs: Mapping[int, float]
    max_depth: int
    prior_accept: float = 0.5
    prior_weight: float = 2.0
    draft_cost: float = 0.0  # cost of drafting one token, relative to one trunk step
    # The drafting rows of a batch draft in one forward per depth (an MTP head: head_batch.py):
    # D rows drafting k cost d k c(D), as the trunk's forward over D rows, not D d k.
    shared_drafts: bool = False
    batch: Callable[[], BatchView] | None = None  # the other rows of this request's forward
    accepted: list[float] = field(default_factory=list)
    tried: list[float] = field(default_factory=list)

    def rates(self) -> list[float]:
        out = []
        for i in range(self.max_depth):
            a = self.accepted[i] if i < len(self.accepted) else 0.0
            t = self.tried[i] if i < len(self.tried) else 0.0
            out.append((a + self.prior_accept * self.prior_weight) / (t + self.prior_weight))
        return out

    def record(self, drafted: int, accepted: int) -> None:
        while len(self.tried) < drafted:
            self.tried.append(0.0)
            self.accepted.append(0.0)
        # Position i was tried only if every earlier position was accepted.
        for i in range(min(drafted, accepted + 1)):
            self.tried[i] += 1
            self.accepted[i] += int(i < accepted)

    def best_depth(self, limit: int, batch: BatchView | None = None) -> tuple[int, float]:
        """(k, expected speed-up over plain) for k in 0..limit.

        In a batch of B rows (engine/batching/scheduler.py) one forward runs every row; its cost is
        `step_cost` of the rows' widths: padded to the widest, c(B W) (the table prices a
        forward by the token rows it multiplies), or, where the step runs packed
        (`batch.packing`: MLPs and head on the real tokens only), that part at the real tokens.
        A draft of k is priced by what it adds to THIS step's forward, given the other rows'
        widths (`batch`): the step with this row at k + 1 against it at 1 (padded: nothing
        when the others already verify as wide; packed: the MLPs and head of its k tokens),
        plus its drafter's own cost d k.
        The gain is the batch's tokens per unit of time against this row plain, counting one
        token for each other row: ((B - 1) + E(k)) cost(others, 1) / (B (cost(others, k + 1)
        + d k)).

        Priced only that way, rows that all went plain would each find drafting alone too dear
        and stay plain for good, although drafting together may pay (each widening costs the
        same for every drafting row's E(k)). So a draft is also priced as one of the D drafting
        rows (this one included) all drafting k, the other B - D plain:
        ((B - D) + D E(k)) c(B) / (B (cost(D x (k + 1), (B - D) x 1) + D d k)); the others then
        follow up to its width. The better of the two decides. For B = 1 both are
        E(k) / (c(k + 1) + d k). A drafter run per row costs the D rows D d k; one whose rows
        draft in one forward per depth (`shared_drafts`: a batched MTP head) d k c(D)."""
        view = batch if batch is not None else self.batch() if self.batch is not None else SOLO
        others = list(view.widths)
        rows = len(others) + 1
        drafting = min(view.drafting, rows - 1) + 1

        def step(widths: list[int]) -> float:
            return step_cost(self.costs, widths, view.packing)

        base = step(others + [1])
        together = width_cost(self.costs, rows)
        best_k, best_gain = 0, 1.0
        expected, reach = 1.0, 1.0
        for k, a in enumerate(self.rates()[:limit], start=1):
            reach *= a
            expected += reach
            drafting_cost = self.draft_cost * k  # one row's drafter
            alone = step(others + [k + 1]) + drafting_cost
            drafters = width_cost(self.costs, drafting) if self.shared_drafts else drafting
            all_of_us = step([k + 1] * drafting + [1] * (rows - drafting)) \
                + drafters * drafting_cost
            gain = max((rows - 1 + expected) * base / (rows * alone),
                       (rows - drafting + drafting * expected) * together / (rows * all_of_us))
            if gain > best_gain:
                best_k, best_gain = k, gain
        return best_k, best_gain


# Belief that a side branch offered beside the chain is taken when the chain's token at its
# depth is rejected, before any is measured (weighs as much as this many trials).
SIDE_PRIOR_ACCEPT = 0.5
SIDE_PRIOR_WEIGHT = 4.0
# A drafter that went off because no depth paid at the verify costs of that moment is priced
# again every this many tokens while off: where the costs are a live table (a tensor group's:
# call_costs.py) a burst of load can price wide calls far above what they cost once it passes,
# and the acceptance estimate, which cannot change without drafting, would keep it off for the
# rest of the request. With a fixed table the price never changes, nor does the decision.
REPRICE_EVERY = 16
# A round's tree holds at most this many draft nodes beside its chain.
MAX_SIDE_NODES = 12
# Beside lookup's chain, the model drafter's (MTP head's) likeliest first tokens offered as
# branches (the gate keeps those that pay).
MODEL_BRANCHES = 2


def build_tree(main: list[int], branches: list[Branch], rates: list[float], side_rate: float,
               costs: Mapping[int, float], rows: int = 1, draft_cost: float = 0.0,
               packing: StepPacking | None = None) -> DraftTree:
    """The chain plus the side branches that pay for their width.

    The chain's node at depth d is reached with r_d = a_1 ... a_d; a branch standing in for the
    chain's token d + 1 is taken with about r_d (1 - a_{d+1}) s share-weighted (s: the measured
    chance a branch is taken when the chain is rejected there), and then emits its tokens at
    the chain's rates. A branch (or its first token alone) goes in only when the round's
    expected tokens per unit of forward cost, E / c(rows x width), goes up with it; with
    `packing` (a batch whose ragged steps run packed) the forward is priced as it runs,
    step_cost of this row at the tree's width among rows - 1 plain ones."""
    tree = DraftTree.chain(main)
    m = len(main)
    reach = [1.0]
    for a in rates[:m]:
        reach.append(reach[-1] * a)
    expected = sum(reach[:m + 1])
    base = width_cost(costs, rows)
    plain = [1] * (rows - 1)

    def value(e: float, width: int) -> float:
        step = step_cost(costs, plain + [width], packing) + draft_cost * (width - 1)
        return (rows - 1 + e) * base / (rows * step)

    scored = []
    for b in branches:
        d = b.depth
        if d >= m or not b.tokens:
            continue
        a_next = rates[d] if d < len(rates) else 0.5
        taken = reach[d] * (1.0 - a_next) * side_rate * min(1.0, 2.0 * b.share)
        scored.append((taken, b))
    scored.sort(key=lambda x: -x[0])
    added = 0
    for taken, b in scored:
        for length in (min(len(b.tokens), m - b.depth), 1):
            if added + length > MAX_SIDE_NODES:
                continue
            gain, r = 0.0, taken
            for i in range(length):
                gain += r
                r *= rates[b.depth + 1 + i] if b.depth + 1 + i < len(rates) else 0.5
            width = 1 + len(tree)
            if value(expected + gain, width + length) > value(expected, width):
                parent = b.depth  # the chain's node at depth d is node d
                first = -1
                for t in b.tokens[:length]:
                    parent = tree.add(parent, t)
                    first = parent if first < 0 else first
                tree.side.append(first)
                expected += gain
                added += length
                break
    return tree


class GatedDrafter(Drafter):
    """Wraps a drafter with the runtime gate and the depth controller.

    The inner drafter observes every round while it may still draft (an MTP head must keep its
    cache in step with the trunk); a drafter gated off is no longer run at all. Off is for the
    rest of the request unless the drafter can be brought back in step (lookup reads the
    history; an MTP head's `catch_up` appends the rows it skipped): such a drafter comes back
    when the output turns repetitive (lookup, `can_return`) or when the verify costs it was
    priced at fell enough for a depth to pay at the acceptance it had (REPRICE_EVERY).
    """

    # (its propose_tree gives the inner drafter's tree where trees are on, else its chain)
    capabilities = DrafterCapabilities(trees=True)

    def __init__(self, inner: InnerDrafter, costs: Mapping[int, float], max_depth: int, *,
                 start_on: bool = True, can_return: bool = False, draft_cost: float = 0.0,
                 prior_accept: float = 0.5, prior_weight: float = 2.0, log_every: int = 64,
                 request_id: JSONValue = None, weigh_batch: bool = True, trees: bool = False):
        """`weigh_batch`: let the batch's size change the depth (see DepthController.
        best_depth). Off for a seeded sampled request, whose text depends on which drafts
        were offered: it must not depend on what else runs. `trees`: may propose token trees
        where the inner drafter offers branches (`propose_tree`)."""
        self.inner = inner
        self.trees = trees
        self.weigh_batch = weigh_batch
        self.name = inner.name
        self.controller = DepthController(costs, max_depth, prior_accept=prior_accept,
                                          prior_weight=prior_weight, draft_cost=draft_cost)
        # One estimate per kind of draft the inner drafter says a round's is (`context`: the
        # suffix drafter tells long matches from short ones, whose drafts run far shorter);
        # the round's kind picks the depth and learns from its outcome.
        self._controllers: dict[int, DepthController] = {0: self.controller}
        self._active = self.controller
        self.on = start_on
        self.can_return = can_return
        self.events: list[JSONObject] = []
        self.generated = 0
        self.rounds = 0
        self.drafted = 0
        self.accepted = 0
        self.log_every = log_every
        self._next_log = log_every
        self.request_id = request_id
        self._recent: list[int] = []
        self.side_offered = 0  # side branches offered beside the chain (trees)
        self.side_trials = 0  # ... whose parent was reached and the chain rejected below it
        self.side_taken = 0  # ... and that were then taken
        self.tree_rounds = 0
        # Set while off because no depth paid: the estimate that decided it, and the depth
        # limit it was asked for (priced again every REPRICE_EVERY tokens).
        self._priced_off: tuple[DepthController, int] | None = None
        self._next_reprice = 0
        self.can_reprice = can_return or inner.capabilities.resumes

    @property
    def side_rate(self) -> float:
        """Chance a side branch is taken when the chain is rejected at its depth."""
        return (self.side_taken + SIDE_PRIOR_ACCEPT * SIDE_PRIOR_WEIGHT) / (
            self.side_trials + SIDE_PRIOR_WEIGHT)

    def propose_tree(self, history: list[int], k: int, extra: list[Branch] | None = None
                     ) -> DraftTree | None:
        """A token tree for this round (gates.build_tree), or None: the chain `propose` would
        give, with the side branches the inner drafter offers (and `extra` ones from another
        drafter) where they pay for their width."""
        if not self.inner.capabilities.branches or not self.trees or not self.on:
            draft, q = self.propose(history, k)
            return DraftTree.chain(draft, q) if draft else None
        self._choose_controller(history)
        depth = self._depth(k)
        if depth == 0:
            return None
        main, branches = self.inner.propose_branches(history, depth)
        if not main:
            return None
        if extra:
            offered = {b.tokens[0] for b in branches if b.depth == 0} | {main[0]}
            branches = branches + [b for b in extra if b.tokens[0] not in offered]
        # (the rows of this forward price its widths, as the step runs: gates.step_cost)
        view = self.controller.batch() if self.controller.batch is not None else SOLO
        return build_tree(main, branches, self._active.rates(), self.side_rate,
                          self.controller.costs, len(view.widths) + 1,
                          self.controller.draft_cost, view.packing)

    def observe_tree(self, tree: DraftTree, path: list[int], emitted: list[int],
                     forward: Forward) -> None:
        """A tree round: the chain's controller learns from the chain's part of the path (how
        deep the chain was right), the side estimate from whether a side branch was taken."""
        on_chain = 0
        while on_chain < len(path) and path[on_chain] == on_chain + 1 and on_chain < tree.main:
            on_chain += 1
        self.tree_rounds += 1
        self.side_offered += len(tree.side)
        depths = tree.depths()
        for node in tree.side:
            d = depths[node] - 1  # the branch stands in for the chain's token d + 1
            if on_chain == d:
                self.side_trials += 1
                self.side_taken += len(path) > d and path[d] == node
        self._observe(len(tree), len(path), emitted, forward, chain=(tree.main, on_chain),
                      tree=(tree, path))

    def quiet(self) -> bool:
        """Off (for good, or until the output turns repetitive): nothing to offer for a while
        (decode runs such stretches pipelined)."""
        return not self.on

    def begin(self, prompt: list[int], forward: Forward) -> None:
        # A row of a batch shows the other rows of its forwards (a forward of its own: none).
        if isinstance(forward, RowForward):
            forward.drafts = True  # (the other rows' gates count it among the drafting rows)
            if self.weigh_batch:
                self.controller.batch = forward.batch_view
                # (an MTP head's rows draft in one forward per depth: engine/batching/head_batch.py)
                self.controller.shared_drafts = self.inner.capabilities.shared_in_batch
        self.inner.begin(prompt, forward)

    def propose(self, history: list[int], k: int) -> tuple[list[int], list[np.ndarray] | None]:
        if not self.on:
            return [], None
        self._choose_controller(history)
        depth = self._depth(k)
        if depth == 0:
            return [], None
        return self.inner.propose(history, depth)

    def propose_past_unseen(self, history: list[int], k: int
                            ) -> tuple[list[int], list[np.ndarray] | None]:
        if not self.inner.capabilities.drafts_past_unseen:
            return [], None
        return self.propose(history, k)

    def _choose_controller(self, history: list[int]) -> None:
        kind = self.inner.context(history)
        active = self._controllers.get(kind)
        if active is None:
            c = self.controller
            priors = self.inner.context_priors
            active = self._controllers[kind] = DepthController(
                c.costs, c.max_depth, prior_accept=priors.get(kind, c.prior_accept),
                prior_weight=c.prior_weight, draft_cost=c.draft_cost, batch=c.batch)
        self._active = active

    def _depth(self, k: int) -> int:
        depth, _ = self._active.best_depth(k)
        if depth == 0 and self._active.best_depth(k, SOLO)[0] > 0:
            return 0  # pays alone but not in this batch: back off for this round only
        if depth == 0:
            # Once the estimate says no depth pays, it cannot change without drafting: the
            # drafter is off (lookup may come back, see observe; the costs may fall, _reprice).
            self._switch(False, "acceptance below break-even")
            if self.can_reprice:
                self._priced_off = (self._active, k)
                self._next_reprice = self.generated + REPRICE_EVERY
        return depth

    def observe(self, drafted: int, accepted: int, emitted: list[int], forward: Forward) -> None:
        self._observe(drafted, accepted, emitted, forward)

    def _observe(self, drafted: int, accepted: int, emitted: list[int], forward: Forward,
                 chain: tuple[int, int] | None = None,
                 tree: tuple[DraftTree, list[int]] | None = None) -> None:
        if self.on or self.can_return:  # a drafter that is off for good stops costing anything
            if tree is not None:
                self.inner.observe_tree(*tree, emitted, forward)
            else:
                self.inner.observe(drafted, accepted, emitted, forward)
        else:
            self._lag(accepted, emitted, forward)
        self.generated += len(emitted)
        self._recent = (self._recent + emitted)[-64:]
        if drafted:
            self.rounds += 1
            self.drafted += drafted
            self.accepted += accepted
            self._active.record(*(chain if chain is not None else (drafted, accepted)))
        elif not self.on and self.can_return and repetition_score(self._recent) >= 0.3:
            # Output turned repetitive: give lookup another chance with a fresh estimate.
            for c in self._controllers.values():
                c.accepted.clear()
                c.tried.clear()
            self.rounds = 0
            self._priced_off = None
            self._switch(True, "output turned repetitive")
        else:
            self._reprice()
        if self.generated >= self._next_log and self.drafted:
            self._next_log += self.log_every
            log.info("%s acceptance so far: %d/%d (%.0f%%)%s", self.name, self.accepted,
                     self.drafted, 100 * self.accepted / self.drafted,
                     f" [request {self.request_id}]" if self.request_id is not None else "")

    def follow(self, accepted: int, emitted: list[int], forward: Forward) -> None:
        """A round another drafter drafted: keep the inner drafter in step (an MTP head's cache
        must see every verified row) without counting the round as its own."""
        if self.on or self.can_return:
            self.inner.follow(accepted, emitted, forward)
        else:
            self._lag(accepted, emitted, forward)
        self.generated += len(emitted)
        self._recent = (self._recent + emitted)[-64:]
        self._reprice()

    def _reprice(self) -> None:
        """Off because no depth paid: every REPRICE_EVERY tokens, whether one pays now at the
        verify costs of now (alone: in a batch the round's own pricing backs off again where
        the batch says so). If so, bring the inner drafter back in step and switch it on."""
        if self.on or self._priced_off is None or self.generated < self._next_reprice:
            return
        self._next_reprice = self.generated + REPRICE_EVERY
        controller, limit = self._priced_off
        if controller.best_depth(limit, SOLO)[0] == 0:
            return
        self._priced_off = None
        self.inner.catch_up()
        self._switch(True, "verify costs fell")

    def _lag(self, accepted: int, emitted: list[int], forward: Forward) -> None:
        # Off for good: an MTP head only keeps references to the verified rows (no compute),
        # so that its cache can be brought in step for the prefix cache at the end.
        self.inner.lag(accepted, emitted, forward)

    def _switch(self, on: bool, reason: str) -> None:
        self.on = on
        self.events.append({"at_token": self.generated, "event": "on" if on else "off",
                            "reason": reason})
        log.info("%s drafter %s at token %d: %s", self.name, "on" if on else "off",
                 self.generated, reason)


class LookupThenModel(Drafter):
    """Auto drafting when the model has its own drafter (MTP head or draft model): prompt lookup
    where the history has a match, the model drafter everywhere else.

    Lookup is free and, where it matches (echoed code, quoted text), drafts long runs the model
    drafter rarely gets right; a head drafts novel text where lookup has nothing. Each keeps its
    own gate and depth controller, fed only by the rounds it drafted; the model drafter follows
    every round so that its cache stays in step with the trunk."""

    capabilities = DrafterCapabilities(trees=True)

    def __init__(self, lookup: GatedDrafter, model: GatedDrafter):
        self.lookup = lookup
        self.model = model
        self.name = f"lookup+{model.name}"
        self._source: GatedDrafter | None = None  # who drafted the round being verified
        self.prefetch_calls = 0  # rounds after which the model drafter started its draft early

    @property
    def events(self) -> list[JSONObject]:
        return sorted(({**e, "drafter": g.name} for g in (self.lookup, self.model)
                       for e in g.events), key=_at_token)

    def quiet(self) -> bool:
        return self.lookup.quiet() and self.model.quiet()

    def begin(self, prompt: list[int], forward: Forward) -> None:
        self.lookup.begin(prompt, forward)
        self.model.begin(prompt, forward)

    def propose(self, history: list[int], k: int) -> tuple[list[int], list[np.ndarray] | None]:
        drafts, q = self.lookup.propose(history, k)
        if drafts:
            self._source = self.lookup
            return drafts, q
        self._source = self.model
        drafts, q = self.model.propose(history, k)
        return self._continued(history, drafts, q, k)

    def propose_past_unseen(self, history: list[int], k: int
                            ) -> tuple[list[int], list[np.ndarray] | None]:
        """After tokens a grammar forced: lookup (it reads the history), and the model
        drafter only where it can draft there (a draft model; not an MTP head)."""
        drafts, q = self.lookup.propose(history, k)
        if drafts:
            self._source = self.lookup
            return drafts, q
        self._source = self.model
        return self.model.propose_past_unseen(history, k)

    def _continued(self, history: list[int], drafts: list[int], q: list[np.ndarray] | None,
                   k: int) -> tuple[list[int], list[np.ndarray] | None]:
        """The model drafter's one-token guess, continued by lookup where the guess makes a
        match (suffix.SuffixDrafter.continue_after: after an edit, the head's token often
        resumes a copy that lookup alone had lost)."""
        if len(drafts) != 1 or q is not None or not self.lookup.on or k < 2:
            return drafts, q
        return drafts + self.lookup.inner.continue_after(history, drafts[0], k - 1), q

    def propose_tree(self, history: list[int], k: int) -> DraftTree | None:
        """Lookup's tree, with the model drafter's first choice beside it as one more branch
        (an MTP head has it at hand: nothing runs) where it differs and pays."""
        extra = []
        if self.model.on and self.lookup.trees and self.lookup.on:
            extra = [Branch(0, [t], p) for t, p in self.model.inner.first_choices(MODEL_BRANCHES)]
        tree = self.lookup.propose_tree(history, k, extra)
        if tree is not None:
            self._source = self.lookup
            return tree
        self._source = self.model
        # The model drafter's own tree (an MTP head's top-k where they are close), or its
        # chain with its q (a sampling drafter's chain is verified with q).
        tree = self.model.propose_tree(history, k)
        if tree is not None and tree.is_chain and tree.q is None:
            drafts, _ = self._continued(history, tree.tokens, None, k)
            if len(drafts) > len(tree.tokens):
                return DraftTree.chain(drafts)
        return tree

    def observe_tree(self, tree: DraftTree, path: list[int], emitted: list[int],
                     forward: Forward) -> None:
        source, self._source = self._source, None
        if source is self.model:
            self.model.observe_tree(tree, path, emitted, forward)
            self.lookup.observe(0, 0, emitted, forward)  # may bring lookup back on
            self._prefetch()
            return
        self.lookup.observe_tree(tree, path, emitted, forward)
        self.model.follow(len(path), emitted, forward)
        self._prefetch()

    def observe(self, drafted: int, accepted: int, emitted: list[int], forward: Forward) -> None:
        source, self._source = self._source, None
        if source is self.lookup:
            self.lookup.observe(drafted, accepted, emitted, forward)
            self.model.follow(accepted, emitted, forward)
        else:  # the model drafted, or nobody did (a plain step): the model observes it
            self.model.observe(drafted, accepted, emitted, forward)
            self.lookup.observe(0, 0, emitted, forward)  # may bring lookup back on
        self._prefetch()

    def _prefetch(self) -> None:
        """After a round: when lookup will have no draft for the next one, the model drafter
        will be asked, so let it start its draft now (an MTP head's `prefetch`: its evaluation
        then overlaps the loop's Python between rounds instead of following it). Where lookup
        drafts, the head's rows stay unevaluated until a round needs them."""
        if not self.model.inner.capabilities.prefetches or not self.model.on:
            return
        if self.lookup.on and self.lookup.inner.offers_draft():
            return
        self.prefetch_calls += 1
        self.model.inner.prefetch()

    def counts(self) -> dict[str, dict[str, int]]:
        return {g.name: {"rounds": g.rounds, "drafted": g.drafted, "accepted": g.accepted}
                for g in (self.lookup, self.model)}


def _at_token(event: JSONObject) -> int:
    at = event["at_token"]
    assert isinstance(at, int)  # (the gates write it)
    return at
