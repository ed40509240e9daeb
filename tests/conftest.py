"""Shared fixtures: tiny random-weight models made by the project's own tool (built once per
test session, by tests/helpers/models.py), and the real SmolLM2 pulled once into a test cache
that survives between runs."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers.models import FAMILIES, TinyModels, test_data_dir


def pytest_configure(config: pytest.Config) -> None:
    """Run the suite as the agents run: the engine's CPU switch (engine/cpu/switch.py:
    install(), as `join` calls it), which re-execs pytest once with OpenBLAS preloaded unless
    SKULKP2P_BLAS=off or it cannot load, and gives the models the tests load the CPU pieces
    an agent's models get (weight-first verifies, numpy verifies, the rope table). Without the
    preload the test process ran MLX's reference float32 BLAS while the agents the tests start
    ran OpenBLAS, and the in-process prefills were ~20x slower (a 156-token prompt 13.4 s
    against 0.59 s): most of the suite's time. (pytest suspends its fd capture once the
    initial conftests are loaded, before this hook: the new process gets the real stdout.)"""
    from skulkp2p.engine.cpu import switch

    switch.install()  # returns only where it did not re-exec


# The tiers: every test carrying one of these also carries ``heavy``; the quick tier deselects
# them (``-m "not heavy"``). A test that starts a process must carry one of PROCESS_MARKERS (the
# guard below fails it otherwise), and one that uses the real SmolLM2 is marked ``model`` here.
HEAVY_MARKERS = ("process", "cluster", "browser", "served", "model", "training", "slow")
PROCESS_MARKERS = ("process", "cluster", "browser", "served")
# Programs the standard library and our BLAS probe run to look things up (ctypes.util's
# find_library, platform): not processes a test starts.
SYSTEM_PROBES = frozenset({"ldconfig", "gcc", "cc", "ld", "objdump", "uname"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "smollm2_path" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.model)
        if any(item.get_closest_marker(name) for name in HEAVY_MARKERS):
            item.add_marker(pytest.mark.heavy)


@pytest.fixture(autouse=True)
def _processes_are_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Fail a test that starts a child process but carries no process marker, so the quick tier
    stays free of processes. (Session-scoped fixtures are set up before this one and are not
    watched: the tests that use them are marked by what they use.)"""
    if any(request.node.get_closest_marker(name) for name in PROCESS_MARKERS):
        yield
        return
    execute_child = subprocess.Popen._execute_child  # type: ignore[attr-defined]
    test = request.node.nodeid

    def refuse(self, args, *rest, **kwargs):
        argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        program = os.path.basename(os.fsdecode(argv[0])) if argv else ""
        if program in SYSTEM_PROBES:
            return execute_child(self, args, *rest, **kwargs)
        raise AssertionError(f"{test} starts a process ({program}) but carries none of the "
                             f"markers {', '.join(PROCESS_MARKERS)}: mark it")

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    yield


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
    """Verify forwards take mlx-lm's own attention and SwiGLU (engine/cpu/numpy_verify.py hands
    every call back): for checks of bit-for-bit cache equality between forwards of different
    widths, which that module's numpy keeps only within rounding (its products run on other
    shapes)."""
    from skulkp2p.engine.cpu import numpy_verify

    monkeypatch.setattr(numpy_verify, "active", False)
