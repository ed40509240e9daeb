"""Cards inferred from what a repository says of itself: config.json (and the tokenizer config,
the chat template and the safetensors tensor names) for MLX-layout repositories, the GGUF
metadata for GGUF ones. The result is card data in the TOML's shape; a hand-written card for the
same repository is laid over it field by field (`merge`), and models/cards.py validates the
result as it validates any card.

No weights are read: tensor names and sizes come from model.safetensors.index.json or the
safetensors headers, GGUF facts from the file's header (the first megabytes).
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from skulkp2p.models.repo_ids import RepoRef

# mlx-lm's inference of a tool parser from the chat template (mlx_lm.tokenizer_utils.
# _infer_tool_parser), in its order: the first row whose strings all occur names the parser.
# Repeated here because the store must not import mlx (the CPU switch runs before it);
# tests/test_hf_models.py checks that mlx-lm picks the same parser for each row.
TOOL_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("minimax_m2", ("<minimax:tool_call>",)),
    ("gemma4", ("<|tool_call>", "<tool_call|>")),
    ("function_gemma", ("<start_function_call>",)),
    ("longcat", ("<longcat_tool_call>",)),
    ("glm47", ("<arg_key>",)),
    ("pythonic", ("<|tool_list_start|>",)),
    ("pythonic", ("<|tool_call_start|>",)),
    ("qwen3_coder", ("<tool_call>\\n<function=",)),
    ("qwen3_coder", ("<tool_call>\n<function=",)),
    ("kimi_k2", ("<|tool_calls_section_begin|>",)),
    ("minicpm5", ('<function name="', '<param name="')),
    ("mistral", ("[TOOL_CALLS]",)),
    ("muse_spark", ("<atem:function_calls>",)),
    ("json_tools", ("<tool_call>", "tool_call.name")),
)


def tool_parser_from(template: str | None, tokenizer_config: Mapping[str, Any]) -> str | None:
    """The mlx-lm tool parser the tokenizer config names (`tool_parser_type`), else the one
    the chat template's markers point to, else None."""
    named = tokenizer_config.get("tool_parser_type")
    if isinstance(named, str) and named.isidentifier():
        return named
    if not template:
        return None
    for parser, markers in TOOL_MARKERS:
        if all(m in template for m in markers):
            return parser
    return None


def mtp_style_from(names: list[str]) -> str | None:
    """The native MTP head's naming among tensor names (as engine/model/mtp_conventions.py
    detects it at load): qwen (`mtp.fc`), eagle (`eagle.fc`), deepseek (a layer past the trunk
    with `enorm`), mimo (`model.mtp_layers.0.`); None when there is none."""
    for name in names:
        if name.endswith("mtp.fc.weight"):
            return "qwen"
        if name.endswith("eagle.fc.weight"):
            return "eagle"
    if any(re.fullmatch(r"model\.layers\.\d+\.enorm\.weight", n) for n in names):
        return "deepseek"
    if any(n.startswith("model.mtp_layers.0.") for n in names):
        return "mimo"
    return None


def chat_template_of(folder: Path, tokenizer_config: Mapping[str, Any]) -> tuple[str, str | None]:
    """(where the chat template comes from, its text): chat_template.jinja, chat_template.json
    or tokenizer_config.json (as transformers reads them), else ("none", None)."""
    import json

    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return "chat_template.jinja", jinja.read_text(encoding="utf-8")
    as_json = folder / "chat_template.json"
    if as_json.is_file():
        try:
            text = json.loads(as_json.read_text(encoding="utf-8")).get("chat_template")
        except (OSError, ValueError, AttributeError):
            text = None
        if isinstance(text, str):
            return "chat_template.json", text
    text = tokenizer_config.get("chat_template")
    if isinstance(text, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in text if isinstance(t, dict)}
        text = named.get("default") or next(iter(named.values()), None)
    if isinstance(text, str):
        return "tokenizer_config.json", text
    return "none", None


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return max(value)  # per-layer counts: the largest sizes the cache
    return None


def _first(config: Mapping[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = _int(config.get(key))
        if value is not None:
            return value
    return None


def _source(ref: RepoRef, file: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {"kind": "hf", "repo": ref.repo}
    if ref.revision:
        out["revision"] = ref.revision
    if file:
        out["file"] = file
    return out


def from_config(ref: RepoRef, config: Mapping[str, Any], tokenizer_config: Mapping[str, Any],
                template: tuple[str, str | None], tensor_names: list[str] | None,
                tensor_bytes: int | None) -> dict[str, Any]:
    """Card data of an MLX-layout repository. A value the files do not give is left out (a
    hand-written card supplies it, or the card is refused naming the field)."""
    text = config.get("text_config")
    flat = {**config, **(text if isinstance(text, dict) else {})}
    layers = _first(flat, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(flat, "num_attention_heads", "n_head")
    data: dict[str, Any] = {"name": ref.repo.split("/", 1)[1], "format": "mlx",
                            "source": _source(ref)}
    family = config.get("model_type") or flat.get("model_type")
    if isinstance(family, str) and family:
        data["family"] = family
    fields = {
        "layers": layers,
        "hidden_size": _first(flat, "hidden_size", "n_embd", "d_model"),
        "kv_heads": _first(flat, "num_key_value_heads", "n_head_kv") or heads,
        "context_length": _first(flat, "max_position_embeddings", "max_sequence_length",
                                 "seq_length", "n_positions"),
        "size_bytes": tensor_bytes,
    }
    data.update({k: v for k, v in fields.items() if v is not None and v > 0})
    source_name, template_text = template
    chat: dict[str, Any] = {"template": source_name}
    parser = tool_parser_from(template_text, tokenizer_config)
    if parser:
        chat["tool_parser"] = parser
    data["chat"] = chat
    style = mtp_style_from(tensor_names or [])
    if style:
        data["speculation"] = {"mtp_style": style}
    return data


# --- GGUF -----------------------------------------------------------------------------------

_FIRST_READ = 4 << 20  # a GGUF's metadata and tensor list: a few MB (the vocabulary dominates)


def gguf_facts_of_file(path: Path) -> dict[str, Any]:
    """The facts a card needs from a GGUF file's header (gguf-py's reader; no tensor data)."""
    import gguf

    return _facts(gguf.GGUFReader(str(path)))


def gguf_facts(read_prefix: Callable[[int], bytes], size: int) -> dict[str, Any]:
    """The same facts from the first bytes of a GGUF of `size` bytes that is not on disk (a
    hub file read by range requests): the prefix is laid into a sparse file of the whole size,
    and read again, longer, until the reader's tensor list ends inside what was read."""
    import gguf

    n = min(_FIRST_READ, size)
    while True:
        head = read_prefix(n)
        with tempfile.TemporaryDirectory(prefix="skulkp2p-gguf-") as tmp:
            path = os.path.join(tmp, "header.gguf")
            with open(path, "wb") as f:
                f.write(head)
                f.truncate(size)  # sparse: only the prefix takes disk space
            try:
                reader = gguf.GGUFReader(path)
                if reader.data_offset <= len(head):
                    return _facts(reader)
            except (ValueError, KeyError, IndexError, OverflowError, MemoryError):
                if len(head) >= size:
                    raise
        if len(head) >= size:
            raise ValueError("not a GGUF file: its header does not end within the file")
        n = min(n * 4, size)


def _facts(reader: Any) -> dict[str, Any]:
    def get(key: str) -> Any:
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    arch = get("general.architecture")
    if not isinstance(arch, str):
        raise ValueError("GGUF metadata lacks general.architecture")
    head_count = get(f"{arch}.attention.head_count")
    kv = get(f"{arch}.attention.head_count_kv")
    return {
        "arch": arch,
        "name": get("general.name"),
        "layers": _int(get(f"{arch}.block_count")),
        "hidden_size": _int(get(f"{arch}.embedding_length")),
        "kv_heads": _int(kv if kv is not None else head_count),
        "context_length": _int(get(f"{arch}.context_length")),
        "chat_template": get("tokenizer.chat_template"),
        "parameters": sum(math.prod(int(d) for d in t.shape) for t in reader.tensors),
    }


def from_gguf(ref: RepoRef, file: str, facts: Mapping[str, Any], file_bytes: int | None,
              served: bool) -> dict[str, Any]:
    """Card data of a GGUF repository's file. `served`: it runs as it is in a llama-server
    child (size: the file's bytes), else it is converted for MLX (size: bf16 weights)."""
    data: dict[str, Any] = {"name": file.rsplit("/", 1)[-1], "format": "gguf",
                            "family": facts["arch"], "source": _source(ref, file)}
    for key in ("layers", "hidden_size", "kv_heads", "context_length"):
        if facts.get(key):
            data[key] = facts[key]
    size = file_bytes if served else 2 * int(facts.get("parameters") or 0)
    if size:
        data["size_bytes"] = size
    template = facts.get("chat_template")
    chat: dict[str, Any] = {"template": "gguf" if isinstance(template, str) else "none"}
    parser = tool_parser_from(template if isinstance(template, str) else None, {})
    if parser:
        chat["tool_parser"] = parser
    data["chat"] = chat
    if served:
        data["placement"] = {"engine": "llama_server"}
    return data


def merge(inferred: Mapping[str, Any], hand: Mapping[str, Any]) -> dict[str, Any]:
    """`inferred` with every field of the hand-written card `hand` laid over it; tables merge
    key by key, so a card can override one field of [chat] and keep the rest."""
    out = dict(inferred)
    for key, value in hand.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out
