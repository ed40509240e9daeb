"""The MTP head as an MLX module (`MtpHead`) and its loading from a checkpoint or a sidecar
(`load_mtp_head`); engine/model/mtp_conventions.py says how each checkpoint naming lays it out.

A sidecar's `{prefix}vocab_ids` (int32 [K]) is a reduced draft vocabulary: the head then scores
only those K rows of the shared lm_head (taken at load, quantised like the base),
which cuts a draft's cost when the vocabulary is large; other tokens are never drafted. Heads
trained by `python -m skulkp2p head train` use it.

The decoder layer is built from the family's own mlx-lm class (the class of a trunk layer whose
parameter names match the head's layer tensors), so attention, RoPE and the MLP are the trunk's
code. The embedding and lm_head are the trunk's (DeepSeek's `shared_head.head` when present).
"""

from __future__ import annotations

import inspect
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from skulkp2p.engine.cache.batch_cache import RowsKVCache
from skulkp2p.engine.json_types import JSONObject
from skulkp2p.engine.model.arrays import materialize
from skulkp2p.engine.model.mtp_conventions import (
    _IGNORED,
    _NESTED_LAYER,
    _PARTS,
    VOCAB_IDS,
    MtpConventions,
    _conventions,
    _header_names,
    _locate,
    _safetensors_files,
    _text_config,
    config_number,
)
from skulkp2p.engine.model.trunk import Trunk

log = logging.getLogger("skulkp2p.mtp")


@dataclass
class MtpOutput:
    logits: mx.array  # [rows, V]: the last row only unless all rows were asked for
    pre_norm: mx.array  # [L, H] decoder layer output, before the head's final norm
    post_norm: mx.array  # [L, H] after it

    def chain(self, which: str) -> mx.array:
        return self.post_norm if which == "after" else self.pre_norm


class DepthNorms(nn.Module):
    """An RMSNorm per trunk depth over rows [..., n * H] (n layers' outputs side by side): each
    depth's residual stream has its own scale (the high layers' is far larger)."""

    def __init__(self, depths: int, hidden_size: int, eps: float):
        super().__init__()
        self.weight = mx.ones((depths, hidden_size))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        parts = x.reshape(*x.shape[:-1], *self.weight.shape)
        normed = mx.fast.rms_norm(parts, None, self.eps) * self.weight.astype(parts.dtype)
        return normed.reshape(x.shape)


class MtpHead(nn.Module):
    """The MTP head's own modules; embedding and (shared) lm_head stay the trunk's. `depths`
    > 0 (eagle3): the trunk's feature is that many layers' outputs side by side, normed per
    depth and fused to one row (`fuse_norm`, `fuse`) before the usual input projection."""

    def __init__(self, trunk: Trunk, layer: nn.Module, hidden_size: int, eps: float,
                 conventions: MtpConventions, own_head_vocab: int | None = None,
                 proj_bias: bool = False, depths: int = 0):
        super().__init__()
        if depths:
            self.fuse_norm = DepthNorms(depths, hidden_size, eps)
            self.fuse = nn.Linear(depths * hidden_size, hidden_size, bias=False)
        self._fused_width = depths * hidden_size
        self.proj = nn.Linear(2 * hidden_size, hidden_size, bias=proj_bias)
        self.norm_embed = nn.RMSNorm(hidden_size, eps=eps)
        self.norm_hidden = nn.RMSNorm(hidden_size, eps=eps)
        self.layer = layer
        self.final_norm = nn.RMSNorm(hidden_size, eps=eps)
        if own_head_vocab is not None:
            self.head = nn.Linear(hidden_size, own_head_vocab, bias=False)
        # Plain attributes (not child modules): the trunk's weights are not the head's parameters.
        self._trunk = trunk
        self._conventions = conventions
        self._vocab_ids: mx.array | None = None
        self._vocab_size = 0

    @property
    def conventions(self) -> MtpConventions:
        return self._conventions

    @property
    def trunk(self) -> Trunk:
        return self._trunk

    def make_cache(self) -> KVCache:
        return KVCache()

    @property
    def vocab_ids(self) -> mx.array | None:
        """Token ids the head drafts from (a reduced draft vocabulary), or None for all."""
        return self._vocab_ids

    def restrict_vocab(self, ids: mx.array) -> None:
        """Draft only tokens `ids`: the head's logits come from those rows of the (shared)
        lm_head, taken once here, so a draft reads K rows instead of the whole vocabulary.
        Exactness does not depend on it: the verifier decides every token."""
        ids = ids.astype(mx.int32)
        vocab = int(self._trunk.embed_tokens.weight.shape[0])
        if ids.ndim != 1 or ids.size == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"MTP vocab_ids must be a non-empty list of token ids below {vocab}")
        source = self.head if "head" in self else (
            self._trunk.body.embed_tokens if self._trunk.tied else self._trunk.text.lm_head)
        if "scales" in source:
            # Quantised rows: dequantise them; a quantised base quantises the head again. (An
            # mlx quantized module from before quantization modes has no `mode`: affine.)
            rows = mx.dequantize(source["weight"][ids], source["scales"][ids],
                                 source["biases"][ids] if "biases" in source else None,
                                 source.group_size, source.bits,
                                 mode=getattr(source, "mode", "affine"))
        else:
            rows = source["weight"][ids]
        self.vocab_head = nn.Linear(rows.shape[1], rows.shape[0], bias=False)
        self.vocab_head.weight = rows
        self.vocab_head.freeze()
        self._vocab_ids = ids
        self._vocab_size = vocab

    def input_rows(self, hidden: mx.array) -> mx.array:
        """The rows `features` reads as the trunk's feature: a fusing head's trunk rows (several
        layers side by side, wider than H) fused to one row; anything else as it is (a chained
        head state is already one row)."""
        if self._fused_width and hidden.shape[-1] == self._fused_width:
            return self.fuse(self.fuse_norm(hidden.astype(self.fuse_norm.weight.dtype)))
        return hidden

    def features(self, hidden: mx.array, tokens: mx.array,
                 cache: KVCache | RowsKVCache | None = None,
                 first: bool = True, attn_mask: mx.array | str | None = None
                 ) -> tuple[mx.array, mx.array]:
        """(pre, post) head states [B, L, H] for rows (hidden[b, i], tokens[b, i]): batched,
        for decoding (B = 1, with `cache`) and for training (no cache, causal over L). `first`:
        row 0 is position 0 (where DeepSeek/MiMo zero the embedding). `attn_mask` (default: causal
        over the cache and the rows) lets training lay out a second draft step beside the first
        (`head train`)."""
        conv = self._conventions
        embed = self._trunk.embed_tokens(tokens)
        if conv.zero_first_embed and first:
            mask = (mx.arange(embed.shape[1]) > 0)[None, :, None]
            embed = mx.where(mask, embed, mx.zeros_like(embed))
        e = self.norm_embed(embed)
        h = self.norm_hidden(self.input_rows(hidden).astype(e.dtype))
        x = self.proj(mx.concatenate([e, h] if conv.concat == "embed_first" else [h, e], -1))
        pre = self.layer(x, create_attention_mask(x, cache) if attn_mask is None else attn_mask,
                         cache)
        return pre, self.final_norm(pre)

    def draft_logits(self, rows: mx.array) -> mx.array:
        """Logits over the draft vocabulary (K columns when restricted) for head states."""
        if "vocab_head" in self:
            return self.vocab_head(rows)
        return self.head(rows) if "head" in self else self._trunk.head(rows)

    def logits(self, rows: mx.array) -> mx.array:
        """Full-vocabulary logits; tokens outside a restricted draft vocabulary get -inf."""
        sub = self.draft_logits(rows)
        if "vocab_head" not in self:
            return sub
        full = mx.full((*sub.shape[:-1], self._vocab_size), -mx.inf, dtype=sub.dtype)
        full[..., self._vocab_ids] = sub
        return full

    def __call__(self, hidden: mx.array, tokens: mx.array, cache: KVCache,
                 all_logits: bool = False) -> MtpOutput:
        """Run rows (hidden[i], tokens[i]) at positions cache.offset + i, appending them to
        `cache`. `hidden` is [L, H] trunk (or chained head) states ([L, n H] for a fusing head's
        trunk rows), `tokens` [L] the next tokens.
        Logits come for the last row only unless `all_logits` (the lm_head is the big matmul)."""
        pre, post = self.features(hidden[None], tokens[None], cache, first=cache.offset == 0)
        rows = post if all_logits else post[:, -1:]
        return MtpOutput(self.logits(rows)[0], pre[0], post[0])


def _read_tensors(files: list[Path], prefix: str) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for f in files:
        if not any(n.startswith(prefix) for n in _header_names(f)):
            continue
        # mx.load maps the file lazily; only the arrays kept here are ever read.
        tensors = mx.load(str(f))
        assert isinstance(tensors, dict)  # (safetensors, no metadata asked for)
        out.update({k: v for k, v in tensors.items() if k.startswith(prefix)})
    return out


def _stack_experts(tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """Raw per-expert MoE tensors -> mlx-lm's stacked `switch_mlp` layout (the trunk's sanitize
    does this for the trunk's layers only). Handles per-expert `experts.{e}.{proj}.weight`
    (with quantised scales/biases) and the fused `experts.gate_up_proj` / `experts.down_proj`."""
    out = dict(tensors)
    per_expert = re.compile(
        r"(.*)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)")
    groups: dict[tuple[str, str, str], dict[int, str]] = {}
    for k in tensors:
        if m := per_expert.fullmatch(k):
            groups.setdefault((m.group(1), m.group(3), m.group(4)), {})[int(m.group(2))] = k
    for (base, proj, kind), keys in groups.items():
        out[f"{base}.switch_mlp.{proj}.{kind}"] = mx.stack(
            [out.pop(keys[e]) for e in sorted(keys)])
    for k in [k for k in out if k.endswith(".experts.gate_up_proj")]:
        base = k[: -len(".experts.gate_up_proj")]
        gate_up = out.pop(k)
        mid = gate_up.shape[-2] // 2
        out[f"{base}.switch_mlp.gate_proj.weight"] = gate_up[..., :mid, :]
        out[f"{base}.switch_mlp.up_proj.weight"] = gate_up[..., mid:, :]
        out[f"{base}.switch_mlp.down_proj.weight"] = out.pop(f"{base}.experts.down_proj")
    return out


def _is_norm(name: str, value: mx.array) -> bool:
    parts = name.split(".")
    return value.ndim == 1 and parts[-1] == "weight" and len(parts) > 1 and "norm" in parts[-2]


def _names(module: nn.Module) -> set[str]:
    # Quantisation adds scales/biases; compare layers by their float tensor names.
    # (tree_flatten gives a dict only when handed one to fill)
    named = cast(list[tuple[str, mx.array]], tree_flatten(module.parameters()))
    return {k for k, _ in named if not k.endswith((".scales", ".biases"))}


def _build_layer(trunk: Trunk, layer_tensors: dict[str, mx.array]) -> nn.Module:
    """A fresh decoder layer of the family's own mlx-lm class, shaped like the head's tensors.

    The class and constructor arguments are those of a trunk layer with the same parameter
    names (for qwen3_5 a full-attention DecoderLayer, not a gated-delta one)."""
    args = trunk.text.args
    # (an mlx-lm model's body holds its layers, or the text model does: family by family)
    layers = list(getattr(trunk.body, "layers", None) or trunk.text.layers)
    wanted = {k for k in layer_tensors if not k.endswith((".scales", ".biases"))}

    def make(cls: type, index: int) -> nn.Module:
        params = inspect.signature(cls).parameters
        return cls(args, layer_idx=index) if "layer_idx" in params else cls(args)

    for i, layer in enumerate(layers):
        if _names(layer) == wanted and _names(built := make(type(layer), i)) == wanted:
            return built
    # DeepSeek numbers its MTP layer after the trunk's: that index picks the right MLP kind.
    if _names(built := make(type(layers[-1]), len(layers))) == wanted:
        return built
    missing = sorted(_names(built) - wanted)[:5]
    extra = sorted(wanted - _names(built))[:5]
    raise ValueError(f"MTP decoder layer matches no {type(layers[-1]).__name__} of the trunk "
                     f"(missing {missing}, unexpected {extra})")


def _check_shapes(head: MtpHead, weights: dict[str, mx.array], origin: dict[str, str],
                  source: Path) -> None:
    """Refuse tensors that do not fit the base model, naming the file's tensor (a sidecar made
    for another model, or a corrupt one); mlx's own error would name the head's parameter."""
    params = dict(tree_flatten(head.parameters()))
    for key, value in weights.items():
        want = params.get(key)
        if want is not None and tuple(want.shape) != tuple(value.shape):
            raise ValueError(f"MTP tensor {origin.get(key, key)} in {source} has shape "
                             f"{tuple(value.shape)}, but the base model needs "
                             f"{tuple(want.shape)}: this head was made for another model")


def _quantization(config: JSONObject) -> tuple[int, int, str] | None:
    q = config.get("quantization")
    if not q:
        return None
    if not isinstance(q, dict):
        raise ValueError(f"quantization must be a table, got {q!r}")
    return (int(config_number(q.get("group_size", 64), "group_size")),
            int(config_number(q.get("bits", 4), "bits")), str(q.get("mode", "affine")))


def load_mtp_head(model_path: Path, model: nn.Module, config: JSONObject,
                  overrides: JSONObject | None = None,
                  sidecar: Path | None = None) -> MtpHead | None:
    """The MTP head of the checkpoint at `model_path` (or of the `sidecar` safetensors file, a
    separate mtp.safetensors holding only the head's tensors), attached to the loaded trunk
    `model`; None when there are no MTP tensors. `config` is the model's config.json, `overrides`
    the card's mtp_* fields."""
    files = _safetensors_files(Path(sidecar) if sidecar is not None else Path(model_path))
    names = [n for f in files for n in _header_names(f)]
    found = _locate(names, config)
    if found is None:
        return None
    style, prefix = found
    conv = _conventions(style, config, overrides)
    tensors = _read_tensors(files, prefix)
    parts = _PARTS[style]
    layer_prefix = prefix + "layers.0." if style in _NESTED_LAYER else prefix
    ignored = tuple(prefix + p for p in _IGNORED.get(style, ()))
    if style in _NESTED_LAYER and any(n.startswith(prefix + "layers.1.") for n in tensors):
        log.warning("MTP head has more than one layer; only layer 0 is used")

    trunk = Trunk(model)
    # A reduced draft vocabulary (trained heads): token ids whose lm_head rows the head uses.
    vocab_ids = tensors.pop(prefix + VOCAB_IDS, None)
    weights: dict[str, mx.array] = {}
    layer_tensors: dict[str, mx.array] = {}
    origin: dict[str, str] = {}  # head parameter -> the file's tensor name, for errors
    for name, value in tensors.items():
        if name.startswith(ignored):
            continue
        part = next((p for p, raw in parts.items() if name.startswith(prefix + raw + ".")), None)
        if part is not None:
            key = part + name[len(prefix + parts[part]):]
            weights[key] = value
            origin[key] = name
        elif name.startswith(layer_prefix):
            layer_tensors[name[len(layer_prefix):]] = value
            origin["layer." + name[len(layer_prefix):]] = name
    stacked = _stack_experts(layer_tensors)
    for k in set(stacked) - set(layer_tensors):  # restacked experts: name the first source
        base = k.split(".switch_mlp.")[0]
        origin["layer." + k] = layer_prefix + base + ".experts.*"
    weights.update({"layer." + k: v for k, v in stacked.items()})
    layer_tensors = stacked
    if conv.norm_offset:
        # Zero-centred checkpoints: x * (1 + w), for every RMSNorm of the head (norm_embed,
        # norm_hidden, final_norm, the layer's layernorms and q/k norms). Added in float32, as
        # the reference kernels compute it.
        weights = {k: (v.astype(mx.float32) + conv.norm_offset if _is_norm(k, v) else v)
                   for k, v in weights.items()}

    args = trunk.text.args
    hidden_size = int(args.hidden_size)
    # (any family's mlx-lm args: not every one names the epsilon)
    eps = float(getattr(args, "rms_norm_eps", None)
                or config_number(_text_config(config).get("rms_norm_eps") or 1e-6, "rms_norm_eps"))
    own_head = weights.get("head.weight")  # DeepSeek's shared_head.head, when the file has it
    vocab = int(own_head.shape[0]) if own_head is not None else None
    fuse = weights.get("fuse_norm.weight")
    head = MtpHead(trunk, _build_layer(trunk, layer_tensors), hidden_size, eps, conv, vocab,
                   proj_bias="proj.bias" in weights,
                   depths=int(fuse.shape[0]) if fuse is not None else 0)
    quant = _quantization(config)
    prequantized = any(k.endswith(".scales") for k in weights)
    if prequantized:
        # Quantised head tensors: quantise exactly the modules that carry scales, then load.
        group_size, bits, mode = quant or (64, 4, "affine")
        nn.quantize(head, group_size, bits, mode=mode,
                    class_predicate=lambda p, m: f"{p}.scales" in weights)
    _check_shapes(head, weights, origin, sidecar or model_path)
    head.load_weights(list(weights.items()), strict=True)
    # The engine may run the trunk in float32 over bf16 weights: compute the head alike.
    head.set_dtype(trunk.body.norm.weight.dtype)
    if vocab_ids is not None:
        head.restrict_vocab(vocab_ids)
    if quant and not prequantized:
        # Float head beside a quantised trunk: quantise on load to match it.
        group_size, bits, mode = quant
        nn.quantize(head, group_size, bits, mode=mode,
                    class_predicate=lambda p, m: isinstance(m, nn.Linear)
                    and m.weight.shape[-1] % group_size == 0)
    materialize(head)
    return head
