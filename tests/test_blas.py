"""OpenBLAS preload for mlx on Linux CPU (skulkp2p.engine.cpu.blas).

LD_PRELOAD only counts at process start, so the re-exec is tested in child interpreters with a
controlled environment; each child prints START before ensure_fast_blas() (so a re-exec shows as
a second START) and a JSON report at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from skulkp2p.engine.cpu import blas
from tests.helpers.blas import child_env, fast_path_available

REPO = Path(__file__).resolve().parents[1]
LINUX = sys.platform.startswith("linux")

CHILD = r"""
import json, logging, os, sys
print("START", flush=True)
from skulkp2p.engine.cpu import blas
blas.ensure_fast_blas()
import mlx.core  # noqa: F401  (imported after the decision, as the CLI does)
report = blas.fast_path_report()
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
log = logging.getLogger("child")
blas.log_fast_path(report, log)
blas.log_fast_path(report, log)  # a second call must not log again
report["threads"] = os.environ.get("OPENBLAS_NUM_THREADS")
report["ld_library_path"] = os.environ.get("LD_LIBRARY_PATH", "")
report["argv"] = sys.argv[1:]
print("REPORT " + json.dumps(report), flush=True)
"""


def run_child(env: dict[str, str], args: list[str] | None = None) -> tuple[int, dict, str]:
    """(how many times the child started, its report, its stderr)."""
    cmd = [sys.executable, *(args or ["-c", CHILD])]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    report_lines = [ln for ln in lines if ln.startswith("REPORT ")]
    assert len(report_lines) == 1, out.stdout
    return lines.count("START"), json.loads(report_lines[0][len("REPORT "):]), out.stderr


@pytest.mark.process
def test_reexec_turns_openblas_on() -> None:
    fast_path_available()
    starts, report, err = run_child(child_env())
    assert starts == 2, "exactly one re-exec"
    assert report["blas"] == "openblas", report
    assert report["dtype"] == "float32"
    assert report["reason"] is None
    assert "libopenblas" in report["library"]
    # (the CPU time's rate: the wall clock's falls below the bar on a loaded machine)
    assert max(report["gflops_f32"], report["gflops_f32_cpu"]) >= blas.FAST_GFLOPS_MIN
    assert report["threads"] == str(blas.default_blas_threads())
    assert err.count("OpenBLAS active") == 1, err
    assert "WARNING" not in err


@pytest.mark.process
def test_reexec_keeps_python_dash_m(tmp_path: Path) -> None:
    fast_path_available()
    (tmp_path / "blas_child_mod.py").write_text(CHILD)
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    starts, report, _ = run_child(env, ["-m", "blas_child_mod", "alpha", "--beta"])
    assert starts == 2
    assert report["argv"] == ["alpha", "--beta"]
    assert report["blas"] == "openblas"


@pytest.mark.process
def test_user_thread_setting_is_kept() -> None:
    fast_path_available()
    _, report, _ = run_child(child_env(OPENBLAS_NUM_THREADS="1"))
    assert report["threads"] == "1"
    assert report["blas"] == "openblas"


@pytest.mark.process
def test_bundled_gfortran_fallback(tmp_path: Path) -> None:
    fast_path_available()
    if blas._bundled_gfortran() is None:
        pytest.skip("this mlx wheel vendors no libgfortran")
    env = child_env(SKULKP2P_BLAS_GFORTRAN="bundled", XDG_CACHE_HOME=str(tmp_path))
    starts, report, _ = run_child(env)
    assert starts == 2
    assert report["blas"] == "openblas", report
    assert str(tmp_path) in report["ld_library_path"]
    assert (Path(report["ld_library_path"].split(":")[0]) / "libgfortran.so.5").exists()


@pytest.mark.process
@pytest.mark.skipif(not LINUX, reason="the OpenBLAS preload is for Linux only")
def test_missing_library_falls_back_and_warns_once() -> None:
    starts, report, err = run_child(child_env(SKULKP2P_BLAS_LIB="/nonexistent/libopenblas.so"))
    assert starts == 1, "no re-exec without a usable library"
    assert report["blas"] == "reference"
    assert report["dtype"] == "bfloat16"
    assert report["library"] is None
    assert "/nonexistent/libopenblas.so" in report["reason"]
    assert err.count("WARNING") == 1, err
    assert "reference BLAS" in err


@pytest.mark.process
@pytest.mark.skipif(not LINUX, reason="the OpenBLAS preload is for Linux only")
def test_off_keeps_reference() -> None:
    starts, report, err = run_child(child_env(SKULKP2P_BLAS="off"))
    assert starts == 1
    assert report["blas"] == "reference"
    assert report["dtype"] == "bfloat16"
    assert "SKULKP2P_BLAS=off" in report["reason"]
    assert report["disabled_by_user"] is True
    assert "WARNING" not in err  # asked for: informational only
    assert err.count("reference BLAS") == 1


@pytest.mark.process
@pytest.mark.skipif(not LINUX, reason="the OpenBLAS preload is for Linux only")
def test_marker_prevents_a_second_exec() -> None:
    # A process that already went through the re-exec but lost LD_PRELOAD must not exec again.
    starts, report, err = run_child(child_env(SKULKP2P_BLAS_REEXEC="1"))
    assert starts == 1
    assert report["blas"] == "reference"
    assert "SKULKP2P_BLAS_REEXEC" in report["reason"]
    assert err.count("WARNING") == 1


@pytest.mark.process
@pytest.mark.skipif(not LINUX, reason="the OpenBLAS preload is for Linux only")
def test_dtype_override() -> None:
    _, report, err = run_child(child_env(SKULKP2P_BLAS="off", SKULKP2P_DTYPE="float16"))
    assert report["dtype"] == "float16"
    assert report["dtype_overridden"] is True
    assert "float16 (SKULKP2P_DTYPE)" in err


def test_bad_dtype_override_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SKULKP2P_DTYPE", "float64")
    with pytest.raises(ValueError, match="SKULKP2P_DTYPE"):
        blas.fast_path_report()


def test_find_openblas_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SKULKP2P_BLAS_LIB", "/somewhere/libopenblas.so.0")
    assert blas.find_openblas() == Path("/somewhere/libopenblas.so.0")


@pytest.mark.skipif(not LINUX, reason="cmeel-openblas is a Linux dependency")
def test_find_openblas_from_the_wheel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SKULKP2P_BLAS_LIB", raising=False)
    lib = blas.find_openblas()
    if lib is None:
        pytest.skip("cmeel-openblas is not installed")
    assert lib.name.startswith("libopenblas") and lib.is_file()
    assert "cmeel.prefix" in str(lib)


@pytest.mark.process
@pytest.mark.skipif(not LINUX or shutil.which("ldd") is None, reason="needs Linux and ldd")
def test_missing_dependencies_names_what_is_missing(tmp_path: Path) -> None:
    assert blas.missing_dependencies(tmp_path / "nope.so") == [f"{tmp_path / 'nope.so'}: no such file"]
    not_a_lib = tmp_path / "libfake.so"
    not_a_lib.write_text("not an ELF file\n")
    assert blas.missing_dependencies(not_a_lib)
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return
    # A real library whose NEEDED entry cannot be found, like libopenblas without libgfortran.
    dep_dir = tmp_path / "dep"
    dep_dir.mkdir()
    (dep_dir / "dep.c").write_text("int skulk_dep(void) { return 1; }\n")
    (tmp_path / "top.c").write_text("int skulk_dep(void);\nint top(void) { return skulk_dep(); }\n")
    subprocess.run([cc, "-shared", "-fPIC", "-Wl,-soname,libskulkdep.so.7", "-o",
                    str(dep_dir / "libskulkdep.so.7"), str(dep_dir / "dep.c")], check=True)
    top = tmp_path / "libtop.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(top), str(tmp_path / "top.c"),
                    str(dep_dir / "libskulkdep.so.7")], check=True)
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    assert blas.missing_dependencies(top, env) == ["libskulkdep.so.7 not found"]
    assert blas.missing_dependencies(top, dict(env, LD_LIBRARY_PATH=str(dep_dir))) == []
    assert blas.probe_library(top, env) is not None  # dlopen fails the same way


def _shared_library(cc: str, path: Path, source: str, *needs: Path, soname: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    c_file = path.with_suffix(".c")
    c_file.write_text(source)
    subprocess.run([cc, "-shared", "-fPIC", *([f"-Wl,-soname,{soname}"] if soname else []),
                    "-o", str(path), str(c_file), *map(str, needs)], check=True)
    return path


@pytest.mark.process
@pytest.mark.skipif(not LINUX or shutil.which("ldd") is None, reason="needs Linux and ldd")
def test_dependency_checks_do_not_inherit_a_preload_that_cannot_load(tmp_path: Path) -> None:
    """A process we re-executed preloads libopenblas, and where the system has no libgfortran5
    finds the mlx wheel's copy only through the LD_LIBRARY_PATH that came with the preload.
    Checking a library under an environment without that path must not start ldd's shell (or
    the probe's interpreter) with that preload: they died before looking at anything ("bash:
    error while loading shared libraries: libgfortran.so.5"). Simulated with a preload whose
    dependency lives in a folder only LD_LIBRARY_PATH names."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler to build the test libraries")
    gfortran = _shared_library(cc, tmp_path / "gf" / "libskulkgf.so.5",
                               "int skulk_gf(void) { return 5; }\n", soname="libskulkgf.so.5")
    preload = _shared_library(cc, tmp_path / "libpreblas.so",
                              "int skulk_gf(void);\nint pre(void) { return skulk_gf(); }\n",
                              gfortran)
    dep = _shared_library(cc, tmp_path / "dep" / "libskulkdep.so.7",
                          "int skulk_dep(void) { return 1; }\n", soname="libskulkdep.so.7")
    top = _shared_library(cc, tmp_path / "libtop.so",
                          "int skulk_dep(void);\nint top(void) { return skulk_dep(); }\n", dep)
    base = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "LD_PRELOAD")}
    preloaded = dict(base, LD_PRELOAD=str(preload))
    # The preload really cannot load without its folder on the path (and can with it).
    assert subprocess.run([sys.executable, "-c", "pass"], env=preloaded,
                          capture_output=True).returncode != 0
    assert subprocess.run([sys.executable, "-c", "pass"], capture_output=True, env=dict(
        preloaded, LD_LIBRARY_PATH=str(gfortran.parent))).returncode == 0

    assert blas.missing_dependencies(top, dict(preloaded, LD_LIBRARY_PATH=str(dep.parent))) == []
    assert blas.missing_dependencies(top, preloaded) == ["libskulkdep.so.7 not found"]
    # The probe's interpreter starts and loads the library; this one has no cblas_sgemm.
    why = blas.probe_library(top, dict(preloaded, LD_LIBRARY_PATH=str(dep.parent)))
    assert why is not None and "cblas_sgemm" in why, why

    # The default environment is this process's: as in a re-executed process, the preload's
    # folder is on LD_LIBRARY_PATH here, and the check asks about another path.
    script = ("import os, sys\n"
              "from skulkp2p.engine.cpu import blas\n"
              "env = {k: v for k, v in os.environ.items() if k != 'LD_LIBRARY_PATH'}\n"
              "print(blas.missing_dependencies(sys.argv[1], env))\n"
              "print(blas.missing_dependencies(sys.argv[1]))\n")
    out = subprocess.run([sys.executable, "-c", script, str(top)], capture_output=True,
                         text=True, timeout=60, env=dict(
                             child_env(), LD_PRELOAD=str(preload),
                             LD_LIBRARY_PATH=f"{gfortran.parent}:{dep.parent}"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["['libskulkdep.so.7 not found']", "[]"], out.stdout


@pytest.mark.skipif(not LINUX, reason="the OpenBLAS preload is for Linux only")
def test_in_process_report_has_every_key() -> None:
    report = blas.fast_path_report()
    assert {"blas", "library", "dtype", "gflops_f32", "reason"} <= report.keys()
    assert report["gflops_f32"] > 0
    if report["blas"] == "reference":
        assert report["reason"]


def test_the_fast_path_is_measured_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node's dtype must not follow the machine's load from one model load to the next: the
    product is timed once, and later reports reuse that measurement (a loaded box once made
    one member of a tensor group reload in bfloat16 beside a float32 peer)."""
    first = blas.fast_path_report()
    assert first["gflops_f32_cpu"] > 0

    def measured_again(*_args, **_kwargs):
        raise AssertionError("the product was timed a second time")

    monkeypatch.setattr(blas, "_measure_f32", measured_again)
    again = blas.fast_path_report()
    assert (again["dtype"], again["blas"], again["gflops_f32"]) == (
        first["dtype"], first["blas"], first["gflops_f32"])


LOADED_CHILD = r"""
import json
print("START", flush=True)
from skulkp2p.engine.cpu import blas
blas.ensure_fast_blas()
import mlx.core  # noqa: F401
got = {}
bar = blas.FAST_GFLOPS_MIN
for name, rates in (("loaded", (bar / 4, bar * 8)), ("slow", (bar / 4, bar / 4))):
    blas._measured = rates  # (wall clock, CPU time) as a loaded / a reference-BLAS box gives
    got[name] = blas.fast_path_report()
print("REPORT " + json.dumps(got), flush=True)
"""


@pytest.mark.process
def test_a_loaded_machine_keeps_the_fast_path() -> None:
    """With OpenBLAS preloaded, a wall-clock rate under the bar (the process waited behind
    others) with a CPU-time rate over it still means the preload took effect: float32, as on a
    quiet machine; both rates under the bar mean it did not."""
    fast_path_available()
    env = {k: v for k, v in child_env().items() if k != "SKULKP2P_DTYPE"}
    _, got, _ = run_child(env, ["-c", LOADED_CHILD])
    assert (got["loaded"]["blas"], got["loaded"]["dtype"]) == ("openblas", "float32"), got
    assert got["slow"]["blas"] == "reference", got
