"""Shared fixtures: tiny random-weight models made by the project's own tool (built once per
test session, by tests/helpers/models.py), and the real SmolLM2 pulled once into a test cache
that survives between runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.models import FAMILIES, TinyModels, test_data_dir


def pytest_configure(config: pytest.Config) -> None:
    """Run the suite on the BLAS the agents run on: re-exec pytest once with OpenBLAS preloaded
    (engine/blas.py: ensure_fast_blas, as `join` does), unless SKULKP2P_BLAS=off or it cannot
    load. Without it the test process ran MLX's reference float32 BLAS while the agents the
    tests start ran OpenBLAS, and the in-process prefills were ~20x slower (a 156-token prompt
    13.4 s against 0.59 s): most of the suite's time. (pytest suspends its fd capture once the
    initial conftests are loaded, before this hook: the new process gets the real stdout.)"""
    from skulkp2p.engine import blas

    blas.ensure_fast_blas()  # returns only where it did not re-exec


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> TinyModels:
    """``tiny_model(family, seed=0, mtp=False, mtp_style="qwen", name=None)``: the folder of
    that tiny model, built the first time this session asks for it. Read-only."""
    return TinyModels(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_models(tiny_model) -> dict[str, Path]:
    """The seed-0 tiny model of every family, by family."""
    return {fam: tiny_model(fam) for fam in FAMILIES}


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from skulkp2p.models.store import ModelStore

    store = ModelStore(test_data_dir())
    return store.pull("smollm2-135m")


@pytest.fixture
def mlx_lm_functions(monkeypatch):
    """Verify forwards take mlx-lm's own attention and SwiGLU (engine/numpy_verify.py hands
    every call back): for checks of bit-for-bit cache equality between forwards of different
    widths, which that module's numpy keeps only within rounding (its products run on other
    shapes)."""
    from skulkp2p.engine import numpy_verify

    monkeypatch.setattr(numpy_verify, "active", False)
