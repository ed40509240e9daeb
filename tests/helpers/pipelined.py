"""What the pipelined-decoding tests share (tests/test_pipelined.py, tests/test_quiet_stretch.py):
the tiny models they load once, a repetitive prompt, mlx-lm's own greedy tokens, and a forward
that makes decode run its round loop."""

from __future__ import annotations

from pathlib import Path

from skulkp2p.engine.model.forward import LocalForward
from skulkp2p.engine.model.loaded import load_model

TRIMMABLE = ("llama", "qwen3")
# Repetitive text (as tests/test_decode.py's): a stop string is found halfway.
ECHO = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(a,"
_models: dict[Path, object] = {}


def loaded(path: Path):
    """The tiny model at `path`, float32, loaded once per test session."""
    if path not in _models:
        _models[path] = load_model(path, path.name, dtype="float32")
    return _models[path]




class RoundLoopForward(LocalForward):
    """A LocalForward that never runs ahead: decode runs its round loop on it (no pipelined
    plain greedy, no quiet stretches)."""

    def may_run_ahead(self) -> bool:
        return False
