"""Tiny GGUF files written with gguf-py's own writer (2 layers, a byte-level vocabulary), and
the llama.cpp layout facts the converter must undo."""

from __future__ import annotations

from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np

N_EMBD, N_HEAD, N_KV, N_FF, N_LAYER = 64, 4, 2, 128, 2
HEAD_DIM = N_EMBD // N_HEAD
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The row reordering llama.cpp's converter applies to llama Q/K (rotate-half -> pairs)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def bf16_exact(rng: np.random.Generator, *shape: int) -> np.ndarray:
    """Random float32 values that bf16 represents exactly, so conversion must be lossless."""
    a = rng.standard_normal(shape).astype(np.float32)
    return (a.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def byte_level_vocab() -> tuple[list[str], list[int], list[str]]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    merges = ["h e", "l l", "he ll", "Ġ w", "o r"]
    tokens = alphabet + [m.replace(" ", "") for m in merges] + SPECIALS
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)  # 3 = control
    return tokens, types, merges


def hf_weights(arch: str, tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    """A tiny model's weights in Hugging Face layout and naming."""
    rng = np.random.default_rng(seed)
    vocab = len(byte_level_vocab()[0])
    w = {"model.embed_tokens.weight": bf16_exact(rng, vocab, N_EMBD)}
    for i in range(N_LAYER):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = bf16_exact(rng, N_EMBD)
        w[p + "post_attention_layernorm.weight"] = bf16_exact(rng, N_EMBD)
        w[p + "self_attn.q_proj.weight"] = bf16_exact(rng, N_HEAD * HEAD_DIM, N_EMBD)
        w[p + "self_attn.k_proj.weight"] = bf16_exact(rng, N_KV * HEAD_DIM, N_EMBD)
        w[p + "self_attn.v_proj.weight"] = bf16_exact(rng, N_KV * HEAD_DIM, N_EMBD)
        w[p + "self_attn.o_proj.weight"] = bf16_exact(rng, N_EMBD, N_HEAD * HEAD_DIM)
        w[p + "mlp.gate_proj.weight"] = bf16_exact(rng, N_FF, N_EMBD)
        w[p + "mlp.up_proj.weight"] = bf16_exact(rng, N_FF, N_EMBD)
        w[p + "mlp.down_proj.weight"] = bf16_exact(rng, N_EMBD, N_FF)
        if arch == "qwen2":
            w[p + "self_attn.q_proj.bias"] = bf16_exact(rng, N_HEAD * HEAD_DIM)
            w[p + "self_attn.k_proj.bias"] = bf16_exact(rng, N_KV * HEAD_DIM)
            w[p + "self_attn.v_proj.bias"] = bf16_exact(rng, N_KV * HEAD_DIM)
    w["model.norm.weight"] = bf16_exact(rng, N_EMBD)
    if not tied:
        w["lm_head.weight"] = bf16_exact(rng, vocab, N_EMBD)
    return w


TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{TO_GGUF[rest]}"


def write_gguf(
    path: Path,
    weights: dict[str, np.ndarray],
    arch: str = "llama",
    quant: gguf.GGMLQuantizationType | None = None,
) -> Path:
    """Write ``weights`` (HF layout) the way llama.cpp's converter would, with a tokenizer."""
    tokens, types, merges = byte_level_vocab()
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(N_LAYER)
    w.add_context_length(256)
    w.add_embedding_length(N_EMBD)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm" if arch == "llama" else "qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    for hf, arr in weights.items():
        if arch == "llama" and (".q_proj." in hf or ".k_proj." in hf):
            arr = llama_cpp_permute(arr, N_HEAD if ".q_proj." in hf else N_KV)
        if quant is not None and arr.ndim == 2:
            w.add_tensor(gguf_name(hf), gguf.quants.quantize(arr, quant), raw_dtype=quant)
        else:
            w.add_tensor(gguf_name(hf), np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def load_converted(folder: Path) -> dict[str, np.ndarray]:
    return {
        k: np.array(v.astype(mx.float32))
        for k, v in mx.load(str(folder / "model.safetensors")).items()
    }


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith((".tmp-", ".old-")))


# --------------------------------------------------------------------------- permutation
