"""The EAGLE-3-class drafting head (engine/model/mtp_head.py, style "eagle3"): it reads a low, a
middle and a high layer of the trunk (the forward keeps their outputs, hidden "layers:i,j,k"),
fuses them, and drafts over a reduced vocabulary mapped back to the full one. A random head of
that kind on a tiny model loads from its own tensor names, its fused rows are the layers' own
outputs, its multi-step training rows are what the drafter computes, and it drafts exactly
(greedy byte-identical at depths 1-3, alone and in a batch); a head trained by
`head train --kind eagle3` in seconds decodes byte-identically too."""

from __future__ import annotations

import json
import tomllib

import mlx.core as mx
import numpy as np
import pytest

from skulkp2p.cli import main as cli_main
from skulkp2p.engine.decode.loop import DecodeStats, decode
from skulkp2p.engine.decode.sampling import SamplingParams, make_rng
from skulkp2p.engine.drafting.mtp_drafter import MtpDrafter
from skulkp2p.engine.model.forward import LocalForward
from skulkp2p.engine.model.loaded import load_model
from skulkp2p.engine.model.mtp_conventions import detect_conventions, fused_layers
from skulkp2p.engine.model.trunk import Trunk, hidden_layers
from skulkp2p.training import head_fit
from tests.helpers.eagle import TEXT, make_eagle_sidecar
from tests.helpers.eagle import decode_after_text as _decode


@pytest.fixture(scope="module")
def eagle3_llama(tiny_models, tmp_path_factory):
    base = tiny_models["llama"]
    vocab = int(Trunk(load_model(base, "base").model).embed_tokens.weight.shape[0])
    ids = np.sort(np.random.default_rng(3).choice(vocab, 96, replace=False)).astype(np.int32)
    sidecar = make_eagle_sidecar(base, tmp_path_factory.mktemp("eagle3") / "e3.safetensors",
                                 ids, kind="eagle3")
    return base, sidecar, ids


def test_fused_layers_are_a_low_a_middle_and_a_high_one():
    assert fused_layers(30) == (2, 15, 29)  # SmolLM2-135M
    assert fused_layers(4) == (1, 2, 3)  # the tiny models: three layers apart
    assert all(0 <= i < n for n in range(1, 40) for i in fused_layers(n))
    assert hidden_layers("layers:2,15,27") == (2, 15, 27)
    assert hidden_layers("after") is None
    with pytest.raises(ValueError, match="layers:i,j,k"):
        LocalForward(None, hidden="layers:x")


def test_eagle3_head_loads_as_its_own_kind_and_reads_three_layers(eagle3_llama):
    base, sidecar, ids = eagle3_llama
    names = set(mx.load(str(sidecar)))
    assert {"eagle3.fc.weight", "eagle3.fc.bias", "eagle3.fuse.weight",
            "eagle3.fuse_norm.weight", "eagle3.vocab_ids"} <= names
    config = json.loads((base / "config.json").read_text())
    conv = detect_conventions(sidecar, config)
    assert conv is not None and conv.style == "eagle3" and conv.chain == "after"
    picked = fused_layers(config["num_hidden_layers"])
    assert conv.hidden == "layers:" + ",".join(map(str, picked))
    lm = load_model(base, "tiny", dtype="float32", sidecar=sidecar)
    head = lm.mtp
    assert head is not None and head.conventions.hidden == conv.hidden

    # The forward keeps the picked layers' outputs side by side: the last layer's, normed, is
    # the trunk's feature after the final norm (what an eagle head reads).
    prompt = lm.tokenizer.encode(TEXT)
    deep = LocalForward(lm.model, hidden=conv.hidden)
    deep.prefill(prompt)
    after = LocalForward(lm.model, hidden="after")
    after.prefill(prompt)
    width = after.last_hidden.shape[-1]
    assert deep.last_hidden.shape == (len(prompt), 3 * width)
    last = deep.last_hidden[:, 2 * width:]
    assert picked[2] == config["num_hidden_layers"] - 1  # (the tiny model's high layer)
    np.testing.assert_allclose(np.array(Trunk(lm.model).norm(last)), np.array(after.last_hidden),
                               rtol=1e-5, atol=1e-5)
    # ... and the verify's logits are the plain forward's.
    np.testing.assert_array_equal(np.array(deep(prompt[:3])), np.array(after(prompt[:3])))

    # The fusion: per-depth norms, then fuse; a chained (one-row-wide) state passes as it is.
    head.set_dtype(mx.float32)
    rows = deep.last_hidden
    parts = rows.reshape(rows.shape[0], 3, width)
    normed = mx.fast.rms_norm(parts, None, 1e-5) * head.fuse_norm.weight
    np.testing.assert_allclose(np.array(head.input_rows(rows)),
                               np.array(head.fuse(normed.reshape(rows.shape))), rtol=1e-4,
                               atol=1e-4)
    chained = mx.ones((2, width))
    assert head.input_rows(chained) is chained


def test_draft_vocabulary_maps_back_and_nothing_outside_is_drafted(eagle3_llama):
    base, sidecar, ids = eagle3_llama
    lm = load_model(base, "tiny", dtype="float32", sidecar=sidecar)
    head = lm.mtp
    vocab = int(Trunk(lm.model).embed_tokens.weight.shape[0])
    np.testing.assert_array_equal(np.array(head.vocab_ids), ids)
    rng = np.random.default_rng(2)
    width = int(head.proj.weight.shape[0])
    rows = mx.array(rng.standard_normal((5, 3 * width)).astype(np.float32))
    out = head(rows, mx.array(rng.integers(0, vocab, 5).astype(np.int32)), head.make_cache(),
               all_logits=True)
    logits = np.array(out.logits)
    assert logits.shape == (5, vocab)
    outside = np.setdiff1d(np.arange(vocab), ids)
    assert np.isneginf(logits[:, outside]).all()
    # Column j of the reduced logits is full-vocabulary token ids[j].
    sub = np.array(head.draft_logits(out.post_norm))
    np.testing.assert_allclose(logits[:, ids], sub, rtol=1e-5, atol=1e-5)
    stats = DecodeStats()
    fwd = LocalForward(lm.model, hidden=head.conventions.hidden)
    drafter = MtpDrafter(head)
    list(decode(fwd, lm.tokenizer.encode(TEXT), SamplingParams(), 16, make_rng(0), drafter, 3,
                stats))
    drafter.begin(lm.tokenizer.encode(TEXT), _prefilled(lm, head))
    drafts, _ = drafter.propose([], 3)
    assert drafts and set(drafts) <= set(ids.tolist())


def _prefilled(lm, head):
    fwd = LocalForward(lm.model, hidden=head.conventions.hidden)
    fwd.prefill(lm.tokenizer.encode(TEXT)[:-1])
    return fwd


def test_eagle3_head_is_greedy_exact(eagle3_llama):
    base, sidecar, _ = eagle3_llama
    lm = load_model(base, "tiny", dtype="float32", sidecar=sidecar)
    plain = _decode(lm)
    for depth in (1, 2, 3):
        stats = DecodeStats()
        assert _decode(lm, lm.mtp, depth, stats) == plain, depth
        assert stats.rounds > 0 and sum(stats.drafted_at) > 0


def test_unrolled_training_steps_are_what_the_drafter_computes(eagle3_llama):
    """The training-time test's steps 2 and 3 (all positions in one forward each, masks standing
    in for the speculative rows) give, at every position, the states the drafter computes for
    its second and third drafts: verified rows 0..t in the head's cache, then its own chained
    outputs with the next tokens. Checked against the drafter's code path, in float32."""
    base, sidecar, _ = eagle3_llama
    lm = load_model(base, "tiny", dtype="float32", sidecar=sidecar)
    head = lm.mtp
    head.set_dtype(mx.float32)
    rng = np.random.default_rng(4)
    n, width = 8, int(head.proj.weight.shape[0])
    hidden = mx.array(rng.standard_normal((2, n, 3 * width)).astype(np.float32))
    tokens = mx.array(rng.integers(0, 90, (2, n)).astype(np.int32))
    posts = head_fit.unrolled_features(head, hidden, tokens, 3)
    assert [p.shape[1] for p in posts] == [n, n - 1, n - 2]
    for b in range(2):
        for t in range(n - 2):
            cache = head.make_cache()
            out = head(hidden[b, :t + 1], tokens[b, :t + 1], cache)
            np.testing.assert_allclose(np.array(posts[0][b, t]), np.array(out.post_norm[-1]),
                                       rtol=1e-4, atol=1e-4)
            for k in (1, 2):
                out = head(out.chain(head.conventions.chain)[-1:], tokens[b, t + k:t + k + 1],
                           cache)
                np.testing.assert_allclose(np.array(posts[k][b, t]),
                                           np.array(out.post_norm[-1]), rtol=1e-4, atol=1e-4,
                                           err_msg=f"step {k + 1}, row {b}, {t}")
    # Each step's loss counts: three steps cost more than two, two more than one.
    k = 3
    args = (hidden, tokens, mx.array(rng.integers(0, 96, (2, n, k)).astype(np.int32)),
            mx.array(np.full((2, n, k), 1.0 / k, np.float32)),
            mx.array(rng.standard_normal((2, n, width)).astype(np.float32)),
            mx.array(np.ones((2, n), np.float32)))
    losses = [float(head_fit.make_loss(0.5, 1.0, s)(head, *args)[0]) for s in (1, 2, 3)]
    assert losses[0] < losses[1] < losses[2]


@pytest.mark.training
def test_head_train_eagle3_on_a_tiny_model_decodes_exactly(tiny_models, tmp_path):
    """`head train --kind eagle3`: the shards keep the three layers' outputs, the head trains
    with three unrolled steps, reports held-out acceptance per depth (and given the depth
    before), loads as a sidecar and decodes byte-identically to plain decoding."""
    base = tiny_models["llama"]
    out = tmp_path / "trained"
    assert cli_main(["head", "train", "--model", str(base), "--out", str(out), "--batch", "4",
                     "--gen-tokens", "12", "--max-batches", "2", "--eval-tokens", "40",
                     "--kind", "eagle3", "--heldout-batches", "2", "--steps", "3",
                     "--vocab", "256"]) == 0
    shard = np.load(out / ".train" / "train-0000.npz")
    config = json.loads((base / "config.json").read_text())
    picked = fused_layers(config["num_hidden_layers"])
    assert list(shard["layer_ids"]) == list(picked)
    assert shard["layers"].shape[-1] == 3 * shard["hidden"].shape[-1]
    prov = tomllib.loads((out / "mtp.provenance.toml").read_text())
    assert prov["conventions"]["style"] == "eagle3"
    assert prov["training"]["training_time_test_steps"] == 3
    assert prov["training"]["fused_layers"] == list(picked)
    acc = prov["acceptance"]
    assert [len(acc[f"depth{d}_per_position"]) for d in (1, 2, 3)] == [1, 2, 3]
    assert len(acc["depth3_given_previous"]) == 2
    tensors = mx.load(str(out / "mtp.safetensors"))
    assert tensors["eagle3.fuse.weight"].dtype == mx.bfloat16
    assert tensors["eagle3.vocab_ids"].size == 256
    lm = load_model(base, "tiny", dtype="float32", sidecar=out / "mtp.safetensors")
    assert lm.mtp is not None and lm.mtp.conventions.style == "eagle3"
    plain = _decode(lm)
    for depth in (1, 3):
        assert _decode(lm, lm.mtp, depth) == plain, depth
    # --init-from an earlier head with --keep-vocab keeps that head's draft vocabulary.
    again = tmp_path / "again"
    assert cli_main(["head", "train", "--model", str(base), "--out", str(again), "--batch", "4",
                     "--gen-tokens", "8", "--max-batches", "1", "--eval-tokens", "20",
                     "--kind", "eagle3", "--heldout-batches", "1", "--steps", "1",
                     "--init-from", str(out / "mtp.safetensors"), "--keep-vocab"]) == 0
    np.testing.assert_array_equal(np.array(mx.load(str(again / "mtp.safetensors"))[
        "eagle3.vocab_ids"]), np.array(tensors["eagle3.vocab_ids"]))


def test_an_eagle3_head_warm_started_from_an_eagle_head_drafts_as_it_does(tiny_models,
                                                                           tmp_path):
    """`head train --kind eagle3 --init-from EAGLE_HEAD` starts from that head exactly: its
    fusion passes only the last layer's output through the trunk's final norm (the feature
    the eagle head reads), so both draft the same tokens before any training."""
    from skulkp2p.training import head_init

    base = tiny_models["llama"]
    config = json.loads((base / "config.json").read_text())
    lm = load_model(base, "base", dtype="float32")
    vocab = int(Trunk(lm.model).embed_tokens.weight.shape[0])
    ids = np.sort(np.random.default_rng(5).choice(vocab, 96, replace=False)).astype(np.int32)
    eagle = make_eagle_sidecar(base, tmp_path / "eagle.safetensors", ids, seed=2)
    warm = head_init.warm_start_tensors(base, lm.model, config, eagle, ids, "eagle3")
    mx.save_safetensors(str(tmp_path / "e3.safetensors"), warm)
    old = load_model(base, "old", dtype="float32", sidecar=eagle)
    new = load_model(base, "new", dtype="float32", sidecar=tmp_path / "e3.safetensors")
    assert new.mtp.conventions.style == "eagle3"
    stats = {}
    for name, m in (("eagle", old), ("eagle3", new)):
        stats[name] = DecodeStats()
        assert _decode(m, m.mtp, 3, stats[name]) == _decode(m)
    assert stats["eagle"].accepted_at == stats["eagle3"].accepted_at
    assert stats["eagle"].drafted_at == stats["eagle3"].drafted_at
    assert sum(stats["eagle"].drafted_at) > 0
    prompt = mx.array(lm.tokenizer.encode(TEXT))
    toks = prompt[1:]
    rows = {}
    for name, m in (("eagle", old), ("eagle3", new)):
        fwd = LocalForward(m.model, hidden=m.mtp.conventions.hidden)
        fwd.prefill(prompt.tolist()[:-1])
        rows[name] = np.array(m.mtp(fwd.last_hidden, toks, m.mtp.make_cache(),
                                    all_logits=True).logits)
    np.testing.assert_allclose(rows["eagle3"], rows["eagle"], rtol=1e-4, atol=1e-4)


def test_a_stage_without_the_low_layers_loads_the_cards_stage_head(eagle3_llama, tmp_path):
    """A card's `mtp_stage_sidecar`: one node (every layer) loads the eagle3 head; a ring's
    later stage and a tensor group's loop member, which lack the low layers it reads, load the
    stage head instead (its style detected from its tensor names, whatever `mtp_style` says
    of the eagle3 one). Without one they load no head, as before."""
    from skulkp2p.engine.model.stage import StageSpan
    from skulkp2p.engine.runner.loader import open_model
    from skulkp2p.models.cards import parse_card
    from skulkp2p.models.store import ModelStore

    base, sidecar, ids = eagle3_llama
    eagle = make_eagle_sidecar(base, tmp_path / "eagle.safetensors", ids, seed=2)
    fields = {"id": "t3", "family": "llama", "format": "mlx", "layers": 4, "hidden_size": 64,
              "kv_heads": 2, "context_length": 4096, "size_bytes": 1_000_000,
              "source": {"kind": "local", "path": str(base)}}

    def opened(speculation, **where):
        card = parse_card({**fields, "speculation": speculation}, tmp_path / "t3.toml")
        store = ModelStore(tmp_path / "data", cards={"t3": card})
        return open_model(store, "t3", "float32", **where).mtp

    both = {"mtp_sidecar": str(sidecar), "mtp_style": "eagle3",
            "mtp_stage_sidecar": str(eagle)}
    whole = opened(both)
    assert whole is not None and whole.conventions.style == "eagle3"
    for where in ({"span": StageSpan(2, 4, 4)}, {"head_only": True}):
        head = opened(both, **where)
        assert head is not None and head.conventions.style == "eagle", where
        assert opened({"mtp_sidecar": str(sidecar)}, **where) is None, where
    first_alone = opened(both, span=StageSpan(0, 4, 4))  # a one-stage "ring": every layer
    assert first_alone is not None and first_alone.conventions.style == "eagle3"
