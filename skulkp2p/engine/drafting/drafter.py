"""What a gate asks of the drafter it wraps, declared: `InnerDrafter`, and the side `Branch`es a
drafter offers beside its chain.

The gates (gates.py) call these methods and read the drafter's capabilities
(engine/decode/drafter_seam.py: `DrafterCapabilities`); they never ask whether a drafter has a
method. A drafter subclasses `InnerDrafter` and keeps the defaults of what it cannot do: one
kind of round, no branches, nothing to keep in step, no early draft.

Imports no mlx (the suffix drafter and prompt lookup are pure Python).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

from skulkp2p.engine.decode.drafter_seam import Drafter

if TYPE_CHECKING:
    from skulkp2p.engine.model.forward import Forward

NO_PRIORS: Mapping[int, float] = MappingProxyType({})


class InnerDrafter(Drafter, Protocol):
    """What a gate (gates.GatedDrafter, gates.LookupThenModel) asks of the drafter it wraps,
    beyond the loop's questions. Each default is what a drafter without the matching ability
    does: nothing to keep in step, one kind of round, no branches, nothing to say early."""

    # The gate's starting belief per context (`context`) where it differs from the gate's own.
    context_priors: Mapping[int, float] = NO_PRIORS

    def context(self, history: list[int]) -> int:
        """Which kind of draft this round's would be: the gate keeps an acceptance estimate per
        kind (the suffix drafter tells long matches from short ones)."""
        return 0

    def propose_branches(self, history: list[int], k: int) -> tuple[list[int], list[Branch]]:
        """The chain `propose` gives and the side branches offered beside it (asked where
        `capabilities.branches`)."""
        return self.propose(history, k)[0], []

    def follow(self, accepted: int, emitted: list[int], forward: Forward) -> None:
        """A round another drafter drafted: keep in step with the trunk (an MTP head's cache
        must see every verified row) without counting the round as its own."""
        return None

    def lag(self, accepted: int, emitted: list[int], forward: Forward) -> None:
        """A round while the gate has it off: keep what `catch_up` needs, computing nothing."""
        return None

    def catch_up(self) -> None:
        """Bring it back in step after rounds it lagged (`capabilities.resumes`)."""
        return None

    def prefetch(self) -> None:
        """Start the next round's draft now (`capabilities.prefetches`)."""
        return None

    def first_choices(self, n: int) -> list[tuple[int, float]]:
        """Its n likeliest tokens for the first draft position with their probabilities, where
        it has them at hand without running anything (an MTP head); else none."""
        return []

    def offers_draft(self) -> bool:
        """Whether `propose` would find something to draft now; a drafter that cannot tell
        says it may (so no other drafter starts its own draft early for nothing)."""
        return True

    def continue_after(self, history: list[int], token: int, k: int) -> list[int]:
        """Up to k tokens that would follow `history` + [token], another drafter's guess of
        the next token; none where it has no continuation of its own."""
        return []


@dataclass
class Branch:
    """A side branch a drafter offers beside its chain: `tokens` would stand in for the chain's
    token at `depth` (0: the first draft token), under the chain's node at that depth; `share`
    is how often its first token followed there."""
    depth: int
    tokens: list[int]
    share: float
