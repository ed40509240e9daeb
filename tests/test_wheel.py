"""The package as a wheel installs it: built from this repository, installed into a fresh
virtual environment, and run from a folder outside the repository, it has its model cards and
the trained drafting head (package data), answers --version, lists the cards, serves one
request through `pipe`, and serves a chat completion through a real `join`.

The fresh environment gets the wheel alone (--no-deps): its dependencies are this environment's,
made visible by a .pth file that names this environment's site-packages. A directory a .pth file
names is put on sys.path but the .pth files inside it are not processed, so the editable install
of the repository (a .pth file and its finder) does not shadow the wheel; the tests check that
the package imported is the installed one."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from skulkp2p.models.cards import DEFAULT_MODEL, PACKAGE_CARDS_DIR
from tests.helpers import ROOT
from tests.helpers.http_client import call
from tests.helpers.procs import kill, listening_port

pytestmark = [pytest.mark.process, pytest.mark.slow]

HEAD = ("skulkp2p/cards/sidecars/smollm2-135m-eagle3/mtp.safetensors",
        "skulkp2p/cards/sidecars/smollm2-135m-eagle3/mtp.provenance.toml",
        "skulkp2p/cards/sidecars/smollm2-135m/mtp.safetensors",
        "skulkp2p/cards/sidecars/smollm2-135m/mtp.provenance.toml")
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@dataclass(frozen=True)
class Installed:
    wheel: Path
    python: Path  # the fresh environment's interpreter
    site: Path  # its site-packages, where the wheel went
    cwd: Path  # outside the repository
    env: dict[str, str]

    def run(self, *args: str, input: str | None = None, timeout: float = 120,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.python), *args], input=input, capture_output=True,
                              text=True, timeout=timeout, cwd=self.cwd,
                              env={**self.env, **(env or {})})


def _clean_env() -> dict[str, str]:
    """This process's environment without what would point the children at the repository or
    carry this process's settings: PYTHONPATH, our variables (SKULKP2P_CARDS_DIR among them),
    the OpenBLAS preload and its re-exec marker (each child arranges its own)."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith("SKULKP2P_")
            and k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONSAFEPATH",
                          "LD_PRELOAD", "OPENBLAS_NUM_THREADS", "__PYVENV_LAUNCHER__")}


def _build_wheel(tmp: Path) -> Path:
    """A wheel of a copy of the sources (setuptools writes build/ and *.egg-info beside them;
    the repository is left as it is). Built without isolation where this environment can build
    it (pyproject's build-system asks for setuptools >= 77, the first to read an SPDX licence
    string), else pip fetches the build-system requirements into an isolated environment."""
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "skulkp2p", src / "skulkp2p",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp / "dist"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check",
           "-q", "-w", str(out), str(src)]
    if _can_build_without_isolation():
        cmd.insert(4, "--no-build-isolation")
    built = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp,
                           env=_clean_env())
    assert built.returncode == 0, built.stdout + built.stderr
    wheels = sorted(out.glob("skulkp2p-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def _can_build_without_isolation() -> bool:
    try:
        import setuptools
    except ImportError:
        return False
    version = tuple(int(p) for p in setuptools.__version__.split(".")[:2] if p.isdigit())
    return version >= (77, 0)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    tmp = tmp_path_factory.mktemp("wheel")
    wheel = _build_wheel(tmp)
    venv = tmp / "venv"
    made = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)],
                          capture_output=True, text=True, timeout=120, cwd=tmp)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    env = _clean_env()
    paths = subprocess.run([str(python), "-c", "import json, sysconfig; print(json.dumps("
                            "[sysconfig.get_paths()[k] for k in ('purelib', 'platlib')]))"],
                           capture_output=True, text=True, timeout=60, cwd=tmp, env=env)
    assert paths.returncode == 0, paths.stderr
    site = Path(json.loads(paths.stdout)[0])
    # This environment's site-packages (its dependencies), after the fresh one's own.
    ours = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (site / "_skulkp2p_test_deps.pth").write_text("".join(f"{p}\n" for p in ours))
    # pip of this environment installs into the fresh one (--python: pip >= 22.3).
    inst = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                           "--no-deps", "--no-index", "--disable-pip-version-check", "-q",
                           str(wheel)], capture_output=True, text=True, timeout=300, cwd=tmp,
                          env=env)
    assert inst.returncode == 0, inst.stdout + inst.stderr
    cwd = tmp / "elsewhere"
    cwd.mkdir()
    return Installed(wheel, python, site, cwd, env)


def test_the_wheel_holds_the_cards_and_the_trained_head(installed: Installed) -> None:
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    cards = {f"skulkp2p/cards/{p.name}" for p in PACKAGE_CARDS_DIR.glob("*.toml")}
    assert f"skulkp2p/cards/{DEFAULT_MODEL}.toml" in cards
    assert cards | set(HEAD) <= names, sorted(cards | set(HEAD) - names)
    for name in HEAD:  # installed, and the same bytes as the repository's
        assert (installed.site / name).read_bytes() == (ROOT / name).read_bytes()


def test_the_installed_package_is_imported_not_the_repository(installed: Installed) -> None:
    probe = ("import json, skulkp2p\n"
             "from skulkp2p.engine.runner.loader import resolve_sidecar\n"
             "from skulkp2p.models.cards import load_cards\n"
             f"card = load_cards()[{DEFAULT_MODEL!r}]\n"
             "sidecar = resolve_sidecar(card.speculation['mtp_sidecar'], card.file)\n"
             "print(json.dumps([skulkp2p.__file__, str(card.file), str(sidecar)]))\n")
    out = installed.run("-c", probe)
    assert out.returncode == 0, out.stderr
    site = installed.site.resolve()
    for path in json.loads(out.stdout):
        assert Path(path).resolve().is_relative_to(site), (path, site)
        assert not Path(path).resolve().is_relative_to(ROOT), path


def test_version(installed: Installed) -> None:
    out = installed.run("-m", "skulkp2p", "--version", timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "skulkp2p 0.1.0\n"


def test_cards_list(installed: Installed) -> None:
    out = installed.run("-m", "skulkp2p", "cards", "list", timeout=60)
    assert out.returncode == 0, out.stderr
    assert DEFAULT_MODEL in {line.split()[0] for line in out.stdout.splitlines() if line}


def test_pipe_answers_with_the_shipped_head(installed: Installed, smollm2_path: Path) -> None:
    request = {"id": "q", "messages": CHAT, "max_tokens": 12, "temperature": 0}
    out = installed.run("-m", "skulkp2p", "pipe", "--engine", "mlx",
                        input=json.dumps(request) + "\n",
                        timeout=400, env={"SKULKP2P_DATA_DIR": str(smollm2_path.parent.parent)})
    assert out.returncode == 0, out.stderr
    results = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(results) == 1 and "error" not in results[0], results
    result = results[0]
    assert result["id"] == "q" and "Paris" in result["text"], result
    # The card's drafting head (the wheel's sidecars/ file) loaded and drafts beside lookup.
    assert "MTP head loaded" in out.stderr, out.stderr[-3000:]
    assert "mtp" in result["speculation"]["drafter"], result["speculation"]


def test_join_serves_a_chat_completion_and_stops_on_ctrl_c(installed: Installed,
                                                           smollm2_path: Path) -> None:
    log = installed.cwd / "join.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [str(installed.python), "-m", "skulkp2p", "join", "--model", DEFAULT_MODEL,
             "--engine", "mlx", "--data-dir", str(smollm2_path.parent.parent), "--http-host", "127.0.0.1",
             "--http-port", "0", "--host", "127.0.0.1", "--port", "0", "--no-cluster-state"],
            cwd=installed.cwd, env=installed.env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        port = listening_port(log, proc, timeout=120)
        deadline = time.monotonic() + 300
        while b"ready: model" not in log.read_bytes():
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "join never said it was ready"
            time.sleep(0.1)
        status, _, body = call(f"127.0.0.1:{port}", "POST", "/v1/chat/completions",
                               {"messages": CHAT, "max_tokens": 12, "temperature": 0},
                               timeout=300)
        assert status == 200, body
        assert "Paris" in body["choices"][0]["message"]["content"], body
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, log.read_text(errors="replace")[-3000:]
        assert "stopped" in log.read_text(errors="replace")
    finally:
        kill(proc)
