"""The Gemma 4 assistant drafter (engine/drafting/assistant.py) on the tiny gemma4_text target and its two
tiny assistants (centroid head, tied dense head) from tests/helpers/tiny_gemma4.py.

Random weights draft tokens the target rarely keeps, so these tests check what must hold for
any weights: greedy output byte-identical to plain decoding and to mlx-lm's own generation
(past the sliding window, so the rotating caches wrap and are rolled back by snapshot); the
drafts of every round computed from the target's live cache equal the drafts computed from a
cache rebuilt from scratch over the same tokens (nothing a rejection undid is read, a wrapped
cache is read in time order); the checkpoints' tensor names; the pair check naming the field;
the card fields. The sampled exactness test lives with the other chi-square tests
(test_sampling_exactness.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import load as mlx_load
from mlx_lm.generate import generate_step

from skulkp2p.engine.decode.loop import DecodeStats, decode
from skulkp2p.engine.decode.sampling import SamplingParams
from skulkp2p.engine.drafting.assistant import (
    AssistantDrafter,
    AssistantError,
    draft_row,
    load_assistant,
)
from skulkp2p.engine.model.forward import LocalForward
from skulkp2p.engine.model.loaded import load_model
from skulkp2p.engine.request import RequestError
from skulkp2p.engine.runner import generate as engine_generate
from skulkp2p.formats.pipe_format import parse_request
from skulkp2p.models.cards import CardError, parse_card
from tests.helpers import tiny_gemma4
from tests.helpers.gemma_cards import write_gemma_card

KINDS = ("ordered", "dense")
PROMPT = "The river was high after the rain, and the"
TOKENS = 48  # three times the sliding window (16): the rotating caches wrap


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("gemma4")
    paths = {"target": tiny_gemma4.make_target(base / "gemma4-tiny")}
    for kind in KINDS:
        paths[kind] = tiny_gemma4.make_assistant(base / f"assistant-{kind}", kind)
    return paths


@pytest.fixture(scope="module")
def target(gemma):
    model, tokenizer = mlx_load(str(gemma["target"]))
    return model, tokenizer


def _mlx_lm_greedy(model, prompt: list[int], n: int) -> list[int]:
    steps = generate_step(mx.array(prompt), model)
    return [int(tok) for tok, _ in (next(steps) for _ in range(n))]


def test_tiny_models_are_deterministic_and_named_as_published(gemma, tmp_path):
    again = tiny_gemma4.make_assistant(tmp_path / "a", "ordered")
    assert (again / "model.safetensors").read_bytes() == (
        gemma["ordered"] / "model.safetensors").read_bytes()
    names = set(mx.load(str(gemma["ordered"] / "model.safetensors")))
    published = {"pre_projection.weight", "post_projection.weight", "model.embed_tokens.weight",
                 "model.norm.weight", "masked_embedding.centroids.weight",
                 "masked_embedding.token_ordering"}
    for i in range(4):
        p = f"model.layers.{i}."
        published |= {p + n + ".weight" for n in (
            "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
            "post_feedforward_layernorm", "self_attn.q_proj", "self_attn.q_norm",
            "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
        published.add(p + "layer_scalar")
    assert names == published
    ordering = mx.load(str(gemma["ordered"] / "model.safetensors"))[
        "masked_embedding.token_ordering"]
    assert ordering.dtype == mx.int64 and sorted(ordering.tolist()) == list(range(512))
    dense = set(mx.load(str(gemma["dense"] / "model.safetensors")))
    assert dense == published - {"masked_embedding.centroids.weight",
                                 "masked_embedding.token_ordering"}
    assert json.loads((gemma["dense"] / "config.json").read_text())["model_type"] == \
        "gemma4_unified_assistant"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("depth", [1, 3])
def test_greedy_is_plain_and_mlx_lm(target, gemma, kind, depth):
    model, tokenizer = target
    prompt = tokenizer.encode(PROMPT)
    assistant = load_assistant(gemma[kind], model, mx.bfloat16)
    stats = DecodeStats()
    drafter = AssistantDrafter(assistant, SamplingParams(), np.random.default_rng(0))
    spec = list(decode(LocalForward(model, hidden="after"), prompt, SamplingParams(), TOKENS,
                       np.random.default_rng(0), drafter, depth, stats))
    plain = list(decode(LocalForward(model), prompt, SamplingParams(), TOKENS,
                        np.random.default_rng(0)))
    assert spec == plain == _mlx_lm_greedy(model, prompt, TOKENS)
    assert stats.drafted >= (TOKENS // (depth + 1)) * depth  # it drafted every round


class _Recording(AssistantDrafter):
    """Keeps, for every round, the history and the first draft's logits from the live cache."""

    def __init__(self, *args):
        super().__init__(*args)
        self.rounds: list[tuple[list[int], np.ndarray]] = []

    def propose(self, history, k):
        if self.carry is not None and len(history) >= 2:
            row = draft_row(self.assistant, self.forward.cache, self.carry, history[-1])
            self.rounds.append((list(history), np.array(row.astype(mx.float32))))
        return super().propose(history, k)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("query_position", ["last", "next"])
def test_drafts_read_the_live_cache_as_a_rebuilt_one(gemma, kind, query_position):
    """After every rollback (trims, and snapshot restores once the sliding caches wrap) the
    assistant's first logits row equals the one computed over caches prefilled from scratch
    with the same tokens (float32: only summation order differs)."""
    model, tokenizer = mlx_load(str(gemma["target"]))
    model.set_dtype(mx.float32)
    prompt = tokenizer.encode(PROMPT)
    assistant = load_assistant(gemma[kind], model, mx.float32, query_position=query_position)
    # A drafter that proposes the target's own greedy tokens would never reject; random
    # assistant drafts are rejected nearly always, which is the case to check.
    drafter = _Recording(assistant, SamplingParams(), np.random.default_rng(0))
    list(decode(LocalForward(model, hidden="after"), prompt, SamplingParams(), TOKENS,
                np.random.default_rng(0), drafter, 3))
    assert len(drafter.rounds) >= TOKENS // 4
    assert len(drafter.rounds[-1][0]) - 1 > 2 * tiny_gemma4.SLIDING_WINDOW  # wrapped
    for history, live in drafter.rounds[::3]:
        fresh = LocalForward(model, hidden="after")
        fresh.prefill(history[:-1])
        rebuilt = draft_row(assistant, fresh.cache, fresh.last_hidden[-1:], history[-1])
        np.testing.assert_allclose(live, np.array(rebuilt), atol=2e-4, rtol=1e-4)


def test_live_cache_check_catches_a_stale_cache(gemma):
    """The check above fails when the assistant reads a cache one round old (its power)."""
    model, tokenizer = mlx_load(str(gemma["target"]))
    model.set_dtype(mx.float32)
    prompt = tokenizer.encode(PROMPT)
    assistant = load_assistant(gemma["dense"], model, mx.float32)
    fresh = LocalForward(model, hidden="after")
    fresh.prefill(prompt[:-1])
    right = draft_row(assistant, fresh.cache, fresh.last_hidden[-1:], prompt[-1])
    stale = LocalForward(model, hidden="after")
    stale.prefill(prompt[:-2])
    wrong = draft_row(assistant, stale.cache, fresh.last_hidden[-1:], prompt[-1])
    assert not np.allclose(np.array(right), np.array(wrong), atol=2e-4)


def test_engine_runs_the_assistant_explicit_and_auto(gemma):
    loaded = load_model(gemma["target"], "gemma4-tiny", dtype="bfloat16")
    req = parse_request({"prompt": PROMPT, "max_tokens": 24, "speculation": "off"})
    plain = engine_generate.run(loaded, req)
    with pytest.raises(RequestError, match="no assistant drafter"):
        engine_generate.run(loaded, parse_request(
            {"prompt": PROMPT, "max_tokens": 4, "speculation": {"drafter": "assistant"}}))
    loaded.assistant = load_assistant(gemma["ordered"], loaded.model, mx.bfloat16, block_size=3)
    explicit = engine_generate.run(loaded, parse_request(
        {"prompt": PROMPT, "max_tokens": 24, "speculation": {"drafter": "assistant"}}))
    assert explicit.tokens == plain.tokens
    assert explicit.speculation.drafter == "assistant"
    assert explicit.speculation.max_depth == 2  # block size 3: the verified token + 2 drafts
    assert explicit.speculation.drafted > 0
    auto = engine_generate.run(loaded, parse_request({"prompt": PROMPT, "max_tokens": 24}))
    assert auto.tokens == plain.tokens
    assert "assistant" in auto.speculation.drafter


def _copy_with(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("edit,field", [
    (lambda c: c.update(backbone_hidden_size=32), "backbone_hidden_size"),
    (lambda c: c["text_config"].update(head_dim=8), "text_config.head_dim"),
    (lambda c: c["text_config"].update(global_head_dim=16), "text_config.global_head_dim"),
    (lambda c: c["text_config"].update(num_attention_heads=2), "text_config.num_attention_heads"),
    (lambda c: c.update(model_type="gemma4_text"), "model_type"),
])
def test_a_mismatched_pair_is_refused_naming_the_field(target, gemma, tmp_path, edit, field):
    bad = _copy_with(gemma["dense"], tmp_path / "bad", edit)
    with pytest.raises(AssistantError, match=f"'?{field}'?"):
        load_assistant(bad, target[0])


def test_missing_tensors_are_refused(target, gemma, tmp_path):
    # An ordered config over the dense checkpoint: the centroid tensors are missing.
    bad = _copy_with(gemma["dense"], tmp_path / "bad",
                     lambda c: c.update(use_ordered_embeddings=True))
    with pytest.raises(AssistantError, match="do not match"):
        load_assistant(bad, target[0])


def test_the_assistant_needs_a_gemma4_target(gemma, tiny_model):
    from mlx_lm import load
    llama, _ = load(str(tiny_model("llama")))
    with pytest.raises(AssistantError, match="Gemma 4 target"):
        load_assistant(gemma["dense"], llama)


BASE_CARD = {"id": "g", "family": "gemma4_text", "format": "mlx", "layers": 6,
             "hidden_size": 64, "kv_heads": 2, "context_length": 4096, "size_bytes": 1,
             "source": {"kind": "local", "path": "."}}


def _card(**sections):
    return parse_card({**BASE_CARD, **sections}, Path("card.toml"))


def test_card_fields():
    card = _card(speculation={"drafter": "assistant", "assistant_model":
                              "hf:mlx-community/gemma-4-E4B-it-assistant-bf16",
                              "assistant_block_size": 4})
    assert card.speculation["assistant_block_size"] == 4
    for spec, field in [({"drafter": "assistant"}, "speculation.assistant_model"),
                        ({"drafter": "eagle"}, "speculation.drafter"),
                        ({"assistant_model": "x"}, "speculation.assistant_model"),
                        ({"drafter": "assistant", "assistant_model": "x",
                          "assistant_block_size": 1}, "speculation.assistant_block_size"),
                        ({"drafter": "assistant", "assistant_model": "x",
                          "assistant_query_position": "first"},
                         "speculation.assistant_query_position")]:
        with pytest.raises(CardError, match=field.replace(".", r"\.")):
            _card(speculation=spec)


def test_served_cards_pair_the_assistant_gguf_with_draft_mtp():
    served = {**BASE_CARD, "format": "gguf"}
    card = parse_card({**served, "placement": {
        "engine": "llama_server", "served_spec_type": "draft_mtp",
        "served_spec_draft": "gemma-4-E2B-it-assistant.gguf"}}, Path("card.toml"))
    assert card.placement["served_spec_draft"].endswith("assistant.gguf")
    with pytest.raises(CardError, match="speculation.drafter"):
        parse_card({**served, "placement": {"engine": "llama_server"},
                    "speculation": {"drafter": "assistant", "assistant_model": "x"}},
                   Path("card.toml"))


def test_loader_resolves_a_folder_beside_the_card(gemma, tmp_path):
    from skulkp2p.engine.runner.loader import open_assistant, resolve_assistant
    from skulkp2p.models.store import ModelStore

    store = ModelStore(tmp_path / "data", cards={})
    card_file = gemma["ordered"].parent / "card.toml"
    assert resolve_assistant(store, "assistant-ordered", card_file) == gemma["ordered"]
    with pytest.raises(FileNotFoundError, match="speculation.assistant_model"):
        resolve_assistant(store, "nowhere", card_file)
    loaded = load_model(gemma["target"], "gemma4-tiny", dtype="bfloat16")
    spec = {"assistant_model": "assistant-dense", "assistant_block_size": 5}
    assistant = open_assistant(store, spec, card_file, loaded)
    assert assistant.depth == 4 and not assistant.config.use_ordered_embeddings


DOCUMENTED_CARD = '''
id = "gemma-4-e4b-it"
family = "gemma4"
format = "mlx"
layers = 42
hidden_size = 2560
kv_heads = 2
context_length = 131072
size_bytes = 9_000_000_000

[source]
kind = "hf"
repo = "mlx-community/gemma-4-e4b-it-8bit"

[speculation]
drafter = "assistant"
assistant_model = "hf:mlx-community/gemma-4-E4B-it-assistant-bf16"
assistant_block_size = 4
'''


def test_the_documented_card_parses(tmp_path):
    from skulkp2p.models.cards import load_card
    page = (Path(__file__).parent.parent / "docs" / "gemma4-assistant.md").read_text()
    for line in DOCUMENTED_CARD.strip().splitlines():
        assert line in page  # the card shown in docs/gemma4-assistant.md is this one
    f = tmp_path / "gemma.toml"
    f.write_text(DOCUMENTED_CARD)
    card = load_card(f)
    assert card.speculation["assistant_model"].startswith("hf:mlx-community/")


def test_served_card_passes_the_assistant_gguf_as_draft_mtp(tmp_path):
    from skulkp2p.models.cards import load_card
    from skulkp2p.served.child_config import server_args

    f = tmp_path / "gemma-gguf.toml"
    f.write_text('''id = "gemma-4-e2b-it-gguf"
family = "gemma4"
format = "gguf"
layers = 35
hidden_size = 1536
kv_heads = 1
context_length = 131072
size_bytes = 3_000_000_000

[source]
kind = "local"
path = "gemma-4-E2B-it-Q4_0.gguf"

[placement]
engine = "llama_server"
served_spec_type = "draft_mtp"
served_spec_draft = "gemma-4-E2B-it-assistant-Q4_0.gguf"
served_spec_n_max = 3
''')
    card = load_card(f)

    class NoCards:
        cards: dict = {}

    args = server_args(NoCards(), card, tmp_path / "gemma-4-E2B-it-Q4_0.gguf", no_spec=False)
    assert args[args.index("--spec-type") + 1] == "draft-mtp"
    assert args[args.index("--model-draft") + 1] == str(
        tmp_path / "gemma-4-E2B-it-assistant-Q4_0.gguf")
    assert args[args.index("--spec-draft-n-max") + 1] == "3"


@pytest.mark.process
def test_pipe_runs_a_card_that_pairs_the_assistant(gemma, tmp_path):
    """The whole path a user takes: a card in SKULKP2P_CARDS_DIR naming the target folder and its
    assistant beside it, `python -m skulkp2p pipe`, explicit and auto speculation."""
    from tests.helpers.procs import run_cli

    cards = tmp_path / "cards"
    write_gemma_card(cards, "gemma-tiny", gemma["target"], gemma["ordered"], block_size=3)
    lines = [json.dumps({"id": i, "prompt": PROMPT, "max_tokens": 20, "speculation": spec})
             for i, spec in enumerate(["off", {"drafter": "assistant"}, "auto"])]
    proc = run_cli("pipe", "--model", "gemma-tiny", "--data-dir", str(tmp_path / "data"),
                   input="".join(line + "\n" for line in lines),
                   env={"SKULKP2P_CARDS_DIR": str(cards)})
    assert proc.returncode == 0, proc.stderr
    off, explicit, auto = [json.loads(line) for line in proc.stdout.splitlines()]
    assert explicit["tokens"] == off["tokens"] == auto["tokens"]
    assert explicit["speculation"]["drafter"] == "assistant"
    assert explicit["speculation"]["max_depth"] == 2 and explicit["speculation"]["drafted"] > 0
    assert "assistant" in auto["speculation"]["drafter"]


@pytest.mark.process
def test_pipe_names_the_field_of_a_mismatched_pair(gemma, tmp_path):
    from tests.helpers.procs import run_cli

    bad = _copy_with(gemma["ordered"], tmp_path / "bad",
                     lambda c: c["text_config"].update(head_dim=8))
    cards = tmp_path / "cards"
    write_gemma_card(cards, "g", gemma["target"], bad)
    proc = run_cli("pipe", "--model", "g", "--data-dir", str(tmp_path / "data"),
                   input=json.dumps({"prompt": "x", "max_tokens": 2}) + "\n",
                   env={"SKULKP2P_CARDS_DIR": str(cards)})
    # The pipe answers the line with the load's error and goes on (as for any card field error).
    assert proc.returncode == 0, proc.stderr
    error = json.loads(proc.stdout)["error"]["message"]
    assert "speculation.assistant_model" in error and "text_config.head_dim = 8" in error


@pytest.mark.parametrize("kind", KINDS)
def test_a_quantized_assistant_loads_and_drafts_close_to_the_full_one(target, gemma, kind,
                                                                      tmp_path):
    """mlx-community also publishes quantized conversions: `quantization` in config.json,
    `.scales`/`.biases` beside packed weights (8-bit here, groups of 32)."""
    from mlx.utils import tree_flatten

    from skulkp2p.engine.drafting.assistant import AssistantModel, read_config

    model, tokenizer = target
    full = load_assistant(gemma[kind], model, mx.float32)
    q = AssistantModel(read_config(gemma[kind]))
    q.load_weights(tree_flatten(full.model.parameters()))
    nn.quantize(q, group_size=32, bits=8)
    out = tmp_path / "q"
    out.mkdir()
    weights = dict(tree_flatten(q.parameters()))
    if kind == "ordered":
        weights["masked_embedding.token_ordering"] = q.masked_embedding.token_ordering
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    config = json.loads((gemma[kind] / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 8}
    (out / "config.json").write_text(json.dumps(config))
    quant = load_assistant(out, model, mx.float32)
    assert hasattr(quant.model.model.embed_tokens, "scales")

    prompt = tokenizer.encode(PROMPT)
    forward = LocalForward(model, hidden="after")
    forward.prefill(prompt[:-1])
    carry = forward.last_hidden[-1:]
    a = np.array(draft_row(full, forward.cache, carry, prompt[-1]))[0]
    b = np.array(draft_row(quant, forward.cache, carry, prompt[-1]))[0]
    assert np.corrcoef(a, b)[0, 1] > 0.99
    spec = list(decode(LocalForward(model, hidden="after"), prompt, SamplingParams(), 16,
                       np.random.default_rng(0),
                       AssistantDrafter(quant, SamplingParams(), np.random.default_rng(0)), 3))
    assert spec == _mlx_lm_greedy(model, prompt, 16)


def test_the_sliding_mask_uses_the_assistants_window(target, gemma, tmp_path):
    """As mlx-vlm and transformers do: an assistant whose window is smaller than the target's
    sees only the keys within its own window of the query (and is not refused for it)."""
    model, tokenizer = target
    narrow = _copy_with(gemma["dense"], tmp_path / "narrow",
                        lambda c: c["text_config"].update(sliding_window=8))
    wide = load_assistant(gemma["dense"], model, mx.float32)
    small = load_assistant(narrow, model, mx.float32)
    assert (wide.view.window, small.view.window) == (16, 8)
    prompt = tokenizer.encode(PROMPT + " " + PROMPT)
    assert len(prompt) > 16  # more keys than either window
    forward = LocalForward(model, hidden="after")
    forward.prefill(prompt[:-1])
    carry = forward.last_hidden[-1:]
    a = np.array(draft_row(wide, forward.cache, carry, prompt[-1]).astype(mx.float32))
    b = np.array(draft_row(small, forward.cache, carry, prompt[-1]).astype(mx.float32))
    assert not np.allclose(a, b, atol=1e-3)
