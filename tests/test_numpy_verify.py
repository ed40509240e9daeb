"""A verify's softmax and SwiGLU in numpy (engine/cpu/numpy_verify.py): the same numbers as MLX's
attention within rounding for every mask a verify passes (causal, a tree's boolean mask,
additive, per head, batched rows) and as mlx-lm's SwiGLU, mlx-lm's own functions everywhere
else (one row, outside a verify, another dtype, a quantized cache, switched off), routed by
load_model on float32 CPU models of the attention-only families, and a verify or a tree
through them picks the tokens single steps pick."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from skulkp2p.engine.cpu import numpy_verify
from skulkp2p.engine.cpu.numpy_verify import attention, install, swiglu
from skulkp2p.engine.cpu.weight_first import verify_rows
from skulkp2p.engine.model.forward import LocalForward
from skulkp2p.engine.model.loaded import load_model


def qkv(b: int, hq: int, hkv: int, w: int, s: int, seed: int = 0, d: int = 16):
    rng = np.random.default_rng(seed)
    return tuple(mx.array(rng.standard_normal(shape).astype(np.float32))
                 for shape in ((b, hq, w, d), (b, hkv, s, d), (b, hkv, s, d)))


def masks(b: int, hq: int, w: int, s: int) -> dict[str, object]:
    rng = np.random.default_rng(1)
    tree = rng.random((b, 1, w, s)) > 0.3
    tree[..., 0] = True  # every row sees something, as every verify row sees the prompt
    return {"none": None, "causal": "causal", "tree (bool, one head)": mx.array(tree),
            "additive 2-d": mx.array(rng.standard_normal((w, s)).astype(np.float32)),
            "per head (bool)": mx.array(np.broadcast_to(tree, (b, hq, w, s)).copy()),
            "3-d, per head": mx.array(rng.standard_normal((hq, w, s)).astype(np.float32))}


@pytest.mark.parametrize("shape", [(1, 9, 3, 5, 40), (2, 4, 4, 3, 20), (1, 8, 2, 16, 100),
                                   (3, 6, 1, 2, 7)])
def test_the_same_attention_as_mlx_for_every_mask(shape):
    b, hq, hkv, w, s = shape
    q, k, v = qkv(b, hq, hkv, w, s)
    for name, mask in masks(b, hq, w, s).items():
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
        got = attention(q, k, v, 0.25, mask)
        assert got is not None, name
        assert got.shape == want.shape, name
        assert np.allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6), name


def test_a_mask_it_does_not_know_is_left_to_mlx_lm():
    q, k, v = qkv(2, 4, 2, 3, 10)
    assert attention(q, k, v, 0.25, mx.zeros((2, 2, 3, 10))) is None  # 2 of 4 heads
    assert attention(q, k, v, 0.25, "sliding") is None


def routed(monkeypatch) -> tuple[object, object, list[str]]:
    """The llama family's attention and SwiGLU as the model calls them, and a log of the calls
    this module's numpy answered ("attention", "swiglu")."""
    import mlx_lm.models.llama as llama

    install_llama_modules()
    calls: list[str] = []
    real_attention, real_swiglu = numpy_verify.attention, numpy_verify.swiglu

    def counting_attention(*args, **kwargs):
        out = real_attention(*args, **kwargs)
        if out is not None:
            calls.append("attention")
        return out

    def counting_swiglu(*args, **kwargs):
        calls.append("swiglu")
        return real_swiglu(*args, **kwargs)
    monkeypatch.setattr(numpy_verify, "attention", counting_attention)
    monkeypatch.setattr(numpy_verify, "swiglu", counting_swiglu)
    return llama.scaled_dot_product_attention, llama.swiglu, calls


def install_llama_modules() -> None:
    class Attention:  # stands for a layer whose class lives in mlx-lm's llama module
        pass
    Attention.__module__ = "mlx_lm.models.llama"

    class Model:
        def named_modules(self):
            return [("layers.0.self_attn", Attention())]
    assert install(Model()) == ["llama"]


@pytest.mark.parametrize("shape", [(1, 2, 1536), (1, 17, 64), (3, 5, 40)])
def test_swiglu_is_mlx_lms_within_rounding(shape):
    from mlx_lm.models.activations import swiglu as mlx_lm_swiglu

    rng = np.random.default_rng(2)
    gate, x = (mx.array((rng.standard_normal(shape) * 8).astype(np.float32)) for _ in range(2))
    gate[..., :3] = mx.array([-200.0, 0.0, 200.0])  # exp(-gate) overflows at the first
    want, got = mlx_lm_swiglu(gate, x), swiglu(gate, x)
    assert got.dtype == mx.float32 and got.shape == want.shape
    assert np.allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)


def test_only_a_verify_of_several_float32_rows_is_diverted(monkeypatch):
    fn, mlp, calls = routed(monkeypatch)
    original = fn.__wrapped__
    q, k, v = qkv(1, 6, 2, 4, 12)
    plain = original(q, k, v, cache=None, scale=0.3, mask="causal")
    assert mx.array_equal(fn(q, k, v, None, 0.3, "causal"), plain)  # outside a verify
    with verify_rows(False):
        assert mx.array_equal(fn(q, k, v, None, 0.3, "causal"), plain)
    assert calls == []
    with verify_rows():
        for rows in (1, numpy_verify.MIN_ROWS - 1):  # a step, a narrow verify: mlx-lm's
            q1, k1, v1 = qkv(1, 6, 2, rows, 12)
            assert mx.array_equal(fn(q1, k1, v1, None, 0.3, "causal"),
                                  original(q1, k1, v1, cache=None, scale=0.3, mask="causal"))

        class Quantized:  # a quantized KV cache: mlx-lm's quantized attention
            bits, group_size = 8, 64
        # A quantized KV cache and another dtype keep mlx-lm's (the call would fail or differ).
        half = [a.astype(mx.bfloat16) for a in (q, k, v)]
        assert mx.array_equal(fn(*half, None, 0.3, "causal"),
                              original(*half, cache=None, scale=0.3, mask="causal"))
        def quantized():  # fresh arrays each call: mlx-lm scales the queries in place
            q64, k64, v64 = qkv(1, 6, 2, 4, 12, d=64)
            return q64, *(mx.quantize(a, group_size=64, bits=8) for a in (k64, v64))
        assert mx.array_equal(fn(*quantized(), Quantized(), 0.3, "causal"),
                              original(*quantized(), cache=Quantized(), scale=0.3, mask="causal"))
        assert calls == []
        got = fn(q, k, v, None, 0.3, "causal")
        assert calls == ["attention"]
        gate, x = (a.reshape(1, 4, -1) for a in qkv(1, 6, 2, 4, 12)[1:])
        for rows in (1, numpy_verify.MIN_ROWS - 1):
            few = [a[:, :rows] for a in (gate, x)]
            assert mx.array_equal(mlp(*few), mlp.__wrapped__(*few))  # mlx-lm's
        assert calls == ["attention"]
        both = mlp(gate, x)
        assert calls == ["attention", "swiglu"]
        monkeypatch.setattr(numpy_verify, "active", False)  # switched off: mlx-lm's again
        assert mx.array_equal(fn(q, k, v, None, 0.3, "causal"), plain)
        assert mx.array_equal(mlp(gate, x), mlp.__wrapped__(gate, x))
        assert calls == ["attention", "swiglu"]
    assert mx.array_equal(mlp(gate, x), mlp.__wrapped__(gate, x))  # outside a verify
    assert np.allclose(np.array(both), np.array(mlp.__wrapped__(gate, x)), rtol=1e-5, atol=1e-6)
    assert np.allclose(np.array(got), np.array(plain), rtol=1e-5, atol=1e-6)


def test_install_routes_each_family_once_and_enabled_reads_dtype_and_env(monkeypatch):
    import mlx_lm.models.llama as llama

    install_llama_modules()
    first, mlp = llama.scaled_dot_product_attention, llama.swiglu
    install_llama_modules()
    assert llama.scaled_dot_product_attention is first and llama.swiglu is mlp  # once
    assert first.__wrapped__.__module__ == "mlx_lm.models.base"
    assert mlp.__wrapped__.__module__ == "mlx_lm.models.activations"
    assert numpy_verify.enabled("float32")
    assert not numpy_verify.enabled("bfloat16")
    monkeypatch.setenv(numpy_verify.ENV, "0")
    assert not numpy_verify.enabled("float32")


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_a_verify_and_a_tree_pick_what_single_steps_pick(tiny_model, family, monkeypatch):
    """Through load_model's routing on a tiny model: a verify of 9 tokens and a tree of the
    same 9 as a chain against the tokens stepped one at a time (mlx-lm's attention), after the
    same prefill; this module's numpy answered the verify's attention and SwiGLU in every
    layer."""
    loaded = load_model(tiny_model(family), family, dtype="float32")
    assert family in install(loaded.model)  # load_model routed it already
    _, _, calls = routed(monkeypatch)
    prompt = [5, 17, 42, 8, 99, 3, 64, 21, 7, 11, 30, 2]
    tokens = [14, 6, 77, 40, 9, 1, 58, 23, 35]
    wide = LocalForward(loaded.model)
    wide.prefill(prompt)
    assert calls == []  # a prefill is mlx-lm's
    rows = wide(tokens)
    layers = len(loaded.model.layers)
    assert calls == ["attention", "swiglu"] * layers
    wide.rollback(len(prompt), len(tokens))
    tree = wide.verify_tree(tokens, [-1] + list(range(len(tokens) - 1)))
    assert calls == ["attention", "swiglu"] * (2 * layers)
    steps = LocalForward(loaded.model)
    steps.prefill(prompt)
    single = mx.concatenate([steps([t]) for t in tokens], axis=0)
    assert len(calls) == 4 * layers  # one-token steps are mlx-lm's
    for got in (rows, tree):
        assert got.shape == single.shape
        assert np.allclose(np.array(got), np.array(single), rtol=1e-4, atol=1e-4)
        assert mx.argmax(got, axis=-1).tolist() == mx.argmax(single, axis=-1).tolist()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_compacted_tree_is_the_path_alone_within_rounding(tiny_model, family):
    """With numpy's softmax and SwiGLU, a tree's kept path leaves the caches a verify of the
    path alone leaves within rounding (bit for bit with mlx-lm's: tests/test_trees.py), and the
    next round picks the same tokens from either."""
    loaded = load_model(tiny_model(family), family, dtype="float32")
    prompt = list(range(5, 40))
    tokens = [14, 6, 77, 40, 9, 1, 58]
    parents = [-1, 0, 0, 1, 2, 4, 3]
    path = [2, 4, 5]
    tree = LocalForward(loaded.model)
    tree.prefill(prompt)
    tree.verify_tree(tokens, parents)
    tree.keep_path(path)
    alone = LocalForward(loaded.model)
    alone.prefill(prompt)
    alone([tokens[0], *[tokens[j] for j in path]])
    for a, b in zip(tree.cache, alone.cache, strict=True):
        assert a.offset == b.offset == len(prompt) + 1 + len(path)
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            assert np.allclose(np.array(x[..., :a.offset, :]), np.array(y[..., :b.offset, :]),
                               rtol=1e-5, atol=1e-5)
    got, want = tree([3, 4]), alone([3, 4])
    assert np.allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
    assert mx.argmax(got, axis=-1).tolist() == mx.argmax(want, axis=-1).tolist()
