"""Convert a GGUF checkpoint into mlx-lm's model folder layout (Hugging Face names, bf16).

The weights are dequantised with gguf-py, llama.cpp's own reader, and re-laid out the way
Hugging Face and mlx-lm expect. The folder is built in a hidden sibling and renamed into place
only when complete, so readers never see a half-written model.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf.quants import dequantize

__all__ = ["CONVERTER_VERSION", "GGUFConversionError", "convert_gguf"]

# Bump when the produced folder changes for the same input, so caches can tell stale output apart.
CONVERTER_VERSION = "1"

_CHUNK_ELEMENTS = 4 << 20  # dequantise ~16 MB of float32 at a time: bounded memory at any size
_HASH_CHUNK = 8 << 20
_SUPPORTED_ARCHS = ("llama", "qwen2")
_HF_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# GGUF tensor name -> Hugging Face / mlx-lm name, per transformer block.
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")

# llama.cpp splits digits one by one before its GPT-2 regex for these vocabularies, as their
# original tokenizer.json files do; transformers' GGUF reader does not know these pre-types.
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact"}


class GGUFConversionError(ValueError):
    """The GGUF file cannot be converted (unsupported architecture, missing tensors...)."""


@dataclass(frozen=True)
class _Hparams:
    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    context_length: int
    vocab_size: int
    rope_scaling: dict[str, Any] | None


@dataclass(frozen=True)
class _Plan:
    hf_name: str
    gguf: gguf.ReaderTensor
    shape: tuple[int, ...]  # numpy / Hugging Face order (ggml lists dimensions reversed)
    rows: np.ndarray | None  # source row for each output row; None = identity


def convert_gguf(
    gguf_path: Path,
    out_dir: Path,
    progress: Callable[[int, int], None] | None = None,
    source_id: str | None = None,
) -> dict[str, Any]:
    """Convert ``gguf_path`` (llama or qwen2 architecture) into an mlx-lm model folder ``out_dir``.

    Writes config.json, generation_config.json, model.safetensors (bf16), the tokenizer files with
    the GGUF's chat template, and skulkp2p.json (sha256 of the source and of every file written).
    ``progress(done, total)`` is called once per tensor. An existing ``out_dir`` is replaced, and
    only once the new folder is complete. Returns a summary: model_type, layers, hidden_size,
    kv_heads, context_length, parameters, bytes (size of model.safetensors), sha256 (of it).
    ``source_id``: the model name the GGUF came by (a repository id), recorded as source.id.
    """
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(out_dir)
    # The pid in the name lets a later run recognise (and delete) leftovers of a killed one.
    tmp = out_dir.parent / f".tmp-{out_dir.name}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        summary = _convert_into(gguf_path, tmp, progress, source_id)
        _fsync_tree(tmp)
        _install(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return summary


def _convert_into(
    gguf_path: Path, tmp: Path, progress: Callable[[int, int], None] | None,
    source_id: str | None = None,
) -> dict[str, Any]:
    reader = gguf.GGUFReader(gguf_path)
    meta = _Meta(reader)
    hp = _read_hparams(meta, reader)
    plan = _plan_tensors(reader, hp)
    tied = "lm_head.weight" not in {p.hf_name for p in plan}

    model_sha, model_bytes, n_params = _write_safetensors(tmp / "model.safetensors", plan, progress)

    eos_ids, eos_token, bos_id = _special_ids(meta)
    config = _hf_config(hp, tied, bos_id, eos_ids)
    _write_json(tmp / "config.json", config)
    gen = {"bos_token_id": bos_id, "eos_token_id": eos_ids}
    if (pad := meta.get("tokenizer.ggml.padding_token_id")) is not None:
        gen["pad_token_id"] = int(pad)
    _write_json(tmp / "generation_config.json", gen)
    _write_tokenizer(meta, hp, eos_token, tmp)

    summary = {
        "model_type": hp.arch,
        "layers": hp.n_layer,
        "hidden_size": hp.n_embd,
        "kv_heads": hp.n_head_kv,
        "context_length": hp.context_length,
        "parameters": n_params,
        "bytes": model_bytes,
        "sha256": model_sha,
    }
    files = {
        p.name: {
            "sha256": model_sha if p.name == "model.safetensors" else _sha256_file(p),
            "bytes": p.stat().st_size,
        }
        for p in sorted(tmp.iterdir())
    }
    record = {
        "converter": "skulkp2p.models.gguf_convert",
        "converter_version": CONVERTER_VERSION,
        "source": {
            "path": str(gguf_path.resolve()),
            "sha256": _sha256_file(gguf_path),
            "bytes": gguf_path.stat().st_size,
            "name": meta.get("general.name"),
            "file_type": meta.get("general.file_type"),
            **({"id": source_id} if source_id else {}),
        },
        "files": files,
        "model": summary,
    }
    _write_json(tmp / "skulkp2p.json", record)
    return summary


class _Meta:
    """Plain Python values of a GGUF's metadata fields, read on demand."""

    def __init__(self, reader: gguf.GGUFReader) -> None:
        self._fields = reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def need(self, key: str) -> Any:
        field = self._fields.get(key)
        if field is None:
            raise GGUFConversionError(f"GGUF metadata lacks {key}")
        return field.contents()


def _f32(x: float) -> float:
    # GGUF stores these as float32; print the shortest decimal that round-trips (1e-06, not
    # 9.999999974752427e-07) so config.json reads like the original.
    return float(np.format_float_scientific(np.float32(x), unique=True))


def _read_hparams(meta: _Meta, reader: gguf.GGUFReader) -> _Hparams:
    arch = meta.need("general.architecture")
    if arch not in _SUPPORTED_ARCHS:
        raise GGUFConversionError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(_SUPPORTED_ARCHS)})"
        )
    n_embd = int(meta.need(f"{arch}.embedding_length"))
    n_head = meta.need(f"{arch}.attention.head_count")
    n_head_kv = meta.get(f"{arch}.attention.head_count_kv", n_head)
    if isinstance(n_head, list) or isinstance(n_head_kv, list):
        raise GGUFConversionError("per-layer head counts are not supported")
    n_head, n_head_kv = int(n_head), int(n_head_kv)
    head_dim = int(meta.get(f"{arch}.attention.key_length", n_embd // n_head))
    if int(meta.get(f"{arch}.attention.value_length", head_dim)) != head_dim:
        raise GGUFConversionError("different key and value head sizes are not supported")
    rot = meta.get(f"{arch}.rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise GGUFConversionError(f"partial rotary embeddings ({rot} of {head_dim}) unsupported")

    rope_scaling = None
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind == "linear":
        rope_scaling = {
            "rope_type": "linear",
            "factor": _f32(meta.need(f"{arch}.rope.scaling.factor")),
        }
    elif kind not in (None, "none"):
        raise GGUFConversionError(f"rope scaling {kind!r} is not supported")

    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise GGUFConversionError("GGUF has no token_embd.weight tensor")
    return _Hparams(
        arch=arch,
        n_layer=int(meta.need(f"{arch}.block_count")),
        n_embd=n_embd,
        n_ff=int(meta.need(f"{arch}.feed_forward_length")),
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        rms_eps=_f32(meta.need(f"{arch}.attention.layer_norm_rms_epsilon")),
        # llama.cpp's own default when a file does not state the base
        rope_theta=_f32(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        context_length=int(meta.need(f"{arch}.context_length")),
        vocab_size=int(embd.shape[-1]),  # ggml order: (n_embd, n_vocab)
        rope_scaling=rope_scaling,
    )


def _unpermute_rows(n_rows: int, n_head: int) -> np.ndarray:
    """Source row, in the GGUF tensor, of each row of the Hugging Face Q/K projection.

    llama.cpp's converter reorders each head's rows from HF's rotate-half layout (first half of the
    head dim, then second half) to interleaved pairs: reshape(n_head, 2, head_dim // 2, in) then
    swap axes 1 and 2. Within head h, HF row s*(head_dim/2) + j was stored at GGUF row 2*j + s.
    Reading GGUF rows in the order of the inverse reshape (n_head, head_dim // 2, 2) with axes 1
    and 2 swapped undoes it. Done as a row gather so quantised tensors can be read in chunks.
    """
    half = n_rows // n_head // 2
    if half * 2 * n_head != n_rows:
        raise GGUFConversionError(f"{n_rows} rows do not split into {n_head} rotary heads")
    return np.arange(n_rows).reshape(n_head, half, 2).swapaxes(1, 2).reshape(-1)


def _plan_tensors(reader: gguf.GGUFReader, hp: _Hparams) -> list[_Plan]:
    by_hf: dict[str, _Plan] = {}
    for t in reader.tensors:
        if (m := _BLOCK_RE.match(t.name)) and m.group(2) in _BLOCK_NAMES:
            hf = f"model.layers.{int(m.group(1))}.{_BLOCK_NAMES[m.group(2)]}"
        elif t.name in _GLOBAL_NAMES:
            hf = _GLOBAL_NAMES[t.name]
        else:
            # e.g. rope_freqs.weight (llama 3 rope scaling): dropping it would silently change
            # the model, so refuse instead.
            raise GGUFConversionError(f"GGUF tensor {t.name!r} has no supported equivalent")
        shape = tuple(int(d) for d in reversed(t.shape))
        rows = None
        # Only llama GGUFs are permuted; llama.cpp writes qwen2's Q/K as Hugging Face has them.
        if hp.arch == "llama" and m and m.group(2).startswith(("attn_q.", "attn_k.")):
            heads = hp.n_head if m.group(2).startswith("attn_q.") else hp.n_head_kv
            rows = _unpermute_rows(shape[0], heads)
        by_hf[hf] = _Plan(hf, t, shape, rows)

    per_layer = [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    ]
    if hp.arch == "qwen2":
        per_layer += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
    order = ["model.embed_tokens.weight"]
    for i in range(hp.n_layer):
        order += [f"model.layers.{i}.{n}" for n in per_layer]
    order.append("model.norm.weight")
    if "lm_head.weight" in by_hf:
        order.append("lm_head.weight")
    missing = [n for n in order if n not in by_hf]
    extra = sorted(set(by_hf) - set(order))
    if missing or extra:
        raise GGUFConversionError(
            f"GGUF tensors do not match a {hp.n_layer}-layer {hp.arch} model: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected {extra[:5]}"
        )
    return [by_hf[n] for n in order]  # fixed order: deterministic file, layers contiguous


def _to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, rounding to nearest even (numpy has no bfloat16)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    u = a.view(np.uint32)
    out = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    out = out.astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():  # the rounding add could carry a NaN payload into infinity
        out[nan] = 0x7FC0
    return out


def _tensor_chunks(p: _Plan) -> Iterable[np.ndarray]:
    """The tensor's rows, dequantised, in Hugging Face order, a bounded number at a time."""
    data = p.gguf.data  # memory-mapped; rows in numpy order
    n_rows = p.shape[0]
    row_elems = int(np.prod(p.shape[1:], dtype=np.int64)) if len(p.shape) > 1 else 1
    step = max(1, _CHUNK_ELEMENTS // max(row_elems, 1))
    qtype = p.gguf.tensor_type
    for start in range(0, n_rows, step):
        stop = min(start + step, n_rows)
        raw = data[start:stop] if p.rows is None else data[p.rows[start:stop]]
        values = dequantize(np.asarray(raw), qtype)
        yield values.reshape((stop - start, *p.shape[1:]))


def _write_safetensors(
    path: Path, plan: list[_Plan], progress: Callable[[int, int], None] | None
) -> tuple[str, int, int]:
    """Stream the tensors into a safetensors file; return (sha256, bytes, parameter count).

    The header only needs shapes, known before any data is read, so it is written first and each
    tensor follows as it is dequantised: peak memory is one chunk, not the model.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    n_params = 0
    for p in plan:
        n = int(np.prod(p.shape, dtype=np.int64))
        header[p.hf_name] = {
            "dtype": "BF16",
            "shape": list(p.shape),
            "data_offsets": [offset, offset + 2 * n],
        }
        offset += 2 * n
        n_params += n
    blob = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    digest = hashlib.sha256()
    total = len(plan)
    with open(path, "wb") as f:
        for piece in (len(blob).to_bytes(8, "little"), blob):
            f.write(piece)
            digest.update(piece)
        for done, p in enumerate(plan, start=1):
            for chunk in _tensor_chunks(p):
                raw = _to_bf16_bits(chunk).tobytes()
                f.write(raw)
                digest.update(raw)
            if progress is not None:
                progress(done, total)
    size = path.stat().st_size
    if size != 8 + len(blob) + offset:
        raise GGUFConversionError(
            f"wrote {size} bytes to {path.name}, expected {8 + len(blob) + offset}"
        )
    return digest.hexdigest(), size, n_params


def _special_ids(meta: _Meta) -> tuple[list[int], str | None, int | None]:
    """(eos ids that should stop generation, eos token text, bos id)."""
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    ids: list[int] = []
    if eos is not None:
        ids.append(int(eos))
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if (extra := meta.get(key)) is not None:
            ids.append(int(extra))
    template = meta.get("tokenizer.chat_template") or ""
    index = {t: i for i, t in enumerate(tokens)} if tokens else {}
    eos_token = tokens[int(eos)] if eos is not None and tokens else None
    # ChatML models end a turn with <|im_end|>; some GGUFs name <|endoftext|> as eos instead. Both
    # must stop generation, and the chat turn end is the eos the tokenizer should report.
    if "<|im_end|>" in template and "<|im_end|>" in index:
        ids.append(index["<|im_end|>"])
        eos_token = "<|im_end|>"
        if "<|endoftext|>" in index:
            ids.append(index["<|endoftext|>"])
    unique = list(dict.fromkeys(ids))
    if eos_token is not None and index.get(eos_token) in unique:
        unique.remove(index[eos_token])
        unique.insert(0, index[eos_token])  # primary eos first
    return unique, eos_token, None if bos is None else int(bos)


def _hf_config(hp: _Hparams, tied: bool, bos: int | None, eos: list[int]) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": [_HF_CLASS[hp.arch]],
        "model_type": hp.arch,
        "hidden_size": hp.n_embd,
        "intermediate_size": hp.n_ff,
        "num_hidden_layers": hp.n_layer,
        "num_attention_heads": hp.n_head,
        "num_key_value_heads": hp.n_head_kv,
        "head_dim": hp.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": hp.rms_eps,
        "rope_theta": hp.rope_theta,
        "rope_scaling": hp.rope_scaling,
        "max_position_embeddings": hp.context_length,
        "vocab_size": hp.vocab_size,
        "tie_word_embeddings": tied,
        "torch_dtype": "bfloat16",
        "bos_token_id": bos,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
    }
    if hp.arch == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    else:
        # Qwen2 always has Q/K/V biases (mlx-lm's qwen2 hard-codes them); stated for readers.
        config.update(attention_bias=True, use_sliding_window=False)
    return config


def _write_tokenizer(meta: _Meta, hp: _Hparams, eos_token: str | None, out: Path) -> None:
    """Build a fast tokenizer from the GGUF vocabulary and save it with the chat template.

    transformers' own ``from_pretrained(gguf_file=...)`` imports torch to read the file; its
    vocabulary converter does not, so it is fed metadata read with gguf-py instead.
    """
    from tokenizers import normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    keys = {
        "model": "tokenizer_type",
        "pre": "pre_tokenizer_type",
        "tokens": "tokens",
        "scores": "scores",
        "token_type": "token_type",
        "merges": "merges",
        "precompiled_charsmap": "precompiled_charsmap",
        "bos_token_id": "bos_token_id",
        "eos_token_id": "eos_token_id",
        "unknown_token_id": "unk_token_id",
        "padding_token_id": "pad_token_id",
        "add_space_prefix": "add_prefix_space",
    }
    spec = {
        name: value
        for key, name in keys.items()
        if (value := meta.get(f"tokenizer.ggml.{key}")) is not None
    }
    if "tokens" not in spec or "tokenizer_type" not in spec:
        raise GGUFConversionError("GGUF carries no tokenizer vocabulary")
    backend, _ = convert_gguf_tokenizer(hp.arch, spec)

    pre = spec.get("pre_tokenizer_type")
    if pre in _DIGIT_SPLIT_PRE and spec["tokenizer_type"] == "gpt2":
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre == "qwen2" and backend.normalizer is None:
        backend.normalizer = normalizers.NFC()  # as Qwen's own tokenizer.json does

    tokens = spec["tokens"]

    def token(key: str) -> str | None:
        i = spec.get(key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    # llama.cpp adds BOS to sentencepiece vocabularies unless told otherwise, never to BPE ones.
    add_bos = meta.get("tokenizer.ggml.add_bos_token", spec["tokenizer_type"] == "llama")
    template = meta.get("tokenizer.chat_template")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=token("bos_token_id"),
        eos_token=eos_token,
        unk_token=token("unk_token_id"),
        pad_token=token("pad_token_id"),
        add_bos_token=bool(add_bos),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=template,
        model_max_length=hp.context_length,
        clean_up_tokenization_spaces=False,
    )
    tok.save_pretrained(str(out))

    # transformers 5 keeps the template in chat_template.jinja; older readers (and anything that
    # only parses tokenizer_config.json) look for it there, so keep a copy in both places.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    if template:
        cfg["chat_template"] = template
    cfg["eos_token"] = eos_token
    _write_json(cfg_path, cfg)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_tree(folder: Path) -> None:
    # Data must be on disk before the rename publishes the folder, or a crash could expose a
    # complete-looking folder with truncated files.
    for p in folder.iterdir():
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _install(tmp: Path, out_dir: Path) -> None:
    """Rename the finished folder into place, replacing an existing one."""
    if not out_dir.exists():
        os.replace(tmp, out_dir)
        return
    # A directory cannot be renamed over a non-empty one: move the old one aside first.
    old = out_dir.parent / f".old-{out_dir.name}-{secrets.token_hex(4)}"
    os.replace(out_dir, old)
    try:
        os.replace(tmp, out_dir)
    except BaseException:
        os.replace(old, out_dir)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _remove_stale_temps(out_dir: Path) -> None:
    """Delete temp folders left by conversions into ``out_dir`` whose process is gone (killed)."""
    pattern = re.compile(rf"^\.tmp-{re.escape(out_dir.name)}-(\d+)-[0-9a-f]{{8}}$")
    for p in out_dir.parent.iterdir():
        m = pattern.match(p.name)
        if m and p.is_dir() and not _pid_alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    except OSError:
        return True  # cannot tell (e.g. platform without signal 0): keep the folder
    return True
