"""Progress of a long step (fetching, converting a model) on stderr.

`ProgressBar(label, stream)` is the `progress(done, total)` callback the model store hands to a
fetch or a conversion. On a terminal it draws a tqdm bar, redrawn in place; anywhere else (a log
file, a pipe, a test) it writes one line when the step starts and one when it ends, so that logs
are not filled with redraws.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

from tqdm import tqdm

BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}]"


class ProgressBar:
    def __init__(self, label: str, stream: TextIO | None = None):
        self.label = label
        self.stream = stream or sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty())
        self._bar: tqdm | None = None
        self._t0: float | None = None
        self._ended = False

    def __call__(self, done: int, total: int) -> None:
        if self._ended:
            return
        total = max(total, 1)
        done = min(max(done, 0), total)
        if self.tty:
            self._draw(done, total)
        else:
            self._lines(done, total)
        if done >= total:
            self._ended = True

    def _draw(self, done: int, total: int) -> None:
        if self._bar is None:
            # A terminal that reports no size (a fresh pseudo-terminal) gets 80 columns.
            cols = _columns(self.stream)
            self._bar = tqdm(total=total, desc=self.label, file=self.stream,
                             bar_format=BAR_FORMAT, ncols=cols or 80,
                             dynamic_ncols=cols is not None, leave=True)
        elif self._bar.total != total:
            self._bar.total = total
        self._bar.update(done - self._bar.n)  # tqdm limits the redraws itself
        if done >= total:
            self._bar.close()

    def _lines(self, done: int, total: int) -> None:
        now = time.monotonic()
        if self._t0 is None:
            self._t0 = now
            if done < total:
                self.stream.write(f"{self.label}: {done / total:.0%} ({done}/{total})\n")
        if done >= total:
            self.stream.write(f"{self.label}: 100% ({total}/{total}, {now - self._t0:.1f} s)\n")
        self.stream.flush()


def _columns(stream: TextIO) -> int | None:
    try:
        return os.get_terminal_size(stream.fileno()).columns or None
    except (AttributeError, OSError, ValueError):
        return None
