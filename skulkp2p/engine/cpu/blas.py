"""Fast float32 matrix products for mlx on Linux CPU nodes.

The ``mlx[cpu]`` wheel links the reference BLAS it vendors, so float32 products run at a few
GFLOP/s. OpenBLAS (from the ``cmeel-openblas`` wheel) exports the same ``cblas_*`` and LAPACK
symbols; preloading it makes the dynamic linker bind mlx's imports to OpenBLAS instead. A preload
only counts at process start, so :func:`ensure_fast_blas` re-executes the process once with
``LD_PRELOAD`` set, before mlx is imported. Processes reach it through the engine's CPU switch
(switch.install); importing this module changes nothing.

Environment:

* ``SKULKP2P_BLAS=off`` (or ``reference``): keep the reference BLAS.
* ``SKULKP2P_BLAS_LIB=PATH``: preload this library instead of the one cmeel-openblas installed.
* ``SKULKP2P_BLAS_GFORTRAN=system|bundled``: where libgfortran.so.5 comes from (default: the
  system's if present, else the copy vendored in the mlx[cpu] wheel).
* ``SKULKP2P_DTYPE=float32|bfloat16|float16``: override the dtype models run in.
* ``SKULKP2P_DEVICE=cuda``: treat this node as a CUDA node (no CPU BLAS preload).
* ``OPENBLAS_NUM_THREADS``: respected if set; otherwise the re-exec sets it to cores - 1.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TypedDict

ENV_MODE = "SKULKP2P_BLAS"
ENV_LIB = "SKULKP2P_BLAS_LIB"
ENV_GFORTRAN = "SKULKP2P_BLAS_GFORTRAN"
ENV_MARKER = "SKULKP2P_BLAS_REEXEC"
ENV_DTYPE = "SKULKP2P_DTYPE"
ENV_DEVICE = "SKULKP2P_DEVICE"

OFF_VALUES = frozenset({"off", "reference", "ref", "0", "no", "false", "none"})
DTYPES = ("float32", "bfloat16", "float16")
GFORTRAN_SONAME = "libgfortran.so.5"
APT_FIX = "apt-get install libgfortran5"

# The reference BLAS does ~1-6 GFLOP/s on a 256^3 float32 product, OpenBLAS well over 50 even on
# one core: anything above this means the preload took effect.
FAST_GFLOPS_MIN = 12.0

# Why the fast path is off in this process (set by ensure_fast_blas, read by the report).
_reason: str | None = None
_disabled_by_user = False
_logged = False


def _set_reason(reason: str | None, *, by_user: bool = False) -> None:
    global _reason, _disabled_by_user
    _reason = reason
    _disabled_by_user = by_user


# --------------------------------------------------------------------------------------------
# Locating the library and checking that it loads


def find_openblas() -> Path | None:
    """Path of the libopenblas shipped by the installed cmeel-openblas wheel, or None.

    ``SKULKP2P_BLAS_LIB`` overrides the search (the path is returned even if it does not exist,
    so that the caller can say why it cannot be used).
    """
    override = os.environ.get(ENV_LIB)
    if override:
        return Path(override)
    candidates: list[Path] = []
    try:
        dist = importlib.metadata.distribution("cmeel-openblas")
        for f in dist.files or ():
            if f.name.startswith("libopenblas") and ".so" in f.name:
                candidates.append(Path(str(dist.locate_file(f))))
    except importlib.metadata.PackageNotFoundError:
        pass
    # Installs without a RECORD (or a copied prefix): look for the cmeel prefix on sys.path.
    for entry in sys.path:
        lib_dir = Path(entry or ".") / "cmeel.prefix" / "lib"
        candidates.extend(sorted(lib_dir.glob("libopenblas*.so*")))

    def rank(p: Path) -> int:
        # The SONAME file first: it is the name the linker would record.
        return {"libopenblas.so.0": 0, "libopenblas.so": 1}.get(p.name, 2)

    for path in sorted(candidates, key=rank):
        if path.is_file():
            return path.resolve()
    return None


def _helper_env(env: Mapping[str, str] | None) -> dict[str, str]:
    """``env`` (default: this process's) for a helper that inspects a library (``ldd``'s shell,
    the probe's interpreter), without ``LD_PRELOAD``.

    A process we re-executed preloads libopenblas, whose libgfortran may be found only through
    the LD_LIBRARY_PATH that came with the preload. A check under an environment without that
    path would otherwise start its helper with a preload that cannot load there, and the helper
    dies before it looks at anything ("bash: error while loading shared libraries:
    libgfortran.so.5"). The question asked is whether ``lib`` loads under ``env``'s search path;
    what this process preloads is no part of it.
    """
    helper = dict(os.environ if env is None else env)
    helper.pop("LD_PRELOAD", None)
    return helper


def missing_dependencies(lib: Path, env: dict[str, str] | None = None) -> list[str]:
    """What keeps ``lib`` from loading, per ``ldd``: e.g. ``["libgfortran.so.5 not found"]``.

    An empty list means every dependency resolves (under ``env``, default: this process's;
    ``LD_PRELOAD`` is not passed on, see :func:`_helper_env`).
    """
    lib = Path(lib)
    if not lib.is_file():
        return [f"{lib}: no such file"]
    ldd = shutil.which("ldd")
    if ldd is None:
        # No ldd (minimal images): the dlopen probe says the same in its own words.
        err = probe_library(lib, env)
        return [err] if err else []
    try:
        out = subprocess.run(
            [ldd, str(lib)], env=_helper_env(env), capture_output=True, text=True, timeout=30,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return [f"ldd failed: {exc}"]
    text = out.stdout + out.stderr
    problems = [f"{m.group(1)} not found" for m in re.finditer(r"^\s*(\S+) => not found", text, re.M)]
    problems += [m.group(0).strip() for m in re.finditer(r"version `[^']+' not found.*$", text, re.M)]
    if not problems and out.returncode != 0:
        problems.append(f"{lib}: {text.strip().splitlines()[-1] if text.strip() else 'ldd failed'}")
    return problems


# Loads the library in a fresh interpreter and runs a real sgemm through it: catches what ldd
# cannot, such as a kernel built for instructions this CPU lacks (cmeel-openblas 0.3.31 is a
# SKYLAKEX build without DYNAMIC_ARCH, i.e. it needs AVX-512).
_PROBE = r"""
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
n = 64
a = (ctypes.c_float * (n * n))(*([1.0] * (n * n)))
b = (ctypes.c_float * (n * n))(*([0.5] * (n * n)))
c = (ctypes.c_float * (n * n))()
lib.cblas_sgemm(101, 111, 111, n, n, n, ctypes.c_float(1.0), a, n, b, n, ctypes.c_float(0.0), c, n)
if any(abs(x - 0.5 * n) > 1e-3 for x in c):
    sys.exit("cblas_sgemm gave a wrong result")
cfg = getattr(lib, "openblas_get_config", None)
if cfg is not None:
    cfg.restype = ctypes.c_char_p
    print(cfg().decode(errors="replace"))
"""


def probe_library(lib: Path, env: dict[str, str] | None = None) -> str | None:
    """Load ``lib`` in a subprocess and run a small sgemm; None if that works, else why not.

    The subprocess gets ``env`` (default: this process's) without ``LD_PRELOAD``
    (:func:`_helper_env`)."""
    try:
        out = subprocess.run(
            [sys.executable, "-I", "-S", "-c", _PROBE, str(lib)],
            env=_helper_env(env),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"could not run the BLAS probe: {exc}"
    if out.returncode == 0:
        return None
    if out.returncode < 0:
        try:
            name = signal.Signals(-out.returncode).name
        except ValueError:
            name = f"signal {-out.returncode}"
        hint = " (library built for a newer CPU?)" if name == "SIGILL" else ""
        return f"{lib.name} crashed with {name} in a test sgemm{hint}"
    lines = (out.stderr or out.stdout).strip().splitlines()
    return f"{lib.name} failed to load: {lines[-1] if lines else f'exit {out.returncode}'}"


def _bundled_gfortran() -> Path | None:
    """The libgfortran that the mlx[cpu] wheel vendors (auditwheel renames it with a hash)."""
    for name in ("mlx-cpu", "mlx"):
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        for f in dist.files or ():
            if f.name.startswith("libgfortran") and ".so" in f.name:
                path = Path(str(dist.locate_file(f)))
                if path.is_file():
                    return path.resolve()
    return None


def _gfortran_shim(bundled: Path) -> Path | None:
    """A directory where ``libgfortran.so.5`` names the vendored copy, for LD_LIBRARY_PATH.

    The vendored file's SONAME is hashed, so OpenBLAS's ``NEEDED libgfortran.so.5`` only finds
    it under an alias; its own hashed dependencies (libquadmath) are linked beside it.
    """
    tag = hashlib.sha256(str(bundled).encode()).hexdigest()[:12]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    roots = [cache / "skulkp2p" / f"gfortran-{tag}",
             Path(tempfile.gettempdir()) / f"skulkp2p-{os.getuid()}-gfortran-{tag}"]
    links = {GFORTRAN_SONAME: bundled}
    links.update({p.name: p for p in bundled.parent.iterdir() if ".so" in p.name})
    for root in roots:
        try:
            root.mkdir(parents=True, exist_ok=True)
            for name, target in links.items():
                link = root / name
                if link.is_symlink() and Path(os.readlink(link)) == target:
                    continue
                # Replace atomically: another process may be building the same directory.
                tmp = root / f".{name}.{os.getpid()}"
                tmp.unlink(missing_ok=True)
                tmp.symlink_to(target)
                os.replace(tmp, link)
            return root
        except OSError:
            continue
    return None


def _prepend(value: str, current: str | None, sep: str = ":") -> str:
    return value if not current else f"{value}{sep}{current}"


def _fast_env(lib: Path) -> tuple[dict[str, str] | None, str | None]:
    """The environment that preloads ``lib``, or (None, why it cannot be used)."""
    env = dict(os.environ)
    problems = missing_dependencies(lib, env)
    gfortran_mode = os.environ.get(ENV_GFORTRAN, "").strip().lower()
    needs_gfortran = any(p.startswith(GFORTRAN_SONAME) for p in problems)
    if gfortran_mode == "bundled" or (needs_gfortran and gfortran_mode != "system"):
        bundled = _bundled_gfortran()
        shim = _gfortran_shim(bundled) if bundled else None
        if shim is not None:
            trial = dict(env, LD_LIBRARY_PATH=_prepend(str(shim), env.get("LD_LIBRARY_PATH")))
            trial_problems = missing_dependencies(lib, trial)
            if not trial_problems:
                env, problems = trial, []
    if problems:
        why = "; ".join(problems)
        if any(p.startswith(GFORTRAN_SONAME) for p in problems):
            why += f" ({APT_FIX})"
        return None, why
    err = probe_library(lib, env)
    if err:
        return None, err
    env["LD_PRELOAD"] = _prepend(str(lib), env.get("LD_PRELOAD"))
    if not any(env.get(k) for k in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")):
        env["OPENBLAS_NUM_THREADS"] = str(default_blas_threads())
    return env, None


def default_blas_threads(cores: int | None = None) -> int:
    """OpenBLAS threads to use: one core fewer than this process may run on (or `cores`).

    mlx calls BLAS from its own stream thread while Python keeps working on the main thread;
    with as many OpenBLAS threads as cores the spinning workers get descheduled mid-product,
    and products and forwards take many times as long on a 2-core machine
    (docs/measurements/blas-threads.md).
    """
    if cores is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
    return max(1, cores - 1)


# --------------------------------------------------------------------------------------------
# Deciding and re-executing


def _cuda_node() -> bool:
    device = os.environ.get(ENV_DEVICE, "").strip().lower()
    if device:
        return device == "cuda"
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name.startswith("mlx-cuda"):
            return True
    return False


def _preloaded(env: Mapping[str, str]) -> bool:
    return "libopenblas" in env.get("LD_PRELOAD", "")


def _reexec_argv(argv: list[str] | None) -> list[str] | None:
    """The interpreter's own arguments to start this program again, or None if impossible."""
    if argv is not None:
        return list(argv)
    # sys.orig_argv keeps "-m pkg", "-c code" and interpreter flags; sys.argv lost them.
    orig = getattr(sys, "orig_argv", None)
    if not orig or sys.argv[:1] in ([""], ["-"]):
        return None  # interactive or a script read from stdin: cannot be started again
    return list(orig[1:])


def ensure_fast_blas(argv: list[str] | None = None) -> None:
    """Re-exec this process once with OpenBLAS preloaded, if that is possible and useful.

    Call it first thing in a command that loads models, before mlx is imported. ``argv`` is the
    interpreter's argument list to re-exec with (default: ``sys.orig_argv[1:]``, so that
    ``python -m skulkp2p ...`` comes back as ``python -m skulkp2p ...``). Returns without
    exec'ing when the fast path is already on, off by choice, or unavailable; the reason is kept
    for :func:`fast_path_report`.
    """
    if not sys.platform.startswith("linux"):
        return
    mode = os.environ.get(ENV_MODE, "").strip().lower()
    if mode in OFF_VALUES:
        _set_reason(f"disabled by {ENV_MODE}={mode}", by_user=True)
        return
    if _cuda_node():
        _set_reason("CUDA node: models run on the GPU")
        return
    if _preloaded(os.environ):
        return  # already preloaded (by our re-exec or by the user)
    if os.environ.get(ENV_MARKER):
        # Our re-exec ran but LD_PRELOAD was dropped on the way: never exec a second time.
        _set_reason(f"{ENV_MARKER} is set but LD_PRELOAD lost libopenblas; not re-executing")
        return
    lib = find_openblas()
    if lib is None:
        _set_reason("cmeel-openblas is not installed (pip install cmeel-openblas)")
        return
    env, why = _fast_env(lib)
    if env is None:
        _set_reason(why)
        return
    args = _reexec_argv(argv)
    if args is None:
        _set_reason("cannot re-exec an interactive session or a script read from stdin")
        return
    env[ENV_MARKER] = "1"
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()  # what is buffered would otherwise be lost by exec
        except (AttributeError, OSError, ValueError):
            pass
    try:
        os.execve(sys.executable, [sys.executable, *args], env)
    except OSError as exc:
        _set_reason(f"re-exec with LD_PRELOAD failed: {exc}")


def preload_state() -> str:
    """"openblas" when libopenblas is preloaded in this process, else why not (as
    :func:`ensure_fast_blas` left it; for the CPU switch's record, without importing mlx)."""
    if _preloaded(os.environ):
        return "openblas"
    if _reason is not None:
        return _reason
    return f"no OpenBLAS preload on {sys.platform}" if not sys.platform.startswith("linux") \
        else "ensure_fast_blas() was not called"


# --------------------------------------------------------------------------------------------
# After mlx is imported: what runs


def _mapped(fragment: str) -> str | None:
    """Path of the first file mapped into this process whose name contains ``fragment``."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and fragment in os.path.basename(parts[5].strip()):
                    return parts[5].strip()
    except OSError:
        pass
    return None


def measure_f32_gflops(n: int = 256, reps: int = 4) -> float:
    """GFLOP/s of an n x n float32 product on the CPU (best of ``reps``, after a warm-up)."""
    return _measure_f32(n, reps)[0]


def _measure_f32(n: int = 256, reps: int = 4) -> tuple[float, float]:
    """(GFLOP/s by the wall clock, GFLOP per second of this process's CPU time), best of
    ``reps`` each. The second is what a busy machine cannot lower: descheduled, the process
    uses no CPU time."""
    import mlx.core as mx

    a = mx.random.normal((n, n), dtype=mx.float32, stream=mx.cpu)
    b = mx.random.normal((n, n), dtype=mx.float32, stream=mx.cpu)
    mx.eval(a, b)
    mx.eval(mx.matmul(a, b, stream=mx.cpu))
    best_wall = best_cpu = float("inf")
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        mx.eval(mx.matmul(a, b, stream=mx.cpu))
        best_wall = min(best_wall, time.perf_counter() - t0)
        best_cpu = min(best_cpu, time.process_time() - c0)
    flop = 2.0 * n**3 / 1e9
    return flop / max(best_wall, 1e-9), flop / max(best_cpu, 1e-9)


# This process's measurement, made once: the dtype a node serves in must not change with the
# machine's load from one model load to the next (two members of a tensor group once chose
# float32 and bfloat16 on a loaded box, and a rank died with SIGSEGV in the all-reduce).
_measured: tuple[float, float] | None = None


def _fast_path_gflops() -> tuple[float, float]:
    global _measured
    if _measured is None:
        _measured = _measure_f32()
    return _measured


def _diagnose() -> str:
    """Why the fast path is off when ensure_fast_blas left no reason (e.g. was never called)."""
    if not sys.platform.startswith("linux"):
        return f"no OpenBLAS preload on {sys.platform}"
    lib = find_openblas()
    if lib is None:
        return "cmeel-openblas is not installed (pip install cmeel-openblas)"
    env, why = _fast_env(lib)
    if env is None:
        return why or "libopenblas cannot be used"
    return "mlx was imported without OpenBLAS preloaded (switch.install() not called first?)"


class FastPathReport(TypedDict):
    """:func:`fast_path_report`'s answer (its docstring says what each key means)."""
    blas: str
    library: str | None
    dtype: str
    gflops_f32: float
    gflops_f32_cpu: float
    reason: str | None
    disabled_by_user: bool
    dtype_overridden: bool
    device: str


def fast_path_report() -> FastPathReport:
    """Which BLAS mlx's CPU products use in this process, and the dtype models should run in.

    Keys: ``blas`` ("openblas" | "reference", "accelerate" on macOS), ``library`` (mapped
    libopenblas or None), ``dtype``, ``gflops_f32`` (measured once per process, 256^3 product,
    by the wall clock), ``gflops_f32_cpu`` (the same per second of CPU time), ``reason`` (why
    the fast path is off, or None), ``disabled_by_user``, ``dtype_overridden``.
    """
    import mlx.core as mx

    gflops, gflops_cpu = _fast_path_gflops()
    library = _mapped("libopenblas")
    gpu = mx.default_device() != mx.cpu
    reason: str | None = None
    if sys.platform == "darwin":
        blas = "accelerate"
    # Either rate clears the bar only when the preload took effect: the wall clock's on a quiet
    # many-core machine (OpenBLAS threads spinning cost CPU time), the CPU time's on a loaded
    # one (the wall clock counts the time other processes ran; it fell below the bar at nice 15
    # beside busy processes, and that node alone chose bfloat16).
    elif library is not None and max(gflops, gflops_cpu) >= FAST_GFLOPS_MIN:
        blas = "openblas"
    else:
        blas = "reference"
        if _reason is not None:
            reason = _reason
        elif library is not None:
            reason = (f"libopenblas is loaded but a float32 product ran at {gflops:.1f} GFLOP/s "
                      f"(< {FAST_GFLOPS_MIN:g})")
        else:
            reason = _diagnose()
    dtype = "float32" if blas == "openblas" and not gpu and sys.platform.startswith("linux") \
        else "bfloat16"
    override = os.environ.get(ENV_DTYPE, "").strip().lower()
    if override:
        if override not in DTYPES:
            raise ValueError(f"{ENV_DTYPE}={override!r}: expected one of {', '.join(DTYPES)}")
        dtype = override
    return {
        "blas": blas,
        "library": library,
        "dtype": dtype,
        "gflops_f32": round(gflops, 2),
        "gflops_f32_cpu": round(gflops_cpu, 2),  # per second of CPU time: load does not lower it
        "reason": reason,
        "disabled_by_user": _disabled_by_user and blas != "openblas",
        "dtype_overridden": bool(override),
        "device": "gpu" if gpu else "cpu",
    }


def log_fast_path(report: FastPathReport, logger: logging.Logger, *, force: bool = False) -> None:
    """Log the report once per process: INFO when fast (or off by choice), else one WARNING."""
    global _logged
    if _logged and not force:
        return
    _logged = True
    dtype = report["dtype"] + (f" ({ENV_DTYPE})" if report.get("dtype_overridden") else "")
    g = report["gflops_f32"]
    if report["blas"] == "openblas":
        logger.info("mlx cpu: OpenBLAS active (%s), %.1f GFLOP/s f32, models run in %s",
                    report["library"], g, dtype)
    elif report["blas"] == "accelerate" or report.get("device") == "gpu":
        logger.info("mlx %s: models run in %s", report.get("device", "cpu"), dtype)
    elif report.get("disabled_by_user"):
        logger.info("mlx cpu: reference BLAS (%s), %.1f GFLOP/s f32, models run in %s",
                    report["reason"], g, dtype)
    else:
        logger.warning("mlx cpu: reference BLAS (%s), %.1f GFLOP/s f32; models run in %s, "
                       "prefill ~10x slower than with OpenBLAS", report["reason"], g, dtype)
