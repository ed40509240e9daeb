"""The progress of a fetch or a conversion: a tqdm bar on a terminal, two lines in a log."""

from __future__ import annotations

import fcntl
import io
import os
import select
import struct
import subprocess
import sys
import termios

import pytest

from skulkp2p.progress import ProgressBar
from tests.helpers import ROOT


def test_not_a_terminal_one_line_at_the_start_and_one_at_the_end():
    out = io.StringIO()
    bar = ProgressBar("fetching m", out)
    assert not bar.tty
    for done in range(0, 101):
        bar(done, 100)
    bar(100, 100)  # a repeated last call adds nothing
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert lines[0] == "fetching m: 0% (0/100)"
    assert lines[1].startswith("fetching m: 100% (100/100, ") and lines[1].endswith(" s)")


def test_a_single_step_is_one_line():
    out = io.StringIO()
    ProgressBar("converting m", out)(1, 1)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("converting m: 100% (1/1, "), lines


def _read_all(fd: int) -> bytes:
    data = b""
    while select.select([fd], [], [], 0.5)[0]:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the other end is closed (Linux raises EIO)
            break
        if not chunk:
            break
        data += chunk
    return data


def _on_a_terminal(columns: int | None, steps: int) -> str:
    """What a pseudo-terminal of `columns` (None: one that reports no size) shows of a bar
    driven from 0 to `steps`."""
    master, slave = os.openpty()
    if columns:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    stream = open(slave, "w", encoding="utf-8")  # noqa: SIM115 - closed below
    try:
        bar = ProgressBar("fetching m", stream)
        assert bar.tty
        for done in range(0, steps + 1):
            bar(done, steps)
        stream.flush()
        return _read_all(master).decode("utf-8", "replace")
    finally:
        stream.close()
        os.close(master)


@pytest.mark.parametrize("columns", [None, 50])
def test_terminal_gets_a_bar_redrawn_in_place(columns):
    text = _on_a_terminal(columns, 40)
    assert "\r" in text, repr(text)  # redrawn in place, not a line per update
    assert text.count("\n") == 1 and text.endswith("\n"), repr(text)  # a newline once done
    draws = [d for d in text.replace("\r\n", "\n").split("\r") if d.strip()]
    last = draws[-1].rstrip("\n")
    assert last.startswith("fetching m: 100%|") and "█" in last and "40/40" in last, repr(last)
    assert all(len(d.rstrip("\n")) <= (columns or 80) for d in draws), draws


@pytest.mark.process
def test_models_pull_logs_two_lines_per_step(tmp_path):
    """`models pull` of a GGUF file with stderr in a log (a pipe): the conversion says when it
    starts and when it ends, nothing in between."""
    from tests.helpers.gguf_files import hf_weights, write_gguf

    src = write_gguf(tmp_path / "m.gguf", hf_weights("llama", True), "llama")
    proc = subprocess.run([sys.executable, "-m", "skulkp2p", "models", "pull", str(src),
                           "--data-dir", str(tmp_path / "data")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("converting ")]
    assert len(lines) == 2, proc.stderr
    assert "% (1/" in lines[0] and ": 100% (" in lines[1]
