"""The engine's one CPU switch (engine/cpu/switch.py): importing the engine switches nothing
(mlx-lm's functions, the environment, no re-exec, no thread policy, no model piece); `install()`
switches every piece on, once, and keeps each piece's variable working."""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest

from skulkp2p.engine.cpu import blas, blas_threads, switch
from skulkp2p.engine.cpu import weight_first as wf
from skulkp2p.engine.cpu.table_rope import TableRoPE
from tests.helpers.blas import LINUX, child_env, fast_path_available

# The state a child reports: mlx-lm's functions in the families numpy_verify routes, the
# environment, the switch's record, the thread policy, and what a tiny llama's modules became.
STATE = r"""
def state(model=None):
    import os
    import mlx_lm.models.activations as activations
    import mlx_lm.models.base as base
    from skulkp2p.engine.cpu import blas_threads, switch
    out = {"stock": {}, "env": dict(os.environ), "switched": None, "policy": None}
    if model is not None:
        out["given"] = switch.apply(model, "float32")
        out["kinds"] = sorted({type(m).__name__ for _, m in model.named_modules()})
    for family in ("llama", "qwen2", "qwen3"):
        module = __import__(f"mlx_lm.models.{family}", fromlist=["x"])
        out["stock"][family] = (module.scaled_dot_product_attention
                                is base.scaled_dot_product_attention
                                and module.swiglu is activations.swiglu)
    got = switch.installed()
    if got is not None:
        out["switched"] = {"blas": got.blas, "threads": got.threads, "models": got.models,
                           "routed": got.routed}
    out["policy"] = blas_threads.policy() is not None
    return out

def tiny_llama():
    from mlx_lm.models import llama
    return llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=32, num_hidden_layers=1, intermediate_size=64,
        num_attention_heads=4, rms_norm_eps=1e-5, vocab_size=64, num_key_value_heads=2))
"""

# Imports every module of the engine, then reports (START once per process: a re-exec shows).
IMPORT_ALL = STATE + r"""
import importlib, json, os, pkgutil, sys
print("START", flush=True)
import mlx_lm  # noqa: F401  (sets a variable of its own at import: not the engine's doing)
before = dict(os.environ)
import skulkp2p.engine
names = [m.name for m in pkgutil.walk_packages(skulkp2p.engine.__path__, "skulkp2p.engine.")]
for name in names:
    importlib.import_module(name)
out = state(tiny_llama())
out["env_changed"] = sorted(k for k in set(before) | set(out.pop("env"))
                            if before.get(k) != os.environ.get(k))
out["modules"] = len(names)
print("REPORT " + json.dumps(out), flush=True)
"""

# install() first thing, as `join` does, then the same report.
INSTALL = STATE + r"""
import json, os
print("START", flush=True)
from skulkp2p.engine.cpu import switch
first = switch.install()
assert switch.install() is first  # idempotent
out = state(tiny_llama())
out["ld_preload"] = os.environ.get("LD_PRELOAD", "")
out.pop("env")
print("REPORT " + json.dumps(out), flush=True)
"""


def run(script: str, **env: str) -> tuple[int, dict]:
    """(how many times the child started, its report)."""
    out = subprocess.run([sys.executable, "-c", script], env=child_env(**env),
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    reports = [ln for ln in lines if ln.startswith("REPORT ")]
    assert len(reports) == 1, out.stdout + out.stderr
    return lines.count("START"), json.loads(reports[0][len("REPORT "):])


@pytest.mark.process
def test_importing_the_engine_switches_nothing():
    # float32 forced: the model pieces would apply to this model if anything had switched
    starts, got = run(IMPORT_ALL, SKULKP2P_DTYPE="float32")
    assert got["modules"] > 40
    assert starts == 1, "no re-exec"
    assert got["env_changed"] == []
    assert got["stock"] == {"llama": True, "qwen2": True, "qwen3": True}
    assert got["switched"] is None and got["policy"] is False
    assert got["given"] == []
    assert "WeightFirstLinear" not in got["kinds"] and "TableRoPE" not in got["kinds"]
    assert "Linear" in got["kinds"] and "RoPE" in got["kinds"]


@pytest.mark.process
def test_install_switches_every_piece_on():
    fast_path_available()
    starts, got = run(INSTALL)
    assert starts == 2, "one re-exec with OpenBLAS preloaded"
    assert "libopenblas" in got["ld_preload"]
    assert got["switched"]["blas"] == "openblas" and got["switched"]["threads"] is None
    assert got["policy"] is True
    assert got["given"] == ["weight_first", "numpy_verify", "table_rope"]
    assert got["switched"]["routed"] == ["llama"]
    assert got["switched"]["models"] == {"weight_first": 1, "numpy_verify": 1, "table_rope": 1}
    assert got["stock"] == {"llama": False, "qwen2": True, "qwen3": True}
    assert {"WeightFirstLinear", "WeightFirstEmbedding", "TableRoPE"} <= set(got["kinds"])
    assert "Linear" not in got["kinds"] and "RoPE" not in got["kinds"]


@pytest.mark.process
@pytest.mark.skipif(not LINUX, reason="the OpenBLAS preload is for Linux only")
def test_the_variables_still_turn_pieces_off():
    starts, got = run(INSTALL, SKULKP2P_BLAS="off", SKULKP2P_DTYPE="float32",
                      SKULKP2P_NUMPY_VERIFY="0", SKULKP2P_TABLE_ROPE="off",
                      SKULKP2P_BLAS_THREADS="1")
    assert starts == 1 and "libopenblas" not in got["ld_preload"]
    assert got["switched"]["blas"] == f"disabled by {blas.ENV_MODE}=off"
    assert got["switched"]["threads"] == 1
    assert got["given"] == ["weight_first"]
    assert got["stock"] == {"llama": True, "qwen2": True, "qwen3": True}


def _tiny() -> nn.Module:
    from mlx_lm.models import llama

    return llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=32, num_hidden_layers=1, intermediate_size=64,
        num_attention_heads=4, rms_norm_eps=1e-5, vocab_size=64, num_key_value_heads=2))


def test_apply_gives_nothing_before_install(monkeypatch):
    monkeypatch.setattr(switch, "_switched", None)
    model = _tiny()
    assert switch.apply(model, "float32") == []
    assert {type(m) for _, m in model.named_modules()} >= {nn.Linear, nn.RoPE}
    monkeypatch.setattr(blas_threads, "_armed", False)
    assert blas_threads.policy() is None


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the pieces are for CPU nodes")
def test_install_once_then_apply_per_model(monkeypatch):
    calls: list[list[str] | None] = []
    monkeypatch.setattr(switch, "_switched", None)
    monkeypatch.setattr(blas, "ensure_fast_blas", calls.append)  # no re-exec of pytest
    monkeypatch.setenv(blas_threads.ENV, "many")
    with pytest.raises(ValueError):
        switch.install()
    assert switch.installed() is None and calls == []
    monkeypatch.setenv(blas_threads.ENV, "2")
    parent = switch.install(blas=False)
    assert parent.blas == switch.PARENT and parent.threads == 2 and calls == []
    assert switch.install(blas=False) is parent
    again = switch.install(argv=["x"])  # the BLAS step, once
    assert again is parent and calls == [["x"]] and again.blas != switch.PARENT
    assert switch.install() is parent and calls == [["x"]]
    model = _tiny()
    assert switch.apply(model, "bfloat16") == []
    monkeypatch.setenv(wf.ENV, "0")
    assert switch.apply(model, "float32") == ["numpy_verify", "table_rope"]
    assert type(model.layers[0].self_attn.rope) is TableRoPE
    assert type(model.layers[0].self_attn.q_proj) is nn.Linear
    assert parent.models == {"numpy_verify": 1, "table_rope": 1} and "llama" in parent.routed
