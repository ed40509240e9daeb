"""What a GGUF card asks of its llama-server child: whether the card is served at all, where its
GGUF is, and the child's command line (parallel slots, context per slot, speculation)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from skulkp2p.models.cards import SERVED_DEFAULT_CONTEXT, SERVED_DEFAULT_SLOTS, Card
from skulkp2p.models.repo_ids import parse_repo_ref
from skulkp2p.served.child import ServedError

FORCE_NO_SPEC = "SKULKP2P_LLAMA_SERVER_FORCE_NO_SPEC"
DEFAULT_CONTEXT = SERVED_DEFAULT_CONTEXT  # llama-server allocates KV for the whole -c up front
DEFAULT_MAX_BATCH = SERVED_DEFAULT_SLOTS  # each slot gets the card's whole context


def wants_served(card: Card | None) -> bool:
    return card is not None and card.engine == "llama_server"


def resolve_gguf(store: Any, card: Card, progress: Any = None) -> Path:
    """The card's GGUF on disk: its gguf_file (relative to the card) or its fetched source."""
    name = card.placement.get("gguf_file")
    if name:
        path = Path(name).expanduser()
        if not path.is_absolute() and card.file is not None:
            path = card.file.parent / path
        if not path.is_file():
            raise ServedError(f"card {card.id}: placement.gguf_file {path} does not exist")
        return path
    return store.fetch_gguf(card, progress)


def served_slots(card: Card, max_batch: int | None = None) -> int:
    """Parallel slots for the card's child (see Card.served_slots)."""
    return card.served_slots(max_batch)


def slot_context(card: Card) -> int:
    """Context of one slot (see Card.served_slot_context)."""
    return card.served_slot_context


def server_args(store: Any, card: Card, model: Path, *, no_spec: bool | None = None,
                max_batch: int | None = None) -> list[str]:
    """llama-server flags from the card. FORCE_NO_SPEC drops speculation (for benchmarks).
    `max_batch`: parallel slots (see served_slots)."""
    p = card.placement
    if no_spec is None:
        no_spec = os.environ.get(FORCE_NO_SPEC, "") not in ("", "0")
    slots = served_slots(card, max_batch)
    # -np N slots, batched together by llama.cpp (continuous batching is its default). Without
    # a unified KV cache (off when -np is given) llama-server splits -c evenly across slots, so
    # -c is N x the context one request may use: every slot keeps the card's whole context.
    # Speculation stays on with -np (each slot drafts and verifies its own rows in the shared
    # batch; the child reports draft_n per request).
    # --jinja: the GGUF's own chat template renders tools, and the child parses calls itself.
    args = ["-m", str(model), "-c", str(slot_context(card) * slots), "--parallel", str(slots),
            "--no-kv-unified", "--no-webui", "--jinja"]
    threads = os.environ.get("SKULKP2P_LLAMA_SERVER_THREADS")
    if threads:
        args += ["-t", threads]
    spec = p.get("served_spec_type", "none")
    if spec != "none" and not no_spec:
        args += ["--spec-type", spec.replace("_", "-")]
        if p.get("served_spec_n_max"):
            args += ["--spec-draft-n-max", str(p["served_spec_n_max"])]
        if p.get("served_spec_draft"):
            draft = p["served_spec_draft"]
            draft_path = Path(draft).expanduser()
            if not draft_path.is_absolute() and card.file is not None:
                draft_path = card.file.parent / draft_path
            if draft in store.cards:
                draft_path = resolve_gguf(store, store.cards[draft])
            elif not draft_path.exists() and parse_repo_ref(draft) is not None:
                # a GGUF repository: owner/repo[@revision][:QUANT|:file.gguf]
                draft_path = resolve_gguf(store, store.resolve(draft, fetch=True).card)
            args += ["--model-draft", str(draft_path)]
    args += [str(a) for a in p.get("served_args", [])]
    return args
