"""A file written whole or not at all (skulkp2p/atomic_file.py), shared by the cluster's durable
state, the prefix cache's disk store and the bench's JSON."""

import os
import stat

import pytest

from skulkp2p.atomic_file import temporary_name, write_atomic


def test_written_whole_with_its_mode_and_no_temporary_left(tmp_path):
    path = tmp_path / "state.json"
    write_atomic(path, (b"one", memoryview(b"-two")), mode=0o600)
    assert path.read_bytes() == b"one-two"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert os.listdir(tmp_path) == ["state.json"]


def test_a_failure_mid_write_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    path = tmp_path / "state.json"
    path.write_bytes(b"old")

    def parts():
        yield b"new, half"
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, parts())
    assert path.read_bytes() == b"old"
    assert not temporary_name(path).exists()
    assert os.listdir(tmp_path) == ["state.json"]
