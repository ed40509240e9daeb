"""Greedy exactness of the one decode loop: plain equals mlx-lm's own generate, and every drafter
depth equals plain, for each tiny family (llama, qwen3, hybrid qwen3_5 with recurrent state)."""

import pytest

from skulkp2p.engine.decode.generate import generate
from skulkp2p.engine.decode.loop import DecodeStats, decode
from skulkp2p.engine.decode.sampling import SamplingParams, make_rng
from skulkp2p.engine.drafting.prompt_lookup import PromptLookup
from skulkp2p.engine.model.forward import LocalForward
from skulkp2p.engine.model.loaded import load_model
from skulkp2p.engine.request import parse_request
from tests.helpers.models import FAMILIES
from tests.helpers.reference import mlx_lm_tokens

# Repetitive text so that lookup drafts are both accepted and rejected.
ECHO = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(a,"


@pytest.fixture(scope="module")
def loaded(tiny_models):
    return {fam: load_model(tiny_models[fam], fam) for fam in FAMILIES}




@pytest.mark.parametrize("family", FAMILIES)
def test_plain_equals_mlx_lm_generate(loaded, family):
    lm = loaded[family]
    prompt = lm.tokenizer.encode(ECHO)
    ours = list(decode(LocalForward(lm.model), prompt, SamplingParams(), 40, make_rng(0)))
    assert ours == mlx_lm_tokens(lm, prompt, 40)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_lookup_equals_plain(loaded, family, depth):
    lm = loaded[family]
    prompt = lm.tokenizer.encode(ECHO)
    plain = list(decode(LocalForward(lm.model), prompt, SamplingParams(), 48, make_rng(0)))
    stats = DecodeStats()
    spec = list(decode(LocalForward(lm.model), prompt, SamplingParams(), 48, make_rng(0),
                       PromptLookup(), depth, stats))
    assert spec == plain
    assert stats.drafted > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_request_equals_mlx_lm(loaded, family):
    lm = loaded[family]
    req = parse_request({"messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 24})
    result = generate(lm, req)
    prompt = lm.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True)
    assert result["tokens"] == mlx_lm_tokens(lm, prompt, 24)
    assert result["usage"]["completion_tokens"] == len(result["tokens"])


def test_seeded_sampling_repeats_and_seeds_differ(loaded):
    lm = loaded["llama"]
    body = {"prompt": "Once upon a time", "max_tokens": 30, "temperature": 1.0, "top_p": 0.95,
            "top_k": 50, "repetition_penalty": 1.1}
    a = generate(lm, parse_request({**body, "seed": 7}))["tokens"]
    b = generate(lm, parse_request({**body, "seed": 7}))["tokens"]
    c = generate(lm, parse_request({**body, "seed": 8}))["tokens"]
    assert a == b and a != c


def test_max_tokens_and_finish_reason(loaded):
    lm = loaded["qwen3"]
    r = generate(lm, parse_request({"prompt": "abc", "max_tokens": 5}))
    assert len(r["tokens"]) == 5 and r["finish_reason"] == "length"
