"""Greedy output on the OpenBLAS float32 path equals mlx-lm's own generate on the same float32
weights, in one process (so both run on the same BLAS)."""

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT

SCRIPT = r"""
import json, sys
from skulkp2p.engine.cpu import blas, switch
switch.install()
import mlx.core as mx
from mlx_lm import stream_generate
from tests.helpers.pipe_result import generate
from skulkp2p.engine.model.loaded import load_model
from skulkp2p.formats.pipe_format import parse_request
report = blas.fast_path_report()
lm = load_model(sys.argv[1], "smollm2-135m", dtype="float32")
out = {"report": report, "cases": []}
for messages in ([{"role": "user", "content": "What is the capital of France?"}],
                 [{"role": "user", "content": "Write a Python function that reverses a string."}]):
    prompt = lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ref = []  # mlx-lm's greedy tokens: one generation per prompt, compared with both arms
    for r in stream_generate(lm.model, lm.tokenizer, mx.array(prompt), max_tokens=32):
        if r.token in lm.tokenizer.eos_token_ids:
            break
        ref.append(r.token)
    for spec in ("off", {"drafter": "lookup", "depth": 4}):
        req = parse_request({"messages": messages, "max_tokens": 32, "speculation": spec})
        ours = generate(lm, req)
        out["cases"].append({"ours": ours["tokens"], "ref": ref, "spec": str(spec),
                             "speculation": ours.get("speculation")})
print(json.dumps(out))
"""


@pytest.mark.process
@pytest.mark.slow
def test_float32_openblas_greedy_equals_mlx_lm(smollm2_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(smollm2_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["report"]["blas"] == "openblas", out["report"]
    assert out["report"]["dtype"] == "float32"
    for case in out["cases"]:
        assert case["ours"] == case["ref"], case["spec"]
        assert len(case["ours"]) > 5
        if case["speculation"] is not None:  # lookup drafted; drafts accepted and rejected
            assert 0 < case["speculation"]["accepted"] < case["speculation"]["drafted"], case


def test_the_suite_runs_on_the_blas_the_agents_run_on():
    """tests/conftest.py re-execs pytest with OpenBLAS preloaded, as `join` does: in-process
    tests then run the same float32 products as the agents they start (and ~20x faster)."""
    import os

    from skulkp2p.engine.cpu import blas

    if not sys.platform.startswith("linux") or blas.find_openblas() is None \
            or os.environ.get(blas.ENV_MODE, "").strip().lower() in blas.OFF_VALUES:
        pytest.skip("no OpenBLAS to preload here (or SKULKP2P_BLAS=off)")
    report = blas.fast_path_report()
    assert report["blas"] == "openblas", report
