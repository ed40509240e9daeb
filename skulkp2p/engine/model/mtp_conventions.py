"""How a checkpoint's multi-token-prediction (MTP) head is laid out and run, found from its
tensor names without reading any tensor data (no MLX here: engine/model/mtp_head.py builds the head,
engine/drafting/mtp_drafter.py drafts with it).

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
(`python -m skulkp2p head train`, shipped as a sidecar):

* eagle (EAGLE-style): `eagle.fc` (with a bias, as EAGLE's fc) over `eagle.enorm` /
  `eagle.hnorm` of the next token's embedding and the trunk's feature, one decoder layer of the
  trunk's family under `eagle.layers.0.`, `eagle.norm`, and `eagle.vocab_ids` (the reduced
  draft vocabulary over the trunk's lm_head, as the trainer writes it). It is trained so that
  its normed output is the trunk's next feature, and that output is what depth > 1 feeds back
  (chain "after").
* eagle3 (EAGLE-3-class): the eagle layout under `eagle3.`, plus `eagle3.fuse_norm` (an RMSNorm
  weight per depth, [3, H]) and `eagle3.fuse` (no bias, [H, 3H]): the trunk's feature is the
  outputs of a low, a middle and a high layer (`fused_layers`: 2, L // 2, L - 1),
  each normed, concatenated and fused to one row; the forward keeps those layers' outputs
  (hidden "layers:i,j,k"). Depth > 1 feeds back the head's own normed output (chain "after"),
  which skips the fusion; it is trained so (multi-step training-time test, `head train --kind
  eagle3`).

A sidecar may also hold `{prefix}vocab_ids` (int32 [K]): a reduced draft vocabulary
(engine/model/mtp_head.py scores only those rows of the shared lm_head).

Which head output depth > 1 feeds back is `MtpConventions.chain`: "after" the head's final norm
for qwen and mimo, "before" it for deepseek (engine/drafting/mtp_drafter.py says where that comes from);
a card can override it (`mtp_chain`).
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, replace
from pathlib import Path

from skulkp2p.engine.json_types import JSONObject, JSONValue

STYLES = ("qwen", "deepseek", "mimo", "eagle", "eagle3")
# Families whose raw checkpoints store RMSNorm weights zero-centred (x * (1 + w)).
ZERO_CENTRED_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")

# Per style: (concat order, which head output is chained at depth > 1, zero the embedding at
# position 0). See the module docstring for where these come from.
_STYLE_DEFAULTS: dict[str, tuple[str, str, bool]] = {
    "qwen": ("embed_first", "after", False),
    "deepseek": ("embed_first", "before", True),
    "mimo": ("hidden_first", "after", True),
    "eagle": ("embed_first", "after", False),
    "eagle3": ("embed_first", "after", False),
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
    "eagle3": {"proj": "fc", "norm_embed": "enorm", "norm_hidden": "hnorm", "final_norm": "norm",
               "fuse": "fuse", "fuse_norm": "fuse_norm"},
}
# Styles whose decoder layer sits under `{prefix}layers.0.` (the others: under the prefix itself).
_NESTED_LAYER = ("qwen", "eagle", "eagle3")
# DeepSeek's MTP layer carries a copy of the shared embedding; the trunk's is used instead.
_IGNORED = {"deepseek": ("embed_tokens.",)}
# Optional int32 tensor (under the style's prefix) listing a reduced draft vocabulary.
VOCAB_IDS = "vocab_ids"


@dataclass(frozen=True)
class MtpConventions:
    """How to run one checkpoint's MTP head. Card fields override the detected values."""
    style: str  # "qwen" | "deepseek" | "mimo" | "eagle" | "eagle3"
    # trunk hidden fed to the head: "after" | "before" the final norm, or "layers:i,j,k" (the
    # outputs of those layers, concatenated: eagle3)
    hidden: str = "after"
    concat: str = "embed_first"  # "embed_first" | "hidden_first"
    norm_offset: float = 0.0  # 1.0 when the checkpoint stores RMSNorm weights zero-centred
    max_depth: int = 4  # most drafts per round (chained head calls)
    chain: str = "after"  # head output fed back at depth > 1: "after" | "before" its final norm
    zero_first_embed: bool = False  # zero the embedding at position 0 (DeepSeek, MiMo)

    def __post_init__(self) -> None:
        if self.style not in STYLES:
            raise ValueError(f"mtp style must be one of {STYLES}, got {self.style!r}")
        layers = self.hidden.startswith("layers:") and all(
            i.isdigit() for i in self.hidden[len("layers:"):].split(","))
        for name, value, allowed in (("hidden", "after" if layers else self.hidden,
                                      ("after", "before", "layers:i,j,k")),
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


def _text_config(config: JSONObject) -> JSONObject:
    text = config.get("text_config")
    return text if isinstance(text, dict) and text else config


def config_number(value: JSONValue, field: str) -> float:
    """A number from a config or a card (JSON: an int, a float, or a numeric string)."""
    if not isinstance(value, int | float | str):
        raise ValueError(f"{field} must be a number, got {value!r}")
    return float(value)


def _num_layers(config: JSONObject) -> int | None:
    n = _text_config(config).get("num_hidden_layers", config.get("num_hidden_layers"))
    return int(config_number(n, "num_hidden_layers")) if n is not None else None


def _locate(names: list[str], config: JSONObject) -> tuple[str, str] | None:
    """(style, tensor prefix) of the MTP head among `names`, or None when there is none."""
    for name in names:
        if name.endswith("mtp.fc.weight"):
            return "qwen", name[: -len("fc.weight")]
        if name.endswith("eagle.fc.weight"):
            return "eagle", name[: -len("fc.weight")]
        if name.endswith("eagle3.fc.weight"):
            return "eagle3", name[: -len("fc.weight")]
    deepseek = sorted(int(m.group(1)) for n in names
                      if (m := re.fullmatch(r"model\.layers\.(\d+)\.enorm\.weight", n)))
    if deepseek:
        n_layers = _num_layers(config)
        index = n_layers if n_layers in deepseek else deepseek[0]
        return "deepseek", f"model.layers.{index}."
    if any(n.startswith("model.mtp_layers.0.") for n in names):
        return "mimo", "model.mtp_layers.0."
    return None


def _family(config: JSONObject) -> str:
    return str(config.get("model_type") or _text_config(config).get("model_type") or "")


def fused_layers(num_layers: int) -> tuple[int, int, int]:
    """The layers an eagle3 head reads: a low, a middle and a high one, 2, L // 2 and L - 1
    (in range for tiny models). EAGLE-3 takes L - 3 as the high one; the last layer instead
    makes the trunk's final feature (its output, normed) one of the head's inputs, so a head
    can start as an eagle head that fuses only it (`head train --kind eagle3 --init-from`)."""
    return (min(2, num_layers // 4), min(num_layers // 2, num_layers - 1), num_layers - 1)


def _style_hidden(style: str, config: JSONObject) -> str:
    """The trunk hidden a style reads: "after" its final norm, or for an eagle3 head the
    outputs of its fused_layers ("layers:i,j,k")."""
    if style != "eagle3":
        return "after"
    n = _num_layers(config)
    if not n:
        raise ValueError("an eagle3 head needs the model's num_hidden_layers")
    return "layers:" + ",".join(str(i) for i in fused_layers(n))


# The card fields that describe a head's file (its conventions), and the one that caps its depth:
# what a card may override of what the tensor names and the config give.
FILE_FIELDS = ("mtp_style", "mtp_hidden", "mtp_concat", "mtp_norm_offset", "mtp_chain",
               "mtp_zero_first_embed")
CONVENTION_FIELDS = (*FILE_FIELDS, "mtp_max_depth")


def _conventions(style: str, config: JSONObject,
                 overrides: JSONObject | None) -> MtpConventions:
    concat, chain, zero_first = _STYLE_DEFAULTS[style]
    family = _family(config)
    offset = 1.0 if any(family.startswith(f) for f in ZERO_CENTRED_FAMILIES) else 0.0
    conv = MtpConventions(style=style, concat=concat, norm_offset=offset, chain=chain,
                          zero_first_embed=zero_first, hidden=_style_hidden(style, config))
    o = overrides or {}
    if "mtp_style" in o and o["mtp_style"] != style:
        # A style named by the card re-derives the style's defaults; explicit fields still win.
        named = str(o["mtp_style"])
        concat, chain, zero_first = _STYLE_DEFAULTS[named]
        conv = replace(conv, style=named, concat=concat, chain=chain,
                       hidden=_style_hidden(named, config),
                       zero_first_embed=zero_first)
    if o.get("mtp_hidden") is not None:
        conv = replace(conv, hidden=str(o["mtp_hidden"]))
    if o.get("mtp_concat") is not None:
        conv = replace(conv, concat=str(o["mtp_concat"]))
    if o.get("mtp_norm_offset") is not None:
        conv = replace(conv, norm_offset=config_number(o["mtp_norm_offset"], "mtp_norm_offset"))
    if o.get("mtp_max_depth") is not None:
        conv = replace(conv, max_depth=int(config_number(o["mtp_max_depth"], "mtp_max_depth")))
    if o.get("mtp_chain") is not None:
        conv = replace(conv, chain=str(o["mtp_chain"]))
    if o.get("mtp_zero_first_embed") is not None:
        conv = replace(conv, zero_first_embed=bool(o["mtp_zero_first_embed"]))
    return conv


def detect_conventions(model_path: Path, config: JSONObject,
                       overrides: JSONObject | None = None) -> MtpConventions | None:
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


def has_mtp_tensors(model_path: Path, config: JSONObject,
                    sidecar: Path | None = None) -> bool:
    """Whether the checkpoint (or sidecar) has an MTP head, from tensor names only."""
    files = _safetensors_files(Path(sidecar) if sidecar is not None else Path(model_path))
    return _locate([n for f in files for n in _header_names(f)], config) is not None
