"""MTP sidecars: publish -> load round trips for every naming (dense and MoE), loading beside a
4-bit base, refusals (no MTP tensors, shapes that do not fit), where a card's sidecar comes from,
and `python -m skulkp2p head train` on a tiny model."""

from __future__ import annotations

import copy
import json
import shutil
import tomllib
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from skulkp2p.cli import main as cli_main
from skulkp2p.engine.decode.loop import DecodeStats, decode
from skulkp2p.engine.decode.sampling import SamplingParams, make_rng
from skulkp2p.engine.drafting.mtp_drafter import MtpDrafter
from skulkp2p.engine.model.forward import LocalForward
from skulkp2p.engine.model.loaded import is_mtp_key, load_model
from skulkp2p.engine.model.mtp_head import load_mtp_head
from skulkp2p.engine.runner import loader
from skulkp2p.training import head_fit, head_init, prompt_batches, publish, train_run
from skulkp2p.training.head_options import PREFIXES, HeadError

TEXT = "The river was high after the rain. It carried branches, leaves and once a gate"
MAX_TOKENS = 24
HIDDEN, VOCAB, LAYERS, EXPERTS = 64, 512, 2, 4


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _strip(src: Path, dst: Path) -> Path:
    """A copy of `src` without its MTP tensors: what quantised or trimmed releases look like."""
    shutil.copytree(src, dst)
    n_layers = _config(src).get("num_hidden_layers") or _config(src)["text_config"][
        "num_hidden_layers"]
    for f in dst.glob("*.safetensors"):
        f.unlink()
    (dst / "model.safetensors.index.json").unlink(missing_ok=True)
    weights = {k: v for f in sorted(src.glob("*.safetensors"))
               for k, v in mx.load(str(f)).items() if not is_mtp_key(k, n_layers)}
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "pt"})
    return dst


def _decode(lm, head=None, depth=0, stats=None) -> list[int]:
    fwd = LocalForward(lm.model, hidden=head.conventions.hidden if head else None)
    prompt = lm.tokenizer.encode(TEXT)
    drafter = MtpDrafter(head) if head else None
    return list(decode(fwd, prompt, SamplingParams(), MAX_TOKENS, make_rng(0), drafter, depth,
                       stats))


def _rows(seed: int, n: int = 6) -> tuple[mx.array, mx.array]:
    rng = np.random.default_rng(seed)
    return (mx.array(rng.standard_normal((n, HIDDEN)).astype(np.float32)),
            mx.array(rng.integers(3, VOCAB, n)))


def _logits(head, hidden, tokens) -> np.ndarray:
    return np.array(head(hidden, tokens, head.make_cache(), all_logits=True).logits)


# --- a tiny MoE checkpoint (make_tiny_model writes dense ones only) ----------------------------


def _moe_config() -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 128,
        "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_experts": EXPERTS, "num_experts_per_tok": 2,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 32,
        "norm_topk_prob": True, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "rope_scaling": None, "tie_word_embeddings": False, "max_position_embeddings": 4096,
        "hidden_act": "silu", "bos_token_id": None, "eos_token_id": 2, "torch_dtype": "bfloat16",
    }


def _raw_layer(layer: nn.Module, prefix: str) -> dict[str, mx.array]:
    """A decoder layer's tensors as a raw checkpoint names them: one tensor per expert."""
    out = {}
    for k, v in tree_flatten(layer.parameters()):
        if ".switch_mlp." in k:
            base, proj = k.split(".switch_mlp.")
            for e in range(v.shape[0]):
                out[f"{prefix}{base}.experts.{e}.{proj}"] = v[e]
        else:
            out[prefix + k] = v
    return out


def make_moe_model(out: Path, style: str, tok: Path, shards: int = 1) -> Path:
    """A tiny qwen3_moe checkpoint (bf16, per-expert tensors, optionally sharded with an index)
    with an MoE MTP head in `style`'s naming; tokenizer from `tok` (a make_tiny_model folder)."""
    from mlx_lm.models import qwen3_moe

    out.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tok / name, out / name)
    config = _moe_config()
    args = qwen3_moe.ModelArgs.from_dict(config)
    mx.random.seed(7)
    trunk = qwen3_moe.Model(args)
    mx.random.seed(8)
    spare = qwen3_moe.Model(args)  # its first layer becomes the head's decoder layer
    weights: dict[str, mx.array] = {}
    for i, layer in enumerate(trunk.model.layers):
        weights.update(_raw_layer(layer, f"model.layers.{i}."))
    weights["model.embed_tokens.weight"] = trunk.model.embed_tokens.weight
    weights["model.norm.weight"] = trunk.model.norm.weight
    weights["lm_head.weight"] = trunk.lm_head.weight
    rng = np.random.default_rng(3)

    def norm() -> mx.array:
        return mx.array((1 + 0.05 * rng.standard_normal(HIDDEN)).astype(np.float32))

    proj = mx.array((rng.standard_normal((HIDDEN, 2 * HIDDEN)) * 0.09).astype(np.float32))
    if style == "qwen":
        p, names = "mtp.", ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")
        layer_prefix = "mtp.layers.0."
    elif style == "deepseek":
        p, names = f"model.layers.{LAYERS}.", ("eh_proj", "enorm", "hnorm", "shared_head.norm")
        layer_prefix = p
        weights[p + "embed_tokens.weight"] = weights["model.embed_tokens.weight"]
        weights[p + "shared_head.head.weight"] = weights["lm_head.weight"]
        config["num_nextn_predict_layers"] = 1
    else:
        p, names = "model.mtp_layers.0.", ("input_proj", "token_layernorm", "hidden_layernorm",
                                           "final_layernorm")
        layer_prefix = p
        config["num_nextn_predict_layers"] = 1
    weights[p + names[0] + ".weight"] = proj
    for n in names[1:]:
        weights[p + n + ".weight"] = norm()
    weights.update(_raw_layer(spare.model.layers[0], layer_prefix))
    weights = {k: v.astype(mx.bfloat16) for k, v in weights.items()}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    names_sorted = sorted(weights)
    if shards == 1:
        mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
        return out
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: weights[k] for k in names_sorted[s::shards]}
        mx.save_safetensors(str(out / file), part, metadata={"format": "pt"})
        weight_map.update({k: file for k in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return out


# --- publish -> load round trips --------------------------------------------------------------

CASES = [("llama", "qwen", False), ("llama", "deepseek", False), ("llama", "mimo", False),
         ("qwen3_5", "qwen", False), ("qwen3_moe", "qwen", True), ("qwen3_moe", "deepseek", True),
         ("qwen3_moe", "mimo", True)]


@pytest.mark.parametrize("family,style,moe", CASES)
def test_publish_load_round_trip(tmp_path, tiny_model, family, style, moe):
    if moe:
        src = make_moe_model(tmp_path / "src", style, tiny_model("llama"),
                             shards=2 if style == "qwen" else 1)
    else:
        src = tiny_model(family, mtp=True, mtp_style=style)
    side_dir = tmp_path / "side"
    assert cli_main(["head", "publish", str(src), str(side_dir)]) == 0
    sidecar = side_dir / "mtp.safetensors"
    names = set(mx.load(str(sidecar)))
    # The sidecar holds the head alone; experts are stacked; DeepSeek's copies are dropped.
    assert names and all(is_mtp_key(n, _config(src).get("num_hidden_layers", 4)) for n in names)
    assert not any(".experts." in n for n in names)
    assert moe == any(".switch_mlp." in n for n in names)
    assert not any("embed_tokens" in n or "shared_head.head" in n for n in names)
    prov = tomllib.loads((side_dir / "mtp.provenance.toml").read_text())
    conv = prov["conventions"]
    assert conv["style"] == style and conv["layers"] == 1 and conv["dtype"] == "bfloat16"
    assert conv["concat"] == ("hidden_first" if style == "mimo" else "embed_first")
    assert conv["norm_offset"] == (1.0 if family == "qwen3_5" else 0.0)
    assert prov["experts_restacked"] == moe
    for f in src.glob("*.safetensors"):
        assert prov["source"][f.name]["sha256"] == publish.sha256_file(f)
    assert prov["sidecar"]["sha256"] == publish.sha256_file(sidecar)

    base = _strip(src, tmp_path / "base")
    lm = load_model(base, "base", dtype="float32", sidecar=sidecar)
    assert lm.mtp is not None and lm.mtp.conventions.style == style
    original = load_mtp_head(src, lm.model, _config(src))  # from the original tensors
    hidden, tokens = _rows(1)
    np.testing.assert_array_equal(_logits(lm.mtp, hidden, tokens),
                                  _logits(original, hidden, tokens))
    plain = _decode(lm)
    for depth in (1, 3):
        stats = DecodeStats()
        assert _decode(lm, lm.mtp, depth, stats) == plain, f"depth {depth}"
        assert stats.drafted > 0
    text = lm.tokenizer.decode(plain).encode()
    assert lm.tokenizer.decode(_decode(lm, lm.mtp, 2)).encode() == text


def test_publish_refuses_a_checkpoint_without_mtp(tiny_models, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli_main(["head", "publish", str(tiny_models["llama"]), str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no MTP tensors" in err
    assert not (out / "mtp.safetensors").exists()


def test_head_train_refuses_an_unknown_model_before_touching_its_folder(tmp_path, capsys):
    """A bad --model ends `head train` with one line and status 1, and an earlier run's work
    folder is left as it was (it is cleared only once the model resolves)."""
    out = tmp_path / "trained"
    (out / ".train").mkdir(parents=True)
    (out / ".train" / "train-0000.npz").write_bytes(b"kept")
    assert cli_main(["head", "train", "--model", "no-such-card", "--out", str(out),
                     "--data-dir", str(tmp_path / "store")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no-such-card" in err
    assert (out / ".train" / "train-0000.npz").read_bytes() == b"kept"
    with pytest.raises(SystemExit) as e:  # argparse: a usage line, then the error
        cli_main(["head", "train", "--model", "x", "--out", str(out), "--gen-share", "0.9"])
    assert e.value.code == 2 and "--gen-share: must be between 0 and 0.85" in \
        capsys.readouterr().err


# --- beside a quantised base, and refusals --------------------------------------------------


@pytest.fixture(scope="module")
def llama_sidecar(tmp_path_factory, tiny_model) -> tuple[Path, Path, Path]:
    """(original with head, stripped base, sidecar file) for a tiny llama with a qwen head."""
    root = tmp_path_factory.mktemp("llama-side")
    src = tiny_model("llama", mtp=True, mtp_style="qwen")
    publish.publish(src, root / "side")
    return src, _strip(src, root / "base"), root / "side" / "mtp.safetensors"


def _quantise(base: Path, out: Path, bits: int = 4, group: int = 32) -> Path:
    from mlx_lm import convert
    convert(hf_path=str(base), mlx_path=str(out), quantize=True, q_bits=bits,
            q_group_size=group)
    return out


def test_sidecar_beside_a_4bit_base_quantises_to_match(llama_sidecar, tmp_path):
    src, base, sidecar = llama_sidecar
    q4 = _quantise(base, tmp_path / "q4")
    assert _config(q4)["quantization"]["bits"] == 4
    lm = load_model(q4, "q4", dtype="float32", sidecar=sidecar)
    for module in (lm.mtp.proj, lm.mtp.layer.self_attn.q_proj, lm.mtp.layer.mlp.down_proj):
        assert isinstance(module, nn.QuantizedLinear)
        assert (module.bits, module.group_size) == (4, 32)
    ref = load_model(src, "full", dtype="float32")
    hidden, tokens = _rows(2)
    a = _logits(ref.mtp, hidden, tokens)
    b = _logits(lm.mtp, hidden, tokens)
    assert np.corrcoef(a.ravel(), b.ravel())[0, 1] > 0.97  # 4-bit: close, not equal
    assert _decode(lm, lm.mtp, 3) == _decode(lm)


def test_shape_mismatch_is_refused_by_name(llama_sidecar, tmp_path):
    _, base, sidecar = llama_sidecar
    tensors = dict(mx.load(str(sidecar)))
    name = "mtp.layers.0.mlp.up_proj.weight"
    tensors[name] = mx.zeros((96, HIDDEN), mx.bfloat16)
    bad = tmp_path / "bad.safetensors"
    mx.save_safetensors(str(bad), tensors)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_model(base, "base", dtype="float32", sidecar=bad)
    # A head made for a wider model: the first mismatching tensor is named, too.
    tensors = dict(mx.load(str(sidecar)))
    tensors["mtp.fc.weight"] = mx.zeros((HIDDEN, 3 * HIDDEN), mx.bfloat16)
    mx.save_safetensors(str(bad), tensors)
    with pytest.raises(ValueError, match=r"mtp\.fc\.weight"):
        load_model(base, "base", dtype="float32", sidecar=bad)


# --- where a card's sidecar comes from ---------------------------------------------------------


def test_card_sidecar_local_path_folder_and_project_file(llama_sidecar, tmp_path, monkeypatch):
    _, base, sidecar = llama_sidecar
    cards = tmp_path / "cards"
    (cards / "sidecars" / "tiny").mkdir(parents=True)
    shutil.copy(sidecar, cards / "sidecars" / "tiny" / "mtp.safetensors")
    card = cards / "tiny.toml"
    assert loader.resolve_sidecar("sidecars/tiny/mtp.safetensors", card) == \
        cards / "sidecars" / "tiny" / "mtp.safetensors"
    assert loader.resolve_sidecar("sidecars/tiny", card).name == "mtp.safetensors"
    assert loader.resolve_sidecar(str(sidecar)) == sidecar
    with pytest.raises(FileNotFoundError, match="no file"):
        loader.resolve_sidecar("sidecars/missing/mtp.safetensors", card)
    # The whole path: a card in SKULKP2P_CARDS_DIR names its sidecar relative to itself.
    card.write_text(f'''id = "tiny-side"
family = "llama"
format = "mlx"
layers = 4
hidden_size = {HIDDEN}
kv_heads = 2
context_length = 4096
size_bytes = 1000000
[source]
kind = "local"
path = "{base}"
[speculation]
mtp_sidecar = "sidecars/tiny/mtp.safetensors"
mtp_max_depth = 2
''')
    monkeypatch.setenv("SKULKP2P_CARDS_DIR", str(cards))
    from skulkp2p.models.store import ModelStore
    lm = loader.open_model(ModelStore(tmp_path / "data"), "tiny-side", dtype="float32")
    assert lm.mtp is not None and lm.mtp.conventions.max_depth == 2


def test_card_sidecar_from_hf_repo(tmp_path, monkeypatch):
    import huggingface_hub
    got = {}
    fake = tmp_path / "mtp.safetensors"
    fake.write_bytes(b"")

    def download(repo, filename, **kw):
        got["args"] = (repo, filename)
        return str(fake)

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    assert loader.resolve_sidecar("hf:someone/smol-mtp") == fake
    assert got["args"] == ("someone/smol-mtp", "mtp.safetensors")
    # A bare owner/repo that is no local path means the hub too.
    assert loader.resolve_sidecar("someone/other", tmp_path / "card.toml") == fake
    assert got["args"][0] == "someone/other"


def test_card_sidecar_from_hf_offline(tmp_path, monkeypatch):
    import huggingface_hub
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cached = tmp_path / "cached.safetensors"
    monkeypatch.setattr(huggingface_hub, "hf_hub_download",
                        lambda *a, **k: pytest.fail("no network call when offline"))
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **k: None)
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache and "
                                                "HF_HUB_OFFLINE is set"):
        loader.resolve_sidecar("hf:someone/smol-mtp")
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **k: str(cached))
    assert loader.resolve_sidecar("hf:someone/smol-mtp") == cached


# --- training ---------------------------------------------------------------------------------


@pytest.mark.training
@pytest.mark.parametrize("kind,data", [("eagle", "broad"), ("qwen", "stdlib")])
def test_head_train_on_a_tiny_model(tiny_models, tmp_path, monkeypatch, kind, data):
    base = tiny_models["llama"]
    out = tmp_path / "trained"
    p = PREFIXES[kind]
    common = ["head", "train", "--model", str(base), "--out", str(out), "--batch", "4",
              "--gen-tokens", "12", "--max-batches", "2", "--eval-tokens", "40", "--kind", kind,
              "--data", data, "--heldout-batches", "2"]
    if data == "stdlib":
        common += ["--limit-files", "30", "--heldout-batch", "4"]
        # The resumed run below builds the very prompts the first run built (the same files,
        # seed and tokenizer): it gets a copy of them rather than parsing the stdlib again
        # (~5 s: ast.get_source_segment splits a whole file into lines per function).
        build, built = train_run.build_prompts, {}

        def build_once(tokenizer, seed, limit_files=None):
            if (seed, limit_files) not in built:
                built[seed, limit_files] = build(tokenizer, seed, limit_files)
            return copy.deepcopy(built[seed, limit_files])

        monkeypatch.setattr(train_run, "build_prompts", build_once)
    assert cli_main([*common, "--steps", "3"]) == 0
    prov = tomllib.loads((out / "mtp.provenance.toml").read_text())
    assert prov["conventions"]["style"] == kind
    assert prov["training"]["steps"] == 3
    acc = prov["acceptance"]
    assert [len(acc[f"depth{d}_per_position"]) for d in (1, 2, 3)] == [1, 2, 3]
    assert all(0.0 <= a <= 1.0 for a in acc["depth3_per_position"])
    tensors = mx.load(str(out / "mtp.safetensors"))
    assert tensors[p + "fc.weight"].dtype == mx.bfloat16
    assert "lm_head.weight" not in tensors and p + "vocab_ids" in tensors
    assert (p + "fc.bias" in tensors) == (kind == "eagle")

    lm = load_model(base, "tiny", dtype="float32", sidecar=out / "mtp.safetensors")
    head = lm.mtp
    assert head is not None and head.conventions.hidden == "after"
    assert head.conventions.style == kind
    ids = np.array(head.vocab_ids)
    assert len(ids) == tensors[p + "vocab_ids"].size <= VOCAB
    hidden, tokens = _rows(4)
    logits = _logits(head, hidden, tokens)
    assert logits.shape[-1] == VOCAB  # full vocabulary, -inf outside the draft vocabulary
    assert np.isin(logits.argmax(-1), ids).all()
    assert _decode(lm, head, 3) == _decode(lm)
    if kind == "qwen":
        # --init-from: an eagle head warm-started from this one drafts exactly as it does.
        warm = head_init.warm_start_tensors(base, lm.model, _config(base),
                                                out / "mtp.safetensors", ids, "eagle")
        mx.save_safetensors(str(tmp_path / "warm.safetensors"), warm)
        lw = load_model(base, "tiny", dtype="float32", sidecar=tmp_path / "warm.safetensors")
        assert lw.mtp.conventions.style == "eagle"
        np.testing.assert_allclose(_logits(lw.mtp, hidden, tokens), logits, rtol=1e-5,
                                   atol=1e-5)

    # The shards record the temperature each was answered at, and the provenance says it.
    temps = sorted(round(float(np.load(f)["temperature"]), 3)
                   for f in (out / ".train").glob("train-*"))
    assert temps == [0.0, 0.8]
    assert "temperature 0.8)" in prov["training"]["data"]

    # Resumable: the checkpoint carries the step; a resumed run goes on from it (here with
    # noisy training features; the eagle run also adds terse answers and the second step's loss).
    before = {f.name: f.read_bytes() for f in (out / ".train").glob("train-*")}
    extra = ["--terse", "4", "--depth2-weight", "0.5"] if data == "broad" else []
    assert cli_main([*common, "--steps", "5", "--resume", "--feature-noise", "0.1",
                     *extra]) == 0
    state = json.loads((out / ".train" / "state.json").read_text())
    assert state["step"] == 5 and len(state["runs"]) == 2
    after = {f.name: f.read_bytes() for f in (out / ".train").glob("train-*")}
    assert {k: after[k] for k in before} == before  # the shards already there are kept as they were
    assert sorted(set(after) - set(before)) == (["train-terse-0000.npz"] if extra else [])
    if extra:
        training = tomllib.loads((out / "mtp.provenance.toml").read_text())["training"]
        assert training["depth2_weight"] == 0.5 and training["terse_prompts"] == 4
        assert training["train_shards"] == 3
    runs = tomllib.loads((out / "mtp.provenance.toml").read_text())["training"]["runs"]
    assert [r.split("steps ")[1].split(",")[0] for r in runs] == ["0-3", "3-5"]
    # Beside a 4-bit base the reduced head is quantised too (from the base's quantised rows).
    q4 = _quantise(base, tmp_path / "q4")
    lq = load_model(q4, "q4", dtype="float32", sidecar=out / "mtp.safetensors")
    assert isinstance(lq.mtp.vocab_head, nn.QuantizedLinear)
    assert _decode(lq, lq.mtp, 2) == _decode(lq)


@pytest.mark.training
def test_skipped_batches_stay_out_of_training(tiny_models, tmp_path, capsys):
    """--skip-batches: a broad batch held for validation (`head validation-shards` answers it)
    is never answered into a training shard, and a folder that already trained on it, or an
    index past the list, is refused."""
    import random

    from skulkp2p.engine.model.loaded import load_model as load
    base = tiny_models["llama"]
    out = tmp_path / "trained"
    common = ["head", "train", "--model", str(base), "--out", str(out), "--batch", "4",
              "--gen-tokens", "4", "--prompt-tokens", "96", "--max-batches", "3",
              "--heldout-batches", "1", "--generate-only", "--resume"]
    assert cli_main([*common, "--skip-batches", "1"]) == 0
    work = out / ".train"
    assert sorted(f.name for f in work.glob("train-*")) == ["train-0000.npz", "train-0002.npz"]
    # The skipped batch is the one `head validation-shards` answers at --batch-index 1: its
    # prompts are in no training shard.
    tok = load(base, "tiny", dtype="float32").tokenizer
    train_p, _, _ = prompt_batches.build_broad_prompts(tok, 0)
    batches = prompt_batches.batches_of(train_p, 4, 96, prompt_batches.tail_length(tok))
    random.Random(0).shuffle(batches)
    held_back = {tuple(p) for p in batches[1]}
    for f in work.glob("train-*"):
        s = np.load(f)
        trained = {tuple(row[:int(s["prompt_len"])]) for row in s["tokens"].tolist()}
        assert trained and not trained & held_back, f.name
    capsys.readouterr()
    for skip, why in (("0", "already answered"), ("3", "must be below 3")):
        assert cli_main([*common, "--skip-batches", skip]) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and why in err, err


def test_broad_training_prompts_hold_no_heldout_validation_or_bench_text():
    """What acceptance is measured on stays out of the training list: the held-out and validation
    prompts and the bench's messages are none of the broad list's prompts, nor inside one."""
    from skulkp2p.bench.workloads import WORKLOADS
    from skulkp2p.training.sidecar_prompts import HELDOUT_PROMPTS, VALIDATION_PROMPTS, train_prompts
    bench = [m["content"] for msgs in WORKLOADS.values() for m in msgs
             if isinstance(m.get("content"), str) and m["content"].strip()]
    training = train_prompts(0)
    assert len(training) > 2000 and bench
    measured = [*HELDOUT_PROMPTS, *VALIDATION_PROMPTS, *bench]
    for text in training:
        assert all(text not in m and m not in text for m in measured), text


def test_terse_prompts_are_fresh_and_deterministic():
    from skulkp2p.bench.workloads import WORKLOADS
    from skulkp2p.training.sidecar_prompts import HELDOUT_PROMPTS, TERSE_QUESTIONS, terse_prompts
    prompts = terse_prompts(0, 50)
    assert prompts == terse_prompts(0, 50) and prompts != terse_prompts(1, 50)
    assert len(set(prompts)) == 50
    bench = " ".join(m["content"] for msgs in WORKLOADS.values() for m in msgs
                     if isinstance(m.get("content"), str))
    for q in TERSE_QUESTIONS:
        assert q not in bench and all(q not in h for h in HELDOUT_PROMPTS), q
    for text in prompts:
        header, *questions = text.split("\n")
        assert 3 <= len(questions) <= 5 and header not in bench
        assert [q.split(". ", 1)[0] for q in questions] == [str(i + 1) for i in
                                                            range(len(questions))]


@pytest.mark.training
def test_a_larger_terse_count_adds_only_messages_not_yet_answered(tmp_path):
    """--terse N then a larger N': the batches N made stay first and unchanged, and the new
    ones hold only messages no earlier batch answered (re-sorting the whole list by length
    mixed 181 of 576 answered messages into the new batches)."""
    import random
    rng = random.Random(0)
    # Message i starts with token i (the cut keeps a prompt's head), lengths spread as the
    # terse list's are; 2 tail tokens stand for the chat template's.
    prompts = [[i] + [7] * rng.randint(6, 40) + [1, 2] for i in range(300)]
    ids = lambda batches: [p[0] for b in batches for p in b]  # noqa: E731
    first = prompt_batches.terse_batches(prompts, [100], 8, 64, 2, seed=3)
    both = prompt_batches.terse_batches(prompts, [100, 300], 8, 64, 2, seed=3)
    assert both[:len(first)] == first
    assert len(ids(both)) == len(set(ids(both))), "a message answered twice"
    assert set(ids(first)) <= set(range(100)) and len(ids(both)) >= 300 - 8 * 2
    # The one-round list is batched as before rounds existed (older work folders' shards).
    old = prompt_batches.batches_of(prompts, 8, 64, 2)
    random.Random(3 + 2).shuffle(old)
    assert prompt_batches.terse_batches(prompts, [300], 8, 64, 2, seed=3) == old
    # The counts are kept in the work folder: only a larger one adds a round.
    manifest = tmp_path / "terse.json"
    assert prompt_batches.terse_bounds(manifest, 100, shards_made=False) == [100]
    assert prompt_batches.terse_bounds(manifest, 300, shards_made=True) == [100, 300]
    assert prompt_batches.terse_bounds(manifest, 200, shards_made=True) == [100, 300]
    manifest.unlink()
    with pytest.raises(HeadError, match="terse.json"):
        prompt_batches.terse_bounds(manifest, 300, shards_made=True)


@pytest.mark.training
def test_feature_noise_jitters_only_the_training_features():
    rng = np.random.default_rng(0)
    n_seq, n, dim, vocab = 4, 9, 16, 50
    shard = {"tokens": rng.integers(0, vocab, (n_seq, n)).astype(np.int32),
             "hidden": rng.normal(size=(n_seq, n, dim)).astype(np.float16),
             "top_ids": rng.integers(0, vocab, (n_seq, n, 8)).astype(np.int32),
             "top_vals": rng.normal(size=(n_seq, n, 8)).astype(np.float16),
             "prompt_len": np.array(3, np.int32), "ends": np.full(n_seq, n, np.int32)}
    vocab_ids = np.arange(0, vocab, 2)
    clean = head_fit.Batches([shard], vocab_ids, vocab, n_seq, seed=1).sample()
    noisy = head_fit.Batches([shard], vocab_ids, vocab, n_seq, seed=1,
                                  feature_noise=0.1).sample()
    for a, b in zip(clean[1:], noisy[1:], strict=True):  # tokens, targets, weights: untouched
        np.testing.assert_array_equal(np.array(a), np.array(b))
    h, hn = np.array(clean[0]), np.array(noisy[0])
    rms = np.sqrt((h * h).mean(-1, keepdims=True))
    delta = np.abs(hn - h) / rms
    assert delta.max() <= 0.1 + 1e-5 and delta.mean() > 0.02  # jittered, within ±10% of RMS
