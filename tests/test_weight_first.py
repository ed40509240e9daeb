"""Weight-first verify products (engine/cpu/weight_first.py): the same numbers as `x @ W.T` within
rounding for a verify's 2+ rows, mlx-lm's own product everywhere else (one row, a prefill chunk,
outside a verify), installed by load_model on float32 CPU models only, and a verify through it
picks the tokens single steps pick."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from skulkp2p.engine.cpu import weight_first
from skulkp2p.engine.cpu.weight_first import (
    MAX_ROWS,
    WeightFirstEmbedding,
    WeightFirstLinear,
    install,
    product,
    verify_rows,
)
from skulkp2p.engine.model.forward import LocalForward
from skulkp2p.engine.model.loaded import load_model


def arrays(rows: int, k: int = 96, n: int = 160, seed: int = 0) -> tuple[mx.array, mx.array]:
    rng = np.random.default_rng(seed)
    x = mx.array(rng.standard_normal((1, rows, k)).astype(np.float32))
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32))
    return x, w


@pytest.mark.parametrize("rows", [2, 3, 5, 16, 17, 33, MAX_ROWS])
def test_a_verify_of_several_rows_is_the_same_product(rows):
    x, w = arrays(rows)
    want = x @ w.T
    with verify_rows():
        got = product(x, w)
    assert got.shape == want.shape == (1, rows, 160)
    assert np.allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, MAX_ROWS + 1, 200])
def test_one_row_and_a_prefill_chunk_keep_mlx_lms_product(rows):
    x, w = arrays(rows, seed=rows)
    with verify_rows():
        got = product(x, w)
    assert mx.array_equal(got, x @ w.T)  # the very same op: bit for bit


def test_outside_a_verify_nothing_changes():
    x, w = arrays(8)
    assert mx.array_equal(product(x, w), x @ w.T)
    with verify_rows(False):
        assert mx.array_equal(product(x, w), x @ w.T)
    with verify_rows():
        with verify_rows(False):  # nested: the inner setting holds, then the outer comes back
            assert mx.array_equal(product(x, w), x @ w.T)
        assert weight_first._verifying.get()
    assert not weight_first._verifying.get()


def test_install_swaps_plain_layers_only_and_keeps_their_weights():
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 24), nn.Linear(24, 8, bias=False))
    quantized = nn.Sequential(nn.Linear(64, 64))
    nn.quantize(quantized, group_size=32, bits=4)
    before = dict(tree_flatten(model.parameters()))
    assert install(model) == 3
    assert isinstance(model.layers[0], WeightFirstEmbedding)
    assert isinstance(model.layers[1], WeightFirstLinear) and "bias" in model.layers[1]
    assert isinstance(model.layers[2], WeightFirstLinear)
    after = dict(tree_flatten(model.parameters()))
    assert before.keys() == after.keys() and all(before[k] is after[k] for k in before)
    assert install(quantized) == 0 and type(quantized.layers[0]) is nn.QuantizedLinear

    x = mx.array(np.random.default_rng(1).standard_normal((1, 5, 16)).astype(np.float32))
    lin = model.layers[1]
    want = x @ lin.weight.T + lin.bias
    assert mx.array_equal(lin(x), want)  # outside a verify: nn.Linear's own call
    with verify_rows():
        assert np.allclose(np.array(lin(x)), np.array(want), rtol=1e-5, atol=1e-5)
        emb = model.layers[0]
        assert np.allclose(np.array(emb.as_linear(x)), np.array(x @ emb.weight.T),
                           rtol=1e-5, atol=1e-5)


def test_load_model_installs_on_float32_cpu_only(tiny_model, monkeypatch):
    path = tiny_model("llama")
    loaded = load_model(path, "llama", dtype="float32")
    kinds = {type(m) for _, m in loaded.model.named_modules()}
    assert WeightFirstLinear in kinds and nn.Linear not in kinds
    loaded = load_model(path, "llama", dtype="bfloat16")
    assert WeightFirstLinear not in {type(m) for _, m in loaded.model.named_modules()}
    monkeypatch.setenv(weight_first.ENV, "0")
    loaded = load_model(path, "llama", dtype="float32")
    assert WeightFirstLinear not in {type(m) for _, m in loaded.model.named_modules()}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_verify_picks_what_single_steps_pick(tiny_model, family):
    """Through the installed model: a verify of 9 tokens (weight-first) against the same 9
    tokens stepped one at a time (mlx-lm's products), after the same prefill."""
    loaded = load_model(tiny_model(family), family, dtype="float32")
    prompt = [5, 17, 42, 8, 99, 3, 64, 21, 7, 11, 30, 2]
    tokens = [14, 6, 77, 40, 9, 1, 58, 23, 35]
    wide = LocalForward(loaded.model)
    wide.prefill(prompt)
    rows = wide(tokens)
    steps = LocalForward(loaded.model)
    steps.prefill(prompt)
    single = mx.concatenate([steps([t]) for t in tokens], axis=0)
    assert rows.shape == single.shape
    assert np.allclose(np.array(rows), np.array(single), rtol=1e-4, atol=1e-4)
    assert mx.argmax(rows, axis=-1).tolist() == mx.argmax(single, axis=-1).tolist()
