"""Verify-width costs that follow the calls a forward really makes.

The depth controller and the gates (gates.py) price a draft of k tokens by c(k + 1), the cost of
a verify call of k + 1 rows relative to one row. Where that table comes from a single probe (a
tensor-parallel group times its widths once, when it forms: engine/parallel/tensor/group.py), it holds whatever
state the machine was in that minute: on a shared CPU a probe can read nearly flat while the
decode calls later grow steeply with their rows, so the controller drafts as deep as where wide
verifies really are cheap (docs/measurements/tensor-parallel.md, "A call's cost grows with its
rows").

A `LiveWidthCosts` is that table, seeded by the probe's seconds and then following the seconds
of the forward's own verify calls: the forward that runs them records each (`observe`), the
controllers read the table (it is a Mapping {w: relative cost}, as the static tables are), so
the decode loop never learns where its forward runs or that it is being timed.

Per width, the estimate is the median of the last `window` (32) calls together with the probe's
counted as `prior_calls` (3) calls: two slow calls (another process scheduled in) move nothing,
four calls of a width outvote the probe. Relative to its own minute:
a call of w > 1 rows is kept as its seconds over the one-row estimate at the time it was made,
and the table's w is the median of those ratios (times the one-row estimate now, for seconds).
Kept in seconds, each width's estimate held calls of whatever minute that width was last called
in: one-row calls of a quiet minute against a few two-row calls of a busy one priced drafting
off, and, drafting no more wide calls, the table never learned otherwise
(docs/measurements/tensor-parallel.md, "a call priced against its own minute").

Why 32 calls and not 16, and why a wide width goes stale: load comes in bursts of a second or
two in which every call costs several times more (the collectives wait for a core), and a spec
arm's two-row MTP rounds are few. With 16, most of a window could fall in bursts, each call
priced against the one-row calls before it, so w2 read above what the MTP head's gate allows;
the gate switched the head off for the request and, no two-row call coming to correct it, at
token 0 in the next ones. Replayed on recorded calls, the median of 32 stays near the quiet
two-row cost (docs/measurements/tensor-parallel.md, "why code-edit missed"). And a wide
width's calls are forgotten once `stale_calls` calls of more than one row (any width) came
after them, so a width that the gates stopped drafting (the MTP head off at token 0 in every
later request, while lookup still drafts wider calls) falls back to its neighbours' and the
probe's estimate instead of staying dear for good. Counted in wide calls, not all calls: a
plain request's one-row calls say nothing about a wide width (counted in all calls, a spec
run's two-row calls went stale across the next plain run, leaving a burst's few calls to
decide). One-row calls, the reference of every ratio, never go stale. (Not a low quantile
instead of the median: against a one-row reference taken the same way it priced wide calls
steeper on a loaded machine, since the many one-row calls find the quiet moments the few wide
ones do not; same page.)

Widths
with no call yet are interpolated between the observed ones; past the widest observed, each row
more costs what the observed rows cost on average (the line through (1, 1) and the widest
observed), never less than the probe said. Finally each width costs at least every narrower one
(a call of more rows never costs less: a width that looks cheaper is noise).

No mlx here: plain numbers, so the tests feed recorded call times.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from skulkp2p.engine.protocol import VerifyCosts

# The last this many calls of a width make its estimate (with the probe's prior). 32, not 16:
# on a code-edit bench's recorded calls 16 priced w2 by its bursts, 32 near its quiet cost
# (docs/measurements/tensor-parallel.md, "why code-edit missed"; python -m skulkp2p bench
# --nodes 2 --parallel tensor).
WINDOW = 32
# The probe's time weighs as much as this many calls: two calls move nothing, four outvote it.
# 3, not 2: with 2, the median of the probe's two and two calls is their midpoint, so the first
# two two-row calls, in a burst, could price the MTP head off for every later request, with no
# two-row call coming to correct it (same page). The probe (every width interleaved, back to
# back) is the cleanest relative measurement the group has.
PRIOR_CALLS = 3
# A wide width's calls are forgotten once this many calls of more than one row came after them
# (about ten requests drafting only lookup's copies; three or four drafting on most rounds).
STALE_CALLS = 128
# Calls wider than this are not verify rounds (a prefill chunk): not recorded.
MAX_WIDTH = 64


def _interp(x: float, x0: float, y0: float, x1: float, y1: float) -> float:
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class LiveWidthCosts(Mapping[int, float]):
    """{width: cost of a call of that many rows relative to one row}, from a probe's seconds
    and then the calls observed. Thread-safe: one forward records, any thread reads (the table
    read is a dict replaced whole on each observation)."""

    def __init__(self, seed_seconds: Mapping[int, float], *, window: int = WINDOW,
                 prior_calls: int = PRIOR_CALLS, max_width: int = MAX_WIDTH,
                 where: str = "", stale_calls: int = STALE_CALLS):
        seed = {int(w): float(s) for w, s in seed_seconds.items()}
        if 1 not in seed:
            raise ValueError("the seed needs the time of a one-row call (width 1)")
        if any(s <= 0 for s in seed.values()) or any(w < 1 for w in seed):
            raise ValueError(f"seed seconds must be positive at widths >= 1: {seed}")
        if window < 1 or prior_calls < 0:
            raise ValueError("window must be >= 1 and prior_calls >= 0")
        if stale_calls < 1:
            raise ValueError("stale_calls must be >= 1")
        self.stale_calls = stale_calls
        self._wide_seen = 0  # calls of more than one row observed: the age of a kept call
        self.seed = dict(sorted(seed.items()))
        self.window = window
        self.prior_calls = prior_calls
        self.max_width = max_width
        self.where = where
        self.seeded_at = time.time()
        self.updated_at = self.seeded_at  # Unix time of the last observed call
        self._calls: dict[int, deque[tuple[int, float]]] = {}  # (_wide_seen then, value)
        self._count: dict[int, int] = {}  # calls observed per width, all time
        self._lock = threading.Lock()
        self._seconds, self._relative = self._estimate()
        # Called (on the recording thread) after each observed call: whoever shows the table
        # elsewhere (a node's stage report) refreshes it.
        self.on_change: Callable[[], None] | None = None

    # -- Mapping over the relative costs (what gates.width_cost reads) ---------------------
    def __getitem__(self, width: int) -> float:
        return self._relative[width]

    def __iter__(self) -> Iterator[int]:
        return iter(self._relative)

    def __len__(self) -> int:
        return len(self._relative)

    def __contains__(self, width: object) -> bool:
        return width in self._relative

    # -- recording ---------------------------------------------------------------------------
    def observe(self, width: int, seconds: float) -> None:
        """One verify call of `width` rows took `seconds` (as the decode loop waited for it)."""
        if width < 1 or width > self.max_width or not seconds > 0:
            return
        with self._lock:
            # A wide call is kept as its cost relative to the one-row calls of its own minute
            # (the one-row estimate now), not in seconds: see "Relative to its own minute".
            value = float(seconds) if width == 1 else float(seconds) / self._typical(1)
            self._wide_seen += width > 1
            self._calls.setdefault(width, deque(maxlen=self.window)).append(
                (self._wide_seen, value))
            self._count[width] = self._count.get(width, 0) + 1
            self.updated_at = time.time()
            self._seconds, self._relative = self._estimate()
        if self.on_change is not None:  # (outside the lock: it may read the table)
            self.on_change()

    def seconds(self) -> dict[int, float]:
        """The current estimate of one call's seconds per width (the table's widths)."""
        return dict(self._seconds)

    def relative(self) -> dict[int, float]:
        return dict(self._relative)

    def snapshot(self) -> VerifyCosts:
        """The table as /v1/models, /v1/cluster and /metrics show it: seconds per width now,
        the calls behind each width, the probe it was seeded with, the time of its last call."""
        from skulkp2p.engine.protocol import VerifyCosts

        return VerifyCosts(self.seconds(), self.updated_at, self.where, source="live",
                           calls=self.calls(), probe_seconds=dict(self.seed))

    def calls(self) -> dict[int, int]:
        """How many calls of each width were observed (all time)."""
        with self._lock:
            return dict(sorted(self._count.items()))

    # -- the estimate --------------------------------------------------------------------------
    def _seed_at(self, width: int) -> float:
        """The probe's seconds at any width (linear between its widths, past the widest along
        its last segment)."""
        ws = list(self.seed)
        if width in self.seed:
            return self.seed[width]
        if len(ws) == 1:
            return self.seed[ws[0]]
        if width > ws[-1]:
            return max(self.seed[ws[-1]], _interp(width, ws[-2], self.seed[ws[-2]], ws[-1],
                                                  self.seed[ws[-1]]))
        hi = next(w for w in ws if w > width)
        lo = max(w for w in ws if w < width)
        return _interp(width, lo, self.seed[lo], hi, self.seed[hi])

    def _recent(self, width: int) -> list[float]:
        """The width's kept calls that are not stale (one-row calls never are)."""
        return [v for at, v in self._calls.get(width, ())
                if width == 1 or self._wide_seen - at < self.stale_calls]

    def _typical(self, width: int) -> float:
        """Width 1: the median of its last calls' seconds; a wider width: of its
        calls' costs relative to one row (each against the one-row estimate when it was made);
        the probe's value counted as `prior_calls` calls."""
        prior = self._seed_at(width) / (self.seed[1] if width > 1 else 1.0)
        return statistics.median([prior] * self.prior_calls + self._recent(width))

    def _estimate(self) -> tuple[dict[int, float], dict[int, float]]:
        one = self._typical(1)
        rel_obs = {1: 1.0, **{w: self._typical(w) for w in sorted(self._calls)
                              if w > 1 and self._recent(w)}}
        seed_one = self.seed[1]
        widths = sorted(set(self.seed) | set(rel_obs))
        obs_ws = sorted(rel_obs)
        widest = obs_ws[-1]
        rel: dict[int, float] = {}
        for w in widths:
            if w in rel_obs:
                r = rel_obs[w]
            elif w < widest:  # between two observed widths
                lo = max(x for x in obs_ws if x < w)
                hi = min(x for x in obs_ws if x > w)
                r = _interp(w, lo, rel_obs[lo], hi, rel_obs[hi])
            else:  # past every observed width: the observed rows' average per row, or the probe
                per_row = (rel_obs[widest] - 1.0) / (widest - 1) if widest > 1 else 0.0
                r = max(self._seed_at(w) / seed_one, rel_obs[widest] + per_row * (w - widest))
            rel[w] = r
        out: dict[int, float] = {}
        floor = 0.0
        for w in widths:  # a call of more rows never costs less than a narrower one
            floor = max(floor, rel[w])
            out[w] = round(floor, 4)
        out[1] = 1.0
        return {w: out[w] * one for w in widths}, out
