"""Tensor-parallel shards: every member holds a slice of every layer.

Attention is split by KV-head groups (a member holds KV heads [a, b) and the query heads that
read them, and the matching input columns of o_proj); the MLP by intermediate columns (rows of
gate/up, columns of down). Each member's o_proj and down_proj produce a partial sum of the full
output, and one all-reduce per sub-layer adds them up (`_AllSum`), so a verify of w rows costs
two all-reduces per layer whatever w is.

Why our own split rather than mlx-lm's `Model.shard`: that one divides head counts evenly
(`n_kv_heads //= N`), and SmolLM2-135M has 3 KV heads, which two members cannot share evenly;
here the groups are split as evenly as they go (2 + 1) and the MLP columns in the same
proportion. Quantised layers are refused (the cards here load as bf16/f32 arrays).

The embedding and the output head are NOT sharded: they live once, on the member that runs the
decode loop (engine/tensor.py), which embeds the tokens and applies the final norm and head to
the summed rows. Vocabulary-splitting the head would need an all-gather of w x V logits (or a
distributed argmax that the exact sampling path cannot use) on every call; holding it once costs
that member V x H more memory instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from skulkp2p.engine.trunk import Trunk

# Families whose layers are plain attention + gated MLP with these names (llama, qwen2/2.5,
# qwen3 with its per-head q/k norms, mistral). qwen3_5's recurrent layers are not sharded.
SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


class ShardError(ValueError):
    """A model that cannot be split tensor-parallel this way (the message says why)."""


@dataclass(frozen=True)
class ShardPlan:
    """What one member holds of every layer."""

    rank: int
    size: int
    kv_heads: tuple[int, int]  # [a, b) of the KV heads
    q_heads: tuple[int, int]
    columns: tuple[int, int]  # [a, b) of the MLP's intermediate columns


def even_split(n: int, size: int) -> list[tuple[int, int]]:
    """[a, b) ranges of n items over size members, the first ones one larger."""
    base, extra = divmod(n, size)
    out, start = [], 0
    for r in range(size):
        c = base + (1 if r < extra else 0)
        out.append((start, start + c))
        start += c
    return out


def plan_shards(n_heads: int, n_kv_heads: int, intermediate: int, size: int,
                hidden: int = 0, head_dim: int = 0) -> list[ShardPlan]:
    """Each member's KV-head group and MLP columns. The KV heads split as evenly as they go;
    when they split unevenly (3 over 2), the MLP columns make up for it, so that every member
    holds about the same number of parameters (and does about the same matmul work):
    attention costs 2 x (query heads + KV heads) x head_dim x hidden per member, a column
    3 x hidden. Without `hidden` the columns follow the heads."""
    if size < 1:
        raise ShardError("a tensor-parallel group needs at least one member")
    if n_kv_heads < size:
        raise ShardError(f"the model has {n_kv_heads} KV heads: it cannot be split "
                         f"tensor-parallel over {size} members (at most {n_kv_heads})")
    group = n_heads // n_kv_heads
    kv = even_split(n_kv_heads, size)
    if hidden and head_dim:
        attn = [2 * (b - a) * (group + 1) * head_dim * hidden for a, b in kv]
        fair = (sum(attn) + 3 * hidden * intermediate) / size
        weights = [max(0.0, fair - x) for x in attn]
    else:
        weights = [float(b - a) for a, b in kv]
    columns = _proportional(intermediate, weights)
    plans, start = [], 0
    for r, (a, b) in enumerate(kv):
        plans.append(ShardPlan(r, size, (a, b), (a * group, b * group),
                               (start, start + columns[r])))
        start += columns[r]
    return plans


def _proportional(n: int, weights: list[float]) -> list[int]:
    """n split in proportion to weights (largest remainder; ties to the earlier member)."""
    total = sum(weights) or float(len(weights))
    quotas = [n * (w if sum(weights) else 1.0) / total for w in weights]
    counts = [int(q) for q in quotas]
    order = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in order[:n - sum(counts)]:
        counts[i] += 1
    return counts


def model_family(model: nn.Module) -> str:
    args = getattr(Trunk(model).text, "args", None)
    return str(getattr(args, "model_type", "") or "")


def check_shardable(model: nn.Module) -> None:
    family = model_family(model)
    if family not in SUPPORTED_FAMILIES:
        hint = (" (its recurrent linear-attention layers are not sharded here; serve it as a "
                "pipeline ring)" if family.startswith("qwen3_5") or family.startswith(
                    "qwen3_next") else "")
        raise ShardError(f"tensor-parallel placement supports the {', '.join(SUPPORTED_FAMILIES)}"
                         f" families; this model is {family or 'of an unknown family'}{hint}")


def layer_plan(model: nn.Module, rank: int, size: int) -> ShardPlan:
    check_shardable(model)
    layer = Trunk(model).body.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    hidden = attn.q_proj.weight.shape[1]
    head_dim = attn.q_proj.weight.shape[0] // attn.n_heads
    return plan_shards(attn.n_heads, attn.n_kv_heads, mlp.gate_proj.weight.shape[0],
                       size, hidden, head_dim)[rank]


_local_only = False  # set by without_collectives (a rank process is single-threaded)


@contextmanager
def without_collectives() -> Iterator[None]:
    """Run the slices with their partial sums left unsummed: wrong values, the same compute.
    Only for timing a rank's own compute apart from the collectives (the bench's breakdown)."""
    global _local_only
    _local_only = True
    try:
        yield
    finally:
        _local_only = False


class _AllSum(nn.Module):
    """A linear layer over this member's input columns whose partial outputs are summed across
    the group (o_proj, down_proj). A bias is added once, after the sum."""

    def __init__(self, weight: mx.array, bias: mx.array | None, group: Any):
        super().__init__()
        self.weight = weight
        if bias is not None:
            self.bias = bias
        self._group = group

    def __call__(self, x: mx.array) -> mx.array:
        y = x @ self.weight.T
        if not _local_only:
            y = mx.distributed.all_sum(y, group=self._group)
        return y + self.bias if "bias" in self else y


def _rows(linear: nn.Module, a: int, b: int) -> None:
    if not isinstance(linear, nn.Linear) or isinstance(linear, nn.QuantizedLinear):
        raise ShardError(f"cannot shard a {type(linear).__name__} (quantised layers are not "
                         "split tensor-parallel here)")
    linear.weight = mx.contiguous(linear.weight[a:b])
    if "bias" in linear:
        linear.bias = mx.contiguous(linear.bias[a:b])


def _columns(linear: nn.Module, a: int, b: int, group: Any) -> _AllSum:
    if not isinstance(linear, nn.Linear) or isinstance(linear, nn.QuantizedLinear):
        raise ShardError(f"cannot shard a {type(linear).__name__} (quantised layers are not "
                         "split tensor-parallel here)")
    bias = linear.bias if "bias" in linear else None
    return _AllSum(mx.contiguous(linear.weight[:, a:b]), bias, group)


def shard_layers(model: nn.Module, plan: ShardPlan, group: Any) -> None:
    """Cut every layer of `model` (loaded lazily: the weights are not read yet) to this member's
    share, in place; each layer is evaluated right after its cut so the full tensors it was cut
    from are let go one layer at a time."""
    body = Trunk(model).body
    for layer in body.layers:
        attn, mlp = layer.self_attn, layer.mlp
        hd = attn.head_dim if hasattr(attn, "head_dim") else attn.q_proj.weight.shape[0] // \
            attn.n_heads
        (qa, qb), (ka, kb) = plan.q_heads, plan.kv_heads
        _rows(attn.q_proj, qa * hd, qb * hd)
        _rows(attn.k_proj, ka * hd, kb * hd)
        _rows(attn.v_proj, ka * hd, kb * hd)
        attn.o_proj = _columns(attn.o_proj, qa * hd, qb * hd, group)
        attn.n_heads = qb - qa
        attn.n_kv_heads = kb - ka
        ca, cb = plan.columns
        _rows(mlp.gate_proj, ca, cb)
        _rows(mlp.up_proj, ca, cb)
        mlp.down_proj = _columns(mlp.down_proj, ca, cb, group)
        mx.eval(layer.parameters())
