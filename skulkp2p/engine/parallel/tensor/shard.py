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

The output head is vocabulary-split: a member holds rows [a, b) of it (`HeadSlice`) and the
final norm, and after the last layer's all-sum (every member then has the whole hidden rows)
computes the logits of its vocabulary ids; one all-gather hands rank 0 all of them. Why split
rather than replicate: on the member that runs the decode loop the head (V x H; 49,152 x 576 for
SmolLM2) is one matrix-vector product as large as a third of a member's whole slice of the
layers, and it ran there alone while every other member waited; split, each member computes 1/N
of it at the same time, and the all-gather of w x V logits costs far less on a verify's few rows.
The embedding is not split: only the loop's member embeds (a table look-up, not a product), so it
keeps the whole table, which for tied models is the head too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from skulkp2p.engine.cpu.weight_first import product
from skulkp2p.engine.model.trunk import Trunk

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


@dataclass(frozen=True)
class HeadSlice:
    """A member's share of the output: the final norm and the head's rows for vocabulary ids
    [start, stop) (`spans` is every member's range, for putting the logits back together in
    order)."""

    norm: nn.Module
    weight: mx.array  # [stop - start, hidden]
    bias: mx.array | None
    start: int
    stop: int
    spans: tuple[tuple[int, int], ...]

    @property
    def widest(self) -> int:
        return max(b - a for a, b in self.spans)

    def logits(self, h: mx.array) -> mx.array:
        """norm(h) @ W[start:stop].T for rows h [w, hidden], padded with zero columns to the
        widest member's share (an all-gather takes equal shapes)."""
        y = product(self.norm(h), self.weight)
        if self.bias is not None:
            y = y + self.bias
        pad = self.widest - (self.stop - self.start)
        return mx.pad(y, [(0, 0), (0, pad)]) if pad else y

    def assemble(self, gathered: mx.array, rows: int) -> mx.array:
        """Every member's padded logits as an all-gather stacks them ([size x rows, widest])
        -> the whole vocabulary's logits [rows, vocab], in order."""
        parts = [gathered[i * rows:(i + 1) * rows, :b - a] for i, (a, b) in enumerate(self.spans)]
        return mx.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]


def head_slice(model: nn.Module, rank: int, size: int) -> HeadSlice:
    """This member's rows of the output head (the tied embedding's, or lm_head's) and the final
    norm; taken before the model drops its embedding, norm and head. The rows are copied, so the
    whole matrix can be let go."""
    trunk = Trunk(model)
    if trunk.softcap:
        raise ShardError("a head with capped logits is not vocabulary-split here")
    layer = trunk.body.embed_tokens if trunk.tied else trunk.text.lm_head
    if isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        raise ShardError(f"cannot shard a {type(layer).__name__} (quantised layers are not "
                         "split tensor-parallel here)")
    vocab = int(layer.weight.shape[0])
    spans = tuple(even_split(vocab, size))
    a, b = spans[rank]
    bias = mx.contiguous(layer.bias[a:b]) if (not trunk.tied and "bias" in layer) else None
    return HeadSlice(trunk.body.norm, mx.contiguous(layer.weight[a:b]), bias, a, b, spans)


class _AllSum(nn.Module):
    """A linear layer over this member's input columns whose partial outputs are summed across
    the group (o_proj, down_proj). A bias is added once, after the sum."""

    def __init__(self, weight: mx.array, bias: mx.array | None, group: mx.distributed.Group):
        super().__init__()
        self.weight = weight
        if bias is not None:
            self.bias = bias
        self._group = group

    def __call__(self, x: mx.array) -> mx.array:
        y = product(x, self.weight)  # weight-first inside a verify (weight_first.py)
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


def _columns(linear: nn.Module, a: int, b: int, group: mx.distributed.Group) -> _AllSum:
    if not isinstance(linear, nn.Linear) or isinstance(linear, nn.QuantizedLinear):
        raise ShardError(f"cannot shard a {type(linear).__name__} (quantised layers are not "
                         "split tensor-parallel here)")
    bias = linear.bias if "bias" in linear else None
    return _AllSum(mx.contiguous(linear.weight[:, a:b]), bias, group)


def shard_layers(model: nn.Module, plan: ShardPlan, group: mx.distributed.Group) -> None:
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
