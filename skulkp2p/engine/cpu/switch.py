"""The engine's one CPU switch: what changes this process's behaviour for CPU speed, on only
after `install()`.

Importing any module of the engine switches nothing: no environment change, no re-exec, no
function of mlx-lm's replaced, no class of a model swapped. A process that runs models calls
`install()` once, first thing, before mlx loads: `join`, `pipe`, `bench` and `head` (cli.py), a
tensor rank (engine/parallel/tensor/rank.py), a bench ring stage, the test suite
(tests/conftest.py). It covers:

* the OpenBLAS preload (blas.ensure_fast_blas: re-executes the process once with libopenblas
  preloaded; `SKULKP2P_BLAS=off` keeps the reference BLAS). `install(blas=False)` leaves BLAS to
  the environment the process was started with: a tensor rank's is its parent's;
* the OpenBLAS thread policy (blas_threads.py: `SKULKP2P_BLAS_THREADS` is checked here, a bad
  setting a ValueError before anything else; the policy itself is made at the first forward);
* the model pieces, which `apply()` gives each model `load_model` loads in float32 on the CPU
  (each also off by its variable, read at that load, as before): weight-first verify products
  (weight_first.py, `SKULKP2P_WEIGHT_FIRST`), a verify's softmax and SwiGLU in numpy
  (numpy_verify.py, `SKULKP2P_NUMPY_VERIFY`: replaces the attention and SwiGLU functions of
  mlx-lm's llama, qwen2 and qwen3 modules, once per family and process, with dispatchers that
  divert only the engine's verifies), rotary embeddings from a table (table_rope.py,
  `SKULKP2P_TABLE_ROPE`).

Without `install()` a model loads and runs as mlx-lm ships it, on whatever BLAS the process
has. `installed()` says what was switched (None before `install()`).

This module imports no mlx (the CLI calls `install()` before mlx may load); `apply()` imports
the pieces, which do.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from skulkp2p.engine.cpu import blas as _blas
from skulkp2p.engine.cpu import blas_threads

if TYPE_CHECKING:
    import mlx.nn as nn

# The model pieces, in the order `apply()` gives them.
PIECES = ("weight_first", "numpy_verify", "table_rope")
# `install(blas=False)`: the process runs the BLAS its environment preloads, or none.
PARENT = "parent"


@dataclass
class Switched:
    """What `install()` switched on in this process, and what `apply()` did since."""
    # "openblas" (preloaded), PARENT (left to the environment), else why the reference BLAS
    # stays (blas.preload_state)
    blas: str
    threads: int | None  # SKULKP2P_BLAS_THREADS: a fixed count, or None for the policy's own
    models: dict[str, int] = field(default_factory=dict)  # piece -> models it was given to
    routed: list[str] = field(default_factory=list)  # mlx-lm families numpy_verify routes


_switched: Switched | None = None
_lock = threading.Lock()


def install(*, blas: bool = True, argv: list[str] | None = None) -> Switched:
    """Switch this process's CPU speed-ups on (module doc); idempotent: a second call returns
    the same record (and runs the BLAS step if only `blas=False` ran before). With `blas`, may
    re-execute the process (`argv`: as for blas.ensure_fast_blas), so call it before mlx is
    imported. Raises ValueError for a bad SKULKP2P_BLAS_THREADS, before anything switches."""
    global _switched
    with _lock:
        if _switched is not None and (not blas or _switched.blas != PARENT):
            return _switched
        threads = blas_threads.parse_setting(os.environ.get(blas_threads.ENV))
        if blas:
            _blas.ensure_fast_blas(argv)  # returns only where it did not re-exec
        state = _blas.preload_state() if blas else PARENT
        if _switched is None:
            _switched = Switched(state, threads)
        else:
            _switched.blas = state
        blas_threads.arm()
        return _switched


def installed() -> Switched | None:
    """What `install()` switched on in this process; None before it ran."""
    return _switched


def apply(model: nn.Module, dtype: str) -> list[str]:
    """Give `model`, just loaded in `dtype`, the model pieces that apply to it (float32 on the
    CPU, each not turned off by its variable); nothing before `install()`. The pieces that
    changed something in it."""
    if _switched is None:
        return []
    from skulkp2p.engine.cpu import numpy_verify, table_rope, weight_first

    given = []
    with _lock:
        # A verify's rows weight-first on the CPU's BLAS.
        if weight_first.enabled(dtype) and weight_first.install(model):
            given.append("weight_first")
        # A verify's softmax and SwiGLU by numpy (mlx-lm's module functions, once per family).
        families = numpy_verify.install(model) if numpy_verify.enabled(dtype) else []
        if families:
            _switched.routed.extend(f for f in families if f not in _switched.routed)
            given.append("numpy_verify")
        # Rotary embeddings from a table (bit for bit mx.fast.rope's).
        if table_rope.enabled(dtype) and table_rope.install(model):
            given.append("table_rope")
        for piece in given:
            _switched.models[piece] = _switched.models.get(piece, 0) + 1
    return given
