"""Child interpreters for the OpenBLAS preload tests (tests/test_blas.py,
tests/test_blas_threads.py): LD_PRELOAD only counts at process start."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from skulkp2p.engine.cpu import blas

REPO = Path(__file__).resolve().parents[2]
LINUX = sys.platform.startswith("linux")


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SKULKP2P_")
           and k not in ("LD_PRELOAD", "OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS",
                         "OMP_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def fast_path_available() -> None:
    """Skip only when OpenBLAS genuinely cannot run here (not installed, or wrong CPU)."""
    if not LINUX:
        pytest.skip("the OpenBLAS preload is for Linux only")
    lib = blas.find_openblas()
    if lib is None:
        pytest.skip("cmeel-openblas is not installed")
    env, why = blas._fast_env(lib)
    if env is None and "SIGILL" in (why or ""):
        pytest.skip(f"this CPU cannot run the cmeel-openblas build: {why}")
    assert env is not None, f"libopenblas should be usable here: {why}"
