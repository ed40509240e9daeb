"""`join` loads its model, says it is ready, and exits cleanly on Ctrl-C (SIGINT) or SIGTERM."""

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

from tests.conftest import ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_join(model, data_dir, wait_for: bytes):
    """A `join` subprocess, yielded once its log shows `wait_for`; killed by pid if still alive."""
    log = data_dir / "join.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "skulkp2p", "join", "--model", str(model),
                                 "--data-dir", str(data_dir), "--http-port", str(free_port())],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 60
        while wait_for not in log.read_bytes():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"join never logged {wait_for!r}"
            time.sleep(0.02)
        yield proc, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_join_ready_then_clean_exit(tiny_models, sig, tmp_path):
    with running_join(tiny_models["llama"], tmp_path, b"ready: model") as (proc, log):
        os.kill(proc.pid, sig)
        assert proc.wait(timeout=20) == 0
        assert "stopped" in log.read_text()


def test_join_unknown_model(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "skulkp2p", "join", "--model", "nope"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1
    assert "unknown model 'nope'" in proc.stderr


def test_join_sigint_while_loading_exits_promptly(tiny_models, tmp_path):
    """Ctrl-C as soon as the API is up (the model may still be loading) ends the node."""
    with running_join(tiny_models["llama"], tmp_path, b"http: ") as (proc, log):
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=30) == 0, log.read_text()
