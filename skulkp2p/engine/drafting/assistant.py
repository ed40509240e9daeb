"""The Gemma 4 assistant: Google's small drafter that attends into the target's own cache.

Google publishes a `gemma-4-*-it-assistant` beside each Gemma 4 target (E2B, E4B, 12B, 26B-A4B,
31B). It is not a model with a cache of its own: four decoder layers (sliding x3, full) that
project queries only and attend over the K/V the target stored in its last cache-owning
full-attention layer and its last cache-owning sliding-window layer. One pass drafts one token;
a round runs k passes (facts read in mlx-vlm's `speculative/drafters/gemma4_assistant`,
transformers' `models/gemma4_assistant` and Skulk's drafter; docs/architecture.md):

* input of a pass: concat(target embedding of the token x sqrt(target hidden), carried hidden)
  -> `pre_projection`; the first carried hidden is the target's final-norm hidden at the last
  position in its cache (the row whose logits chose the pending token);
* after the layers: `model.norm`; `post_projection` gives the next carried hidden, the output
  head gives logits: tied to the assistant's own `model.embed_tokens` (large assistants), or a
  centroid head on E2B/E4B (`masked_embedding`: score centroids, keep the top clusters' tokens,
  every other token gets the smallest kept logit minus one);
* the queries sit at one position for all k passes of a round: the last position in the
  target's cache (`query_position = "last"`, what mlx-vlm and Skulk use now; "next", one
  further, is what mlx-vlm used first and is kept to measure), and see every cached key (the
  sliding layer: those within the window of that position).

The decoder layers are mlx-lm's own `gemma4_text.DecoderLayer` (whose attention takes
`shared_kv=` and `offset=`), built from the assistant's nested `text_config` with every layer
KV-shared, so its tensor names are the published checkpoints' and they load unchanged.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import RotatingKVCache

from skulkp2p.engine.cache.caches import CacheEntry
from skulkp2p.engine.decode.sampling import (
    SamplingParams,
    as_tokens,
    greedy_token,
    process_logits,
    sample_from,
    target_probs,
)
from skulkp2p.engine.drafting.drafter import InnerDrafter
from skulkp2p.engine.model.arrays import materialize
from skulkp2p.engine.model.trunk import Trunk
from skulkp2p.engine.request import RequestError

if TYPE_CHECKING:
    from mlx_lm.models.gemma4_text import ModelArgs as Gemma4TextArgs

    from skulkp2p.engine.model.forward import Forward

log = logging.getLogger("skulkp2p.engine")

MODEL_TYPES = ("gemma4_assistant", "gemma4_unified_assistant")
QUERY_POSITIONS = ("last", "next")
FULL, SLIDING = "full_attention", "sliding_attention"


class AssistantError(ValueError):
    """An assistant that cannot be loaded, or does not fit its target; names the field."""


@dataclass(frozen=True)
class AssistantConfig:
    model_type: str
    backbone_hidden_size: int
    use_ordered_embeddings: bool
    num_centroids: int
    centroid_top_k: int
    tie_word_embeddings: bool
    text: Gemma4TextArgs  # every layer KV-shared
    quantization: dict[str, Any] | None = None


def _field(config: dict[str, Any], key: str, kind: type, where: str = "") -> Any:
    if key not in config:
        raise AssistantError(f"assistant config: missing field '{where}{key}'")
    value = config[key]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise AssistantError(f"assistant config: field '{where}{key}' must be an integer, "
                             f"got {value!r}")
    return value


def read_config(path: Path) -> AssistantConfig:
    """The assistant's config.json, checked: model type, backbone width, head kind, nested
    text config (gemma4_text, every layer KV-shared, only sliding and full layers)."""
    from mlx_lm.models.gemma4_text import ModelArgs

    file = Path(path) / "config.json"
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise AssistantError(f"assistant {path}: cannot read config.json: {e}") from None
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise AssistantError(f"assistant {path}: field 'model_type' must be one of "
                             f"{', '.join(MODEL_TYPES)}, got {model_type!r}")
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise AssistantError(f"assistant {path}: missing field 'text_config'")
    n_layers = _field(text, "num_hidden_layers", int, "text_config.")
    for key in ("hidden_size", "num_attention_heads", "head_dim", "vocab_size"):
        _field(text, key, int, "text_config.")
    text = dict(text)
    # Every layer reads the target's K/V (transformers sets this when the file leaves it out);
    # no per-layer inputs, no experts: the checkpoints hold neither.
    text.update(num_kv_shared_layers=n_layers, hidden_size_per_layer_input=0,
                enable_moe_block=False)
    args = ModelArgs.from_dict(text)
    bad = [t for t in args.layer_types if t not in (FULL, SLIDING)]
    if bad or len(args.layer_types) != n_layers:
        raise AssistantError(f"assistant {path}: field 'text_config.layer_types' must list "
                             f"{n_layers} of {FULL}/{SLIDING}, got {args.layer_types!r}")
    ordered = bool(config.get("use_ordered_embeddings", False))
    centroids = int(config.get("num_centroids", 2048))
    top_k = int(config.get("centroid_intermediate_top_k", 32))
    if ordered and (centroids <= 0 or args.vocab_size % centroids or not 0 < top_k <= centroids):
        raise AssistantError(f"assistant {path}: fields 'num_centroids' ({centroids}) and "
                             f"'centroid_intermediate_top_k' ({top_k}) must split "
                             f"text_config.vocab_size ({args.vocab_size}) evenly")
    return AssistantConfig(
        model_type=model_type,
        backbone_hidden_size=_field(config, "backbone_hidden_size", int),
        use_ordered_embeddings=ordered, num_centroids=centroids, centroid_top_k=top_k,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)), text=args,
        quantization=config.get("quantization"))


class _Body(nn.Module):
    """`model.*`: the output embedding, the decoder layers, the final norm."""

    def __init__(self, args: Any):
        super().__init__()
        from mlx_lm.models.gemma4_text import DecoderLayer

        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


def _rows(embedding: nn.Module, ids: mx.array) -> mx.array:
    """Rows `ids` of an embedding (or linear) weight, as floats."""
    if isinstance(embedding, nn.QuantizedEmbedding | nn.QuantizedLinear):
        # quantized: gather the packed rows, then dequantize them
        biases = embedding.biases
        return mx.dequantize(embedding.weight[ids], embedding.scales[ids],
                             None if biases is None else biases[ids],
                             embedding.group_size, embedding.bits)
    return embedding.weight[ids]


class CentroidHead(nn.Module):
    """`masked_embedding.*` of the E2B/E4B assistants: `centroids` scores clusters of tokens,
    `token_ordering` lists each cluster's token ids (vocab / centroids per cluster); only the
    top clusters' tokens are scored against the embedding."""

    def __init__(self, config: AssistantConfig):
        super().__init__()
        args = config.text
        self.top_k = config.centroid_top_k
        self.per_cluster = args.vocab_size // config.num_centroids
        self.num_centroids = config.num_centroids
        self.centroids = nn.Linear(args.hidden_size, config.num_centroids, bias=False)
        self.token_ordering = mx.zeros((args.vocab_size,), dtype=mx.int32)
        self.freeze(keys="token_ordering", recurse=False)  # an index buffer, not a weight

    def candidates(self, h: mx.array, embedding: nn.Module) -> tuple[mx.array, mx.array]:
        """(token ids [n], their logits [n]) of the top clusters for one row h [d]; only those
        rows of the embedding are read (dequantized row by row when it is quantized)."""
        scores = self.centroids(h)
        top = mx.argpartition(scores, kth=-self.top_k, axis=-1)[-self.top_k:]
        ids = self.token_ordering.reshape(self.num_centroids, self.per_cluster)[top].reshape(-1)
        return ids, _rows(embedding, ids) @ h

    def logits(self, h: mx.array, embedding: nn.Module, vocab: int) -> mx.array:
        """A full row [V]: the candidates' logits, every other token the smallest minus one."""
        ids, values = self.candidates(h, embedding)
        row = mx.full((vocab,), values.min() - 1.0, dtype=values.dtype)
        row[ids] = values
        return row


class AssistantModel(nn.Module):
    """The assistant's weights under the published names: `pre_projection`, `post_projection`,
    `model.{embed_tokens, layers.*, norm}`, `lm_head` when untied, `masked_embedding.*`."""

    def __init__(self, config: AssistantConfig):
        super().__init__()
        args = config.text
        self.config = config
        self.model = _Body(args)
        self.pre_projection = nn.Linear(2 * config.backbone_hidden_size, args.hidden_size,
                                        bias=False)
        self.post_projection = nn.Linear(args.hidden_size, config.backbone_hidden_size,
                                         bias=False)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if config.use_ordered_embeddings:
            self.masked_embedding = CentroidHead(config)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        out = {}
        for name, value in weights.items():
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # a tied copy some exports keep
            if name == "masked_embedding.token_ordering":
                value = value.astype(mx.int32)  # stored as int64
            out[name] = value
        return out

    def output_layer(self) -> nn.Module:
        """The module whose weight rows are the output embedding (tied or not)."""
        return self.model.embed_tokens if self.config.tie_word_embeddings else self.lm_head

    def step(self, x: mx.array, kv: dict[str, tuple[mx.array, mx.array]],
             masks: dict[str, mx.array | None], position: mx.array) -> tuple[mx.array, mx.array]:
        """One pass over x [1, 1, 2*Hb]: (next carried hidden [1, 1, Hb], normed rows
        [1, 1, d] for the output head)."""
        h = self.pre_projection(x)
        for layer in self.model.layers:
            h, _, _ = layer(h, masks[layer.layer_type], None, shared_kv=kv[layer.layer_type],
                            offset=position)
        h = self.model.norm(h)
        return self.post_projection(h), h

    def head_logits(self, h: mx.array) -> mx.array:
        """Logits [1, V] of one normed row h [d]."""
        if self.config.use_ordered_embeddings:
            return self.masked_embedding.logits(h, self.output_layer(),
                                                self.config.text.vocab_size)[None]
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)[None]
        return self.lm_head(h)[None]

    def greedy(self, h: mx.array) -> mx.array:
        """The argmax token of one row without a full-vocabulary row (centroid head)."""
        if self.config.use_ordered_embeddings:
            ids, values = self.masked_embedding.candidates(h, self.output_layer())
            return ids[mx.argmax(values)]
        return mx.argmax(self.head_logits(h)[0])


@dataclass(frozen=True)
class TargetView:
    """What the assistant reads of the target: which cache entries (one per cache-owning layer,
    in layer order) hold the K/V it attends to, the sliding window, the input embedding."""
    full_index: int  # the last cache-owning full-attention layer
    sliding_index: int  # the last cache-owning sliding-window layer
    window: int  # the assistant's sliding window (its masks; mlx-vlm and transformers use it)
    embed_tokens: nn.Module
    embed_scale: float


def target_view(model: nn.Module, window: int | None = None, first_layer: int = 0) -> TargetView:
    """`first_layer`: where the target's layers start here (a ring's last stage holds layers
    from there on, and its cache list starts there)."""
    trunk = Trunk(model)
    # (any family's mlx-lm model: these config fields exist on Gemma 4's only)
    args = getattr(trunk.text, "args", None)
    types = list(getattr(args, "layer_types", None) or [])
    owners = len(types) - int(getattr(args, "num_kv_shared_layers", 0) or 0)
    if (args is None or getattr(args, "model_type", None) != "gemma4_text" or not types
            or owners <= 0):
        raise AssistantError("the Gemma 4 assistant drafts for a Gemma 4 target (gemma4_text, "
                             f"or gemma4 with a text_config); this model is "
                             f"{getattr(args, 'model_type', type(model).__name__)!r}")
    last = {t: i for i, t in enumerate(types[:owners])}
    if FULL not in last or SLIDING not in last:
        raise AssistantError("target: the assistant needs a cache-owning full-attention and a "
                             f"sliding-window layer; its owners are {types[:owners]}")
    if min(last[FULL], last[SLIDING]) < first_layer:
        raise AssistantError(f"target: this stage holds layers from {first_layer} on, but the "
                             f"assistant reads layers {last[FULL]} and {last[SLIDING]}")
    return TargetView(last[FULL] - first_layer, last[SLIDING] - first_layer,
                      int(window or args.sliding_window),
                      trunk.embed_tokens, float(trunk.body.embed_scale))


def check_pair(config: AssistantConfig, target_args: Gemma4TextArgs, where: str = "assistant"
               ) -> None:
    """Refuse an assistant made for another target, naming the first field that differs."""
    a = config.text
    t = target_args

    def differ(field: str, mine: object, theirs: object, target_field: str) -> None:
        if mine != theirs:
            raise AssistantError(f"{where} does not fit this target: {field} = {mine} but the "
                                 f"target's {target_field} = {theirs}")

    differ("backbone_hidden_size", config.backbone_hidden_size, t.hidden_size, "hidden_size")
    differ("text_config.vocab_size", a.vocab_size, t.vocab_size, "vocab_size")
    differ("text_config.head_dim", a.head_dim, t.head_dim, "head_dim")
    differ("text_config.global_head_dim", a.global_head_dim or a.head_dim,
           t.global_head_dim or t.head_dim, "global_head_dim")
    differ("text_config.num_attention_heads", a.num_attention_heads, t.num_attention_heads,
           "num_attention_heads")
    kv_heads = {t.num_key_value_heads}
    if t.attention_k_eq_v and t.num_global_key_value_heads:
        kv_heads.add(t.num_global_key_value_heads)
    for n in sorted(kv_heads):
        if a.num_attention_heads % n:
            raise AssistantError(f"{where} does not fit this target: "
                                 f"text_config.num_attention_heads = {a.num_attention_heads} is "
                                 f"no multiple of the target's {n} key/value heads")


def _safetensors(path: Path) -> list[Path]:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise AssistantError(f"assistant {path}: no *.safetensors files")
    return files


@dataclass
class LoadedAssistant:
    path: Path
    config: AssistantConfig
    model: AssistantModel
    view: TargetView
    block_size: int  # tokens per round as mlx-vlm counts them: the verified one + drafts
    query_position: str = "last"

    @property
    def depth(self) -> int:
        return max(1, self.block_size - 1)

    def weights_per_pass(self) -> int:
        """Parameters one pass reads (decode is bound by reading weights): the layers and
        projections, and of the output embedding only the candidates' rows with a centroid head
        (the centroids too) or all of it with a dense head."""
        from mlx.utils import tree_flatten

        config = self.config
        head = {"model.embed_tokens.weight", "lm_head.weight", "masked_embedding.token_ordering"}
        # (tree_flatten gives a dict only when handed one to fill)
        named = cast(list[tuple[str, mx.array]], tree_flatten(self.model.parameters()))
        own = sum(v.size for name, v in named
                  if name.split(".scales")[0].split(".biases")[0] not in head
                  and not name.startswith(("model.embed_tokens.", "lm_head.")))
        rows = config.text.vocab_size
        if config.use_ordered_embeddings:
            rows = config.centroid_top_k * (config.text.vocab_size // config.num_centroids)
        return own + rows * config.text.hidden_size


def load_assistant(path: Path, target: nn.Module, dtype: mx.Dtype | None = None,
                   block_size: int = 4, query_position: str = "last", first_layer: int = 0
                   ) -> LoadedAssistant:
    """Load the assistant at `path` for `target` (checked to fit), in the target's dtype;
    `first_layer`: the target's first layer here (a ring's last stage)."""
    path = Path(path)
    if query_position not in QUERY_POSITIONS:
        raise AssistantError(f"query position must be one of {', '.join(QUERY_POSITIONS)}, got "
                             f"{query_position!r}")
    config = read_config(path)
    view = target_view(target, config.text.sliding_window, first_layer)
    check_pair(config, Trunk(target).text.args, f"assistant {path}")
    model = AssistantModel(config)
    weights: dict[str, mx.array] = {}
    for file in _safetensors(path):
        tensors = mx.load(str(file))
        assert isinstance(tensors, dict)  # (safetensors, no metadata asked for)
        weights.update(tensors)
    weights = model.sanitize(weights)
    if config.quantization:
        q = config.quantization
        nn.quantize(model, group_size=q["group_size"], bits=q["bits"],
                    class_predicate=lambda p, m: f"{p}.scales" in weights)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise AssistantError(f"assistant {path}: its tensors do not match a "
                             f"{config.model_type}: {e}") from None
    if dtype is not None:
        ordering = model.masked_embedding.token_ordering if config.use_ordered_embeddings \
            else None
        model.set_dtype(dtype)
        if ordering is not None:
            model.masked_embedding.token_ordering = ordering  # indices stay integers
    materialize(model)
    log.info("assistant %s loaded (%s, %s head, %d layers, block size %d)", path,
             config.model_type, "centroid" if config.use_ordered_embeddings else "dense",
             config.text.num_hidden_layers, block_size)
    return LoadedAssistant(path, config, model, view, block_size, query_position)


class _Attention(CacheEntry, Protocol):
    """A target layer's attention cache (mlx-lm's KVCache, or a RotatingKVCache)."""
    keys: mx.array | None
    values: mx.array | None
    offset: int


def _attention(cache: Sequence[CacheEntry], index: int) -> _Attention:
    # (a layer the view names is an attention layer: target_view found it by its layer type)
    return cast(_Attention, cache[index])


def _time_ordered(entry: _Attention) -> tuple[mx.array, mx.array]:
    """A cache entry's keys and values as stored, oldest first: a rotating cache's buffer may
    have wrapped (its `_temporal_order` is mlx-lm's own reordering)."""
    if entry.keys is None or entry.values is None:
        raise ValueError("the target's cache is empty")
    if not isinstance(entry, RotatingKVCache):
        return entry.keys[..., :entry.offset, :], entry.values[..., :entry.offset, :]
    return entry._temporal_order(entry.keys), entry._temporal_order(entry.values)


def shared_kv(view: TargetView, cache: Sequence[CacheEntry], position: int
              ) -> tuple[dict[str, tuple[mx.array, mx.array]], dict[str, mx.array | None]]:
    """The K/V the assistant attends over, read from the target's live cache, and its masks:
    full attention sees every cached key; sliding attention the keys within the window of the
    query position on either side (the published assistants' bidirectional window)."""
    full = _attention(cache, view.full_index)
    sliding = _attention(cache, view.sliding_index)
    kv = {FULL: _time_ordered(full), SLIDING: _time_ordered(sliding)}
    n = kv[SLIDING][0].shape[2]
    first = sliding.offset - n  # the position of the oldest key the sliding cache holds
    mask = None
    if position - first >= view.window:
        keys_at = mx.arange(first, sliding.offset)
        mask = (mx.abs(position - keys_at) < view.window)[None, None, None, :]
    return kv, {FULL: None, SLIDING: mask}


def assistant_pass(assistant: LoadedAssistant, token: mx.array, carry: mx.array, kv: dict,
                   masks: dict, position: mx.array) -> tuple[mx.array, mx.array]:
    """One pass: the target's scaled embedding of `token` [1] beside the carried row [1, 1, Hb]
    -> (next carried row, normed row for the head)."""
    view = assistant.view
    emb = view.embed_tokens(token[None]) * view.embed_scale
    return assistant.model.step(mx.concatenate([emb, carry.astype(emb.dtype)], axis=-1), kv,
                                masks, position)


class AssistantDrafter(InnerDrafter):
    """A drafter (engine/drafting/drafter.py) over a loaded assistant: k passes per round, one token
    each, reading the forward's live caches (after the loop's rollback, so no draft ever reads
    K/V that a rejection undid). Needs the forward's hidden rows after the final norm."""

    name = "assistant"

    def __init__(self, assistant: LoadedAssistant, params: SamplingParams,
                 rng: np.random.Generator):
        self.assistant = assistant
        self.params = params
        self.rng = rng
        self.forward: Forward | None = None
        self.carry: mx.array | None = None  # [1, Hb]: the target's row at the last cached position

    def begin(self, prompt: list[int], forward: Forward) -> None:
        self.forward = forward
        rows = forward.last_hidden
        # A one-token prompt prefills nothing: the first round verifies without drafts.
        self.carry = None if rows is None or len(prompt) < 2 else rows[-1:]

    def observe(self, drafted: int, accepted: int, emitted: list[int], forward: Forward) -> None:
        # The verify's rows are [pending, *drafts]; row `accepted` is the last one kept in the
        # cache, whose logits chose the new pending token.
        rows = forward.last_hidden
        assert rows is not None  # (the forward keeps the rows after the final norm)
        self.carry = rows[accepted:accepted + 1]

    # A round another drafter drafted (lookup first, gates.LookupThenModel), or one while the
    # gate has it off: the carried row still follows the cache (a slice, no compute).
    def follow(self, accepted: int, emitted: list[int], forward: Forward) -> None:
        self.observe(0, accepted, emitted, forward)

    def lag(self, accepted: int, emitted: list[int], forward: Forward) -> None:
        self.observe(0, accepted, emitted, forward)

    def propose(self, history: list[int], k: int) -> tuple[list[int], list[np.ndarray] | None]:
        if k <= 0 or self.carry is None or self.forward is None or len(history) < 2:
            return [], None
        a = self.assistant
        cache = self.forward.cache
        cached = _attention(cache, a.view.full_index).offset  # tokens in the cache: history[:-1]
        position = cached - 1 if a.query_position == "last" else cached
        kv, masks = shared_kv(a.view, cache, position)
        pos = mx.array(position)
        greedy = self.params.greedy
        token, carry = mx.array([history[-1]]), self.carry[None]
        if greedy and self.params.repetition_penalty in (None, 1.0):
            # Each pass's token feeds the next as an array: the k passes are one graph,
            # evaluated once (no round trip to Python between passes).
            chain = []
            for _ in range(k):
                carry, h = assistant_pass(a, token, carry, kv, masks, pos)
                token = a.model.greedy(h[0, 0])[None]
                chain.append(token)
            return as_tokens(mx.concatenate(chain)), None
        ctx = self.params.repetition_context
        recent = history[-ctx:] if ctx > 0 else list(history)
        drafts: list[int] = []
        qs: list[np.ndarray] = []
        for _ in range(k):
            carry, h = assistant_pass(a, token, carry, kv, masks, pos)
            row = process_logits(a.model.head_logits(h[0, 0]), recent + drafts, self.params)
            if greedy:
                drafts.append(greedy_token(row))
            else:
                q = target_probs(row, self.params)
                drafts.append(sample_from(q, self.rng))
                qs.append(q)
            token = mx.array(drafts[-1:])
        return drafts, (None if greedy else qs)


def draft_row(assistant: LoadedAssistant, cache: Sequence[CacheEntry], carry: mx.array,
              token: int) -> mx.array:
    """The logits [1, V] of a round's first draft given the target's cache and carried row
    (what `propose` computes first): for tests that check what a live cache gives against a
    cache rebuilt from the same tokens."""
    cached = _attention(cache, assistant.view.full_index).offset
    position = cached - 1 if assistant.query_position == "last" else cached
    kv, masks = shared_kv(assistant.view, cache, position)
    _, h = assistant_pass(assistant, mx.array([token]), carry[None], kv, masks,
                          mx.array(position))
    return assistant.model.head_logits(h[0, 0])


def explicit_unavailable(model_id: str) -> RequestError:
    return RequestError(f"model {model_id} has no assistant drafter (card field "
                        "speculation.drafter = \"assistant\" with speculation.assistant_model)",
                        "speculation")
