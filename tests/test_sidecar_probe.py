"""`python -m skulkp2p head probe` on a head trained for a tiny model: the held-out share inside the
draft vocabulary, the replayed acceptance at another vocabulary, and the offline policy
simulation, which at its "always draft" settings must count exactly what the engine's decode
loop counts in the replay."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from skulkp2p.cli import main as cli_main


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory):
    base = tiny_model("llama")
    out = tmp_path_factory.mktemp("probe") / "trained"
    # Enough steps for the head to learn the tiny model's repetitive answers: the checks below
    # compare counts of accepted drafts, which must not all be zero.
    assert cli_main(["head", "train", "--model", str(base), "--out", str(out), "--batch", "4",
                     "--gen-tokens", "24", "--max-batches", "2", "--heldout-batches", "2",
                     "--eval-tokens", "400", "--steps", "60", "--lr", "3e-3",
                     "--coverage", "0.5"]) == 0
    return base, out


def _heldout_tokens(work) -> np.ndarray:
    got = []
    for f in sorted(work.glob("heldout-*.npz")):
        s = np.load(f)
        plen = int(s["prompt_len"])
        for b in range(s["tokens"].shape[0]):
            end = min(int(s["ends"][b]), s["tokens"].shape[1] - 1)
            got.append(s["tokens"][b, plen:end + 1])  # what the greedy answer emitted
    return np.concatenate(got)


@pytest.mark.training
def test_probe_counts_what_the_replay_counts(trained, tmp_path, capsys):
    base, out = trained
    report = tmp_path / "probe.json"
    assert cli_main(["head", "probe", "--work", str(out / ".train"), "--sidecar",
                     str(out / "mtp.safetensors"), "--model", str(base), "--sizes", "0",
                     "--depths", "1,2", "--timing-calls", "3", "--policies", "--json",
                     str(report)]) == 0
    result = json.loads(report.read_text())
    own, full = result["vocab"]
    ids = np.array(mx.load(str(out / "mtp.safetensors"))["eagle.vocab_ids"])
    emitted = _heldout_tokens(out / ".train")
    assert own["size"] == ids.size < full["size"]
    assert own["heldout_inside"] == pytest.approx(np.isin(emitted, ids).mean(), abs=1e-4)
    assert own["heldout_inside"] < 1.0 and full["heldout_inside"] == 1.0
    assert own["trunk_step_ms"] > 0 and own["head_call_ms"] > 0

    policies = {(p["t1"], p["t2"]): p for p in result["policies"]}
    always1, always2 = policies[0.0, -1.0], policies[0.0, 0.0]
    # Drafting every round, the offline rounds are the decode loop's rounds.
    assert always1["accepted"][0] > 0
    assert always1["per_position"][0] == pytest.approx(own["depth1"][0], abs=1e-4)
    assert always2["per_position"] == pytest.approx(own["depth2"], abs=1e-4)
    assert always2["drafted"][0] >= always2["drafted"][1] > 0
    # A confidence floor drafts in fewer rounds, and never accepts a draft it did not offer.
    floor = policies[0.3, -1.0]
    assert floor["drafted"][0] < always1["drafted"][0]
    assert floor["accepted"][0] <= floor["drafted"][0]
    assert sum(1 for line in capsys.readouterr().out.splitlines() if '"vocab"' in line) == 2


@pytest.mark.training
def test_probe_refuses_bad_arguments(trained, tmp_path, capsys):
    base, out = trained
    capsys.readouterr()
    assert cli_main(["head", "probe", "--work", str(tmp_path), "--sidecar",
                     str(out / "mtp.safetensors"), "--model", str(base)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no train-*.npz or heldout-*.npz" in err
    with pytest.raises(SystemExit) as e:  # argparse: a usage line, then the error
        cli_main(["head", "probe", "--work", str(out / ".train"), "--sidecar",
                  str(out / "mtp.safetensors"), "--sizes", "big"])
    assert e.value.code == 2 and "whole numbers" in capsys.readouterr().err


def test_validation_prompts_are_fresh():
    from skulkp2p.bench.workloads import WORKLOADS
    from skulkp2p.training.sidecar_prompts import HELDOUT_PROMPTS, VALIDATION_PROMPTS, train_prompts
    bench = " ".join(m["content"] for msgs in WORKLOADS.values() for m in msgs
                     if isinstance(m.get("content"), str))
    training = set(train_prompts(0))
    assert len(set(VALIDATION_PROMPTS)) == len(VALIDATION_PROMPTS) >= 10
    for text in VALIDATION_PROMPTS:
        assert text not in training and text not in HELDOUT_PROMPTS and text not in bench


@pytest.mark.training
def test_validation_shards_replay_through_the_probe(trained, tmp_path):
    from skulkp2p.training.sidecar_prompts import VALIDATION_PROMPTS
    base, out = trained
    val = tmp_path / "val"
    assert cli_main(["head", "validation-shards", "--out", str(val), "--model", str(base),
                     "--broad", "3", "--gen-tokens", "8"]) == 0
    shards = sorted(val.glob("heldout-*.npz"))
    assert len(shards) == 1 + len(VALIDATION_PROMPTS)
    assert np.load(shards[0])["tokens"].shape[0] == 3
    assert all(float(np.load(f)["temperature"]) == 0.0 for f in shards)  # greedy answers
    (val / "train-0000.npz").symlink_to(next((out / ".train").glob("train-*.npz")))
    report = tmp_path / "val.json"
    assert cli_main(["head", "probe", "--work", str(val), "--sidecar",
                     str(out / "mtp.safetensors"), "--model", str(base), "--sizes", "",
                     "--timing-calls", "2", "--context-bias", "0,2", "--json",
                     str(report)]) == 0
    rows = json.loads(report.read_text())["vocab"]
    assert [r["context_bias"] for r in rows] == [0.0, 2.0]
    assert all(0.0 <= r["depth1"][0] <= 1.0 for r in rows)
