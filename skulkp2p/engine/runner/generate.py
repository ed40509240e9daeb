"""Run one generation request on a loaded model: prompt -> decode loop -> text, with stats."""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
import time
from collections.abc import Callable, Generator, Mapping
from typing import TYPE_CHECKING

import mlx.nn as nn
import numpy as np

from skulkp2p.engine.cache import caches
from skulkp2p.engine.cache.prefix_cache import PrefixCache, RawEntry
from skulkp2p.engine.decode.drafter_seam import Drafter
from skulkp2p.engine.decode.grammar import Grammar, compile_format, tokenizer_bridge
from skulkp2p.engine.decode.loop import DecodeStats, decode
from skulkp2p.engine.decode.sampling import Coupling, DraftDraws, make_rng
from skulkp2p.engine.decode.text import TextAssembler
from skulkp2p.engine.decode.tool_calls import (
    ToolCallStream,
    chat_tools,
    forced_opening,
    model_tools,
    tool_stream,
)
from skulkp2p.engine.decode.tool_grammar import CallFormat, tool_grammar
from skulkp2p.engine.drafting.draft_model import DraftModelDrafter, vocab_size
from skulkp2p.engine.drafting.gates import (
    DEFAULT_WIDTH_COSTS,
    GatedDrafter,
    LookupThenModel,
    repetition_score,
)
from skulkp2p.engine.drafting.prompt_lookup import PromptLookup
from skulkp2p.engine.drafting.suffix import SuffixDrafter, SuffixMemory
from skulkp2p.engine.model.arrays import leaves
from skulkp2p.engine.model.forward import Forward, LocalForward
from skulkp2p.engine.model.loaded import LoadedModel
from skulkp2p.engine.request import GenerationRequest, RequestError, Speculation
from skulkp2p.engine.results import (
    Chunk,
    DrafterCounts,
    GenerationResult,
    SpeculationStats,
    Timing,
    Usage,
)

if TYPE_CHECKING:
    from skulkp2p.engine.drafting.assistant import AssistantDrafter
    from skulkp2p.engine.drafting.mtp_drafter import MtpDrafter

log = logging.getLogger("skulkp2p.engine")


# A token's text is at most its tokenizer's longest token (counted in the vocabulary's own
# spelling: a byte-level token's text has a character per byte, never fewer than it decodes to),
# and this margin covers normalisers that fold characters together (NFKC composes some pairs
# into one). A prompt made of more characters than the context's tokens times that cannot fit:
# it is refused before it is tokenised.
CHARS_PER_TOKEN_MARGIN = 2

# Prompts of more characters than the context has tokens times this (about what a token of
# prose spells) are likely too long: they are tokenised one at a time, so that concurrent ones
# do not each hold their tokenisation's memory at once.
LIKELY_CHARS_PER_TOKEN = 4

_tokenising_long = threading.Lock()


def max_token_chars(loaded: LoadedModel) -> int:
    """The most characters one token of the model's tokenizer spells (once per model)."""
    cached = loaded.runtime.get("_max_token_chars")
    if cached is None:
        vocab = loaded.tokenizer.get_vocab()
        cached = loaded.runtime["_max_token_chars"] = max((len(t) for t in vocab), default=1)
    return int(cached)


def too_long(loaded: LoadedModel, req: GenerationRequest, tokens: int) -> RequestError:
    """The error of a prompt of `tokens` tokens that leaves no room in the model's context."""
    return RequestError(f"prompt is {tokens} tokens; model {loaded.id} takes at most "
                        f"{loaded.context_length - 1}",
                        "messages" if req.messages is not None else "prompt")


def prompt_tokens(loaded: LoadedModel, req: GenerationRequest) -> list[int]:
    """The prompt's token ids (a chat rendered by its template), once checked against the
    model's context: first its characters, without tokenising (a prompt that cannot fit is
    refused at the cost of counting them), then its tokens. RequestError for a prompt too
    long; the memory a refused prompt's tokens took goes back to the system."""
    chars = req.text_length
    limit = (loaded.context_length - 1) * max_token_chars(loaded) * CHARS_PER_TOKEN_MARGIN
    if chars > limit:
        raise RequestError(f"prompt is {chars} characters; model {loaded.id} takes at most "
                           f"{loaded.context_length - 1} tokens, which spell at most {limit}",
                           "messages" if req.messages is not None else "prompt")
    if chars <= loaded.context_length * LIKELY_CHARS_PER_TOKEN:
        return _checked(loaded, req)
    with _tokenising_long:
        return _checked(loaded, req)


def _checked(loaded: LoadedModel, req: GenerationRequest) -> list[int]:
    ids = _tokenise(loaded, req)
    n = len(ids)
    if n >= loaded.context_length:
        ids.clear()
        release_freed_memory()
        raise too_long(loaded, req, n)
    return ids


def _tokenise(loaded: LoadedModel, req: GenerationRequest) -> list[int]:
    tok = loaded.tokenizer  # mlx-lm's TokenizerWrapper
    if req.messages is not None:
        if not tok.has_chat_template:
            raise RequestError(f"model {loaded.id} has no chat template: send 'prompt'", "messages")
        messages, tools, opening = chat_tools(loaded, req)  # (tool_calls.py)
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                      **tools)
        if isinstance(ids, dict):  # some tokenizers return a BatchEncoding
            ids = ids["input_ids"]
        if opening:  # tool_choice forces a call: the reply starts inside it
            return list(ids) + list(tok.encode(opening, add_special_tokens=False))
        return list(ids)
    if req.prompt is None:
        raise RequestError("send 'messages' or 'prompt'", "prompt")
    # As mlx-lm does: add special tokens (BOS) unless the prompt already starts with BOS.
    bos = tok.bos_token
    add_special = bos is None or not req.prompt.startswith(bos)
    return list(tok.encode(req.prompt, add_special_tokens=add_special))


def _heap_release() -> Callable[[], object] | None:
    """The C library's call that hands freed heap memory back to the system, where it has
    one (glibc: malloc_trim; macOS: malloc_zone_pressure_relief)."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    if sys.platform == "darwin":
        relief = getattr(libc, "malloc_zone_pressure_relief", None)
        if relief is None:
            return None
        relief.argtypes = [ctypes.c_void_p, ctypes.c_size_t]  # (every zone, as much as it can)
        return lambda: relief(None, 0)
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]  # (keep no slack at the top of the heap)
    return lambda: trim(0)


_release = _heap_release()


def release_freed_memory() -> None:
    """Give the memory a refused prompt's tokenisation freed back to the system now. The C
    library keeps what a thread freed in that thread's arena, and the runner threads live as
    long as the model: without this each refused long prompt would stay in the node's RSS."""
    if _release is not None:
        _release()


# A head's prior acceptance is measured on held-out text (its card says so): it weighs as much as
# this many rounds, so that a few early misses (the opening of a story) do not switch it off for
# the whole request (the measurement behind it: docs/architecture.md).
MTP_PRIOR_WEIGHT = 8.0
# The head drafts nothing where its own probability of its guess is below this. Off (0) by
# default: the replay modelled 0.3 as a gain on every workload, but a one-thread A/B measured
# it 1-3% slower on code-edit and qa (docs/measurements/drafting.md, "The head's confidence").
MTP_MIN_CONFIDENCE = 0.0

# Beside a model drafter, lookup takes only matches of at least this many tokens: a one-token
# match on novel text is a worse bet than the head's draft (docs/architecture.md).
LOOKUP_MIN_KEY_WITH_MODEL = 2


def _lookup(loaded: LoadedModel, min_key: int = 1, memory: SuffixMemory | None = None,
            prompt: list[int] | None = None) -> SuffixDrafter | PromptLookup:
    """The model-free drafter: the suffix drafter (engine/drafting/suffix.py), or with the card's
    `[speculation.lookup] drafter = "scan"` the older n-gram scan (kept for the ablation)."""
    cfg = loaded.speculation.get("lookup", {})
    min_match = max(int(cfg.get("min_key", 1)), min_key)
    if cfg.get("drafter", "suffix") == "scan":
        return PromptLookup(max_key=cfg.get("max_key", 3), min_key=min_match)
    drafter = SuffixDrafter(min_match=min_match, memory=memory,
                            edits=bool(cfg.get("edits", True)))
    if prompt is not None:
        drafter.prepare(prompt)
    return drafter


# Depth and starting belief of the suffix drafter's controller: measured on echo, code-edit and
# agent, 16 and 0.8 beat 12 and 0.5 on all three (docs/architecture.md, "Constants that came
# from measurements"; python -m skulkp2p bench --workloads echo,code-edit,agent).
SUFFIX_MAX_DEPTH = 16
SUFFIX_PRIOR_ACCEPT = 0.8

# A prompt whose end matches this many tokens of an earlier request in the memory (a retried
# request, a templated one) starts lookup on even when the prompt itself does not repeat.
MEMORY_START_MATCH = 16


def _costs(loaded: LoadedModel) -> Mapping[int, float]:
    return loaded.width_costs or DEFAULT_WIDTH_COSTS.get(loaded.dtype, DEFAULT_WIDTH_COSTS[
        "bfloat16"])


def speculation_allowed(loaded: LoadedModel) -> bool:
    """The card's gate: `speculative_multi_node = false` (e.g. MoE models, where verifying k+1
    rows costs nearly k+1 expert reads) turns speculation off once the model spans nodes."""
    multi_node = (loaded.span is not None and not loaded.span.first) or (
        loaded.make_forward is not None)  # a ring's last stage, or a tensor-parallel group
    return not multi_node or bool(loaded.speculation.get("speculative_multi_node", True))


def drafts_sampled(loaded: LoadedModel, spec: Speculation) -> bool:
    """Whether a seeded sampled request's drafts would be drawn from a draft distribution q (a
    draft model, the Gemma assistant) rather than chosen deterministically (lookup, an MTP
    head, whose guesses are coupled to the target's draws; it draws from its q only where the
    request has no seed, and so no text to keep); a request that does not draft has none."""
    if spec.mode == "off":
        return False
    if spec.mode == "explicit":
        return spec.drafter in ("draft", "assistant")
    return loaded.mtp is None and (_assistant_usable(loaded) or loaded.draft is not None)


def _choose_drafter(loaded: LoadedModel, req: GenerationRequest, prompt: list[int],
                    rng: np.random.Generator, memory: SuffixMemory | None = None
                    ) -> tuple[Drafter | None, int, str | None]:
    """(drafter or None, depth, which trunk hidden state the forward must keep). `rng`: the
    request's sampler, which an MTP head reads ahead on a sampled request.

    An explicit drafter runs at the asked depth, ungated: the caller asked for it. "auto" wraps
    the available drafters in the gates: prompt lookup where it finds a match, and the model's
    own drafter (MTP head, else draft model) everywhere else.
    """
    spec = req.speculation
    if spec.mode == "off" or not speculation_allowed(loaded):
        return None, 0, None
    # A seeded sampled request must give the same text whatever ran before it and whatever
    # runs beside it. With deterministic drafts it does (decode.verify_one: plain sampling's own
    # draw decides), but drafts drawn from a q change the text, so such a request then neither
    # drafts from memory nor sizes its drafts by the batch.
    fixed_text = (req.sampling.greedy or req.sampling.seed is None
                  or not drafts_sampled(loaded, spec))
    if not fixed_text:
        memory = None
    if spec.mode == "explicit":
        if spec.drafter == "lookup":
            return _lookup(loaded, memory=memory, prompt=prompt), spec.depth or 4, None
        if spec.drafter == "mtp":
            if loaded.mtp is None:
                raise RequestError(f"model {loaded.id} has no MTP head (no mtp tensors and no "
                                   "sidecar)", "speculation")
            return _mtp_drafter(loaded, req, rng), spec.depth or loaded.mtp.conventions.max_depth, \
                loaded.mtp.conventions.hidden
        if spec.drafter == "assistant":
            return _assistant_drafter(loaded, req, explicit=True), spec.depth or \
                loaded.assistant.depth, "after"
        if loaded.draft is None:
            raise RequestError(f"model {loaded.id} has no draft model (card field "
                               "speculation.draft_model)", "speculation")
        return _draft_drafter(loaded, req), spec.depth or 3, None
    costs = _costs(loaded)
    weigh = fixed_text
    model_drafter: GatedDrafter | None = None
    model_depth, hidden = 0, None
    cfg = loaded.speculation.get("lookup", {})
    # Token trees (engine/model/tree.py) where the counts disagree (lookup) or the MTP head's top two
    # are close, when the card's `trees = true`: off by default, as on a quiet machine they
    # cost 3-5% against chains without accepting a token more (docs/measurements/token-trees.md;
    # python -m skulkp2p bench --arms spec_trees).
    trees = bool(cfg.get("trees", False))
    if loaded.mtp is not None:
        model_depth = loaded.mtp.conventions.max_depth
        prior = float(loaded.speculation.get("mtp_prior_acceptance", 0.5))
        model_drafter = GatedDrafter(_mtp_drafter(loaded, req, rng, mtp_min_confidence(loaded),
                                                  mtp_depth_confidence(loaded)), costs,
                                     model_depth, request_id=req.id,
                                     draft_cost=_relative_cost(loaded.mtp, loaded),
                                     prior_accept=prior, prior_weight=MTP_PRIOR_WEIGHT,
                                     weigh_batch=weigh, trees=trees)
        hidden = loaded.mtp.conventions.hidden
    elif _assistant_usable(loaded):
        model_depth = loaded.assistant.depth
        model_drafter = GatedDrafter(
            _assistant_drafter(loaded, req), costs, model_depth, request_id=req.id,
            # against a step of the whole target (a ring's last stage holds only its layers)
            draft_cost=loaded.assistant.weights_per_pass() / max(
                loaded.whole_params or _param_count(loaded.model), 1))
        hidden = "after"
    elif loaded.draft is not None:
        model_depth = int(loaded.speculation.get("draft_max_depth", 4))
        model_drafter = GatedDrafter(_draft_drafter(loaded, req), costs, model_depth,
                                     request_id=req.id,
                                     draft_cost=_relative_cost(loaded.draft.model, loaded),
                                     weigh_batch=weigh)
    if not cfg.get("enabled", True):
        return model_drafter, model_depth, hidden
    # The suffix drafter caps each draft at its match length, so it may go deep where a long
    # match says so; the scan keeps its old settings (docs/architecture.md, measured constants).
    scan = cfg.get("drafter", "suffix") == "scan"
    depth = int(cfg.get("max_depth", 6 if scan else SUFFIX_MAX_DEPTH))
    # Prompt gate: alone, lookup starts on when the prompt repeats itself (code, quoted text);
    # on novel prompts it starts off and comes back only if the output turns repetitive. The
    # 0.02 default sits between code edits and novel questions (docs/architecture.md).
    alone = model_drafter is None
    # Beside a model drafter (with lookup.edits, the default) lookup starts on whatever the
    # prompt: the head drafts every round lookup has no match of 2+ tokens for, so a lookup
    # that is on costs nothing where it finds nothing, and on novel answers that quote their
    # question it drafts runs the head cannot (on qa the gate kept lookup off through rounds
    # with a copy of 2+ tokens: docs/architecture.md, "Drafting edits").
    # Alone, the gate stays: its rounds would otherwise run pipelined (quiet stretches).
    edits = bool(cfg.get("edits", True))
    default_gate = 0.02 if alone or not edits else 0.0
    start_on = repetition_score(prompt) >= float(cfg.get("min_repetition", default_gate))
    inner = _lookup(loaded, 1 if alone else LOOKUP_MIN_KEY_WITH_MODEL, memory, prompt)
    start_on = start_on or (isinstance(inner, SuffixDrafter)
                            and inner.memory_match >= MEMORY_START_MATCH)
    prior = float(cfg.get("prior_acceptance", 0.5 if scan else SUFFIX_PRIOR_ACCEPT))
    lookup = GatedDrafter(inner, costs, depth, start_on=start_on, can_return=True,
                          request_id=req.id, prior_accept=prior, weigh_batch=weigh,
                          trees=trees)
    if model_drafter is None:
        return lookup, depth, None
    # Both: lookup where it matches, the model's drafter elsewhere (gates.LookupThenModel).
    return LookupThenModel(lookup, model_drafter), max(depth, model_depth), hidden


def _param_count(module: nn.Module) -> int:
    return sum(v.size for v in leaves(module.parameters()))


def _relative_cost(drafter_module: nn.Module, loaded: LoadedModel) -> float:
    """A drafter's per-token cost relative to a trunk step, from weights read per token (decode
    on these machines is bound by reading weights). An MTP head shares the trunk's lm_head,
    which it reads once per draft too."""
    key = id(drafter_module)
    cache = loaded.runtime.setdefault("_draft_costs", {})
    if key not in cache:
        from skulkp2p.engine.model.trunk import Trunk
        trunk = Trunk(loaded.model)
        own = _param_count(drafter_module)
        if drafter_module is loaded.mtp and trunk.tied:
            # The shared head is read again per draft: only its draft-vocabulary rows when the
            # head drafts over a reduced vocabulary.
            rows = loaded.mtp.vocab_ids
            weight = trunk.embed_tokens.weight
            own += weight.size if rows is None else len(rows) * weight.shape[-1]
        cache[key] = own / max(loaded.whole_params or _param_count(loaded.model), 1)
    return cache[key]


def mtp_min_confidence(loaded: LoadedModel) -> float:
    """The head drafts only where it gives its guess at least this probability (the card's
    `speculation.mtp_min_confidence`, default MTP_MIN_CONFIDENCE)."""
    return float(loaded.speculation.get("mtp_min_confidence", MTP_MIN_CONFIDENCE))


def mtp_depth_confidence(loaded: LoadedModel) -> float:
    """Past its first draft the head goes deeper only while it gives each deeper guess at
    least this probability (the card's `speculation.mtp_depth_confidence`; 0: off)."""
    return float(loaded.speculation.get("mtp_depth_confidence", 0.0))


def _mtp_drafter(loaded: LoadedModel, req: GenerationRequest, rng: np.random.Generator,
                 min_confidence: float = 0.0, depth_confidence: float = 0.0) -> MtpDrafter:
    """`min_confidence`, `depth_confidence`: 0 for an explicit drafter (the caller asked for
    its drafts, as deep as it asked). A seeded sampled request's head guesses with the exponentials
    of `rng`, the request's sampler (sampling.Coupling), so its text is plain sampling's; an
    unseeded one's draws from the head's q and hands q to the verifier (sampling.DraftDraws),
    which keeps more of its drafts."""
    from skulkp2p.engine.drafting.mtp_drafter import MtpDrafter
    sampling = req.sampling
    coupling = draws = None
    if not sampling.greedy:
        if sampling.seed is not None:
            coupling = Coupling(sampling, rng)
        else:
            draws = DraftDraws(sampling, make_rng(None))
    return MtpDrafter(loaded.mtp,
                      context_bias=float(loaded.speculation.get("mtp_context_bias", 0.0)),
                      min_confidence=min_confidence, depth_confidence=depth_confidence,
                      coupling=coupling, draws=draws)


def _assistant_usable(loaded: LoadedModel) -> bool:
    # The assistant reads the target's caches of two mid-stack layers: it runs where they are,
    # on one node or on a ring's last stage (placement keeps them there: last_stage_from;
    # load_assistant refuses a stage that lacks them, so a loaded one can run).
    return loaded.assistant is not None


def _assistant_drafter(loaded: LoadedModel, req: GenerationRequest, explicit: bool = False
                       ) -> AssistantDrafter:
    from skulkp2p.engine.drafting.assistant import AssistantDrafter, explicit_unavailable
    if explicit and not _assistant_usable(loaded):
        if loaded.speculation.get("drafter") == "assistant":  # paired, but not loaded here
            raise RequestError(f"model {loaded.id}: the assistant drafter runs on one node or "
                               "a pipeline ring's last stage, not on a tensor-parallel group",
                               "speculation")
        raise explicit_unavailable(loaded.id)
    return AssistantDrafter(loaded.assistant, req.sampling, make_rng(
        None if req.sampling.seed is None else req.sampling.seed + 1))


def _draft_drafter(loaded: LoadedModel, req: GenerationRequest) -> DraftModelDrafter:
    # Tokenizers were checked once when the draft model loaded (loader.open_model).
    assert loaded.draft is not None  # (the callers asked)
    return DraftModelDrafter(loaded.draft, req.sampling, make_rng(
        None if req.sampling.seed is None else req.sampling.seed + 1),
        target_vocab=vocab_size(loaded.model))


def constraint(loaded: LoadedModel, req: GenerationRequest) -> Grammar | None:
    """The request's grammar matcher (a structured output, or tool calls held to the model's
    call format), or None for free text. The tokenizer's bridge to llguidance is built once
    per model."""
    fmt = model_tools(loaded)[0] if req.uses_tools else None
    calls = fmt if fmt is not None and fmt.json_object else None
    if calls is None and req.uses_tools and req.response_format.constrained:
        raise RequestError(f"model {loaded.id}: a response format with tools needs a tool "
                           "format the call grammar knows (json_tools)", "response_format")
    if calls is None and not req.response_format.constrained:
        return None
    bridge = loaded.runtime.get("_grammar_tokenizer")
    if bridge is None:
        tok = loaded.tokenizer
        hf = getattr(tok, "_tokenizer", tok)  # (mlx-lm's TokenizerWrapper holds the HF one)
        try:
            bridge = loaded.runtime["_grammar_tokenizer"] = tokenizer_bridge(
                hf, vocab_size(loaded.model), sorted(tok.eos_token_ids))
        except RequestError:
            if req.response_format.constrained:
                raise
            return None  # (no grammar for this tokenizer: calls are parsed as they come)
    matcher: Grammar
    if calls is not None:
        # Tool calls held to their format (lazy: free until a call opens, tool_grammar.py).
        matcher = tool_grammar(bridge, vocab_size(loaded.model),
                               CallFormat(calls.start, calls.end), req.tools,
                               req.tool_choice.mode, req.tool_choice.name,
                               forced_opening(calls, req), req.response_format)
    else:
        matcher = Grammar(bridge, compile_format(req.response_format), vocab_size(loaded.model))
    return matcher


def _mtp_in(drafter: Drafter | None) -> MtpDrafter | None:
    """The MTP head drafter inside a (gated, combined) drafter, or None."""
    from skulkp2p.engine.drafting.mtp_drafter import MtpDrafter

    if isinstance(drafter, LookupThenModel):
        drafter = drafter.model
    if isinstance(drafter, GatedDrafter):
        drafter = drafter.inner
    return drafter if isinstance(drafter, MtpDrafter) else None


class _PrefixUse:
    """One request's use of the model's prefix cache (engine/cache/prefix_cache.py): restore the
    longest cached prefix of the prompt before the prefill, keep the caches at the end of the
    prompt when they cannot trim back to it later, and at the end of the request."""

    def __init__(self, cache: PrefixCache, forward: Forward, mtp: MtpDrafter | None,
                 caches_trim: bool, persist: bool = True, read: RawEntry | None = None):
        self.cache = cache
        self.read = read  # the entry on disk read ahead, off the model's lock (or None)
        self.persist = persist  # its entries may go to disk (the request did not say no)
        self.forward = forward
        # Whether every stage's caches trim (on a ring, other stages may hold recurrent state
        # even where this one holds none): else entries serve their own length only.
        self.trim = caches_trim and caches.exactly_trimmable(forward.cache)
        self.mtp = mtp  # the request's MTP head drafter: its cache is restored and kept too
        self.held = 0  # prompt tokens restored

    def restore(self, prompt: list[int]) -> int:
        hit = self.cache.fetch(prompt, mtp=self.mtp is not None, read=self.read)
        self.read = None  # (its host buffers: not kept past the restore)
        if hit is None:
            self.held = 0
            return 0
        self.held = self.forward.restore(hit.caches, prompt[:hit.length],
                                         prompt[:hit.length + 1])
        if self.held and self.mtp is not None:
            self.mtp.restore(hit.mtp, hit.mtp_hidden)
        return self.held

    def after_prefill(self, prompt: list[int]) -> None:
        # Trimmable caches are kept at the end of the request only: that entry serves this
        # prompt too (trimmed). Recurrent state is kept here, at the prompt's boundary (unless
        # the entry restored was this very prompt's).
        if not self.trim and self.held < len(prompt) - 1:
            self.keep(prompt)

    def keep(self, key: list[int]) -> None:
        mtp = self.mtp
        if mtp is not None:
            mtp.catch_up()  # the rows it skipped while switched off, in one call
        # A tensor group's ranks keep their slices now (none elsewhere: 0).
        elsewhere = self.forward.keep_in_group(key, self.persist)
        if elsewhere is None:
            return  # some rank could not keep its slice: no entry (a hit would miss there)
        self.cache.store(key, self.forward.cache, None if mtp is None else mtp.cache,
                         None if mtp is None else mtp.last_hidden_row, trim=self.trim,
                         elsewhere_bytes=elsewhere, persist=self.persist)
        # a ring: the other stages keep theirs too
        self.forward.share_store(key, self.persist)


def stream(loaded: LoadedModel, req: GenerationRequest,
           interrupt: Callable[[], None] | None = None,
           prefix_cache: PrefixCache | None = None, prompt: list[int] | None = None,
           memory: SuffixMemory | None = None,
           make_forward: Callable[[str | None, Callable[[], None] | None], Forward] | None = None,
           prefix_read: RawEntry | None = None
           ) -> Generator[Chunk, None, GenerationResult]:
    """Yield chunks as tokens are decoded; return the GenerationResult (finish reason, usage,
    timing, speculation stats) when done.

    `interrupt` is called between prefill chunks and between decoded tokens; it raises (any
    exception, which propagates) to abandon the request, e.g. when an HTTP client went away.
    `prefix_cache`: the model's prefix cache (None: off), used by one request at a time.
    `prompt`: the prompt's token ids, when the caller has them (default: from the request).
    `make_forward(hidden, interrupt)`: the forward to decode on (a row of a batch,
    engine/batching/scheduler.py); default a LocalForward of its own, or the ring's.
    `prefix_read`: the prefix cache's entry on disk for this prompt, read ahead off the model's
    lock (`PrefixCache.read_ahead`): the restore only installs it."""
    t0 = time.perf_counter()
    prompt = list(prompt) if prompt is not None else prompt_tokens(loaded, req)
    if len(prompt) >= loaded.context_length:
        raise too_long(loaded, req, len(prompt))
    if interrupt is not None:  # (cancelled before it started: nothing runs)
        interrupt()
    default_max = int(loaded.runtime.get("max_tokens", 256))
    max_tokens = min(req.max_tokens or default_max, loaded.context_length - len(prompt))
    rng = make_rng(req.sampling.seed)
    drafter, depth, hidden = _choose_drafter(loaded, req, prompt, rng, memory)
    grammar = constraint(loaded, req)
    stats = DecodeStats()
    eos = set() if req.ignore_eos else set(loaded.tokenizer.eos_token_ids)
    text = TextAssembler(loaded.tokenizer, req.stop)
    forward: Forward
    if make_forward is not None:
        forward = make_forward(hidden, interrupt)
    elif loaded.make_forward is not None:
        forward = loaded.make_forward(req, hidden, interrupt)
    else:
        forward = LocalForward(loaded.model, int(loaded.runtime.get("prefill_step", 2048)),
                               hidden=hidden, interrupt=interrupt)
    calls: ToolCallStream | None = tool_stream(loaded, req)  # None without tools
    prefix = None if prefix_cache is None else _PrefixUse(prefix_cache, forward,
                                                             _mtp_in(drafter), loaded.caches_trim,
                                                             req.disk_cache, prefix_read)
    cached = prefix.restore(prompt) if prefix is not None else 0
    if cached:
        log.debug("prefix cache: %d of %d prompt tokens restored", cached, len(prompt))
    # The prompt and every token emitted, when the prefix cache keeps the caches at the end.
    history: list[int] | None = None if prefix is None else []
    generated: list[int] = []
    finish = "length"
    t_first = None
    steps = decode(forward, prompt, req.sampling, max_tokens, rng, drafter, depth, stats,
                   cached=cached, history=history,
                   on_prefill=None if prefix is None else lambda: prefix.after_prefill(prompt),
                   interrupt=interrupt, grammar=grammar)
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
            if calls is None:
                yield Chunk(text.add(token), [token])
            else:
                yield from calls.chunks(text.add(token), [token])
            if text.stopped or (calls is not None and calls.done):
                finish = "stop"
                break
        if prefix is not None and history is not None:
            # Once the loop is closed (pipelined plain greedy takes back its step ahead), the
            # caches hold all of history but its pending last token: the next turn of a
            # conversation (this prompt, this answer, more) starts there.
            steps.close()
            try:
                prefix.keep(history)
            except Exception:  # the answer is complete: a cache that failed must not fail it
                log.exception("prefix cache: keeping the request's caches failed")
    finally:
        steps.close()
        forward.close()  # a ring frees the request's caches on the other stages
    tail = text.finish()
    if calls is not None:
        yield from calls.finish(tail)
    elif tail:
        yield Chunk(tail, [])
    t_end = time.perf_counter()
    decode_s = (t_end - t_first) if t_first else 0.0
    timing = Timing(
        ttft_s=round((t_first or t_end) - t0, 4), total_s=round(t_end - t0, 4),
        decode_tok_s=round((len(generated) - 1) / decode_s, 2) if decode_s > 0 and len(
            generated) > 1 else None)
    done = GenerationResult(text=text.text, tokens=generated, finish_reason=finish,
                            usage=Usage(len(prompt), len(generated), cached), timing=timing,
                            speculation=_speculation_stats(drafter, depth, stats),
                            stop_sequence=text.stop_sequence)
    return done if calls is None else calls.result(done)  # the calls, the text beside them


def _speculation_stats(drafter: Drafter | None, depth: int, stats: DecodeStats
                       ) -> SpeculationStats | None:
    if drafter is None:
        return None
    gated = isinstance(drafter, GatedDrafter | LookupThenModel)
    events = list(drafter.events) if isinstance(drafter, GatedDrafter | LookupThenModel) else []
    by_drafter = None
    if isinstance(drafter, LookupThenModel):
        by_drafter = {name: DrafterCounts(**c) for name, c in drafter.counts().items()}
    return SpeculationStats(
        drafter=drafter.name, mode="auto" if gated else "explicit",
        drafted=stats.drafted, accepted=stats.accepted, max_depth=depth, rounds=stats.rounds,
        acceptance_per_position=[round(a / d, 4) if d else None for a, d in
                                 zip(stats.accepted_at, stats.drafted_at, strict=True)],
        drafted_per_position=list(stats.drafted_at),
        accepted_per_position=list(stats.accepted_at),
        gate_fired=bool(events), gate_events=events, by_drafter=by_drafter,
        tree_rounds=stats.tree_rounds)


def run(loaded: LoadedModel, req: GenerationRequest,
        interrupt: Callable[[], None] | None = None) -> GenerationResult:
    """Generate to the end; the typed result."""
    steps = stream(loaded, req, interrupt)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
