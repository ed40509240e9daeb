"""Rotary embeddings from a table (engine/cpu/table_rope.py): bit for bit `mx.fast.rope` for every
layout, partial rotation, base, scale, width and offset (across the table's growth), mlx's own
rope for what it does not take (array offsets, bfloat16, inside `stock()`), installed by
load_model on float32 CPU models, and whole forwards of tiny models of each family equal to
mlx's rope bit for bit, prefill, steps and verifies."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from skulkp2p.engine.cpu import table_rope
from skulkp2p.engine.cpu.table_rope import TableRoPE, install, stock
from skulkp2p.engine.model.forward import LocalForward
from skulkp2p.engine.model.loaded import load_model


def _x(shape: tuple[int, ...], seed: int = 0, dtype=mx.float32) -> mx.array:
    rng = np.random.default_rng(seed)
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def _table_rope(dims: int, traditional: bool, base: float, scale: float) -> TableRoPE:
    rope = nn.RoPE(dims, traditional=traditional, base=base, scale=scale)
    rope.__class__ = TableRoPE
    return rope


@pytest.mark.parametrize("dims,head", [(64, 64), (32, 64), (16, 24)])
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("base,scale", [(10000.0, 1.0), (100000.0, 1.0), (500000.0, 0.25)])
def test_bit_for_bit_mlx_rope(dims, head, traditional, base, scale):
    rope = _table_rope(dims, traditional, base, scale)
    for t in (1, 2, 7, 17):
        for shape in ((1, 9, t, head), (2, 3, t, head), (1, t, head)):
            x = _x(shape, seed=t)
            for offset in (0, 1, 300, 4095 - t + 1, 4096, 20000):
                want = mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale,
                                    offset=offset)
                got = rope(x, offset)
                assert got.shape == want.shape
                assert mx.array_equal(got, want).item(), (shape, offset)


def test_the_table_grows_and_is_shared():
    table_rope._tables.clear()
    cos, sin = table_rope.table(64, 10000.0, 1.0, 10)
    assert cos.shape == sin.shape == (table_rope.FIRST_POSITIONS, 32)
    assert table_rope.table(64, 10000.0, 1.0, 4096)[0] is cos  # reused, not rebuilt
    bigger, _ = table_rope.table(64, 10000.0, 1.0, 4097)
    assert bigger.shape[0] == 2 * table_rope.FIRST_POSITIONS
    assert mx.array_equal(bigger[:4096], cos).item()  # the same entries, longer


def test_what_it_does_not_take_is_mlxs_rope(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the table answered")

    monkeypatch.setattr(table_rope, "rope", refuse)
    rope = _table_rope(64, False, 10000.0, 1.0)
    x = _x((2, 4, 3, 64))
    want = mx.fast.rope(x, 64, traditional=False, base=10000.0, scale=1.0, offset=5)
    per_row = mx.array([5, 9])  # a batch's caches at different offsets
    assert mx.array_equal(rope(x, per_row)[0], want[0]).item()
    half = x.astype(mx.bfloat16)
    assert mx.array_equal(rope(half, 5), mx.fast.rope(half, 64, traditional=False, base=10000.0,
                                                      scale=1.0, offset=5)).item()
    with stock():
        assert mx.array_equal(rope(x, 5), want).item()
    assert mx.array_equal(rope(x, table_rope.MAX_POSITIONS),
                          mx.fast.rope(x, 64, traditional=False, base=10000.0, scale=1.0,
                                       offset=table_rope.MAX_POSITIONS)).item()
    monkeypatch.undo()
    assert mx.array_equal(rope(x, 5), want).item()  # and the table outside them


def test_install_swaps_plain_ropes_only_and_enabled_reads_dtype_and_env(monkeypatch):
    class Scaled(nn.RoPE):  # a variant with its own frequencies keeps its class
        pass

    model = nn.Sequential(nn.RoPE(8), Scaled(8), nn.Linear(2, 2))
    assert install(model) == 1
    assert type(model.layers[0]) is TableRoPE and type(model.layers[1]) is Scaled
    assert install(model) == 0  # once
    assert table_rope.enabled("float32")
    assert not table_rope.enabled("bfloat16")
    monkeypatch.setenv(table_rope.ENV, "0")
    assert not table_rope.enabled("float32")


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_whole_forwards_equal_mlxs_rope_bit_for_bit(tiny_model, family):
    """load_model installs it; a prefill, one-token steps and a verify give the logits mlx's
    own rope gives (inside stock()), bit for bit."""
    loaded = load_model(tiny_model(family), family, dtype="float32")
    ropes = [m for _, m in loaded.model.named_modules() if isinstance(m, nn.RoPE)]
    assert ropes and all(type(m) is TableRoPE for m in ropes)
    prompt = [5, 17, 42, 8, 99, 3, 64, 21, 7, 11, 30, 2]
    tokens = [14, 6, 77, 40, 9]

    def run() -> list[mx.array]:
        fwd = LocalForward(loaded.model)
        fwd.prefill(prompt)
        out = [fwd([t]) for t in tokens[:2]]
        out.append(fwd(tokens[2:]))
        return out

    with stock():
        want = run()
    got = run()
    for a, b in zip(got, want, strict=True):
        assert mx.array_equal(a, b).item()
