"""A small progress bar on stderr: redrawn in place on a terminal, a few plain lines otherwise."""

from __future__ import annotations

import sys
import time


class ProgressBar:
    def __init__(self, label: str, stream=None, width: int = 30):
        self.label = label
        self.stream = stream or sys.stderr
        self.width = width
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last_draw = 0.0
        self._last_decile = -1

    def __call__(self, done: int, total: int) -> None:
        total = max(total, 1)
        frac = min(done / total, 1.0)
        now = time.monotonic()
        if self.tty:
            if done < total and now - self._last_draw < 0.1:
                return
            self._last_draw = now
            filled = int(frac * self.width)
            bar = "#" * filled + "-" * (self.width - filled)
            self.stream.write(f"\r{self.label} [{bar}] {frac:6.1%}")
            if done >= total:
                self.stream.write("\n")
        else:
            decile = int(frac * 10)
            if decile == self._last_decile:
                return
            self._last_decile = decile
            self.stream.write(f"{self.label}: {frac:.0%}\n")
        self.stream.flush()
