"""A verify's exponentials on a CPU node, taken by numpy: attention's softmax and the MLP's SiLU.

On the CPU, MLX 0.32's `exp` and sigmoid cost tens of nanoseconds an element, numpy's
vectorised exp under one. MLX has no fused CPU attention (`mx.fast.scaled_dot_product_attention`
runs as ops), so a verify of w rows over S tokens of context takes heads x w x S exponentials
per layer in its softmax, and w x intermediate more in the MLP's SiLU: a large share of a wide
verify's forward, most of which numpy saves (docs/measurements/decode-loop.md, "A verify's
exponentials in numpy"). At 2 rows the gain is within
what leaving MLX costs, so 2-row verifies stay mlx-lm's (MIN_ROWS). Nothing in mlx or mlx-lm
offers a faster CPU exp, so these two steps leave MLX for numpy (the matrix products stay
MLX's).

Only inside `weight_first.verify_rows()` (a verify forward; forward.StageCache.run and the
tensor ranks enter it) of MIN_ROWS rows or more, float32 on the CPU:
- attention: the scores and the values' product stay MLX matrix products (grouped-query heads
  folded into the rows, so each KV head is one product with no copy of its keys); the masked
  scores are evaluated and handed to numpy for a softmax in float32, and the probabilities come
  back as an MLX array;
- the MLP: `swiglu(gate, up)` = silu(gate) * up, as gate / (1 + exp(-gate)) * up in numpy.
Prefill chunks and one-token steps run mlx-lm's own functions, so a prompt's cache and plain
decoding stay bit-identical to `mlx_lm.generate`. A verify row already differed from a one-token
step in its last bits (a matrix product against a matrix-vector one; MLX's exp is itself an
approximation, relative error up to 1.3e-6), and greedy output equal to plain decoding is what
the exactness tests check.

`install(model)` points the attention and SwiGLU of mlx-lm's attention-only families (llama,
which mistral maps to; qwen2; qwen3) at the dispatchers below, which hand everything else to
mlx-lm's own functions: outside a verify, a single row, another dtype or device, a quantized KV
cache or attention sinks. mlx-lm's own generate never enters `verify_rows()`, so it is unchanged
in the same process. load_model calls it through the CPU switch (switch.apply, once
switch.install ran); importing this module replaces nothing. `SKULKP2P_NUMPY_VERIFY=0` turns it
off (read when a model loads).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from skulkp2p.engine.cpu.weight_first import cpu_float32_switch, is_verifying

ENV = "SKULKP2P_NUMPY_VERIFY"
FAMILIES = ("llama", "qwen2", "qwen3")
ATTENTION, SWIGLU = "scaled_dot_product_attention", "swiglu"

# mlx-lm's functions: its scaled_dot_product_attention(queries, keys, values, cache=, scale=,
# mask=, sinks=) and its swiglu(gate, x)
MlxLmFunction = Callable[..., mx.array]

_original: dict[tuple[str, str], MlxLmFunction] = {}  # (module name, function name) -> mlx-lm's
# Fewer rows stay mlx-lm's: a 2-row verify (an MTP head's one-token draft) saved too little to
# pay for leaving MLX twice a layer; from 3 rows it gains (docs/measurements/decode-loop.md,
# "A verify's exponentials in numpy").
MIN_ROWS = 3
# False: the installed dispatchers hand every call to mlx-lm's functions (an A/B, or a test of
# bit-for-bit equality between forwards of different widths, which these keep within rounding).
active = True


def enabled(dtype: str) -> bool:
    """Whether a model loaded in `dtype` gets it: float32 on the CPU, not turned off."""
    return cpu_float32_switch(dtype, ENV)


def install(model: nn.Module) -> list[str]:
    """Route the attention and SwiGLU of `model`'s layers from mlx-lm's attention-only
    families through the dispatchers below (each family's module once, for every model of it
    in this process, which only a verify of ours diverts); the families routed."""
    routed = []
    for _, sub in model.named_modules():
        name = type(sub).__module__
        family = name.rsplit(".", 1)[-1]
        if not name.startswith("mlx_lm.models.") or family not in FAMILIES:
            continue
        module = importlib.import_module(name)
        for fn, make in ((ATTENTION, _attention_dispatcher), (SWIGLU, _swiglu_dispatcher)):
            if (name, fn) not in _original and hasattr(module, fn):
                _original[(name, fn)] = getattr(module, fn)
                setattr(module, fn, make(_original[(name, fn)]))
        if family not in routed:
            routed.append(family)
    return routed


def _diverted(a: mx.array) -> bool:
    return active and is_verifying() and a.dtype == mx.float32 and mx.default_device() == mx.cpu


def _attention_dispatcher(original: MlxLmFunction) -> MlxLmFunction:
    def scaled_dot_product_attention(queries: mx.array, keys: mx.array, values: mx.array,
                                     cache: object, scale: float, mask: mx.array | str | None,
                                     sinks: mx.array | None = None) -> mx.array:
        if (queries.ndim == 4 and queries.shape[2] >= MIN_ROWS and _diverted(queries)
                and sinks is None and not hasattr(cache, "bits")):
            out = attention(queries, keys, values, scale, mask)
            if out is not None:
                return out
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention.__wrapped__ = original  # type: ignore[attr-defined]
    return scaled_dot_product_attention


def _swiglu_dispatcher(original: MlxLmFunction) -> MlxLmFunction:
    def swiglu_(gate: mx.array, x: mx.array) -> mx.array:
        if (gate.ndim >= 2 and gate.shape[-2] >= MIN_ROWS and _diverted(gate)
                and x.dtype == mx.float32 and x.shape == gate.shape):
            return swiglu(gate, x)
        return original(gate, x)

    swiglu_.__wrapped__ = original  # type: ignore[attr-defined]
    return swiglu_


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x = gate / (1 + exp(-gate)) * x, in numpy (float32)."""
    mx.eval(gate, x)  # the layer so far, once for both
    g = np.array(gate)
    out = np.negative(g)
    with np.errstate(over="ignore"):  # exp(-gate) = inf for gate < -88: silu is -0.0 there
        np.exp(out, out=out)
    out += 1.0
    np.divide(g, out, out=out)
    out *= np.array(x)
    return mx.array(out)


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
              mask: mx.array | str | None) -> mx.array | None:
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
