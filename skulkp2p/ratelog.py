"""Log lines that strangers can cause, at most one per interval: the first event at once, then
one line per interval that counts what happened since, by source and by detail.

A node refuses connections and malformed requests without end if someone sends them; a line for
each would let anyone fill the disk and bury the lines that matter. The control plane's and the
ring's refused connections and the HTTP server's protocol errors go through a :class:`LogLimiter`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable

INTERVAL_S = 10.0
SHOWN = 3  # sources and details named in a summary line


class LogLimiter:
    """One kind of event (``what``, e.g. "cluster: refused connections to the control port"),
    logged at ``level`` at most once per ``interval_s``.

    ``note(source, detail)``: the first event after a quiet interval is logged at once
    ("WHAT: from SOURCE: DETAIL"); later ones are counted, and a summary ("WHAT: N in the last
    10 s, from A (n), B (m): DETAIL (n), ...") is logged when the interval ends (on the running
    event loop's timer, or at the next event when there is no loop)."""

    def __init__(self, logger: logging.Logger, what: str, level: int = logging.WARNING,
                 interval_s: float = INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic):
        self.logger = logger
        self.what = what
        self.level = level
        self.interval_s = interval_s
        self.clock = clock
        self.total = 0  # every event noted
        self.lines = 0  # lines logged
        self._window_end: float | None = None  # end of the interval the last line opened
        self._sources: collections.Counter[str] = collections.Counter()
        self._details: collections.Counter[str] = collections.Counter()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_loop: asyncio.AbstractEventLoop | None = None

    def note(self, source: str, detail: str) -> None:
        self.total += 1
        now = self.clock()
        if self._window_end is not None and now >= self._window_end:
            self.flush()
        if self._window_end is None:
            self._emit(f"{self.what}: from {source}: {detail}", now)
            return
        self._sources[source] += 1
        self._details[detail] += 1
        self._schedule(now)

    def flush(self) -> None:
        """Log the summary of what was counted (nothing if nothing was): the interval then
        starts again, or ends if it was quiet."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        now = self.clock()
        n = sum(self._sources.values())
        if not n:
            self._window_end = None
            return
        since = self.interval_s if self._window_end is None else \
            max(0.0, now - self._window_end + self.interval_s)
        sources = ", ".join(f"{s} ({c})" for s, c in self._sources.most_common(SHOWN))
        if len(self._sources) > SHOWN:
            sources += f" and {len(self._sources) - SHOWN} more"
        details = ", ".join(f"{d} ({c})" for d, c in self._details.most_common(SHOWN))
        self._sources.clear()
        self._details.clear()
        self._emit(f"{self.what}: {n} in the last {since:.0f} s, from {sources}: {details}", now)

    def _emit(self, line: str, now: float) -> None:
        self.logger.log(self.level, "%s", line)
        self.lines += 1
        self._window_end = now + self.interval_s

    def _schedule(self, now: float) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop: the next event after the interval logs the summary
        if self._timer is not None and self._timer_loop is loop and not loop.is_closed():
            return
        assert self._window_end is not None
        self._timer_loop = loop
        self._timer = loop.call_later(max(0.0, self._window_end - now), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.flush()
