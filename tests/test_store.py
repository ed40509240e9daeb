"""The model store as a user drives it: pull, kill -9 half-way, pull again, path."""

import os
import signal
import subprocess
import sys
import time

import pytest

from skulkp2p.models.store import ModelStore, ModelStoreError
from tests.helpers import ROOT
from tests.helpers.models import test_data_dir
from tests.helpers.procs import run_cli


def test_unknown_model_is_a_clear_error(tmp_path):
    with pytest.raises(ModelStoreError, match="unknown model 'nope'"):
        ModelStore(tmp_path).resolve("nope")
    proc = run_cli("models", "path", "smollm2-135m", "--data-dir", str(tmp_path))
    assert proc.returncode == 1 and "models pull smollm2-135m" in proc.stderr


def test_local_folder_resolves_to_itself(tiny_models, tmp_path):
    store = ModelStore(tmp_path)
    assert store.pull(str(tiny_models["llama"])) == tiny_models["llama"].resolve()


@pytest.mark.slow
def test_killed_conversion_leaves_nothing_and_second_pull_is_noop(smollm2_path, tmp_path):

    gguf = next((test_data_dir() / "downloads" / "smollm2-135m").glob("*.gguf"))
    data = tmp_path / "data"
    models = data / "models"
    proc = subprocess.Popen([sys.executable, "-m", "skulkp2p", "models", "pull", str(gguf),
                             "--data-dir", str(data)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            tmp = [p for p in models.glob(".tmp-*")] if models.exists() else []
            if tmp and any(tmp[0].iterdir()):
                break
            assert proc.poll() is None, "conversion finished before it could be interrupted"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # Nothing that loads: no model folder under its final name, and `models path` says so.
    finished = [p for p in models.iterdir() if not p.name.startswith(".")]
    assert finished == []
    assert run_cli("models", "path", str(gguf), "--data-dir", str(data)).returncode == 1

    first = run_cli("models", "pull", str(gguf), "--data-dir", str(data))
    assert first.returncode == 0, first.stderr
    out = first.stdout.strip()
    marker = os.path.join(out, "skulkp2p.json")
    stamp = os.stat(marker).st_mtime_ns
    assert not list(models.glob(".tmp-*")), "the leftover of the killed run was not cleaned"
    again = run_cli("models", "pull", str(gguf), "--data-dir", str(data))
    assert again.returncode == 0 and again.stdout.strip() == out
    assert os.stat(marker).st_mtime_ns == stamp  # a second pull converts nothing
    path = run_cli("models", "path", str(gguf), "--data-dir", str(data))
    assert path.stdout.strip() == out
