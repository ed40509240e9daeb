"""Native MTP head drafter: the checkpoint's own multi-token-prediction head proposes drafts.

The head maps the trunk's hidden state h_t at position t and the embedding of the
next token x_{t+1} to a prediction of x_{t+2}:

    h' = proj(concat(norm_e(embed(x_{t+1})), norm_h(h_t)))     (MiMo: hidden first)
    y  = decoder_layer(h', own KV cache, position t)
    logits = lm_head(final_norm(y))                             (the trunk's shared lm_head)

Three checkpoint namings carry such a head; `detect_conventions` recognises them by tensor names:

* qwen (Qwen3-Next / Qwen3.5): `mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`,
  `mtp.layers.0.*`, `mtp.norm`. Qwen3.5 / Qwen3-Next raw checkpoints store RMSNorm weights
  zero-centred (the model computes x * (1 + w)): norm_offset 1.0 adds the 1 at load.
* deepseek (DeepSeek-V3): the extra layer `model.layers.{num_hidden_layers}.` with `enorm`,
  `hnorm`, `eh_proj`, `shared_head.norm`, optional `shared_head.head`; embedding zeroed at
  position 0 (as vLLM and SGLang run it).
* mimo (MiMo): `model.mtp_layers.0.` with `token_layernorm`, `hidden_layernorm`, `input_proj`
  (hidden FIRST in the concat), `final_layernorm`; embedding zeroed at position 0.

A fourth kind is no checkpoint's own but a drafting head trained for a model that has none
(tools/train_sidecar.py, shipped as a sidecar):

* eagle (EAGLE-style): `eagle.fc` (with a bias, as EAGLE's fc) over `eagle.enorm` /
  `eagle.hnorm` of the next token's embedding and the trunk's feature, one decoder layer of the
  trunk's family under `eagle.layers.0.`, `eagle.norm`, and `eagle.vocab_ids` (the reduced
  draft vocabulary over the trunk's lm_head, as the trainer writes it). It is trained so that
  its normed output is the trunk's next feature, and that output is what depth > 1 feeds back
  (chain "after").

A sidecar may also hold `{prefix}vocab_ids` (int32 [K]): a reduced draft vocabulary. The head
then scores only those K rows of the shared lm_head (taken at load, quantised like the base),
which cuts a draft's cost when the vocabulary is large; other tokens are never drafted. Heads
trained by tools/train_sidecar.py use it.

The decoder layer is built from the family's own mlx-lm class (the class of a trunk layer whose
parameter names match the head's layer tensors), so attention, RoPE and the MLP are the trunk's
code. The embedding and lm_head are the trunk's (DeepSeek's `shared_head.head` when present).

Pairing. Row t of the head's cache holds (h_t, x_{t+1}) at position t, exactly like the trunk's
row t holds x_t. A round's draft 1 guesses the token the verifier will emit from the pending
token x_p; the pair (h_{p-1}, x_p) predicts precisely that, and it is the last pair appended
(by `begin` from the prompt, or by `observe` from the previous round), so draft 1 costs no
extra head call: its logits are kept from that append.

Depth > 1 feeds the head its own output with the token it just drafted, at the next position,
as speculative cache rows that the next `observe` trims. Which output is fed back is
`MtpConventions.chain`: "after" the head's final norm for qwen and mimo, "before" it for
deepseek. That is how vLLM's Qwen3-Next / MiMo / DeepSeek MTP modules return their hidden state
to the proposer (the first two return the final-normed state, DeepSeek's returns the residual
stream and normalises only inside compute_logits); a card can override it (`mtp_chain`).
"""

from __future__ import annotations

import inspect
import json
import logging
import re
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from skulkp2p.engine.arrays import materialize
from skulkp2p.engine.decode import DecodeStats
from skulkp2p.engine.suffix import Branch
from skulkp2p.engine.tree import DraftTree
from skulkp2p.engine.trunk import Trunk

log = logging.getLogger("skulkp2p.mtp")

STYLES = ("qwen", "deepseek", "mimo", "eagle")
# Families whose raw checkpoints store RMSNorm weights zero-centred (x * (1 + w)).
ZERO_CENTRED_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")

# Per style: (concat order, which head output is chained at depth > 1, zero the embedding at
# position 0). See the module docstring for where these come from.
_STYLE_DEFAULTS: dict[str, tuple[str, str, bool]] = {
    "qwen": ("embed_first", "after", False),
    "deepseek": ("embed_first", "before", True),
    "mimo": ("hidden_first", "after", True),
    "eagle": ("embed_first", "after", False),
}

# Per style, the head's own modules (relative to the style's tensor prefix); every other tensor
# under the layer prefix belongs to the decoder layer.
_PARTS: dict[str, dict[str, str]] = {
    "qwen": {"proj": "fc", "norm_embed": "pre_fc_norm_embedding",
             "norm_hidden": "pre_fc_norm_hidden", "final_norm": "norm"},
    "deepseek": {"proj": "eh_proj", "norm_embed": "enorm", "norm_hidden": "hnorm",
                 "final_norm": "shared_head.norm", "head": "shared_head.head"},
    "mimo": {"proj": "input_proj", "norm_embed": "token_layernorm",
             "norm_hidden": "hidden_layernorm", "final_norm": "final_layernorm"},
    "eagle": {"proj": "fc", "norm_embed": "enorm", "norm_hidden": "hnorm", "final_norm": "norm"},
}
# Styles whose decoder layer sits under `{prefix}layers.0.` (the others: under the prefix itself).
_NESTED_LAYER = ("qwen", "eagle")
# DeepSeek's MTP layer carries a copy of the shared embedding; the trunk's is used instead.
_IGNORED = {"deepseek": ("embed_tokens.",)}
# Optional int32 tensor (under the style's prefix) listing a reduced draft vocabulary.
VOCAB_IDS = "vocab_ids"
# The head offers its second choice at a depth as a side branch when the head gives it at least
# this share of its first choice's probability (gates.build_tree then weighs its width).
HEAD_BRANCH_CLOSE = 0.5


@dataclass(frozen=True)
class MtpConventions:
    """How to run one checkpoint's MTP head. Card fields override the detected values."""
    style: str  # "qwen" | "deepseek" | "mimo" | "eagle"
    hidden: str = "after"  # trunk hidden fed to the head: "after" | "before" the final norm
    concat: str = "embed_first"  # "embed_first" | "hidden_first"
    norm_offset: float = 0.0  # 1.0 when the checkpoint stores RMSNorm weights zero-centred
    max_depth: int = 4  # most drafts per round (chained head calls)
    chain: str = "after"  # head output fed back at depth > 1: "after" | "before" its final norm
    zero_first_embed: bool = False  # zero the embedding at position 0 (DeepSeek, MiMo)

    def __post_init__(self) -> None:
        if self.style not in STYLES:
            raise ValueError(f"mtp style must be one of {STYLES}, got {self.style!r}")
        for name, value, allowed in (("hidden", self.hidden, ("after", "before")),
                                     ("concat", self.concat, ("embed_first", "hidden_first")),
                                     ("chain", self.chain, ("after", "before"))):
            if value not in allowed:
                raise ValueError(f"mtp {name} must be one of {allowed}, got {value!r}")
        if self.max_depth < 1:
            raise ValueError(f"mtp max_depth must be at least 1, got {self.max_depth}")


# --- finding the tensors ------------------------------------------------------------------


def _safetensors_files(source: Path) -> list[Path]:
    source = Path(source)
    if source.is_file():
        return [source]
    return sorted(source.glob("*.safetensors"))


def _header_names(path: Path) -> list[str]:
    """Tensor names from a safetensors header, without reading any tensor data."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return [k for k in header if k != "__metadata__"]


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("text_config") or config


def _num_layers(config: dict[str, Any]) -> int | None:
    n = _text_config(config).get("num_hidden_layers", config.get("num_hidden_layers"))
    return int(n) if n is not None else None


def _locate(names: list[str], config: dict[str, Any]) -> tuple[str, str] | None:
    """(style, tensor prefix) of the MTP head among `names`, or None when there is none."""
    for name in names:
        if name.endswith("mtp.fc.weight"):
            return "qwen", name[: -len("fc.weight")]
        if name.endswith("eagle.fc.weight"):
            return "eagle", name[: -len("fc.weight")]
    deepseek = sorted(int(m.group(1)) for n in names
                      if (m := re.fullmatch(r"model\.layers\.(\d+)\.enorm\.weight", n)))
    if deepseek:
        n_layers = _num_layers(config)
        index = n_layers if n_layers in deepseek else deepseek[0]
        return "deepseek", f"model.layers.{index}."
    if any(n.startswith("model.mtp_layers.0.") for n in names):
        return "mimo", "model.mtp_layers.0."
    return None


def _family(config: dict[str, Any]) -> str:
    return str(config.get("model_type") or _text_config(config).get("model_type") or "")


def _conventions(style: str, config: dict[str, Any],
                 overrides: dict[str, Any] | None) -> MtpConventions:
    concat, chain, zero_first = _STYLE_DEFAULTS[style]
    family = _family(config)
    offset = 1.0 if any(family.startswith(f) for f in ZERO_CENTRED_FAMILIES) else 0.0
    conv = MtpConventions(style=style, concat=concat, norm_offset=offset, chain=chain,
                          zero_first_embed=zero_first)
    o = overrides or {}
    if "mtp_style" in o and o["mtp_style"] != style:
        # A style named by the card re-derives the style's defaults; explicit fields still win.
        concat, chain, zero_first = _STYLE_DEFAULTS[o["mtp_style"]]
        conv = replace(conv, style=o["mtp_style"], concat=concat, chain=chain,
                       zero_first_embed=zero_first)
    fields = {"mtp_hidden": ("hidden", str), "mtp_concat": ("concat", str),
              "mtp_norm_offset": ("norm_offset", float), "mtp_max_depth": ("max_depth", int),
              "mtp_chain": ("chain", str), "mtp_zero_first_embed": ("zero_first_embed", bool)}
    changes = {field: cast(o[key]) for key, (field, cast) in fields.items()
               if o.get(key) is not None}
    return replace(conv, **changes) if changes else conv


def detect_conventions(model_path: Path, config: dict[str, Any],
                       overrides: dict[str, Any] | None = None) -> MtpConventions | None:
    """The MTP conventions of the checkpoint at `model_path` (a model folder or one safetensors
    file such as an `mtp.safetensors` sidecar), or None when it has no MTP tensors.

    The style comes from tensor names, norm_offset from the family (qwen3_5 / qwen3_next store
    zero-centred norms); `overrides` holds card fields: mtp_style, mtp_hidden, mtp_concat,
    mtp_norm_offset, mtp_max_depth (and mtp_chain, mtp_zero_first_embed).
    """
    names = [n for f in _safetensors_files(model_path) for n in _header_names(f)]
    found = _locate(names, config)
    if found is None:
        return None
    return _conventions(found[0], config, overrides)


# --- building the head --------------------------------------------------------------------


@dataclass
class MtpOutput:
    logits: mx.array  # [rows, V]: the last row only unless all rows were asked for
    pre_norm: mx.array  # [L, H] decoder layer output, before the head's final norm
    post_norm: mx.array  # [L, H] after it

    def chain(self, which: str) -> mx.array:
        return self.post_norm if which == "after" else self.pre_norm


class MtpHead(nn.Module):
    """The MTP head's own modules; embedding and (shared) lm_head stay the trunk's."""

    def __init__(self, trunk: Trunk, layer: nn.Module, hidden_size: int, eps: float,
                 conventions: MtpConventions, own_head_vocab: int | None = None,
                 proj_bias: bool = False):
        super().__init__()
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
            # Quantised rows: dequantise them; a quantised base quantises the head again.
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

    def features(self, hidden: mx.array, tokens: mx.array, cache: Any = None,
                 first: bool = True, attn_mask: mx.array | str | None = None
                 ) -> tuple[mx.array, mx.array]:
        """(pre, post) head states [B, L, H] for rows (hidden[b, i], tokens[b, i]): batched,
        for decoding (B = 1, with `cache`) and for training (no cache, causal over L). `first`:
        row 0 is position 0 (where DeepSeek/MiMo zero the embedding). `attn_mask` (default: causal
        over the cache and the rows) lets training lay out a second draft step beside the first
        (tools/train_sidecar.py)."""
        conv = self._conventions
        embed = self._trunk.embed_tokens(tokens)
        if conv.zero_first_embed and first:
            mask = (mx.arange(embed.shape[1]) > 0)[None, :, None]
            embed = mx.where(mask, embed, mx.zeros_like(embed))
        e = self.norm_embed(embed)
        h = self.norm_hidden(hidden.astype(e.dtype))
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
        `cache`. `hidden` is [L, H] trunk (or chained head) states, `tokens` [L] the next tokens.
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
        out.update({k: v for k, v in mx.load(str(f)).items() if k.startswith(prefix)})
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
    return {k for k, _ in tree_flatten(module.parameters())
            if not k.endswith((".scales", ".biases"))}


def _build_layer(trunk: Trunk, layer_tensors: dict[str, mx.array]) -> nn.Module:
    """A fresh decoder layer of the family's own mlx-lm class, shaped like the head's tensors.

    The class and constructor arguments are those of a trunk layer with the same parameter
    names (for qwen3_5 a full-attention DecoderLayer, not a gated-delta one)."""
    args = trunk.text.args
    layers = list(getattr(trunk.body, "layers", None) or trunk.text.layers)
    wanted = {k for k in layer_tensors if not k.endswith((".scales", ".biases"))}

    def make(cls: type, index: int) -> nn.Module:
        params = inspect.signature(cls.__init__).parameters
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


def _quantization(config: dict[str, Any]) -> tuple[int, int, str] | None:
    q = config.get("quantization")
    if not q:
        return None
    return int(q.get("group_size", 64)), int(q.get("bits", 4)), str(q.get("mode", "affine"))


def has_mtp_tensors(model_path: Path, config: dict[str, Any],
                    sidecar: Path | None = None) -> bool:
    """Whether the checkpoint (or sidecar) has an MTP head, from tensor names only."""
    files = _safetensors_files(Path(sidecar) if sidecar is not None else Path(model_path))
    return _locate([n for f in files for n in _header_names(f)], config) is not None


def load_mtp_head(model_path: Path, model: nn.Module, config: dict[str, Any],
                  overrides: dict[str, Any] | None = None,
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
    eps = float(getattr(args, "rms_norm_eps", None) or _text_config(config).get("rms_norm_eps")
                or 1e-6)
    own_head = weights.get("head.weight")  # DeepSeek's shared_head.head, when the file has it
    vocab = int(own_head.shape[0]) if own_head is not None else None
    head = MtpHead(trunk, _build_layer(trunk, layer_tensors), hidden_size, eps, conv, vocab,
                   proj_bias="proj.bias" in weights)
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


# --- the drafter --------------------------------------------------------------------------


class MtpDrafter:
    """Greedy (argmax) drafts from the MTP head, following the Drafter protocol of decode.py.

    Deterministic: propose returns q = None, so the decode loop treats q as one-hot and sampled
    decoding stays exact. Needs a forward that keeps the trunk's hidden rows:
    LocalForward(model, hidden=conventions.hidden)."""

    name = "mtp"

    def __init__(self, head: MtpHead, conventions: MtpConventions | None = None,
                 prefill_step: int = 2048):
        self.head = head
        # The head computes with its own conventions; these cap the depth and check the forward.
        self.conventions = conventions or head.conventions
        self.prefill_step = prefill_step
        self.cache: KVCache = head.make_cache()
        self._next: tuple[mx.array, mx.array] | None = None  # (logits [V], chain hidden [H])
        self._speculative = 0  # rows propose appended past the verified ones
        # From the prefix cache, for begin: the head's rows, and the trunk's hidden row of the
        # position after them when begin must recompute that row (see restore).
        self._restored: tuple[KVCache | None, mx.array | None] | None = None
        self.last_hidden_row: mx.array | None = None  # the trunk row paired in the last row
        # Verified rows not yet appended while the head is switched off (see lag).
        self._lagging: list[tuple[mx.array, list[int]]] = []
        self.stats = DecodeStats()  # the drafter's own per-position acceptance

    def _check_forward(self, forward: Any) -> None:
        kind = getattr(forward, "hidden", self.conventions.hidden)
        if kind != self.conventions.hidden:
            raise ValueError(f"MTP head wants the trunk hidden {self.conventions.hidden!r} its "
                             f"final norm; the forward keeps {kind!r}")

    def _append(self, hidden: mx.array, tokens: list[int]) -> None:
        out = self.head(hidden, mx.array(tokens, dtype=mx.int32), self.cache)
        self._next = (out.logits[-1], out.chain(self.head.conventions.chain)[-1])
        self.last_hidden_row = hidden[-1]

    def restore(self, cache: KVCache | None, hidden: mx.array | None = None) -> None:
        """Begin from these rows (a prefix-cache hit: the head's cache over the positions the
        trunk's restored caches hold); the next `begin` appends only the rows after them.
        `hidden`: the trunk's hidden row of the position right after `cache`'s rows (None: a
        fresh cache), which the trunk's restored caches hold but did not recompute; begin
        recomputes that row of the head first."""
        self._restored = (cache, hidden)

    def begin(self, prompt: list[int], forward: Any) -> None:
        """Fill the head's cache over the prompt: pair (h_i, x_{i+1}) at position i for
        i = 0..n-2 (the prefill covered prompt[:-1]). The last pair, (h_{n-2}, x_{n-1}),
        predicts what the verifier emits from the pending x_{n-1}: round 1's draft 1.

        After a prefix-cache hit the restored rows cover the positions the prefill skipped, and
        the prefill's hidden rows (forward.last_hidden) the ones after them."""
        self._check_forward(forward)
        (cache, row), self._restored = self._restored or (None, None), None
        self.cache = cache if cache is not None else self.head.make_cache()
        self._next = None
        self._speculative = 0
        self._lagging = []
        n = len(prompt) - 1
        first = self.cache.offset
        if n == first:
            return  # a one-token prompt: the first round goes without a draft
        hidden = forward.last_hidden
        if row is not None:
            hidden = row[None] if hidden is None else mx.concatenate([row[None], hidden], 0)
        if hidden is None or hidden.shape[0] != n - first:
            got = None if hidden is None else hidden.shape[0]
            raise ValueError(f"MTP drafter needs the {n - first} prefill hidden rows, got {got}; "
                             f"build the forward with hidden={self.conventions.hidden!r}")
        for start in range(first, n, self.prefill_step):
            stop = min(start + self.prefill_step, n)
            self._append(hidden[start - first:stop - first], prompt[start + 1:stop + 1])
            mx.eval(self.cache.keys, self.cache.values, *self._next)

    def propose(self, history: list[int], k: int) -> tuple[list[int], list[np.ndarray] | None]:
        return self._drafts(k)[0], None

    def _drafts(self, k: int) -> tuple[list[int], list[mx.array]]:
        """The head's greedy chain of up to k tokens and its logits row at each depth."""
        k = min(k, self.conventions.max_depth)
        if k <= 0 or self._next is None:
            return [], []
        logits, chained = self._next
        rows = [logits]
        drafts = [int(mx.argmax(logits).item())]
        chain = self.head.conventions.chain
        while len(drafts) < k:
            # Speculative row (own output, own draft) at the next position; observe trims it.
            out = self.head(chained[None], mx.array(drafts[-1:], dtype=mx.int32), self.cache)
            self._speculative += 1
            chained = out.chain(chain)[-1]
            rows.append(out.logits[-1])
            drafts.append(int(mx.argmax(rows[-1]).item()))
        return drafts, rows

    def propose_branches(self, history: list[int], k: int) -> tuple[list[int], list[Branch]]:
        """The head's chain and, at each depth where its own second choice is close to its
        first (p2 >= HEAD_BRANCH_CLOSE p1), that token as a one-token side branch (its top-2
        at every depth; gates.build_tree keeps those that pay for their width). A side leaf
        needs no head row: nothing more runs than for the chain."""
        drafts, rows = self._drafts(k)
        if not drafts:
            return [], []
        probs = mx.softmax(mx.stack(rows).astype(mx.float32), axis=-1)
        first = mx.array(drafts)[:, None]
        p1 = mx.take_along_axis(probs, first, axis=-1)[:, 0]
        others = mx.where(mx.arange(probs.shape[-1])[None] == first, -1.0, probs)
        second, p2 = mx.argmax(others, axis=-1), mx.max(others, axis=-1)
        branches = []
        for d, (t, a, b) in enumerate(zip(second.tolist(), p1.tolist(), p2.tolist(),
                                          strict=True)):
            if b >= HEAD_BRANCH_CLOSE * a and b > 0.0:
                branches.append(Branch(d, [t], b / (a + b)))
        return drafts, branches

    def observe_tree(self, tree: DraftTree, path: list[int], emitted: list[int],
                     forward: Any) -> None:
        """A tree round it drafted: count it per depth, follow the accepted path's rows."""
        self.stats.record_tree(tree, len(path))
        self.follow(len(path), emitted, forward)

    def first_choices(self, n: int) -> list[tuple[int, float]]:
        """The head's n likeliest tokens for the first draft position with their probabilities
        (its distribution over what the verifier emits next); nothing is run or appended."""
        if n <= 0 or self._next is None:
            return []
        logits = self._next[0].astype(mx.float32)
        probs = mx.softmax(logits, axis=-1)
        top = mx.argsort(-logits)[:n]
        return list(zip(top.tolist(), probs[top].tolist(), strict=True))

    @property
    def drafted_at(self) -> list[int]:
        return self.stats.drafted_at

    @property
    def accepted_at(self) -> list[int]:
        return self.stats.accepted_at

    def observe(self, drafted: int, accepted: int, emitted: list[int], forward: Any) -> None:
        """Trim the speculative rows, then append the verified pairs: row j of the verify
        ([pending, d1..]) is h at the pending position + j, paired with emitted[j]."""
        self.stats.record(drafted, accepted)
        self.follow(accepted, emitted, forward)

    def follow(self, accepted: int, emitted: list[int], forward: Any) -> None:
        """Keep the head's cache in step after a verify round, whoever drafted it."""
        self.catch_up()
        self._append(*self._verified(accepted, emitted, forward))

    def lag(self, accepted: int, emitted: list[int], forward: Any) -> None:
        """A round while the head is switched off: keep the verified rows (references to the
        trunk rows the verify computed anyway) instead of running the head on them, so that
        `catch_up` can bring its cache in step in one call when it is needed again (the
        prefix cache keeps it at the end of the request)."""
        self._lagging.append(self._verified(accepted, emitted, forward))

    def catch_up(self) -> None:
        """Append the rows `lag` kept, in one call per prefill_step rows."""
        if not self._lagging:
            return
        hidden = mx.concatenate([h for h, _ in self._lagging], axis=0)
        tokens = [t for _, ts in self._lagging for t in ts]
        self._lagging = []
        for start in range(0, len(tokens), self.prefill_step):
            stop = min(start + self.prefill_step, len(tokens))
            self._append(hidden[start:stop], tokens[start:stop])
            mx.eval(self.cache.keys, self.cache.values, *self._next)

    def _verified(self, accepted: int, emitted: list[int], forward: Any
                  ) -> tuple[mx.array, list[int]]:
        if self._speculative:
            self.cache.trim(self._speculative)
            self._speculative = 0
        hidden = forward.last_hidden
        keep = 1 + accepted
        if hidden is None or hidden.shape[0] < keep or len(emitted) != keep:
            raise ValueError(f"MTP drafter: {keep} verified rows expected, got hidden "
                             f"{None if hidden is None else hidden.shape[0]} and "
                             f"{len(emitted)} emitted tokens")
        return hidden[:keep], list(emitted)
