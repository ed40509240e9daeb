"""Tests for tests/helpers/tiny_model.py: the tiny random models other tests serve."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache
from mlx_lm.utils import load_model, load_tokenizer
from tokenizers import Tokenizer

from tests.helpers import ROOT
from tests.helpers import tiny_model as tiny

FAMILIES = ["llama", "qwen3", "qwen3_5"]
MTP_CASES = [
    ("llama", "qwen"),
    ("llama", "deepseek"),
    ("llama", "mimo"),
    ("qwen3", "qwen"),
    ("qwen3_5", "qwen"),
]
FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
FILES += ["tokenizer_config.json"]
IM_START, IM_END, ENDOFTEXT = 1, 2, 0


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """build(family, seed=0, mtp=False, style="qwen") -> Path, made once per module."""
    made: dict[tuple, Path] = {}

    def _build(family: str, seed: int = 0, mtp: bool = False, style: str = "qwen") -> Path:
        key = (family, seed, mtp, style)
        if key not in made:
            out = tmp_path_factory.mktemp(f"{family}-{seed}-{int(mtp)}-{style}")
            made[key] = tiny.make_tiny_model(family, out, seed=seed, mtp=mtp, mtp_style=style)
        return made[key]

    return _build


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _text_config(path: Path) -> dict:
    config = json.loads((path / "config.json").read_text())
    return config.get("text_config", config)


def _logits(model, tokens: list[int]) -> mx.array:
    out = model(mx.array([tokens]))
    mx.eval(out)
    return out


# --- loading and generating ---------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_loads_and_generates(build, family):
    model, tok = mlx_lm.load(str(build(family)))
    text = mlx_lm.generate(model, tok, "The river was high", max_tokens=20)
    assert isinstance(text, str) and text

    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
    )
    tokens = [r.token for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=20)]
    # Special tokens' logits are damped, so greedy decoding runs the full length.
    assert len(tokens) == 20
    assert len(set(tokens)) >= 2, tokens
    # Logits are spread out, not flat.
    assert _logits(model, prompt)[0, -1].astype(mx.float32).std().item() > 0.3


def test_qwen3_5_is_hybrid_and_sanitized_like_a_raw_checkpoint(build):
    path = build("qwen3_5")
    model, _ = mlx_lm.load(str(path))
    kinds = [layer.is_linear for layer in model.layers]
    assert kinds == [True, False, True, False]
    cache = model.make_cache()
    assert [type(c) for c in cache] == [ArraysCache, KVCache, ArraysCache, KVCache]

    raw = mx.load(str(path / "model.safetensors"))
    assert all(k.startswith(("model.language_model.", "lm_head.")) for k in raw)
    conv = raw["model.language_model.layers.0.linear_attn.conv1d.weight"]
    assert conv.shape[1] == 1  # PyTorch [C, 1, K]; mlx-lm moves it to [C, K, 1]
    layer0 = model.language_model.model.layers[0]
    assert layer0.linear_attn.conv1d.weight.shape == (conv.shape[0], conv.shape[2], 1)

    # Stored zero-centred; sanitize adds 1 to the trunk's RMSNorms, not to the gated norm.
    stored = raw["model.language_model.layers.0.input_layernorm.weight"]
    assert abs(stored.astype(mx.float32).mean().item()) < 0.1
    assert mx.allclose(layer0.input_layernorm.weight, stored + 1.0).item()
    gated = raw["model.language_model.layers.0.linear_attn.norm.weight"]
    assert mx.array_equal(layer0.linear_attn.norm.weight, gated).item()
    q_norm = raw["model.language_model.layers.1.self_attn.q_norm.weight"]
    loaded_q_norm = model.language_model.model.layers[1].self_attn.q_norm.weight
    assert mx.allclose(loaded_q_norm, q_norm + 1.0).item()


# --- determinism ------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_same_seed_same_bytes(build, tmp_path, family):
    first = build(family, seed=0)
    again = tiny.make_tiny_model(family, tmp_path / "again", seed=0)
    for name in FILES:
        assert _sha256(first / name) == _sha256(again / name), name

    other = build(family, seed=1)
    assert _sha256(first / "model.safetensors") != _sha256(other / "model.safetensors")
    # The tokenizer does not depend on the seed.
    assert _sha256(first / "tokenizer.json") == _sha256(other / "tokenizer.json")


@pytest.mark.process
def test_cli_in_a_fresh_process_matches(build, tmp_path):
    out = tmp_path / "cli"
    args = ["--family", "llama", "--out", str(out), "--seed", "0", "--mtp", "--mtp-style", "mimo"]
    subprocess.run([sys.executable, "-m", "tests.helpers.tiny_model", *args], check=True,
                   capture_output=True, cwd=ROOT)
    expected = build("llama", mtp=True, style="mimo")
    for name in [*FILES, "mtp_conventions.json"]:
        assert _sha256(out / name) == _sha256(expected / name), name


def test_families_and_seeds_draw_different_weights(build):
    llama = mx.load(str(build("llama") / "model.safetensors"))
    qwen3 = mx.load(str(build("qwen3") / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert llama[name].shape == qwen3[name].shape
    assert not mx.array_equal(llama[name], qwen3[name]).item()


def test_cli_rejects_bad_combinations(tmp_path):
    with pytest.raises(SystemExit):
        tiny.main(["--family", "llama", "--out", str(tmp_path), "--mtp-style", "mimo"])
    with pytest.raises(SystemExit):
        tiny.main(["--family", "qwen3_5", "--out", str(tmp_path), "--mtp", "--mtp-style", "mimo"])
    with pytest.raises(ValueError):
        tiny.make_tiny_model("gpt2", tmp_path)


# --- tokenizer --------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_template_and_tokenizer(build, family):
    path = build(family)
    tok = load_tokenizer(path)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert ids[0] == IM_START and ids.count(IM_START) == 3 and ids.count(IM_END) == 2
    assert tok.decode(ids) == text
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == IM_END
    assert tok.vocab_size == _text_config(path)["vocab_size"] == 512

    # transformers rebuilds qwen3_5's pipeline from code; it must match tokenizer.json,
    # or `tokenizers` and transformers would split the same text differently.
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    backend = json.loads(tok._tokenizer.backend_tokenizer.to_str())
    on_disk = json.loads(raw.to_str())
    for part in ("normalizer", "pre_tokenizer", "decoder"):
        assert backend[part] == on_disk[part], part
    sample = "Room 2024, café cafe\u0301 — naïve\n\n  x = [1, 22, 333]  🙂 <|im_end|>"
    assert tok.encode(sample) == raw.encode(sample).ids
    assert tok.decode(tok.encode(sample)) == sample.replace("e\u0301", "é")  # NFC


def test_eos_ids_come_from_generation_config(build):
    _, tok = mlx_lm.load(str(build("llama")))
    assert set(tok.eos_token_ids) == {IM_END, ENDOFTEXT}


# --- MTP heads --------------------------------------------------------------------------


def _expected_mtp_shapes(family: str, style: str, cfg: dict) -> dict[str, tuple]:
    """Written from the family's published naming, independently of the tool's tables."""
    h, v, inter = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    q_out = 2 * heads * hd if family == "qwen3_5" else heads * hd  # qwen3_5 gates attention

    def layer(p: str) -> dict[str, tuple]:
        shapes = {
            f"{p}input_layernorm.weight": (h,),
            f"{p}post_attention_layernorm.weight": (h,),
            f"{p}self_attn.q_proj.weight": (q_out, h),
            f"{p}self_attn.k_proj.weight": (kv * hd, h),
            f"{p}self_attn.v_proj.weight": (kv * hd, h),
            f"{p}self_attn.o_proj.weight": (h, heads * hd),
            f"{p}mlp.gate_proj.weight": (inter, h),
            f"{p}mlp.up_proj.weight": (inter, h),
            f"{p}mlp.down_proj.weight": (h, inter),
        }
        if family != "llama":
            shapes[f"{p}self_attn.q_norm.weight"] = (hd,)
            shapes[f"{p}self_attn.k_norm.weight"] = (hd,)
        return shapes

    if style == "qwen":
        return {
            "mtp.fc.weight": (h, 2 * h),
            "mtp.pre_fc_norm_embedding.weight": (h,),
            "mtp.pre_fc_norm_hidden.weight": (h,),
            "mtp.norm.weight": (h,),
            **layer("mtp.layers.0."),
        }
    if style == "deepseek":
        p = f"model.layers.{cfg['num_hidden_layers']}."
        return {
            f"{p}embed_tokens.weight": (v, h),
            f"{p}enorm.weight": (h,),
            f"{p}hnorm.weight": (h,),
            f"{p}eh_proj.weight": (h, 2 * h),
            f"{p}shared_head.norm.weight": (h,),
            f"{p}shared_head.head.weight": (v, h),
            **layer(p),
        }
    p = "model.mtp_layers.0."
    return {
        f"{p}token_layernorm.weight": (h,),
        f"{p}hidden_layernorm.weight": (h,),
        f"{p}input_proj.weight": (h, 2 * h),
        f"{p}final_layernorm.weight": (h,),
        **layer(p),
    }


@pytest.mark.parametrize(("family", "style"), MTP_CASES)
def test_mtp_head(build, family, style):
    path = build(family, mtp=True, style=style)
    plain = build(family)
    cfg = _text_config(path)
    weights = mx.load(str(path / "model.safetensors"))
    trunk = mx.load(str(plain / "model.safetensors"))

    expected = _expected_mtp_shapes(family, style, cfg)
    assert set(weights) == set(trunk) | set(expected)
    for name, shape in expected.items():
        assert weights[name].shape == shape, name
        assert weights[name].dtype == mx.bfloat16, name
    # The head is extra: every trunk tensor is the same as without --mtp.
    for name, value in trunk.items():
        assert mx.array_equal(weights[name], value).item(), name

    count_key = "mtp_num_hidden_layers" if style == "qwen" else "num_nextn_predict_layers"
    assert cfg[count_key] == 1
    assert count_key not in _text_config(plain)

    # Norm centring follows the trunk's: zero-centred (x * (1 + w)) only for qwen3_5.
    centre = 0.0 if family == "qwen3_5" else 1.0
    norms = [n for n, shape in expected.items() if len(shape) == 1]  # all 1-D ones are norms
    assert len(norms) >= 5
    for name in norms:
        assert abs(weights[name].astype(mx.float32).mean().item() - centre) < 0.05, name

    conventions = json.loads((path / "mtp_conventions.json").read_text())
    assert (conventions["family"], conventions["style"]) == (family, style)
    assert conventions["norm_convention"] == ("zero_centred" if centre == 0.0 else "plain")
    assert sorted(conventions["norm_tensors"]) == sorted(norms)
    for key in ("embedding", "final_norm", "lm_head"):
        assert conventions[key] in weights, key
    assert conventions["combine"]["proj"] in expected

    if style == "deepseek":
        p = f"model.layers.{cfg['num_hidden_layers']}."
        assert mx.array_equal(
            weights[f"{p}embed_tokens.weight"], trunk["model.embed_tokens.weight"]
        )
        assert mx.array_equal(weights[f"{p}shared_head.head.weight"], trunk["lm_head.weight"])


@pytest.mark.parametrize(("family", "style"), MTP_CASES)
def test_mtp_head_and_mlx_lm_load(build, family, style):
    path = build(family, mtp=True, style=style)
    reference, _ = mlx_lm.load(str(build(family)))
    tokens = [IM_START, 300, 301, 302, 303]
    if family == "qwen3_5":
        # qwen3_5's sanitize() drops every "mtp." tensor: the strict load just works.
        model, _ = mlx_lm.load(str(path))
    else:
        # llama and qwen3 keep unknown tensors, and the strict load refuses them.
        n = len(_expected_mtp_shapes(family, style, _text_config(path)))
        with pytest.raises(ValueError, match=f"Received {n} parameters not in model"):
            mlx_lm.load(str(path))
        model, _ = load_model(path, strict=False)
    assert mx.array_equal(_logits(model, tokens), _logits(reference, tokens)).item()
