"""What the decode loop asks of a drafter, declared: the `Drafter` protocol and the
`DrafterCapabilities` that say how a kind of drafter is driven.

The decode loop (loop.py) and the drafter policy (generate.py, the gates in
engine/drafting/gates.py) call these methods and read these capabilities; they never ask whether
a drafter has a method. A drafter subclasses the protocol and keeps the defaults of what it
cannot do: no trees, never quiet, nothing to observe. What a gate asks beyond the loop is
engine/drafting/drafter.py's `InnerDrafter`. The capabilities say where a default would not be
the same thing as the drafter lacking the ability (a gate prices a drafter again only if it can
be brought back in step, and so on). Here, in the loop's room, because the loop reads them;
the drafters, one room up, implement them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from skulkp2p.engine.model.forward import Forward
    from skulkp2p.engine.model.tree import DraftTree


@dataclass(frozen=True)
class DrafterCapabilities:
    """What a kind of drafter can do that changes how the loop or its gate drives it."""
    # Proposes token trees: where the forward verifies trees the loop asks `propose_tree`
    # (and `observe_tree` for a tree that is not a chain) instead of `propose`.
    trees: bool = False
    # Offers side branches beside its chain (`propose_branches`), from which a gate with trees
    # on builds a round's tree (gates.build_tree).
    branches: bool = False
    # Once switched off it can be brought back in step (`catch_up`): its gate prices it again
    # when the verify costs fall. A drafter that cannot stays off once priced off.
    resumes: bool = False
    # The drafting rows of a batch draft with it in one forward per depth (an MTP head:
    # engine/batching/head_batch.py), which the gate prices as one forward over those rows.
    shared_in_batch: bool = False
    # Can start its next draft early (`prefetch`), when the caller knows it will be asked.
    prefetches: bool = False
    # Drafts after tokens no forward has run yet (those a grammar forced, drafted before it):
    # it reads the history only. An MTP head drafts from the last verified row's hidden state,
    # so after unseen tokens it would draft for the wrong position.
    drafts_past_unseen: bool = True


NOTHING_MORE = DrafterCapabilities()


class Drafter(Protocol):
    """What the decode loop asks of a drafter. `propose` is the one method every drafter has
    of its own; the others default to a drafter that keeps no state and proposes chains."""

    name: str
    capabilities: DrafterCapabilities = NOTHING_MORE

    def propose(self, history: list[int], k: int) -> tuple[list[int], list[np.ndarray] | None]:
        """Up to k draft tokens following `history`, and the drafter's distributions q for each
        (None for a deterministic drafter, whose q is one-hot on its token)."""
        ...

    def propose_past_unseen(self, history: list[int], k: int
                            ) -> tuple[list[int], list[np.ndarray] | None]:
        """`propose` where `history` ends in tokens no forward has run yet (a grammar forced
        them): nothing from a drafter that cannot draft there (`drafts_past_unseen`)."""
        if not self.capabilities.drafts_past_unseen:
            return [], None
        return self.propose(history, k)

    def begin(self, prompt: list[int], forward: Forward) -> None:
        """Called once after the prompt (all but its last token) is prefilled; a drafter that
        reads the trunk's hidden rows finds them in `forward.last_hidden` (the rows of the
        positions this prefill ran: after a prefix-cache hit, those past the cached ones)."""
        return None

    def observe(self, drafted: int, accepted: int, emitted: list[int], forward: Forward) -> None:
        """Called after every verify round, after the caches were rolled back: `drafted` tokens
        were proposed, the first `accepted` of them were kept, and `emitted` (accepted drafts
        plus the verifier's own token) were emitted. `forward.last_hidden` holds the hidden rows
        of [pending, *draft] from that round's verify. Gates and depth control listen here too."""
        return None

    def quiet(self) -> bool:
        """Whether it expects to offer nothing for a while (a gate switched off): the loop then
        runs greedy steps pipelined, asking for a draft after every token (loop._pipelined).
        Taking back the step built ahead costs a whole step, so a drafter that merely found no
        match this round (it likely will next round) is not quiet."""
        return False

    def propose_tree(self, history: list[int], k: int) -> DraftTree | None:
        """A token tree (engine/model/tree.py) for this round, or None: asked instead of
        `propose` where `capabilities.trees` and the forward verifies trees (greedy and sampled:
        the sampled rule is tree_accept.py's). A tree that is a chain is verified as a chain
        (`observe`, with the chain's q from `tree.q`). Default: the chain `propose` gives."""
        from skulkp2p.engine.model.tree import DraftTree

        draft, q = self.propose(history, k)
        return DraftTree.chain(draft, q) if draft else None

    def observe_tree(self, tree: DraftTree, path: list[int], emitted: list[int],
                     forward: Forward) -> None:
        """After a round verified `tree` in one tree forward: `path` the accepted path's node
        indices, `emitted` the tokens, `forward.last_hidden` the rows of [pending, *path] (what
        a chain round leaves). Default: a round that drafted the tree's nodes and kept the
        path's."""
        self.observe(len(tree), len(path), emitted, forward)
