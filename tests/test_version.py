"""`python -m skulkp2p --version`: the installed version, from the package metadata."""

from __future__ import annotations

import importlib.metadata
import tomllib

import pytest

import skulkp2p
from skulkp2p import cli
from tests.helpers import ROOT


def _project_version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_version_flag_prints_the_version_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        cli.main(["--version"])
    assert stop.value.code == 0
    out, err = capsys.readouterr()
    assert out == f"skulkp2p {_project_version()}\n" and err == ""


def test_version_comes_from_the_metadata_and_the_fallback_agrees(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert cli.package_version() == importlib.metadata.version("skulkp2p") == _project_version()
    # A source tree on sys.path without an install: the package's own __version__, which must
    # not drift from pyproject.toml's.
    assert skulkp2p.__version__ == _project_version()

    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert cli.package_version() == skulkp2p.__version__
