"""Extract a checkpoint's MTP head into a sidecar: ``mtp.safetensors`` + ``mtp.provenance.toml``.

Usage::

    python -m skulkp2p head publish SRC_DIR OUT_DIR

SRC_DIR is a full-precision checkpoint (one ``*.safetensors`` file, several, or shards listed in
``model.safetensors.index.json``) with its ``config.json``. The MTP tensors are found the way the
engine finds them (skulkp2p.engine.model.mtp_conventions): Qwen3.5 / Qwen3.6 / Qwen3-Next ``mtp.*``, DeepSeek-V3's
extra layer ``model.layers.{num_hidden_layers}.*``, MiMo's ``model.mtp_layers.*``. Per-expert MoE
weights are restacked into mlx-lm's ``switch_mlp`` layout with the loader's own function, so a
sidecar loads without any per-expert work. Names, dtypes and zero-centred norms stay as in the
checkpoint (the loader adds the norm offset from the base's family); DeepSeek's copies of the
shared embedding (and of lm_head, when it is an exact copy) are dropped because the loader uses
the trunk's.

Quantised checkpoints usually drop these tensors: the sidecar restores the head beside any
quantisation of the same base, quantised on load to match it. A checkpoint without MTP tensors is
refused with a one-line error and exit status 1.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import mlx.core as mx

from skulkp2p.engine.model.mtp_conventions import (
    _IGNORED,
    _PARTS,
    _conventions,
    _header_names,
    _locate,
    _num_layers,
    _text_config,
)
from skulkp2p.engine.model.mtp_head import _read_tensors, _stack_experts
from skulkp2p.training.head_options import HeadError

SIDECAR = "mtp.safetensors"
PROVENANCE = "mtp.provenance.toml"


class PublishError(HeadError):
    """A checkpoint that cannot be published; the message is one line."""


# --- small shared helpers (train_run.py uses them too) ------------------------------------------


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a valid TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def write_toml(path: Path, data: dict[str, Any], comment: str = "") -> None:
    """A small TOML writer (the stdlib only reads TOML): scalars and lists first, then tables
    (nested tables as dotted headers)."""
    lines = [f"# {line}" for line in comment.splitlines()]

    def emit(table: dict[str, Any], name: str) -> None:
        scalars = {k: v for k, v in table.items() if not isinstance(v, dict)}
        tables = {k: v for k, v in table.items() if isinstance(v, dict)}
        if name:
            lines.append("")
            lines.append(f"[{name}]")
        for k, v in scalars.items():
            if v is not None:
                lines.append(f"{_key(k)} = {_toml_value(v)}")
        for k, v in tables.items():
            emit(v, f"{name}.{_key(k)}" if name else _key(k))

    emit(data, "")
    Path(path).write_text("\n".join(lines).lstrip("\n") + "\n", encoding="utf-8")


def _key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k)


def licence_of(src: Path, config: dict[str, Any]) -> str:
    """The licence the checkpoint states (config.json, or README.md's front matter)."""
    for key in ("license", "licence"):
        if config.get(key):
            return str(config[key])
    readme = src / "README.md"
    if readme.is_file():
        text = readme.read_text(encoding="utf-8", errors="replace")
        if m := re.search(r"^license:\s*['\"]?([^'\"\n]+)", text, re.M):
            return m.group(1).strip()
    return "unknown (not stated in config.json or README.md)"


# --- publishing ---------------------------------------------------------------------------------


def checkpoint_files(src: Path) -> list[Path]:
    """The checkpoint's safetensors files: those the index lists, else every *.safetensors."""
    index = src / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (src / n).is_file()]
        if missing:
            raise PublishError(f"{src}: the index lists {missing[0]}, which is not there")
        return [src / n for n in names]
    files = sorted(p for p in src.glob("*.safetensors") if p.name != SIDECAR)
    if not files:
        raise PublishError(f"{src}: no *.safetensors files")
    return files


def extract(src: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """(tensors for the sidecar, provenance) of the checkpoint at `src`."""
    src = Path(src)
    config_file = src / "config.json"
    if not config_file.is_file():
        raise PublishError(f"{src}: no config.json")
    config = json.loads(config_file.read_text())
    files = checkpoint_files(src)
    names = [n for f in files for n in _header_names(f)]
    found = _locate(names, config)
    if found is None:
        raise PublishError(f"{src}: no MTP tensors (mtp.*, model.mtp_layers.*, or a layer past "
                           f"num_hidden_layers={_num_layers(config)}) in {len(files)} file(s)")
    style, prefix = found
    tensors = _read_tensors(files, prefix)
    for ignored in _IGNORED.get(style, ()):
        tensors = {k: v for k, v in tensors.items() if not k.startswith(prefix + ignored)}
    own_head = prefix + _PARTS[style].get("head", "\0") + ".weight"
    if own_head in tensors and _is_copy_of_lm_head(tensors[own_head], files, names):
        del tensors[own_head]  # a copy of the shared lm_head: the loader uses the trunk's
    before = len(tensors)
    tensors = _stack_experts(tensors)  # the loader's own restacking: one implementation
    conv = _conventions(style, config, None)
    layers = _head_layer_count(style, names, config)
    dtypes = sorted({str(v.dtype).removeprefix("mlx.core.") for v in tensors.values()})
    provenance = {
        "format": "skulkp2p mtp sidecar 1",
        "made_by": "python -m skulkp2p head publish",
        "model_type": str(config.get("model_type") or _text_config(config).get("model_type")),
        "licence": licence_of(src, config),
        "tensors": len(tensors),
        "experts_restacked": before != len(tensors),
        "conventions": {
            "style": conv.style,
            "prefix": prefix,
            "hidden": conv.hidden,
            "concat": conv.concat,
            "norm_offset": conv.norm_offset,
            "chain": conv.chain,
            "zero_first_embed": conv.zero_first_embed,
            "layers": layers,
            "dtype": ", ".join(dtypes),
        },
        "source": {f.name: {"sha256": sha256_file(f), "bytes": f.stat().st_size}
                   for f in [config_file, *files]},
    }
    return tensors, provenance


def _is_copy_of_lm_head(head: mx.array, files: list[Path], names: list[str]) -> bool:
    lm = next((n for n in names if n.endswith("lm_head.weight") and ".layers." not in n), None)
    if lm is None:
        return False
    shared = _read_tensors(files, lm)[lm]
    return shared.shape == head.shape and bool(mx.array_equal(shared, head).item())


def _head_layer_count(style: str, names: list[str], config: dict[str, Any]) -> int:
    if style == "qwen":
        found = {m.group(1) for n in names if (m := re.search(r"mtp\.layers\.(\d+)\.", n))}
    elif style == "mimo":
        found = {m.group(1) for n in names if (m := re.match(r"model\.mtp_layers\.(\d+)\.", n))}
    else:
        found = {m.group(1) for n in names if (m := re.fullmatch(r"model\.layers\.(\d+)\.enorm"
                                                                  r"\.weight", n))}
    return max(len(found), 1)


def write_sidecar(out: Path, tensors: dict[str, mx.array], provenance: dict[str, Any],
                  comment: str = "") -> Path:
    """Write OUT/mtp.safetensors and OUT/mtp.provenance.toml (with the sidecar's own sha256)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / SIDECAR
    tmp = path.with_suffix(".tmp.safetensors")
    mx.save_safetensors(str(tmp), dict(sorted(tensors.items())), metadata={"format": "pt"})
    tmp.replace(path)  # a half-written sidecar never carries the final name
    provenance = {**provenance, "sidecar": {"file": SIDECAR, "sha256": sha256_file(path),
                                            "bytes": path.stat().st_size}}
    write_toml(out / PROVENANCE, provenance, comment or "MTP sidecar provenance")
    return path


def publish(src: Path, out: Path) -> Path:
    tensors, provenance = extract(src)
    return write_sidecar(out, tensors, provenance,
                         f"MTP head extracted from {Path(src).resolve().name} "
                         "by python -m skulkp2p head publish")



def run(args) -> int:
    """`head publish`: the sidecar's path on stdout."""
    print(publish(args.src, args.out))
    return 0
