"""Run one generation request on a loaded model: prompt -> decode loop -> text, with stats."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from skulkp2p.engine.decode import DecodeStats, decode
from skulkp2p.engine.drafters import PromptLookup
from skulkp2p.engine.forward import LocalForward
from skulkp2p.engine.gates import (
    DEFAULT_WIDTH_COSTS,
    GatedDrafter,
    LookupThenModel,
    repetition_score,
)
from skulkp2p.engine.request import GenerationRequest, RequestError
from skulkp2p.engine.sampling import make_rng
from skulkp2p.engine.stage import StageSpan, slice_model
from skulkp2p.engine.text import TextAssembler

log = logging.getLogger("skulkp2p.engine")

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


@dataclass
class LoadedModel:
    id: str
    path: Path
    model: nn.Module
    tokenizer: Any
    context_length: int
    dtype: str
    runtime: dict[str, Any] = field(default_factory=dict)
    speculation: dict[str, Any] = field(default_factory=dict)  # the card's [speculation]
    width_costs: dict[int, float] | None = None  # measured verify costs, when bench has run
    mtp: Any = None  # a loaded MTP head, when the model has one
    draft: LoadedModel | None = None  # a draft model, when the card names one
    span: StageSpan | None = None  # the layers held here, when this node is one ring stage
    # (request, hidden, interrupt) -> a Forward; set on the last stage of a ring (RingForward)
    make_forward: Callable[..., Any] | None = None


def is_mtp_key(key: str, num_layers: int | None) -> bool:
    """MTP head tensors in any of the namings real checkpoints use (Qwen `mtp.*`, MiMo
    `model.mtp_layers.*`, DeepSeek's extra layer past num_hidden_layers)."""
    return (key.startswith("mtp.") or ".mtp." in key or key.startswith("model.mtp_layers.")
            or (num_layers is not None and key.startswith(f"model.layers.{num_layers}.")))


def _trunk_classes(config: dict[str, Any]):
    """mlx-lm's classes for the family, with MTP tensors stripped before its strict load (some
    families' sanitize keeps them and the load then refuses them). The drafter loads them itself."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    n_layers = config.get("num_hidden_layers") or config.get("text_config", {}).get(
        "num_hidden_layers")

    class Trunk(model_class):
        def sanitize(self, weights):
            weights = {k: v for k, v in weights.items() if not is_mtp_key(k, n_layers)}
            parent = getattr(super(), "sanitize", None)
            return parent(weights) if parent else weights

    Trunk.__name__ = model_class.__name__
    return Trunk, args_class


def load_model(path: Path, model_id: str, context_length: int | None = None,
               dtype: str = "bfloat16", runtime: dict[str, Any] | None = None,
               speculation: dict[str, Any] | None = None,
               sidecar: Path | None = None, span: StageSpan | None = None) -> LoadedModel:
    """Load the trunk with mlx-lm's classes (MTP tensors stripped), cast it to `dtype`, and load
    its MTP head beside it when the checkpoint or a sidecar has one.

    With `span`, only that stage's layers are kept (see stage.py): the model is loaded lazily and
    cut before anything is evaluated; only the last stage loads the MTP head."""
    from mlx_lm.utils import load_model as mlx_load_model
    from mlx_lm.utils import load_tokenizer

    from skulkp2p.engine.mtp import has_mtp_tensors, load_mtp_head

    model, config = mlx_load_model(Path(path), lazy=span is not None,
                                   get_model_classes=_trunk_classes)
    if span is not None:
        # The last stage runs the drafter: an MTP head embeds its draft tokens.
        keep = span.last and has_mtp_tensors(Path(path), config, sidecar)
        slice_model(model, span, keep_embedding=keep)
    tokenizer = load_tokenizer(Path(path), eos_token_ids=config.get("eos_token_id"))
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    model.set_dtype(DTYPES[dtype])
    mx.eval(model.parameters())
    ctx = context_length or config.get("max_position_embeddings") or config.get(
        "text_config", {}).get("max_position_embeddings") or 4096
    speculation = dict(speculation or {})
    overrides = {k: v for k, v in speculation.items()
                 if k.startswith("mtp_") and k not in ("mtp_sidecar", "mtp_prior_acceptance")}
    head = None if span is not None and not span.last else load_mtp_head(
        Path(path), model, config, overrides=overrides, sidecar=sidecar)
    if head is not None:
        log.info("%s: MTP head loaded (%s style, hidden %s the final norm, depth up to %d)",
                 model_id, head.conventions.style, head.conventions.hidden,
                 head.conventions.max_depth)
    return LoadedModel(model_id, Path(path), model, tokenizer, int(ctx), dtype,
                       dict(runtime or {}), speculation, mtp=head, span=span)


def prompt_tokens(loaded: LoadedModel, req: GenerationRequest) -> list[int]:
    tok = loaded.tokenizer
    if req.messages is not None:
        if not getattr(tok, "has_chat_template", True) and not getattr(tok, "chat_template", None):
            raise RequestError(f"model {loaded.id} has no chat template: send 'prompt'", "messages")
        ids = tok.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict):  # some tokenizers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    # As mlx-lm does: add special tokens (BOS) unless the prompt already starts with BOS.
    bos = getattr(tok, "bos_token", None)
    add_special = bos is None or not req.prompt.startswith(bos)
    return list(tok.encode(req.prompt, add_special_tokens=add_special))


@dataclass
class Chunk:
    """One step of a generation: newly final text and the tokens behind it."""
    text: str
    tokens: list[int]


# A head's prior acceptance is measured on held-out text (its card says so): it weighs as much as
# this many rounds, so that a few early misses (the opening of a story) do not switch it off for
# the whole request. SmolLM2 creative: 0 of the first 4 drafts right, 39% over 144.
MTP_PRIOR_WEIGHT = 8.0

# Beside a model drafter, lookup takes only matches of at least this many tokens: a one-token
# match on novel text is a worse bet than the head's draft (SmolLM2 qa: 0/23 accepted).
LOOKUP_MIN_KEY_WITH_MODEL = 2


def _lookup(loaded: LoadedModel, min_key: int = 1) -> PromptLookup:
    cfg = loaded.speculation.get("lookup", {})
    return PromptLookup(max_key=cfg.get("max_key", 3),
                        min_key=max(int(cfg.get("min_key", 1)), min_key))


def _costs(loaded: LoadedModel) -> dict[int, float]:
    return loaded.width_costs or DEFAULT_WIDTH_COSTS.get(loaded.dtype, DEFAULT_WIDTH_COSTS[
        "bfloat16"])


def speculation_allowed(loaded: LoadedModel) -> bool:
    """The card's gate: `speculative_multi_node = false` (e.g. MoE models, where verifying k+1
    rows costs nearly k+1 expert reads) turns speculation off once the model spans nodes."""
    multi_node = loaded.span is not None and not loaded.span.first
    return not multi_node or bool(loaded.speculation.get("speculative_multi_node", True))


def _choose_drafter(loaded: LoadedModel, req: GenerationRequest, prompt: list[int]):
    """(drafter or None, depth, which trunk hidden state the forward must keep).

    An explicit drafter runs at the asked depth, ungated: the caller asked for it. "auto" wraps
    the available drafters in the gates: prompt lookup where it finds a match, and the model's
    own drafter (MTP head, else draft model) everywhere else.
    """
    spec = req.speculation
    if spec.mode == "off" or not speculation_allowed(loaded):
        return None, 0, None
    if spec.mode == "explicit":
        if spec.drafter == "lookup":
            return _lookup(loaded), spec.depth or 4, None
        if spec.drafter == "mtp":
            if loaded.mtp is None:
                raise RequestError(f"model {loaded.id} has no MTP head (no mtp tensors and no "
                                   "sidecar)", "speculation")
            return _mtp_drafter(loaded), spec.depth or loaded.mtp.conventions.max_depth, \
                loaded.mtp.conventions.hidden
        if loaded.draft is None:
            raise RequestError(f"model {loaded.id} has no draft model (card field "
                               "speculation.draft_model)", "speculation")
        return _draft_drafter(loaded, req), spec.depth or 3, None
    costs = _costs(loaded)
    model_drafter, model_depth, hidden = None, 0, None
    if loaded.mtp is not None:
        model_depth = loaded.mtp.conventions.max_depth
        prior = float(loaded.speculation.get("mtp_prior_acceptance", 0.5))
        model_drafter = GatedDrafter(_mtp_drafter(loaded), costs, model_depth, request_id=req.id,
                                     draft_cost=_relative_cost(loaded.mtp, loaded),
                                     prior_accept=prior, prior_weight=MTP_PRIOR_WEIGHT)
        hidden = loaded.mtp.conventions.hidden
    elif loaded.draft is not None:
        model_depth = int(loaded.speculation.get("draft_max_depth", 4))
        model_drafter = GatedDrafter(_draft_drafter(loaded, req), costs, model_depth,
                                     request_id=req.id,
                                     draft_cost=_relative_cost(loaded.draft.model, loaded))
    cfg = loaded.speculation.get("lookup", {})
    if not cfg.get("enabled", True):
        return model_drafter, model_depth, hidden
    depth = int(cfg.get("max_depth", 6))
    # Prompt gate: lookup starts on when the prompt repeats itself (code, quoted text); on novel
    # prompts it starts off and comes back only if the output turns repetitive. 0.02 measured on
    # SmolLM2 (bench workloads): code edits score 0.024 and lookup pays there (1.9x at depth 3);
    # questions and stories score 0.012-0.018 and lookup does not pay from the start.
    start_on = repetition_score(prompt) >= float(cfg.get("min_repetition", 0.02))
    alone = model_drafter is None
    lookup = GatedDrafter(_lookup(loaded, 1 if alone else LOOKUP_MIN_KEY_WITH_MODEL), costs,
                          depth, start_on=start_on, can_return=True, request_id=req.id)
    if alone:
        return lookup, depth, None
    # Both: lookup where it matches, the model's drafter elsewhere (gates.LookupThenModel).
    return LookupThenModel(lookup, model_drafter), max(depth, model_depth), hidden


def _param_count(module: nn.Module) -> int:
    from mlx.utils import tree_flatten
    return sum(v.size for _, v in tree_flatten(module.parameters()))


def _relative_cost(drafter_module: nn.Module, loaded: LoadedModel) -> float:
    """A drafter's per-token cost relative to a trunk step, from weights read per token (decode
    on these machines is bound by reading weights). An MTP head shares the trunk's lm_head,
    which it reads once per draft too."""
    key = id(drafter_module)
    cache = loaded.runtime.setdefault("_draft_costs", {})
    if key not in cache:
        from skulkp2p.engine.trunk import Trunk
        trunk = Trunk(loaded.model)
        own = _param_count(drafter_module)
        if drafter_module is loaded.mtp and trunk.tied:
            # The shared head is read again per draft: only its draft-vocabulary rows when the
            # head drafts over a reduced vocabulary.
            rows = getattr(loaded.mtp, "vocab_ids", None)
            weight = trunk.embed_tokens.weight
            own += weight.size if rows is None else len(rows) * weight.shape[-1]
        cache[key] = own / max(_param_count(loaded.model), 1)
    return cache[key]


def _mtp_drafter(loaded: LoadedModel):
    from skulkp2p.engine.mtp import MtpDrafter
    return MtpDrafter(loaded.mtp)


def _draft_drafter(loaded: LoadedModel, req: GenerationRequest):
    from skulkp2p.engine.draft_model import DraftModelDrafter, vocab_size
    # Tokenizers were checked once when the draft model loaded (loader.open_model).
    return DraftModelDrafter(loaded.draft, req.sampling, make_rng(
        None if req.sampling.seed is None else req.sampling.seed + 1),
        target_vocab=vocab_size(loaded.model))


def stream(loaded: LoadedModel, req: GenerationRequest, result: dict[str, Any],
           interrupt: Callable[[], None] | None = None) -> Iterator[Chunk]:
    """Yield chunks as tokens are decoded; fill `result` with finish_reason, usage and stats.

    `interrupt` is called between prefill chunks and between decoded tokens; it raises (any
    exception, which propagates) to abandon the request, e.g. when an HTTP client went away."""
    t0 = time.perf_counter()
    prompt = prompt_tokens(loaded, req)
    if len(prompt) >= loaded.context_length:
        raise RequestError(f"prompt is {len(prompt)} tokens; model {loaded.id} takes at most "
                           f"{loaded.context_length - 1}", "messages" if req.messages else "prompt")
    default_max = int(loaded.runtime.get("max_tokens", 256))
    max_tokens = min(req.max_tokens or default_max, loaded.context_length - len(prompt))
    drafter, depth, hidden = _choose_drafter(loaded, req, prompt)
    rng = make_rng(req.sampling.seed)
    stats = DecodeStats()
    eos = set(loaded.tokenizer.eos_token_ids)
    text = TextAssembler(loaded.tokenizer, req.stop)
    if loaded.make_forward is not None:
        forward = loaded.make_forward(req, hidden, interrupt)
    else:
        forward = LocalForward(loaded.model, int(loaded.runtime.get("prefill_step", 2048)),
                               hidden=hidden, interrupt=interrupt)
    generated: list[int] = []
    finish = "length"
    t_first = None
    steps = decode(forward, prompt, req.sampling, max_tokens, rng, drafter, depth, stats)
    try:
        for token in steps:
            if interrupt is not None:
                interrupt()
            if t_first is None:
                t_first = time.perf_counter()
            if token in eos:
                finish = "stop"
                break
            generated.append(token)
            yield Chunk(text.add(token), [token])
            if text.stopped:
                finish = "stop"
                break
    finally:
        steps.close()
        if hasattr(forward, "close"):
            forward.close()  # a ring frees the request's caches on the other stages
    tail = text.finish()
    if tail:
        yield Chunk(tail, [])
    t_end = time.perf_counter()
    result["finish_reason"] = finish
    result["tokens"] = generated
    result["text"] = text.text
    result["usage"] = {"prompt_tokens": len(prompt), "completion_tokens": len(generated),
                       "total_tokens": len(prompt) + len(generated)}
    decode_s = (t_end - t_first) if t_first else 0.0
    result["timing"] = {
        "ttft_s": round((t_first or t_end) - t0, 4),
        "total_s": round(t_end - t0, 4),
        "decode_tok_s": round((len(generated) - 1) / decode_s, 2) if decode_s > 0 and len(
            generated) > 1 else None,
    }
    if drafter is not None:
        gated = isinstance(drafter, GatedDrafter | LookupThenModel)
        result["speculation"] = {
            "drafter": drafter.name, "mode": "auto" if gated else "explicit",
            "max_depth": depth, "rounds": stats.rounds,
            "drafted": stats.drafted, "accepted": stats.accepted,
            "acceptance": round(stats.accepted / stats.drafted, 4) if stats.drafted else None,
            "acceptance_per_position": [round(a / d, 4) if d else None for a, d in
                                        zip(stats.accepted_at, stats.drafted_at, strict=True)],
            "drafted_per_position": list(stats.drafted_at),
            "accepted_per_position": list(stats.accepted_at),
            "gate_fired": bool(gated and drafter.events),
            "gate_events": drafter.events if gated else [],
        }
        if isinstance(drafter, LookupThenModel):
            result["speculation"]["by_drafter"] = drafter.counts()


def generate(loaded: LoadedModel, req: GenerationRequest) -> dict[str, Any]:
    """The whole result of one request, as pipe and non-streaming HTTP return it."""
    result: dict[str, Any] = {}
    for _ in stream(loaded, req, result):
        pass
    out: dict[str, Any] = {"id": req.id, "model": loaded.id, "text": result["text"],
                           "tokens": result["tokens"], "finish_reason": result["finish_reason"],
                           "usage": result["usage"], "timing": result["timing"]}
    if "speculation" in result:
        out["speculation"] = result["speculation"]
    return out
