"""The tiny random-weight models of the dense families (llama, qwen2, qwen3, qwen3_5) and what
every tiny model shares: the tokenizer, the tensor recipes and the safetensors writer
(tiny_gemma4.py builds on them; tiny_model.py is the entry point for every family).

The directory holds ``config.json``, ``generation_config.json``, ``model.safetensors``
(bfloat16), ``tokenizer.json`` and ``tokenizer_config.json`` (a byte-level BPE with a
ChatML chat template), and with ``--mtp`` also ``mtp_conventions.json``.

Everything is a pure function of (family, seed, mtp, mtp_style): the same arguments give
byte-identical files (given the same numpy and tokenizers versions). Each tensor draws
from its own random stream keyed by (seed, family, tensor name), so adding the MTP head
leaves every trunk tensor unchanged and a model with and without ``--mtp`` computes the
same logits. The lm_head rows of the special tokens are damped so greedy decoding does
not stop early at a random EOS.

The weights are stored the way the family's *raw* Hugging Face checkpoints store them, so
loaders meet the same conventions as with real downloads:

* qwen3_5 keeps the multimodal wrapper's names (``model.language_model.*``), ``conv1d``
  weights in PyTorch layout ``[C, 1, K]`` and zero-centred RMSNorm weights (the model
  computes ``x * (1 + w)``). mlx-lm's sanitize spots the raw conv layout and then adds 1 to
  the trunk norms; it drops every ``mtp.*`` tensor.
* llama and qwen3 use plain RMSNorm weights (``x * w``).

MTP heads (``--mtp``), all with one predictor layer:

* ``qwen`` (Qwen3-Next / Qwen3.5 naming): ``mtp.fc`` [H, 2H] over
  ``concat(pre_fc_norm_embedding(embed), pre_fc_norm_hidden(hidden))``, one full-attention
  decoder layer under ``mtp.layers.0.``, then ``mtp.norm`` and the shared ``lm_head``.
  Norms follow the trunk's convention (zero-centred for qwen3_5).
* ``deepseek`` (DeepSeek-V3 naming, dense trunks only): layer ``model.layers.{L}.`` with
  L = num_hidden_layers holding ``embed_tokens`` (copy of the trunk's), ``enorm``,
  ``hnorm``, ``eh_proj`` [H, 2H] over ``concat(enorm(embed), hnorm(hidden))``, the decoder
  tensors, ``shared_head.norm`` and ``shared_head.head`` (copy of ``lm_head``).
* ``mimo`` (MiMo naming, dense trunks only): ``model.mtp_layers.0.`` with
  ``token_layernorm``, ``hidden_layernorm``, ``input_proj`` [H, 2H] over
  ``concat(hidden_layernorm(hidden), token_layernorm(embed))`` (hidden first, unlike the
  others), the decoder tensors and ``final_layernorm``; the ``lm_head`` is shared.

mlx-lm's llama and qwen3 sanitize() keep unknown tensors and its strict load then fails
with "Received N parameters not in model"; a loader must strip the MTP tensors first.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_5")  # gemma4_text: tiny_gemma4.py
MTP_STYLES = ("qwen", "deepseek", "mimo")

VOCAB_SIZE = 512
HIDDEN = 64
INTERMEDIATE = 128
NUM_LAYERS = 4
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 16
RMS_EPS = 1e-6
MAX_POSITIONS = 4096

# qwen3_5: gated attention with a wider head, and gated-delta (linear attention) layers.
# Key head dim 32 keeps mlx-lm's Metal gated-delta kernel eligible (it needs Dk % 32 == 0).
Q35_HEAD_DIM = 32
Q35_PARTIAL_ROTARY = 0.25
LINEAR_NUM_KEY_HEADS = 2
LINEAR_NUM_VALUE_HEADS = 4
LINEAR_KEY_HEAD_DIM = 32
LINEAR_VALUE_HEAD_DIM = 32
LINEAR_CONV_KERNEL = 4
FULL_ATTENTION_INTERVAL = 2  # layers 1 and 3 are full attention, 0 and 2 gated delta

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2  # trainer puts specials first, in order

# Qwen3.5's pre-tokenizer split (digits one by one, letters with their combining marks).
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Spread of RMSNorm weights around their centre (1 plain, 0 zero-centred): small, but it
# makes every norm distinct, so a loader that swaps two norms or mixes up the centring
# gets different logits instead of passing by luck.
NORM_JITTER = 0.05

# lm_head rows of the special tokens are scaled by this (see _weights).
SPECIAL_LOGIT_SCALE = 0.1

# Training text for the tokenizer. Written for this file so the tokenizer does not depend
# on which Python (and which stdlib docstrings) happens to be installed.
CORPUS = """\
The morning train left the station a few minutes late, and nobody seemed to mind.
People read, slept, or watched the fields roll past the windows. A child counted cows
out loud until she lost track somewhere after forty, then started again from one.

Good bread needs four things: flour, water, salt and time. Mix the flour and water,
let them rest for half an hour, then add the salt and knead until the dough is smooth.
Leave it to rise in a warm place. When it has doubled, shape it, let it rise again,
and bake it in a hot oven until the crust is brown and the loaf sounds hollow.

A small language model reads a sequence of tokens and predicts the next one. It turns
each token into a vector, mixes the vectors with attention, and writes a score for every
word in its vocabulary. The highest score wins when decoding is greedy; with sampling,
the scores become probabilities and the next token is drawn at random.

Speculative decoding lets a cheap draft propose several tokens at once. The large model
then checks all of them in a single pass and keeps the longest prefix it agrees with.
When the draft is right the answer arrives sooner, and when it is wrong nothing is lost
except a little work, because the output is exactly what the large model would say.

The river was high after the rain. It carried branches, leaves and once a whole wooden
gate that turned slowly in the current as if it were looking for the field it came from.
On the bridge two old men argued about whether the water had ever been this high before.
One said it was higher in the spring of the year the mill closed; the other said no.

<|im_start|>user
What is the capital of France?<|im_end|>
<|im_start|>assistant
The capital of France is Paris.<|im_end|>
<|im_start|>user
And how many people live there?<|im_end|>
<|im_start|>assistant
About two million people live in the city itself, and many more in the wider region.<|im_end|>

def fibonacci(n: int) -> list[int]:
    \"\"\"Return the first n Fibonacci numbers.\"\"\"
    numbers = [0, 1]
    while len(numbers) < n:
        numbers.append(numbers[-1] + numbers[-2])
    return numbers[:n]


for index, value in enumerate(fibonacci(10)):
    print(f"{index}: {value}")

Numbers help: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16, 32, 64, 100, 128, 256, 512, 1024.
Dates like 2024-05-17 and times like 09:45 or 18:30 appear in logs and letters alike.

Every network has nodes that talk to each other. A node sends a message, waits for a
reply, and tries again if the reply does not come in time. When many nodes share the
work, each one holds a part of the model and passes its results to the next, so that
together they can serve a model that none of them could hold alone.

The library opened at nine. The first visitor was a student with a stack of books to
return and a question about a map of the old town. The librarian found the map in a
drawer, unfolded it carefully on the table, and together they traced the streets that
no longer exist: the market lane, the tannery yard, and the narrow steps to the harbour.

Write clear code. Name things for what they mean, keep functions short, and test the
parts that are easy to get wrong. A test that fails for the right reason is worth more
than a hundred that pass for no reason at all. Read the error message before you change
anything, and change one thing at a time.

In the evening the wind dropped and the sea became calm. The boats came back one after
another, their lights moving slowly across the water toward the harbour wall, where
people were waiting with ropes and lanterns and baskets for the catch.
"""


# --- architecture ---------------------------------------------------------------------


def _std(fan_in: int) -> float:
    # 1/sqrt(fan_in) keeps every block's output at unit scale, so attention and the MLPs
    # change the residual stream as much as the embedding does and outputs depend on
    # context; logits come out with std ~1, far from a single repeated token.
    return fan_in**-0.5


# A tensor recipe: ("normal", std) | ("norm", centre) | ("a_log",) | ("dt_bias",)
# | ("copy", other_tensor_name).
Recipe = tuple
TensorSpec = dict[str, tuple[tuple[int, ...], Recipe]]


def _linear(out_dim: int, in_dim: int) -> tuple[tuple[int, ...], Recipe]:
    return (out_dim, in_dim), ("normal", _std(in_dim))


def _norm(dim: int, zero_centred: bool) -> tuple[tuple[int, ...], Recipe]:
    return (dim,), ("norm", 0.0 if zero_centred else 1.0)


def _zero_centred(family: str) -> bool:
    return family == "qwen3_5"


def _attention_layer(family: str, p: str) -> TensorSpec:
    """A full-attention decoder layer of ``family`` under prefix ``p``."""
    zc = _zero_centred(family)
    spec: TensorSpec = {
        f"{p}input_layernorm.weight": _norm(HIDDEN, zc),
        f"{p}post_attention_layernorm.weight": _norm(HIDDEN, zc),
    }
    if family == "qwen3_5":
        # Gated attention: q_proj also emits the output gate, hence 2x.
        q = NUM_HEADS * Q35_HEAD_DIM
        kv = NUM_KV_HEADS * Q35_HEAD_DIM
        spec[f"{p}self_attn.q_proj.weight"] = _linear(2 * q, HIDDEN)
        head_dim = Q35_HEAD_DIM
    else:
        q = NUM_HEADS * HEAD_DIM
        kv = NUM_KV_HEADS * HEAD_DIM
        spec[f"{p}self_attn.q_proj.weight"] = _linear(q, HIDDEN)
        head_dim = HEAD_DIM
    spec[f"{p}self_attn.k_proj.weight"] = _linear(kv, HIDDEN)
    spec[f"{p}self_attn.v_proj.weight"] = _linear(kv, HIDDEN)
    spec[f"{p}self_attn.o_proj.weight"] = _linear(HIDDEN, q)
    if family == "qwen2":  # Qwen2 biases its q, k and v projections
        for name, dim in (("q", q), ("k", kv), ("v", kv)):
            spec[f"{p}self_attn.{name}_proj.bias"] = ((dim,), ("normal", 0.1))
    if family in ("qwen3", "qwen3_5"):
        spec[f"{p}self_attn.q_norm.weight"] = _norm(head_dim, zc)
        spec[f"{p}self_attn.k_norm.weight"] = _norm(head_dim, zc)
    spec.update(_mlp(p))
    return spec


def _mlp(p: str) -> TensorSpec:
    return {
        f"{p}mlp.gate_proj.weight": _linear(INTERMEDIATE, HIDDEN),
        f"{p}mlp.up_proj.weight": _linear(INTERMEDIATE, HIDDEN),
        f"{p}mlp.down_proj.weight": _linear(HIDDEN, INTERMEDIATE),
    }


def _gated_delta_layer(p: str) -> TensorSpec:
    """A qwen3_5 linear-attention layer, in the raw checkpoint's names and layouts."""
    key_dim = LINEAR_NUM_KEY_HEADS * LINEAR_KEY_HEAD_DIM
    value_dim = LINEAR_NUM_VALUE_HEADS * LINEAR_VALUE_HEAD_DIM
    conv_dim = 2 * key_dim + value_dim
    a = f"{p}linear_attn."
    spec: TensorSpec = {
        f"{p}input_layernorm.weight": _norm(HIDDEN, True),
        f"{p}post_attention_layernorm.weight": _norm(HIDDEN, True),
        f"{a}in_proj_qkv.weight": _linear(conv_dim, HIDDEN),
        f"{a}in_proj_z.weight": _linear(value_dim, HIDDEN),
        f"{a}in_proj_b.weight": _linear(LINEAR_NUM_VALUE_HEADS, HIDDEN),
        f"{a}in_proj_a.weight": _linear(LINEAR_NUM_VALUE_HEADS, HIDDEN),
        # PyTorch depthwise Conv1d layout [C, 1, K]; mlx-lm moves it to [C, K, 1] and
        # takes this layout as the sign of a raw checkpoint (then adds 1 to the norms).
        f"{a}conv1d.weight": (
            (conv_dim, 1, LINEAR_CONV_KERNEL),
            ("normal", _std(LINEAR_CONV_KERNEL)),
        ),
        f"{a}dt_bias": ((LINEAR_NUM_VALUE_HEADS,), ("dt_bias",)),
        f"{a}A_log": ((LINEAR_NUM_VALUE_HEADS,), ("a_log",)),
        # The gated norm computes x * w (not 1 + w), also in raw checkpoints.
        f"{a}norm.weight": _norm(LINEAR_VALUE_HEAD_DIM, False),
        f"{a}out_proj.weight": _linear(HIDDEN, value_dim),
    }
    spec.update(_mlp(p))
    return spec


def _trunk(family: str) -> TensorSpec:
    base = "model.language_model." if family == "qwen3_5" else "model."
    spec: TensorSpec = {f"{base}embed_tokens.weight": ((VOCAB_SIZE, HIDDEN), ("normal", 1.0))}
    for i in range(NUM_LAYERS):
        p = f"{base}layers.{i}."
        if family == "qwen3_5" and (i + 1) % FULL_ATTENTION_INTERVAL != 0:
            spec.update(_gated_delta_layer(p))
        else:
            spec.update(_attention_layer(family, p))
    spec[f"{base}norm.weight"] = _norm(HIDDEN, _zero_centred(family))
    spec["lm_head.weight"] = _linear(VOCAB_SIZE, HIDDEN)
    return spec


def _embed_name(family: str) -> str:
    return ("model.language_model." if family == "qwen3_5" else "model.") + "embed_tokens.weight"


def _mtp(family: str, style: str) -> TensorSpec:
    zc = _zero_centred(family)
    if style == "qwen":
        spec: TensorSpec = {
            "mtp.fc.weight": _linear(HIDDEN, 2 * HIDDEN),
            "mtp.pre_fc_norm_embedding.weight": _norm(HIDDEN, zc),
            "mtp.pre_fc_norm_hidden.weight": _norm(HIDDEN, zc),
        }
        spec.update(_attention_layer(family, "mtp.layers.0."))
        spec["mtp.norm.weight"] = _norm(HIDDEN, zc)
        return spec
    if family == "qwen3_5":
        raise ValueError(f"mtp style {style!r} is only made for dense trunks (llama, qwen3)")
    if style == "deepseek":
        p = f"model.layers.{NUM_LAYERS}."
        spec = {
            # DeepSeek-V3 checkpoints carry copies of the shared embedding and head.
            f"{p}embed_tokens.weight": ((VOCAB_SIZE, HIDDEN), ("copy", _embed_name(family))),
            f"{p}enorm.weight": _norm(HIDDEN, zc),
            f"{p}hnorm.weight": _norm(HIDDEN, zc),
            f"{p}eh_proj.weight": _linear(HIDDEN, 2 * HIDDEN),
        }
        spec.update(_attention_layer(family, p))
        spec[f"{p}shared_head.norm.weight"] = _norm(HIDDEN, zc)
        spec[f"{p}shared_head.head.weight"] = ((VOCAB_SIZE, HIDDEN), ("copy", "lm_head.weight"))
        return spec
    if style == "mimo":
        p = "model.mtp_layers.0."
        spec = {
            f"{p}token_layernorm.weight": _norm(HIDDEN, zc),
            f"{p}hidden_layernorm.weight": _norm(HIDDEN, zc),
            f"{p}input_proj.weight": _linear(HIDDEN, 2 * HIDDEN),
        }
        spec.update(_attention_layer(family, p))
        spec[f"{p}final_layernorm.weight"] = _norm(HIDDEN, zc)
        return spec
    raise ValueError(f"unknown mtp style {style!r}; expected one of {MTP_STYLES}")


def tensor_shapes(
    family: str, mtp: bool = False, mtp_style: str = "qwen"
) -> dict[str, tuple[int, ...]]:
    """Names and shapes of every tensor ``write_model`` writes, trunk first."""
    spec = _trunk(family)
    if mtp:
        spec.update(_mtp(family, mtp_style))
    return {name: shape for name, (shape, _) in spec.items()}


def mtp_tensor_shapes(family: str, mtp_style: str = "qwen") -> dict[str, tuple[int, ...]]:
    """Names and shapes of the MTP head's tensors alone."""
    return {name: shape for name, (shape, _) in _mtp(family, mtp_style).items()}


# --- weights ----------------------------------------------------------------------------


def _rng(seed: int, family: str, name: str) -> np.random.Generator:
    # One stream per tensor, keyed by name: adding or reordering tensors moves no others.
    # The family is in the key too, so llama and qwen3 (which share most names) differ.
    digest = hashlib.sha256(f"{family}/{name}".encode()).digest()
    words = [int.from_bytes(digest[i : i + 4], "little") for i in range(0, 16, 4)]
    return np.random.default_rng(np.random.SeedSequence([seed, *words]))


def _materialise(
    family: str, name: str, shape: tuple[int, ...], recipe: Recipe, seed: int
) -> np.ndarray:
    rng = _rng(seed, family, name)
    kind = recipe[0]
    if kind == "normal":
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(recipe[1])
    if kind == "norm":
        jitter = rng.standard_normal(shape, dtype=np.float32) * np.float32(NORM_JITTER)
        return np.float32(recipe[1]) + jitter
    if kind == "a_log":
        # A in [1, 16) as in the reference init; the decay is exp(-A * softplus(.)).
        return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
    if kind == "dt_bias":
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    raise ValueError(f"unknown recipe {recipe!r} for {name}")


def _bf16_bytes(a: np.ndarray) -> bytes:
    """float32 -> bfloat16 bytes, rounding to nearest even (as torch and mlx do)."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return rounded.astype("<u2").tobytes()


def _write_safetensors(path: Path, tensors: dict[str, tuple[tuple[int, ...], bytes]],
                       int64: dict[str, tuple[tuple[int, ...], bytes]] | None = None) -> None:
    """A bf16 safetensors file with a canonical header, so the bytes depend only on data;
    `int64` adds integer tensors (index buffers, e.g. a Gemma 4 assistant's token ordering)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    tensors = {**tensors, **(int64 or {})}
    names = sorted(tensors)
    for name in names:
        shape, data = tensors[name]
        header[name] = {
            "dtype": "I64" if int64 and name in int64 else "BF16",
            "shape": list(shape),
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format allows space padding to align the data
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in names:
            f.write(tensors[name][1])


def _weights(
    family: str, seed: int, mtp: bool, mtp_style: str
) -> dict[str, tuple[tuple[int, ...], bytes]]:
    spec = _trunk(family)
    if mtp:
        spec.update(_mtp(family, mtp_style))
    values: dict[str, np.ndarray] = {}
    for name, (shape, recipe) in spec.items():
        if recipe[0] == "copy":
            continue
        values[name] = _materialise(family, name, shape, recipe, seed)
    # Damp the special tokens' logits to ~0 (others reach ~3), so greedy decoding runs to
    # max_tokens instead of stopping at a random EOS; sampling still reaches them rarely.
    values["lm_head.weight"][: len(SPECIAL_TOKENS)] *= np.float32(SPECIAL_LOGIT_SCALE)
    for name, (_, recipe) in spec.items():
        if recipe[0] == "copy":
            values[name] = values[recipe[1]]
    return {name: (spec[name][0], _bf16_bytes(v)) for name, v in values.items()}


# --- config -----------------------------------------------------------------------------


def _config(family: str, mtp: bool, mtp_style: str) -> dict:
    common = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": RMS_EPS,
        "attention_bias": False,
        "tie_word_embeddings": False,
    }
    if family == "llama":
        config = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **common,
            "head_dim": HEAD_DIM,
            "mlp_bias": False,
            "rope_theta": 10000.0,
            "rope_scaling": None,
        }
    elif family == "qwen2":
        config = {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            **common,
            "rope_theta": 1000000.0,
            "rope_scaling": None,
        }
    elif family == "qwen3":
        config = {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            **common,
            "head_dim": HEAD_DIM,
            "rope_theta": 1000000.0,
            "rope_scaling": None,
        }
    elif family == "qwen3_5":
        layer_types = [
            "full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
            for i in range(NUM_LAYERS)
        ]
        text_config = {
            "model_type": "qwen3_5_text",
            **common,
            "head_dim": Q35_HEAD_DIM,
            "attn_output_gate": True,
            "layer_types": layer_types,
            "full_attention_interval": FULL_ATTENTION_INTERVAL,
            "linear_conv_kernel_dim": LINEAR_CONV_KERNEL,
            "linear_key_head_dim": LINEAR_KEY_HEAD_DIM,
            "linear_value_head_dim": LINEAR_VALUE_HEAD_DIM,
            "linear_num_key_heads": LINEAR_NUM_KEY_HEADS,
            "linear_num_value_heads": LINEAR_NUM_VALUE_HEADS,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000000.0,
                "partial_rotary_factor": Q35_PARTIAL_ROTARY,
                # Text-only positions make the three mrope sections coincide; their sizes
                # only need to add up to the rotary pairs (32 * 0.25 / 2 = 4).
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
            "eos_token_id": IM_END_ID,
            "torch_dtype": "bfloat16",
        }
        if mtp:
            text_config["mtp_num_hidden_layers"] = 1
            text_config["mtp_use_dedicated_embeddings"] = False
        config = {
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "model_type": "qwen3_5",
            "text_config": text_config,
            "tie_word_embeddings": False,
        }
    else:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    if mtp and family != "qwen3_5":
        # Qwen names the count mtp_num_hidden_layers; DeepSeek-V3 and MiMo use nextn.
        key = "mtp_num_hidden_layers" if mtp_style == "qwen" else "num_nextn_predict_layers"
        config[key] = 1
    config["bos_token_id"] = None
    config["eos_token_id"] = IM_END_ID
    config["pad_token_id"] = ENDOFTEXT_ID
    config["torch_dtype"] = "bfloat16"
    return config


def _mtp_conventions(family: str, style: str) -> dict:
    """What a loader must know to run the head; test metadata only, no real checkpoint
    has this file."""
    zc = _zero_centred(family)
    spec = _mtp(family, style)
    norms = [n for n, (_, r) in spec.items() if r[0] == "norm"]
    embed = _embed_name(family)
    if style == "qwen":
        combine = {
            "proj": "mtp.fc.weight",
            "inputs": [
                "mtp.pre_fc_norm_embedding(embedding)",
                "mtp.pre_fc_norm_hidden(trunk hidden state)",
            ],
        }
        final_norm, head = "mtp.norm.weight", "lm_head.weight"
        layer_prefix = "mtp.layers.0."
        count_key = "mtp_num_hidden_layers"
        if family == "qwen3_5":
            count_key = "text_config." + count_key
    elif style == "deepseek":
        p = f"model.layers.{NUM_LAYERS}."
        combine = {
            "proj": f"{p}eh_proj.weight",
            "inputs": [f"{p}enorm(embedding)", f"{p}hnorm(trunk hidden state)"],
        }
        final_norm, head = f"{p}shared_head.norm.weight", f"{p}shared_head.head.weight"
        layer_prefix = p
        embed = f"{p}embed_tokens.weight"
        count_key = "num_nextn_predict_layers"
    else:
        p = "model.mtp_layers.0."
        combine = {
            "proj": f"{p}input_proj.weight",
            "inputs": [
                f"{p}hidden_layernorm(trunk hidden state)",
                f"{p}token_layernorm(embedding)",
            ],
        }
        final_norm, head = f"{p}final_layernorm.weight", "lm_head.weight"
        layer_prefix = p
        count_key = "num_nextn_predict_layers"
    return {
        "family": family,
        "style": style,
        "num_layers": 1,
        "config_key": count_key,
        "decoder_layer_prefix": layer_prefix,
        "decoder_layer_kind": "full_attention layer of the trunk's family (same tensor names)",
        # The projection reads the concatenation of its inputs in this order.
        "combine": combine,
        "pairing": "the hidden state at position i goes with the embedding of token i+1; "
        "the head's logits predict token i+2",
        "embedding": embed,
        "final_norm": final_norm,
        "lm_head": head,
        "norm_convention": "zero_centred" if zc else "plain",
        "norm_formula": "x * (1 + w)" if zc else "x * w",
        "norm_tensors": norms,
        "trunk_norm_convention": "zero_centred" if zc else "plain",
        # Which trunk state feeds the head is the consumer's convention, not the file's;
        # vLLM's MTP proposers get the trunk's output after its final norm (what lm_head
        # reads), and with random weights any choice is self-consistent.
        "hidden_state": "trunk output after the final norm (the input of lm_head)",
        "weights_dtype": "bfloat16",
    }


# --- tokenizer --------------------------------------------------------------------------


def _train_tokenizer() -> str:
    """Byte-level BPE trained on CORPUS; returns tokenizer.json's text."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # Qwen's pipeline, exactly: transformers >= 5 rebuilds a qwen3_5 tokenizer from the
    # vocab and merges with this normalizer and split regex whatever tokenizer.json says,
    # so any other pipeline here would make transformers and `tokenizers` disagree.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols, so any text encodes without an unknown token.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Special tokens in the corpus must not be learnt as ordinary byte sequences.
    text = CORPUS
    for special in SPECIAL_TOKENS:
        text = text.replace(special, "\n")
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, want {VOCAB_SIZE}")
    for i, special in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(special) != i:
            raise RuntimeError(f"{special} is not id {i}")
    return tok.to_str(pretty=True)


def _tokenizer_config() -> dict:
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, t in enumerate(SPECIAL_TOKENS)
        },
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": MAX_POSITIONS,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


# --- entry points -----------------------------------------------------------------------


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_common_files(out: Path) -> None:
    """generation_config.json and the tokenizer, the same for every family."""
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": None, "eos_token_id": [IM_END_ID, ENDOFTEXT_ID], "pad_token_id": 0},
    )
    (out / "tokenizer.json").write_text(_train_tokenizer(), encoding="utf-8")
    _write_json(out / "tokenizer_config.json", _tokenizer_config())


def write_model(
    family: str, out: Path, seed: int = 0, mtp: bool = False, mtp_style: str = "qwen"
) -> Path:
    """Write the tiny model of the dense ``family`` into ``out`` (created if needed); return
    ``out``."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    if mtp_style not in MTP_STYLES:
        raise ValueError(f"unknown mtp style {mtp_style!r}; expected one of {MTP_STYLES}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights = _weights(family, seed, mtp, mtp_style)  # validates the style before writing
    _write_safetensors(out / "model.safetensors", weights)
    _write_json(out / "config.json", _config(family, mtp, mtp_style))
    _write_common_files(out)
    conventions = out / "mtp_conventions.json"
    if mtp:
        _write_json(conventions, _mtp_conventions(family, mtp_style))
    elif conventions.exists():
        conventions.unlink()  # a stale file from an earlier --mtp run would mislead
    return out
