"""A verify's attention on a CPU node: its softmax's exponentials taken by numpy, not by MLX.

On the CPU, MLX 0.32 has no fused attention: `mx.fast.scaled_dot_product_attention` runs as
ops, and its softmax's `exp` costs about 29 ns an element on this Intel Xeon (numpy's vectorised
exp: 0.6 ns; 67,000 elements, 1.9 ms against 0.04). A verify of w rows over a context of S
tokens takes heads x w x S of them per layer, so the exponentials grow with the context as
well as with the width: SmolLM2-135M (float32, two OpenBLAS threads, 450 tokens of context),
whole verify forwards, MLX's attention / this one: 131.6 / 124.5 ms at 2 rows, 179.4 / 156.2
at 8, 249.8 / 195.2 at 16 (64 tokens of context: 187.2 / 180.2 at 16). A one-token step has
only heads x S of them and is left alone.

Only inside `weight_first.verify_rows()` (a verify forward of 2+ rows; forward.StageCache.run
and the tensor ranks enter it), float32 on the CPU: the scores and the values' product stay
MLX matrix products (grouped-query heads folded into the rows, so each KV head is one product
with no copy of its keys), the masked scores are evaluated and handed to numpy for a softmax
in float32, and the probabilities come back as an MLX array. Prefill chunks and one-token steps
run mlx-lm's own attention, so a prompt's cache and plain decoding stay bit-identical to
`mlx_lm.generate`; a verify row already differed from a one-token step in its last bits (a
matrix product against a matrix-vector one, and MLX's exp is itself an approximation with a
relative error up to 1.3e-6), and greedy output equal to plain decoding is what the exactness
tests check.

`install(model)` points the attention of mlx-lm's attention-only families (llama, which
mistral maps to; qwen2; qwen3) at `attention` below, which hands everything else to mlx-lm's own
function: outside a verify, a single row, another dtype or device, a quantized KV cache or
attention sinks. mlx-lm's own generate never enters `verify_rows()`, so it is unchanged in the
same process. `SKULKP2P_VERIFY_ATTENTION=0` turns it off (read when a model loads).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import mlx.core as mx
import numpy as np

from skulkp2p.engine.weight_first import is_verifying

ENV = "SKULKP2P_VERIFY_ATTENTION"
FAMILIES = ("llama", "qwen2", "qwen3")
NAME = "scaled_dot_product_attention"

_original: dict[str, Any] = {}  # module name -> mlx-lm's function it held


def enabled(dtype: str) -> bool:
    """Whether a model loaded in `dtype` gets it: float32 on the CPU, not turned off."""
    return dtype == "float32" and mx.default_device() == mx.cpu \
        and os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def install(model: Any) -> list[str]:
    """Route the attention of `model`'s layers from mlx-lm's attention-only families through
    `attention` (each family's module once, for every model of it in this process, which only
    a verify of ours diverts); the families routed."""
    routed = []
    for _, sub in model.named_modules():
        name = type(sub).__module__
        family = name.rsplit(".", 1)[-1]
        if not name.startswith("mlx_lm.models.") or family not in FAMILIES:
            continue
        if name not in _original:
            module = importlib.import_module(name)
            _original[name] = getattr(module, NAME)
            setattr(module, NAME, _dispatcher(_original[name]))
        if family not in routed:
            routed.append(family)
    return routed


def uninstall() -> None:
    """Give every family its own attention back (tests)."""
    for name, fn in _original.items():
        setattr(importlib.import_module(name), NAME, fn)
    _original.clear()


def _dispatcher(original: Any) -> Any:
    def scaled_dot_product_attention(queries: mx.array, keys: Any, values: Any, cache: Any,
                                     scale: float, mask: Any, sinks: Any = None) -> mx.array:
        if (queries.ndim == 4 and queries.shape[2] >= 2 and is_verifying()
                and queries.dtype == mx.float32 and sinks is None
                and not hasattr(cache, "bits") and mx.default_device() == mx.cpu):
            out = attention(queries, keys, values, scale, mask)
            if out is not None:
                return out
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention.__wrapped__ = original  # type: ignore[attr-defined]
    return scaled_dot_product_attention


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
              mask: Any) -> mx.array | None:
    """softmax(q k^T * scale + mask) v for queries [B, Hq, w, D] over keys and values
    [B, Hkv, S, D], the softmax in numpy; None for a mask shape it does not know (the caller
    then runs mlx-lm's). `mask`: None, "causal" (the w queries are the last w positions), a
    boolean array (True: attend) or an additive one, broadcastable to [B, Hq, w, S]."""
    b, hq, w, d = queries.shape
    hkv, s = keys.shape[1], keys.shape[2]
    if hkv == 0 or hq % hkv:
        return None
    rep = hq // hkv
    # Heads that share a KV head become rows of one product with it.
    scores = (queries * scale).reshape(b, hkv, rep * w, d) @ keys.swapaxes(-1, -2)
    scores = scores.reshape(b, hkv, rep, w, s)
    if isinstance(mask, str):
        if mask != "causal":
            return None
        visible = mx.arange(s)[None] <= mx.arange(s - w, s)[:, None]
        scores = mx.where(visible, scores, -mx.inf)
    elif mask is not None:
        grouped = _grouped_mask(mask, b, hq, hkv, rep)
        if grouped is None:
            return None
        scores = mx.where(grouped, scores, -mx.inf) if grouped.dtype == mx.bool_ \
            else scores + grouped
    probs = np.array(scores)  # evaluates the layer so far; float32
    probs -= probs.max(axis=-1, keepdims=True)
    np.exp(probs, out=probs)
    probs /= probs.sum(axis=-1, keepdims=True)
    out = mx.array(probs).reshape(b, hkv, rep * w, s) @ values
    return out.reshape(b, hq, w, d)


def _grouped_mask(mask: mx.array, b: int, hq: int, hkv: int, rep: int) -> mx.array | None:
    """A mask broadcastable to [B, Hq, w, S] as one broadcastable to [B, Hkv, rep, w, S]."""
    if mask.ndim <= 2:
        return mask
    if mask.ndim == 3:
        mask = mask[None]
    if mask.ndim != 4 or mask.shape[0] not in (1, b):
        return None
    if mask.shape[1] == 1:
        return mask[:, :, None]
    if mask.shape[1] == hq:
        return mask.reshape(mask.shape[0], hkv, rep, *mask.shape[2:])
    return None
