"""What a row of a batch shows the drafting code of its request: the other rows of its forward
(`BatchView`) and how a ragged step runs (`StepPacking`).

A request's forward that is a row of a batch (row_forward.py: `RowForward.batch_view`) hands
these to its gate, which prices its drafts by the rows beside it (engine/drafting/gates.py).
Imports no mlx: the gates' cost model and its tests use these without a model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepPacking:
    """How a batched step whose rows verify different widths runs (engine/model/packed.py): which
    shares of one token row's work run on the rows' real tokens only, not on every position of
    the rows padded to the widest. The rest (attention and its projections) stays padded."""
    head: float  # the final norm and output head: packed in every ragged step
    mlps: float  # the layers' MLPs: packed once at least `mlps_from` token rows are padding
    mlps_from: int = 0

    def __post_init__(self) -> None:
        if not (0.0 <= self.head and 0.0 <= self.mlps and self.head + self.mlps <= 1.0):
            raise ValueError(f"packed shares must be >= 0 and sum to at most 1: head "
                             f"{self.head}, mlps {self.mlps}")
        if self.mlps_from < 0:
            raise ValueError(f"mlps_from must be >= 0, got {self.mlps_from}")


@dataclass(frozen=True)
class BatchView:
    """The other rows of the batched forward a row runs in, as the row decides its draft."""
    widths: tuple[int, ...] = ()  # their widths this step (the last step's, if not handed in)
    drafting: int = 0  # how many of them draft (and so may widen the forward too)
    packing: StepPacking | None = None  # how a ragged step runs (None: padded to the widest)


SOLO = BatchView()

