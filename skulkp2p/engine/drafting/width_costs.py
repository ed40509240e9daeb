"""Verify-width costs: what a verify forward of w tokens costs on this machine, relative to w=1.

`python -m skulkp2p bench --widths` measures the table (:func:`measure_width_seconds`) and saves it
(:func:`save_width_costs`) under `<data-dir>/widths/<model>-<dtype>.json`; the loader reads it
back (:func:`load_width_costs`) for the depth controller, which falls back to the defaults in
`gates.py` when nothing was measured here.

No mlx at module level: the loader imports this after mlx anyway, the bench's CLI before the BLAS
is set up; only the measurement needs the forward.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from skulkp2p.engine.json_types import JSONObject

if TYPE_CHECKING:
    from skulkp2p.engine.model.forward import Forward
    from skulkp2p.engine.model.loaded import LoadedModel

DEFAULT_WIDTHS = tuple(range(1, 17))
WIDTH_PREFILL = 64
WIDTH_REPS = 7
# A tensor-parallel group measures its own table when it forms (engine/parallel/tensor/group.py): fewer widths
# (the controller interpolates between them) and reps, so that forming a group stays quick.
GROUP_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16)
# The median of 5, not the fastest of 3: the table seeds the live one (call_costs.py), which
# prices by the medians of real calls, and a width the gates never choose is never corrected by
# one. The fastest of 3 priced 2 rows at 1.42-1.61x one where the medians of whole calls read
# about 1.2-1.3x, enough to price a group's MTP head off from its first token (docs/measurements/
# tensor-parallel.md, "The probe's statistic"; python -m skulkp2p bench --nodes 2 --parallel
# tensor).
GROUP_REPS = 5
# Text for the measurement where no workload is at hand (the group's: dense layers only, so the
# tokens do not change the cost; a mixture of experts would route by them).
WIDTH_TEXT = ("def add(a, b):\n    return a + b\n\nclass Stack:\n    def __init__(self):\n"
              "        self.items = []\n\n    def push(self, item):\n        self.items.append("
              "item)\n\n    def pop(self):\n        return self.items.pop()\n")


def width_tokens(loaded: LoadedModel, text: str, n: int) -> list[int]:
    ids = list(loaded.tokenizer.encode(text))
    if not ids:
        raise ValueError("the text for the width measurement encodes to no tokens")
    while len(ids) < n:  # a small tokenizer may still need the text twice
        ids += ids
    return ids[:n]


def measure_width_seconds(loaded: LoadedModel, text: str, widths: Sequence[int] = DEFAULT_WIDTHS,
                          prefill: int = WIDTH_PREFILL, reps: int = WIDTH_REPS
                          ) -> dict[int, float]:
    """Fastest of `reps` timings of one verify forward of w tokens after a `prefill`-token
    prefill of `text` (real text: a mixture of experts routes by token). The minimum, not the
    median: the work is deterministic and other load only adds time, and on a shared 2-core node
    the median of a few reps still carried 2x outliers."""
    from skulkp2p.engine.cache import caches
    from skulkp2p.engine.model.forward import LocalForward

    widths = sorted(set(widths))
    tokens = width_tokens(loaded, text, prefill + max(widths))
    fwd = LocalForward(loaded.model, int(loaded.runtime.get("prefill_step", 2048)))
    fwd.prefill(tokens[:prefill])
    # Restore the post-prefill cache after every forward, so each w sees the same context length
    # (and recurrent-state models, which cannot trim, are handled too; the values written into
    # a restored buffer do not matter for timing).
    snap = caches.snapshot(fwd.cache, max(widths))
    times: dict[int, list[float]] = {w: [] for w in widths}
    for rep in range(reps + 1):  # rep 0 warms up every width
        for w in widths:  # interleaved, so drift spreads over all widths
            t0 = time.perf_counter()
            fwd(tokens[prefill:prefill + w])  # evaluates the logits of all w rows
            dt = time.perf_counter() - t0
            caches.restore(fwd.cache, snap, reuse=True)
            if rep:
                times[w].append(dt)
    return {w: min(ts) for w, ts in times.items()}


def measure_forward_seconds(forward: Forward, tokens: list[int], widths: Sequence[int],
                            prefill: int = WIDTH_PREFILL, reps: int = GROUP_REPS
                            ) -> dict[int, float]:
    """As measure_width_seconds, through any Forward whose caches trim back exactly (a tensor
    group's `TensorForward`, whose caches live in other processes and cannot be snapshotted
    here): every verify of w rows is rolled back (`rollback(0, w)`) before the next one, so each
    width sees the same context length. Times the whole call as the decode loop sees it; each
    width's median (GROUP_REPS)."""
    widths = sorted(set(widths))
    if len(tokens) < prefill + max(widths):
        raise ValueError(f"need {prefill + max(widths)} tokens, got {len(tokens)}")
    forward.prefill(tokens[:prefill])
    times: dict[int, list[float]] = {w: [] for w in widths}
    for rep in range(reps + 1):  # rep 0 warms up every width
        for w in widths:
            t0 = time.perf_counter()
            forward(tokens[prefill:prefill + w])
            dt = time.perf_counter() - t0
            forward.rollback(0, w)
            if rep:
                times[w].append(dt)
    return {w: statistics.median(ts) for w, ts in times.items()}


def non_decreasing(seconds: dict[int, float]) -> dict[int, float]:
    """Each width's time capped by every wider one's: a verify of more rows never costs less,
    so a time above a wider width's is noise (another process on a shared CPU), not cost."""
    out: dict[int, float] = {}
    cap = float("inf")
    for w in sorted(seconds, reverse=True):
        cap = min(cap, seconds[w])
        out[w] = cap
    return dict(sorted(out.items()))


def relative_costs(seconds: dict[int, float]) -> dict[int, float]:
    base = seconds[min(seconds)]
    return {w: 1.0 if w == min(seconds) else round(s / base, 4) for w, s in seconds.items()}


def measure_width_costs(loaded: LoadedModel, text: str, widths: Sequence[int] = DEFAULT_WIDTHS
                        ) -> dict[int, float]:
    """Cost of a verify forward of w tokens relative to w=1 (w=1 -> 1.0); needs 1 in widths."""
    if 1 not in widths:
        raise ValueError("widths must include 1 (the reference)")
    return relative_costs(measure_width_seconds(loaded, text, widths))


def width_costs_path(model_id: str, dtype: str, data_dir: Path | str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", model_id)
    return Path(data_dir) / "widths" / f"{safe}-{dtype}.json"


def save_width_costs(model_id: str, dtype: str, data_dir: Path | str, seconds: dict[int, float],
                     extra: JSONObject | None = None) -> Path:
    path = width_costs_path(model_id, dtype, data_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"model": model_id, "dtype": dtype, "prefill_tokens": WIDTH_PREFILL,
           "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "seconds": {str(w): round(s, 6) for w, s in seconds.items()},
           "relative": {str(w): c for w, c in relative_costs(seconds).items()}, **(extra or {})}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)  # a reader never sees half a file
    return path


def load_width_costs(model_id: str, dtype: str, data_dir: Path | str) -> dict[int, float] | None:
    """The saved cost table {w: cost relative to w=1}, or None if never measured or unreadable."""
    path = width_costs_path(model_id, dtype, data_dir)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        costs = {int(w): float(c) for w, c in doc["relative"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return costs if costs.get(1) == 1.0 else None
