"""Tiny random-weight models (written by tiny_model.py) and the directory where the
real models the tests pull (SmolLM2) are kept between runs."""

from __future__ import annotations

import os
from pathlib import Path

FAMILIES = ("llama", "qwen3", "qwen3_5")


def test_data_dir() -> Path:
    """The test model cache: $SKULKP2P_TEST_DATA_DIR, else <user cache>/skulkp2p-tests."""
    env = os.environ.get("SKULKP2P_TEST_DATA_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "skulkp2p-tests"


test_data_dir.__test__ = False  # a helper, not a test, although its name starts with "test"


class TinyModels:
    """Builds each tiny model variant once under ``base`` and hands out its folder after that.

    A model's folder is named after ``name`` (default: its family), since the folder's name is
    the model's id when it is served from a path; the variant decides the folder above it.
    Callers must treat the folders as read-only (copy one to change it)."""

    def __init__(self, base: Path):
        self.base = Path(base)
        self._built: dict[tuple, Path] = {}

    def __call__(self, family: str, seed: int = 0, mtp: bool = False, mtp_style: str = "qwen",
                 name: str | None = None) -> Path:
        from tests.helpers.tiny_model import make_tiny_model

        key = (family, seed, mtp, mtp_style if mtp else None, name or family)
        if key not in self._built:
            variant = f"seed{seed}" + (f"-mtp-{mtp_style}" if mtp else "")
            self._built[key] = make_tiny_model(family, self.base / variant / (name or family),
                                               seed=seed, mtp=mtp, mtp_style=mtp_style)
        return self._built[key]
