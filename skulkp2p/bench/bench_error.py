"""The bench's own error: one line on stderr (the CLI turns it into its own error)."""

from __future__ import annotations


class BenchError(Exception):
    """Ends the bench with one line on stderr (the CLI turns it into its own error)."""
