"""A file written whole or not at all, and durably.

`write_atomic(path, parts)` writes the parts to a temporary file beside `path` (named
`.NAME.PID.tmp`, so a reader that lists the folder can tell it apart), fsyncs it, renames it over
`path` and fsyncs the folder: a reader sees the old file or the new one, never a part, and the
rename survives a power cut once it returns. On any error the temporary file is removed and the
error raised; the caller decides what a failure means. Used by the cluster's durable state and
the prefix cache's disk store alike.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

TMP_SUFFIX = ".tmp"


def temporary_name(path: Path) -> Path:
    """Where `write_atomic` writes before the rename."""
    return path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")


def write_atomic(path: Path, parts: Iterable[bytes | memoryview], mode: int = 0o666) -> None:
    """Write `parts`, in order, to `path` whole or not at all (`mode` before the umask)."""
    tmp = temporary_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            for part in parts:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)


def fsync_folder(folder: Path) -> None:
    """Make a rename in `folder` durable (nothing where the platform has no folder fds)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
