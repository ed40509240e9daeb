"""`join` loads its model, says it is ready, and exits cleanly on Ctrl-C (SIGINT) or SIGTERM."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_join_ready_then_clean_exit(tiny_models, sig, tmp_path):
    log = tmp_path / "join.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "skulkp2p", "join", "--model",
                                 str(tiny_models["llama"]), "--data-dir", str(tmp_path),
                                 "--http-port", str(free_port())],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 60
        while b"ready: model" not in log.read_bytes():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "join never said it was ready"
            time.sleep(0.1)
        os.kill(proc.pid, sig)
        assert proc.wait(timeout=20) == 0
        assert "stopped" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_join_unknown_model(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "skulkp2p", "join", "--model", "nope"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1
    assert "unknown model 'nope'" in proc.stderr


def test_join_sigint_while_loading_exits_promptly(tiny_models, tmp_path):
    """Ctrl-C as soon as the API is up (the model may still be loading) ends the node."""
    log = tmp_path / "join.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "skulkp2p", "join", "--model",
                                 str(tiny_models["llama"]), "--data-dir", str(tmp_path),
                                 "--http-port", str(free_port())],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 60
        while b"http: " not in log.read_bytes():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "join never opened its API"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
