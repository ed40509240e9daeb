"""From a model name to a loaded model: resolve the card, pull it if needed, pick the dtype."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from skulkp2p.engine.json_types import JSONValue
from skulkp2p.engine.model.loaded import LoadedModel, load_model
from skulkp2p.engine.model.mtp_conventions import FILE_FIELDS
from skulkp2p.engine.model.stage import StageSpan
from skulkp2p.models.repo_ids import parse_repo_ref
from skulkp2p.models.store import ModelStore
from skulkp2p.progress import ProgressBar

log = logging.getLogger("skulkp2p.loader")


def serving_dtype() -> str:
    """float32 where a fast BLAS is active on a Linux CPU node, else the weights' bfloat16."""
    if env := os.environ.get("SKULKP2P_DTYPE"):
        return env
    try:
        from skulkp2p.engine.cpu import blas
    except ImportError:
        return "bfloat16"
    return blas.fast_path_report()["dtype"]


def head_speculation(speculation: Mapping[str, JSONValue], stage: bool
                     ) -> dict[str, JSONValue]:
    """A card's [speculation] for where it loads: on a `stage` (a ring's later stage, a tensor
    group's loop member), which lacks the low layers a head reading several depths of the trunk
    needs, the card's `mtp_stage_sidecar` is the head, its conventions detected from its own
    tensor names."""
    out = dict(speculation)
    if stage and out.get("mtp_stage_sidecar"):
        out["mtp_sidecar"] = out["mtp_stage_sidecar"]
        for key in FILE_FIELDS:  # (they describe the other head's file)
            out.pop(key, None)
    return out


def open_model(store: ModelStore, spec: str, dtype: str | None = None,
               span: StageSpan | None = None, head_only: bool = False) -> LoadedModel:
    resolved = store.resolve(spec, fetch=True)  # a card id, a path or a repository id
    path = store.pull(spec, progress=lambda label: ProgressBar(label, sys.stderr))
    card = resolved.card
    dtype = dtype or serving_dtype()
    log.info("loading %s from %s (%s)", resolved.id, path, dtype)
    # (card fields checked by type when the card loaded: mtp_sidecar, draft_model are str)
    speculation: dict[str, Any] = head_speculation(card.speculation if card else {},
                                                   head_only or (span is not None
                                                                 and not span.first))
    sidecar = None
    if speculation.get("mtp_sidecar"):
        sidecar = resolve_sidecar(speculation["mtp_sidecar"], card.file if card else None)
    loaded = load_model(path, resolved.id,
                        context_length=card.context_length if card and card.family else None,
                        dtype=dtype, runtime=card.runtime if card else None,
                        speculation=speculation, sidecar=sidecar, span=span,
                        head_only=head_only)
    if card and card.chat:
        from skulkp2p.engine.decode.tool_calls import model_format
        loaded.chat = dict(card.chat)
        try:
            model_format(loaded.chat, loaded.tokenizer)  # a wrong card field fails the load
        except ValueError as e:
            raise ValueError(f"card {card.id}: {e}") from None
    if speculation.get("draft_model") and (span is None or span.last):
        loaded.draft = open_model(store, speculation["draft_model"], dtype)
        from skulkp2p.engine.drafting.draft_model import check_compatible
        check_compatible(loaded.tokenizer, loaded.draft.tokenizer,
                         _vocab_size(loaded), _vocab_size(loaded.draft))
    # Not on a tensor group's loop member (head_only): it holds none of the layers whose
    # caches the assistant reads.
    if speculation.get("drafter") == "assistant" and (span is None or span.last) \
            and not head_only:
        loaded.assistant = open_assistant(store, speculation, card.file if card else None,
                                          loaded)
    from skulkp2p.engine.drafting.width_costs import (
        load_width_costs,  # `bench --widths` wrote it here
    )
    loaded.width_costs = load_width_costs(resolved.id, dtype, store.data_dir)
    if loaded.width_costs:
        log.info("verify width costs for %s (%s) measured here: %s", resolved.id, dtype,
                 ", ".join(f"w{w}={c:.2f}" for w, c in sorted(loaded.width_costs.items())[:8]))
    return loaded


def open_assistant(store: ModelStore, speculation: dict, card_file: Path | None,
                   target: LoadedModel):
    """The Gemma 4 assistant the card pairs with `target` (engine/drafting/assistant.py), in its dtype."""
    from skulkp2p.engine.drafting.assistant import AssistantError, load_assistant
    from skulkp2p.engine.model.loaded import DTYPES

    path = resolve_assistant(store, speculation["assistant_model"], card_file)
    try:
        return load_assistant(path, target.model, DTYPES[target.dtype],
                              int(speculation.get("assistant_block_size", 4)),
                              speculation.get("assistant_query_position", "last"),
                              target.span.start if target.span is not None else 0)
    except AssistantError as e:
        raise ValueError(f"card field speculation.assistant_model: {e}") from None


def resolve_assistant(store: ModelStore, value: str, card_file: Path | None = None) -> Path:
    """The local folder a card's `speculation.assistant_model` names: a card id (pulled by the
    store), a folder (relative to the card file, or absolute), or a Hugging Face repository id,
    "owner/repo[@revision]" or "hf:owner/repo" (the hub's copy, e.g.
    mlx-community/gemma-4-E4B-it-assistant-bf16; the local cache only under HF_HUB_OFFLINE)."""
    ref = parse_repo_ref(value)
    if value.startswith("hf:") and (ref is None or ref.selector):
        raise ValueError(f"card field speculation.assistant_model {value!r}: not an "
                         "'hf:owner/repo' Hugging Face repo id")
    if value in store.cards and not value.startswith("hf:"):
        return store.pull(value, progress=lambda label: ProgressBar(label, sys.stderr))
    path = Path(value).expanduser()
    if not path.is_absolute() and card_file is not None:
        path = Path(card_file).parent / path
    if not value.startswith("hf:") and (path / "config.json").is_file():
        return path
    if ref is None or ref.selector:
        raise FileNotFoundError(f"card field speculation.assistant_model {value!r}: no card of "
                                f"that id and no folder with a config.json at {path}")
    import huggingface_hub
    try:
        return Path(huggingface_hub.snapshot_download(
            ref.repo, revision=ref.revision, allow_patterns=["*.json", "*.safetensors"],
            local_files_only=_hf_offline()))
    except Exception as e:  # the hub's errors vary by version; the message says what
        raise FileNotFoundError(f"card field speculation.assistant_model {value!r}: cannot "
                                f"fetch it{' (HF_HUB_OFFLINE is set)' * _hf_offline()}: "
                                f"{type(e).__name__}: {' '.join(str(e).split())}") from e


SIDECAR_FILE = "mtp.safetensors"


def resolve_sidecar(value: str, card_file: Path | None = None) -> Path:
    """The local file a card's `speculation.mtp_sidecar` names:

    * a path, absolute or relative to the card file (a file in the project, e.g.
      "sidecars/smollm2-135m/mtp.safetensors"); a folder stands for its mtp.safetensors;
    * "hf:owner/repo" (or a bare "owner/repo" that is no local path), either with
      "@revision": the repo's mtp.safetensors from the Hugging Face hub, from the local cache
      only when offline.
    """
    ref = parse_repo_ref(value) if value.startswith("hf:") else None
    if not value.startswith("hf:"):
        path = Path(value).expanduser()
        if not path.is_absolute() and card_file is not None:
            path = Path(card_file).parent / path
        if path.is_dir():
            path = path / SIDECAR_FILE
        if path.is_file():
            return path
        ref = None if value.endswith(".safetensors") else parse_repo_ref(value)
        if ref is None or ref.selector:
            raise FileNotFoundError(f"MTP sidecar {value!r}: no file {path}")
    if ref is None or ref.selector:
        raise ValueError(f"MTP sidecar {value!r}: not an 'owner/repo' Hugging Face repo id")
    return _hf_sidecar(ref.repo, ref.revision)


def _hf_offline() -> bool:
    import huggingface_hub.constants as hf_constants
    env = os.environ.get("HF_HUB_OFFLINE", "").strip().lower()
    return bool(hf_constants.HF_HUB_OFFLINE) or env in ("1", "true", "yes", "on")


def _hf_sidecar(repo: str, revision: str | None = None) -> Path:
    import huggingface_hub
    if _hf_offline():
        # Offline: the local cache or a clear error, never a network attempt.
        cached = huggingface_hub.try_to_load_from_cache(repo, SIDECAR_FILE, revision=revision)
        if isinstance(cached, str):
            return Path(cached)
        raise FileNotFoundError(
            f"MTP sidecar hf:{repo}: {SIDECAR_FILE} is not in the local Hugging Face cache and "
            "HF_HUB_OFFLINE is set; fetch it once online or name a local file in the card")
    try:
        return Path(huggingface_hub.hf_hub_download(repo, SIDECAR_FILE, revision=revision))
    except Exception as e:  # the hub's errors vary by version; the message says what happened
        raise FileNotFoundError(f"MTP sidecar hf:{repo}: cannot fetch {SIDECAR_FILE}: "
                                f"{type(e).__name__}: {e}") from e


def _vocab_size(loaded: LoadedModel) -> int:
    from skulkp2p.engine.model.trunk import Trunk
    return int(Trunk(loaded.model).embed_tokens.weight.shape[0])
