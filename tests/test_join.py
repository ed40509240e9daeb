"""`join` loads its model, says it is ready, and exits cleanly on Ctrl-C (SIGINT) or SIGTERM."""

import os
import signal
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from tests.helpers.procs import running_join


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
