"""A tiny random-weight Gemma 4 target (mlx-lm's ``gemma4_text``) and a matching tiny assistant
drafter, in the real layouts and tensor names.

Usage::

    python -m tests.helpers.tiny_model --family gemma4_text --out DIR [--seed N]
        [--assistant ordered|dense --assistant-out DIR2]

The target has what the assistant depends on: six layers, the last two KV-shared (they reuse
the K/V of the last cache-owning layer of their type), sliding-window layers (window 16, so
a few dozen tokens wrap the rotating caches) and full-attention layers with a wider head
(``global_head_dim``) and proportional partial RoPE, per-layer inputs (as E2B/E4B have), a
tied, soft-capped output head.

The assistant is what Google publishes as ``gemma-4-*-it-assistant``: four decoder layers
(sliding x3, full) with queries only (no k/v projections: every layer is KV-shared), a
``pre_projection`` over [target embedding, carried hidden], ``post_projection`` back to the
target's width, and an output head tied to its own ``model.embed_tokens``: ``ordered`` adds
the centroid head of the small (E2B/E4B) assistants (``masked_embedding.centroids`` and
``masked_embedding.token_ordering``), ``dense`` is the large assistants' plain tied head
(written with the 12B's ``gemma4_unified_assistant`` model type, which loads the same way).

Deterministic for a seed: every tensor draws from its own stream keyed by (seed, name).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.helpers import tiny_base as base

FAMILY = "gemma4_text"
ASSISTANT_KINDS = ("ordered", "dense")

HIDDEN = 64
INTERMEDIATE = 128
NUM_LAYERS = 6
NUM_KV_SHARED = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 16
GLOBAL_HEAD_DIM = 32
PER_LAYER = 16
SLIDING_WINDOW = 16
SOFTCAP = 30.0
# Owners: 0 s, 1 s, 2 f, 3 s; shared: 4 s (reads 3), 5 f (reads 2). The assistant reads
# layer 2 (last cache-owning full) and layer 3 (last cache-owning sliding).
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
               "sliding_attention", "full_attention"]
ROPE = {
    "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                       "rope_type": "proportional"},
    "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10000.0,
                          "rope_type": "default"},
}

A_HIDDEN = 32
A_INTERMEDIATE = 64
A_LAYERS = 4
A_LAYER_TYPES = ["sliding_attention"] * 3 + ["full_attention"]
NUM_CENTROIDS = 16  # 32 tokens each
CENTROID_TOP_K = 4  # 128 of 512 tokens scored per draft


def _head_dim(layer_type: str) -> int:
    return GLOBAL_HEAD_DIM if layer_type == "full_attention" else HEAD_DIM


def _layer(p: str, hidden: int, intermediate: int, layer_type: str, owns_kv: bool,
           per_layer: bool) -> base.TensorSpec:
    hd = _head_dim(layer_type)
    spec: base.TensorSpec = {
        f"{p}input_layernorm.weight": base._norm(hidden, False),
        f"{p}post_attention_layernorm.weight": base._norm(hidden, False),
        f"{p}pre_feedforward_layernorm.weight": base._norm(hidden, False),
        f"{p}post_feedforward_layernorm.weight": base._norm(hidden, False),
        f"{p}self_attn.q_proj.weight": base._linear(NUM_HEADS * hd, hidden),
        f"{p}self_attn.q_norm.weight": base._norm(hd, False),
        f"{p}self_attn.o_proj.weight": base._linear(hidden, NUM_HEADS * hd),
        f"{p}mlp.gate_proj.weight": base._linear(intermediate, hidden),
        f"{p}mlp.up_proj.weight": base._linear(intermediate, hidden),
        f"{p}mlp.down_proj.weight": base._linear(hidden, intermediate),
        f"{p}layer_scalar": ((1,), ("norm", 1.0)),
    }
    if owns_kv:
        spec[f"{p}self_attn.k_proj.weight"] = base._linear(NUM_KV_HEADS * hd, hidden)
        spec[f"{p}self_attn.v_proj.weight"] = base._linear(NUM_KV_HEADS * hd, hidden)
        spec[f"{p}self_attn.k_norm.weight"] = base._norm(hd, False)
    if per_layer:
        spec[f"{p}per_layer_input_gate.weight"] = base._linear(PER_LAYER, hidden)
        spec[f"{p}per_layer_projection.weight"] = base._linear(hidden, PER_LAYER)
        spec[f"{p}post_per_layer_input_norm.weight"] = base._norm(hidden, False)
    return spec


def target_tensors() -> base.TensorSpec:
    spec: base.TensorSpec = {
        # x sqrt(hidden) on the way in: unit scale inside, logits of std ~1 out (tied head).
        "model.embed_tokens.weight": ((base.VOCAB_SIZE, HIDDEN), ("normal", HIDDEN ** -0.5)),
        "model.embed_tokens_per_layer.weight": (
            (base.VOCAB_SIZE, NUM_LAYERS * PER_LAYER), ("normal", PER_LAYER ** -0.5)),
        "model.per_layer_model_projection.weight": base._linear(NUM_LAYERS * PER_LAYER, HIDDEN),
        "model.per_layer_projection_norm.weight": base._norm(PER_LAYER, False),
        "model.norm.weight": base._norm(HIDDEN, False),
    }
    first_shared = NUM_LAYERS - NUM_KV_SHARED
    for i, kind in enumerate(LAYER_TYPES):
        # KV-shared layers use a double-wide MLP (use_double_wide_mlp), as mlx-lm builds them.
        width = INTERMEDIATE * (2 if i >= first_shared else 1)
        spec.update(_layer(f"model.layers.{i}.", HIDDEN, width, kind, i < first_shared, True))
    return spec


def assistant_tensors(kind: str) -> base.TensorSpec:
    if kind not in ASSISTANT_KINDS:
        raise ValueError(f"unknown assistant kind {kind!r}; expected one of {ASSISTANT_KINDS}")
    spec: base.TensorSpec = {
        "pre_projection.weight": base._linear(A_HIDDEN, 2 * HIDDEN),
        "post_projection.weight": base._linear(HIDDEN, A_HIDDEN),
        "model.embed_tokens.weight": ((base.VOCAB_SIZE, A_HIDDEN), ("normal", A_HIDDEN ** -0.5)),
        "model.norm.weight": base._norm(A_HIDDEN, False),
    }
    for i, layer_type in enumerate(A_LAYER_TYPES):
        spec.update(_layer(f"model.layers.{i}.", A_HIDDEN, A_INTERMEDIATE, layer_type, False,
                           False))
    if kind == "ordered":
        spec["masked_embedding.centroids.weight"] = base._linear(NUM_CENTROIDS, A_HIDDEN)
    return spec


def _text_config(hidden: int, intermediate: int, layers: int, kv_shared: int,
                 layer_types: list[str], per_layer: int) -> dict:
    return {
        "model_type": "gemma4_text",
        "vocab_size": base.VOCAB_SIZE,
        "vocab_size_per_layer_input": base.VOCAB_SIZE,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "num_global_key_value_heads": None,
        "head_dim": HEAD_DIM,
        "global_head_dim": GLOBAL_HEAD_DIM,
        "num_kv_shared_layers": kv_shared,
        "hidden_size_per_layer_input": per_layer,
        "layer_types": layer_types,
        "sliding_window": SLIDING_WINDOW,
        "rope_parameters": ROPE,
        "final_logit_softcapping": SOFTCAP,
        "use_double_wide_mlp": True,
        "attention_k_eq_v": False,
        "enable_moe_block": False,
        "rms_norm_eps": base.RMS_EPS,
        "max_position_embeddings": base.MAX_POSITIONS,
        "tie_word_embeddings": True,
    }


def target_config() -> dict:
    config = {"architectures": ["Gemma4ForCausalLM"],
              **_text_config(HIDDEN, INTERMEDIATE, NUM_LAYERS, NUM_KV_SHARED, LAYER_TYPES,
                             PER_LAYER)}
    config.update(bos_token_id=None, eos_token_id=base.IM_END_ID, pad_token_id=base.ENDOFTEXT_ID,
                  torch_dtype="bfloat16")
    return config


def assistant_config(kind: str) -> dict:
    ordered = kind == "ordered"
    return {
        "architectures": ["Gemma4AssistantForCausalLM" if ordered
                          else "Gemma4UnifiedAssistantForCausalLM"],
        "model_type": "gemma4_assistant" if ordered else "gemma4_unified_assistant",
        "backbone_hidden_size": HIDDEN,
        "use_ordered_embeddings": ordered,
        "num_centroids": NUM_CENTROIDS,
        "centroid_intermediate_top_k": CENTROID_TOP_K,
        "tie_word_embeddings": True,
        "text_config": _text_config(A_HIDDEN, A_INTERMEDIATE, A_LAYERS, A_LAYERS,
                                    A_LAYER_TYPES, 0),
        "torch_dtype": "bfloat16",
    }


def _values(spec: base.TensorSpec, seed: int, key: str) -> dict[str, np.ndarray]:
    return {name: base._materialise(key, name, shape, recipe, seed)
            for name, (shape, recipe) in spec.items()}


def _write(out: Path, values: dict[str, np.ndarray], spec: base.TensorSpec,
           extra: dict[str, tuple[tuple[int, ...], bytes]] | None = None) -> None:
    tensors = {name: (spec[name][0], base._bf16_bytes(v)) for name, v in values.items()}
    base._write_safetensors(out / "model.safetensors", tensors, extra)


def make_target(out: Path, seed: int = 0) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec = target_tensors()
    values = _values(spec, seed, FAMILY)
    # Tied head: damp the special tokens' rows so greedy decoding does not stop at once.
    values["model.embed_tokens.weight"][: len(base.SPECIAL_TOKENS)] *= np.float32(
        base.SPECIAL_LOGIT_SCALE)
    _write(out, values, spec)
    base._write_json(out / "config.json", target_config())
    base._write_common_files(out)
    return out


def make_assistant(out: Path, kind: str = "ordered", seed: int = 0) -> Path:
    """The assistant for the tiny target of the same seed (its folder holds weights and config
    only, as the hub's assistant repositories do beside a tokenizer)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec = assistant_tensors(kind)
    values = _values(spec, seed, f"{FAMILY}-assistant-{kind}")
    extra = None
    if kind == "ordered":
        # token_ordering: which canonical token ids each centroid owns, 32 per centroid, as the
        # checkpoints store it (int64).
        rng = base._rng(seed, f"{FAMILY}-assistant", "masked_embedding.token_ordering")
        order = rng.permutation(base.VOCAB_SIZE).astype("<i8")
        extra = {"masked_embedding.token_ordering": ((base.VOCAB_SIZE,), order.tobytes())}
    _write(out, values, spec, extra)
    base._write_json(out / "config.json", assistant_config(kind))
    return out
