"""Shared fixtures: tiny random-weight models made by the project's own tool, and the real
SmolLM2 pulled once into a test cache that survives between runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = ("llama", "qwen3", "qwen3_5")


def test_data_dir() -> Path:
    env = os.environ.get("SKULKP2P_TEST_DATA_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "skulkp2p-tests"


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    sys.path.insert(0, str(ROOT))
    from tools.make_tiny_model import make_tiny_model

    base = tmp_path_factory.mktemp("tiny")
    return {fam: make_tiny_model(fam, base / fam, seed=0) for fam in FAMILIES}


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from skulkp2p.models.store import ModelStore

    store = ModelStore(test_data_dir())
    return store.pull("smollm2-135m")


def run_cli(*args: str, input: str | None = None, env: dict | None = None,
            timeout: float = 600) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "skulkp2p", *args], input=input,
                          capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)
