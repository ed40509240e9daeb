"""The native MTP head drafter: exactness of decoding with it, its logits against a reference
written here from the raw tensors, acceptance with a head built to be right (and one built to
be wrong), per-position acceptance, sidecar loading and the convention overrides."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama, qwen3, qwen3_5

from skulkp2p.engine.decode.loop import DecodeStats, decode
from skulkp2p.engine.decode.sampling import SamplingParams, make_rng
from skulkp2p.engine.drafting.mtp_drafter import MtpDrafter
from skulkp2p.engine.model.forward import LocalForward
from skulkp2p.engine.model.loaded import load_model
from skulkp2p.engine.model.mtp_conventions import MtpConventions, detect_conventions
from skulkp2p.engine.model.mtp_head import _stack_experts, load_mtp_head
from tests.helpers.tiny_base import RMS_EPS, mtp_tensor_shapes

CASES = [("llama", "qwen"), ("llama", "deepseek"), ("llama", "mimo"), ("qwen3", "qwen"),
         ("qwen3_5", "qwen")]
TEXT = "The river was high after the rain. It carried branches, leaves and once a gate"
MAX_TOKENS = 32


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


class Tiny:
    def __init__(self, path: Path, family: str):
        self.path = path
        self.family = family
        self.config = _config(path)
        self.lm = load_model(path, family, dtype="float32")
        self.prompt = self.lm.tokenizer.encode(TEXT)

    def head(self, **kw):
        return load_mtp_head(self.path, self.lm.model, self.config, **kw)

    def decode(self, drafter=None, depth=0, stats=None, hidden=None, params=None, seed=0):
        fwd = LocalForward(self.lm.model, hidden=hidden)
        return list(decode(fwd, self.prompt, params or SamplingParams(), MAX_TOKENS,
                           make_rng(seed), drafter, depth, stats))


@pytest.fixture(scope="module")
def tiny(tiny_model):
    cache: dict[tuple[str, str], Tiny] = {}

    def get(family: str, style: str) -> Tiny:
        if (family, style) not in cache:
            path = tiny_model(family, mtp=True, mtp_style=style)
            cache[family, style] = Tiny(path, family)
        return cache[family, style]

    return get


# --- exactness and per-position acceptance -------------------------------------------------


@pytest.mark.parametrize("family,style", CASES)
def test_greedy_with_mtp_equals_plain(tiny, family, style):
    t = tiny(family, style)
    head = t.head()
    assert head is not None and head.conventions.style == style
    plain = t.decode()
    for depth in (1, 2, 3, 4):
        stats = DecodeStats()
        drafter = MtpDrafter(head)
        spec = t.decode(drafter, depth, stats, hidden=head.conventions.hidden)
        assert spec == plain, f"depth {depth}"
        assert stats.drafted > 0
        # Acceptance is recorded for every draft position 1..k, by the loop and the drafter.
        assert len(stats.drafted_at) == depth and all(stats.drafted_at)
        assert drafter.drafted_at == stats.drafted_at
        assert drafter.accepted_at == stats.accepted_at


def test_hidden_before_and_sampling_run(tiny):
    t = tiny("llama", "qwen")
    head = t.head(overrides={"mtp_hidden": "before"})
    assert head.conventions.hidden == "before"
    stats = DecodeStats()
    assert t.decode(MtpDrafter(head), 3, stats, hidden="before") == t.decode()
    assert stats.drafted > 0
    # Sampling with the deterministic drafter (q one-hot): runs, seeded, full length.
    params = SamplingParams(temperature=0.8, top_p=0.95)
    a = t.decode(MtpDrafter(head), 3, hidden="before", params=params, seed=3)
    b = t.decode(MtpDrafter(head), 3, hidden="before", params=params, seed=3)
    assert a == b and len(a) == MAX_TOKENS
    # The forward must keep the hidden state the head was made for.
    with pytest.raises(ValueError, match="hidden"):
        t.decode(MtpDrafter(head), 2, hidden="after")


# --- logits against a reference from the raw tensors ---------------------------------------


def _raw(path: Path) -> dict[str, np.ndarray]:
    return {k: np.array(v.astype(mx.float32)) for k, v in
            mx.load(str(path / "model.safetensors")).items()}


# Tensor names per style, written out here rather than taken from the module under test.
NAMES = {
    "qwen": ("mtp.", "fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm", "layers.0."),
    "deepseek": ("model.layers.4.", "eh_proj", "enorm", "hnorm", "shared_head.norm", ""),
    "mimo": ("model.mtp_layers.0.", "input_proj", "token_layernorm", "hidden_layernorm",
             "final_layernorm", ""),
}
NOT_LAYER = ("fc.", "pre_fc_norm", "norm.", "eh_proj.", "enorm.", "hnorm.", "shared_head.",
             "embed_tokens.", "input_proj.", "token_layernorm.", "hidden_layernorm.",
             "final_layernorm.")


def reference_logits(t: Tiny, style: str, hidden: np.ndarray, tokens: np.ndarray,
                     offset: float, embed_first: bool) -> np.ndarray:
    """The head's logits for rows (hidden[i], tokens[i]) at positions 0..L-1, from the raw
    file: numpy norms and projections, one decoder layer of mlx-lm's class."""
    raw = _raw(t.path)
    prefix, proj, norm_e, norm_h, final, layer_sub = NAMES[style]

    def rms(x, w):
        x = x.astype(np.float64)
        return (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + RMS_EPS) * (w + offset))

    embed_name = ("model.language_model." if t.family == "qwen3_5" else "model.") + \
        "embed_tokens.weight"
    e = raw[embed_name][tokens].copy()
    if style in ("deepseek", "mimo"):
        e[0] = 0.0  # these heads see no embedding at position 0
    e = rms(e, raw[prefix + norm_e + ".weight"])
    h = rms(hidden, raw[prefix + norm_h + ".weight"])
    x = np.concatenate([e, h] if embed_first else [h, e], -1) @ raw[prefix + proj +
                                                                      ".weight"].T
    if t.family == "llama":
        layer = llama.TransformerBlock(llama.ModelArgs.from_dict(t.config))
    elif t.family == "qwen3":
        layer = qwen3.TransformerBlock(qwen3.ModelArgs.from_dict(t.config))
    else:
        args = qwen3_5.TextModelArgs.from_dict(t.config["text_config"])
        layer = qwen3_5.DecoderLayer(args, layer_idx=args.full_attention_interval - 1)
    lp = prefix + layer_sub
    weights = []
    for k, v in raw.items():
        rest = k[len(lp):]
        if not k.startswith(lp) or (not layer_sub and rest.startswith(NOT_LAYER)):
            continue
        weights.append((rest, mx.array(v + offset if k.endswith("norm.weight") else v)))
    layer.load_weights(weights, strict=True)
    y = np.array(layer(mx.array(x.astype(np.float32))[None], mask="causal", cache=None)[0])
    head = raw.get(prefix + "shared_head.head.weight", raw["lm_head.weight"])
    return rms(y, raw[prefix + final + ".weight"]) @ head.T


@pytest.mark.parametrize("family,style", CASES)
def test_head_logits_match_reference(tiny, family, style):
    t = tiny(family, style)
    head = t.head()
    rng = np.random.default_rng(1)
    hidden = rng.standard_normal((7, 64)).astype(np.float32)
    tokens = rng.integers(3, 512, 7)
    out = head(mx.array(hidden), mx.array(tokens), head.make_cache(), all_logits=True)
    got = np.array(out.logits)
    zc = family == "qwen3_5"
    offset = 1.0 if zc else 0.0
    embed_first = style != "mimo"
    want = reference_logits(t, style, hidden, tokens, offset, embed_first)
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=1e-3)
    # The reference has the power to tell: a forgotten +1 or a swapped concat changes logits.
    if zc:
        assert not np.allclose(got, reference_logits(t, style, hidden, tokens, 0.0,
                                                     embed_first), atol=0.1)
    assert not np.allclose(got, reference_logits(t, style, hidden, tokens, offset,
                                                 not embed_first), atol=0.1)


def test_rows_in_steps_equal_rows_at_once(tiny):
    """Appending rows one by one to the head's cache gives the logits of one call over all rows:
    positions and the cache are consistent between begin (many rows) and observe/propose."""
    t = tiny("qwen3_5", "qwen")
    head = t.head()
    rng = np.random.default_rng(2)
    hidden = mx.array(rng.standard_normal((6, 64)).astype(np.float32))
    tokens = mx.array(rng.integers(3, 512, 6))
    whole = head(hidden, tokens, head.make_cache(), all_logits=True).logits
    cache = head.make_cache()
    rows = [head(hidden[i:i + 1], tokens[i:i + 1], cache).logits[0] for i in range(6)]
    np.testing.assert_allclose(np.array(mx.stack(rows)), np.array(whole), atol=1e-4)


@pytest.mark.parametrize("family,style", [("llama", "deepseek"), ("qwen3_5", "qwen")])
def test_drafter_cache_equals_one_pass_over_the_sequence(tiny, family, style):
    """After speculative decoding (speculative rows trimmed, verified rows appended each
    round), the head's cache holds exactly the rows one pass over the final sequence gives:
    pair (h_i, x_{i+1}) at position i, for every i, and the trunk's cache is as long."""
    t = tiny(family, style)
    head = t.head()
    drafter = MtpDrafter(head)
    fwd = LocalForward(t.lm.model, hidden="after")
    out = list(decode(fwd, t.prompt, SamplingParams(), MAX_TOKENS, make_rng(0), drafter, 3))
    seq = t.prompt + out
    n = len(seq) - 1  # the last token is pending: neither cache has seen it yet
    assert drafter.cache.offset == n
    assert max(c.offset for c in fwd.cache if hasattr(c, "keys")) == n
    ref = LocalForward(t.lm.model, hidden="after")
    ref.prefill(seq[:-1])
    cache = head.make_cache()
    head(ref.last_hidden, mx.array(seq[1:]), cache)
    for got, want in ((drafter.cache.keys, cache.keys), (drafter.cache.values, cache.values)):
        np.testing.assert_allclose(np.array(got[..., :n, :]), np.array(want[..., :n, :]),
                                   atol=1e-4)


@pytest.mark.parametrize("style,chain", [("deepseek", "before"), ("qwen", "after")])
def test_chained_drafts_feed_back_the_conventional_output(tiny, style, chain):
    """Depth 2 feeds the head its own output (before its final norm for DeepSeek, after it for
    Qwen) with draft 1, at the next position."""
    t = tiny("llama", style)
    head = t.head()
    assert head.conventions.chain == chain
    fwd = LocalForward(t.lm.model, hidden="after")
    fwd.prefill(t.prompt[:-1])
    drafter = MtpDrafter(head)
    drafter.begin(t.prompt, fwd)
    drafts, q = drafter.propose(t.prompt, 2)
    assert q is None and drafter.cache.offset == len(t.prompt)  # one speculative row
    cache = head.make_cache()
    first = head(fwd.last_hidden, mx.array(t.prompt[1:]), cache)
    assert drafts[0] == int(mx.argmax(first.logits[-1]).item())
    fed = first.pre_norm if chain == "before" else first.post_norm
    second = head(fed[-1:], mx.array(drafts[:1]), cache)
    assert drafts[1] == int(mx.argmax(second.logits[-1]).item())


# --- acceptance with heads built to be right or wrong ----------------------------------------


def _bigram(src: Tiny, dst: Path, style: str, right: bool) -> Path:
    """A copy of `src` whose trunk only maps the current token to the next (every attention,
    gated-delta and MLP output projection zeroed: h_t = embed(x_t)), and whose MTP head
    computes lm_head(norm(embed(x_{t+1}))), i.e. the trunk's own prediction for x_{t+2}: the
    projection passes the embedding half through and the head's layer is zeroed to identity.
    With right=False the projection passes the hidden half instead, so the head predicts
    x_{t+1} again: wrong by design."""
    shutil.copytree(src.path, dst)
    raw = mx.load(str(src.path / "model.safetensors"))
    centre = 0.0 if src.family == "qwen3_5" else 1.0
    prefix, proj, norm_e, norm_h, final, _ = NAMES[style]
    out = {}
    for k, v in raw.items():
        if k.endswith(("o_proj.weight", "down_proj.weight", "out_proj.weight")):
            v = mx.zeros_like(v)  # trunk and head layers: identity on the residual stream
        out[k] = v
    eye, zero = mx.eye(64, dtype=mx.bfloat16), mx.zeros((64, 64), mx.bfloat16)
    embed_half_first = style != "mimo"
    take_embed = right
    first = eye if take_embed == embed_half_first else zero
    second = zero if take_embed == embed_half_first else eye
    out[prefix + proj + ".weight"] = mx.concatenate([first, second], 1)
    out[prefix + norm_e + ".weight"] = mx.full((64,), centre, mx.bfloat16)
    out[prefix + norm_h + ".weight"] = mx.full((64,), centre, mx.bfloat16)
    trunk_norm = ("model.language_model." if src.family == "qwen3_5" else "model.") + \
        "norm.weight"
    out[prefix + final + ".weight"] = raw[trunk_norm]
    mx.save_safetensors(str(dst / "model.safetensors"), out, metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("family,style", [("llama", "qwen"), ("llama", "deepseek"),
                                          ("llama", "mimo"), ("qwen3_5", "qwen")])
def test_acceptance_of_right_and_wrong_heads(tiny, tmp_path, family, style):
    src = tiny(family, style)
    results = {}
    for right in (True, False):
        t = Tiny(_bigram(src, tmp_path / f"right-{right}", style, right), family)
        plain = t.decode()
        # The bigram chain must not just repeat a token, or the wrong head would be right too.
        assert sum(a == b for a, b in zip(plain, plain[1:], strict=False)) <= 2
        stats = DecodeStats()
        assert t.decode(MtpDrafter(t.head()), 3, stats, hidden="after") == plain
        results[right] = [a / d for a, d in zip(stats.accepted_at, stats.drafted_at,
                                                strict=True)]
    assert min(results[True]) >= 0.9, results
    assert max(results[False]) <= 0.2, results


# --- loading ------------------------------------------------------------------------------


def test_sidecar_equals_in_model_load(tiny, tmp_path):
    t = tiny("qwen3_5", "qwen")
    raw = mx.load(str(t.path / "model.safetensors"))
    mtp_names = set(mtp_tensor_shapes("qwen3_5", "qwen"))
    stripped = tmp_path / "model"
    shutil.copytree(t.path, stripped)
    mx.save_safetensors(str(stripped / "model.safetensors"),
                        {k: v for k, v in raw.items() if k not in mtp_names})
    sidecar = tmp_path / "side" / "mtp.safetensors"
    sidecar.parent.mkdir()
    mx.save_safetensors(str(sidecar), {k: v for k, v in raw.items() if k in mtp_names})

    assert load_mtp_head(stripped, t.lm.model, t.config) is None
    assert detect_conventions(stripped, t.config) is None
    assert detect_conventions(sidecar, t.config) == t.head().conventions
    side = load_mtp_head(stripped, t.lm.model, t.config, sidecar=sidecar)
    rng = np.random.default_rng(3)
    hidden = mx.array(rng.standard_normal((5, 64)).astype(np.float32))
    tokens = mx.array(rng.integers(3, 512, 5))
    a = t.head()(hidden, tokens, side.make_cache(), all_logits=True).logits
    b = side(hidden, tokens, side.make_cache(), all_logits=True).logits
    np.testing.assert_array_equal(np.array(a), np.array(b))


def test_detect_conventions_and_overrides(tiny):
    expect = {
        ("llama", "qwen"): MtpConventions("qwen"),
        ("llama", "deepseek"): MtpConventions("deepseek", chain="before", zero_first_embed=True),
        ("llama", "mimo"): MtpConventions("mimo", concat="hidden_first", zero_first_embed=True),
        ("qwen3_5", "qwen"): MtpConventions("qwen", norm_offset=1.0),
    }
    for (family, style), conv in expect.items():
        t = tiny(family, style)
        assert detect_conventions(t.path, t.config) == conv
    t = tiny("qwen3_5", "qwen")
    card = {"mtp_hidden": "before", "mtp_concat": "hidden_first", "mtp_norm_offset": 0,
            "mtp_max_depth": 2, "mtp_style": "qwen"}
    assert detect_conventions(t.path, t.config, card) == MtpConventions(
        "qwen", hidden="before", concat="hidden_first", norm_offset=0.0, max_depth=2)
    # max_depth caps the drafts per round.
    head = t.head(overrides={"mtp_max_depth": 2})
    stats = DecodeStats()
    t.decode(MtpDrafter(head), 4, stats, hidden="after")
    assert len(stats.drafted_at) == 2
    with pytest.raises(ValueError):
        MtpConventions("medusa")


def test_no_mtp_tensors_gives_none(tiny_models):
    path = tiny_models["llama"]
    lm = load_model(path, "plain", dtype="float32")
    assert detect_conventions(path, _config(path)) is None
    assert load_mtp_head(path, lm.model, _config(path)) is None


def test_quantised_trunk_quantises_head_on_load(tiny):
    t = tiny("llama", "qwen")
    config = {**t.config, "quantization": {"group_size": 32, "bits": 8}}
    q = load_mtp_head(t.path, t.lm.model, config)
    assert isinstance(q.proj, nn.QuantizedLinear)
    assert isinstance(q.layer.self_attn.q_proj, nn.QuantizedLinear)
    rng = np.random.default_rng(4)
    hidden = mx.array(rng.standard_normal((4, 64)).astype(np.float32))
    tokens = mx.array(rng.integers(3, 512, 4))
    a = np.array(t.head()(hidden, tokens, q.make_cache(), all_logits=True).logits)
    b = np.array(q(hidden, tokens, q.make_cache(), all_logits=True).logits)
    assert np.corrcoef(a.ravel(), b.ravel())[0, 1] > 0.999


def test_stack_experts():
    w = {f"mlp.experts.{e}.{p}.weight": mx.full((2, 3), e, mx.float32)
         for e in range(3) for p in ("gate_proj", "up_proj", "down_proj")}
    w["input_layernorm.weight"] = mx.ones(3)
    out = _stack_experts(w)
    assert sorted(out) == ["input_layernorm.weight", "mlp.switch_mlp.down_proj.weight",
                           "mlp.switch_mlp.gate_proj.weight", "mlp.switch_mlp.up_proj.weight"]
    assert out["mlp.switch_mlp.up_proj.weight"].shape == (3, 2, 3)
    assert out["mlp.switch_mlp.up_proj.weight"][2].sum().item() == 12
    fused = _stack_experts({"mlp.experts.gate_up_proj": mx.zeros((3, 8, 5)),
                            "mlp.experts.down_proj": mx.zeros((3, 5, 4))})
    assert fused["mlp.switch_mlp.gate_proj.weight"].shape == (3, 4, 5)
    assert fused["mlp.switch_mlp.down_proj.weight"].shape == (3, 5, 4)


# --- lookup and the head together (auto mode) ---------------------------------------------------


def test_lookup_then_mtp_is_exact_and_keeps_the_head_in_step(tiny):
    """Lookup drafts where it matches, the head elsewhere; greedy output equals plain and the
    head's cache still equals one pass over the sequence after rounds that lookup drafted."""
    from skulkp2p.engine.drafting.gates import GatedDrafter, LookupThenModel
    from skulkp2p.engine.runner.generate import _lookup

    t = tiny("llama", "qwen")
    t.prompt = t.lm.tokenizer.encode(TEXT + " " + TEXT + " " + TEXT)
    plain = t.decode()
    free = {1: 1.0, 2: 1.0}  # verify as cheap as a step: neither gate ever turns off
    lookup = GatedDrafter(_lookup(t.lm), free, 4, start_on=True)
    mtp = MtpDrafter(t.head())
    both = LookupThenModel(lookup, GatedDrafter(mtp, free, 2))
    stats = DecodeStats()
    fwd = LocalForward(t.lm.model, hidden="after")
    out = list(decode(fwd, t.prompt, SamplingParams(), MAX_TOKENS, make_rng(0), both, 4, stats))
    assert out == plain
    counts = both.counts()
    assert counts["lookup"]["drafted"] > 0 and counts["mtp"]["drafted"] > 0, counts
    assert counts["lookup"]["drafted"] + counts["mtp"]["drafted"] == stats.drafted
    seq = t.prompt + out
    n = len(seq) - 1
    assert mtp.cache.offset == n
    ref = LocalForward(t.lm.model, hidden="after")
    ref.prefill(seq[:-1])
    cache = t.head().make_cache()
    t.head()(ref.last_hidden, mx.array(seq[1:]), cache)
    np.testing.assert_allclose(np.array(mtp.cache.keys[..., :n, :]),
                               np.array(cache.keys[..., :n, :]), atol=1e-4)


def test_auto_mode_with_a_head_uses_lookup_and_mtp(tiny):
    """A model with a head, in auto mode: the combined drafter, exact, counted per drafter."""
    from skulkp2p.formats.pipe_format import parse_request
    from tests.helpers.pipe_result import generate

    t = tiny("llama", "qwen")
    prompt = " ".join([TEXT] * 3)
    res = {mode: generate(t.lm, parse_request({"prompt": prompt, "max_tokens": MAX_TOKENS,
                                               "speculation": mode}))
           for mode in ("off", "auto")}
    assert res["auto"]["tokens"] == res["off"]["tokens"]
    spec = res["auto"]["speculation"]
    assert spec["drafter"] == "lookup+mtp" and spec["mode"] == "auto"
    assert set(spec["by_drafter"]) == {"lookup", "mtp"}
    assert spec["by_drafter"]["lookup"]["drafted"] > 0, spec


def test_head_priced_off_catches_up_and_drafts_exactly_when_costs_fall(tiny):
    """The head's gate goes off at verify costs where no depth pays (a burst on a tensor
    group's live table), keeps only references to the rows it skips, and when the costs fall
    it is priced again, catches its cache up in one call and drafts: the output stays the
    plain one and the head's cache ends where a head that drafted throughout ends."""
    from skulkp2p.engine.drafting.gates import REPRICE_EVERY, GatedDrafter

    t = tiny("llama", "qwen")
    head = t.head()
    hidden = head.conventions.hidden
    plain = t.decode()
    dear = {1: 1.0, 2: 3.0, 3: 4.0, 4: 5.0}
    costs = dict(dear)
    gated = GatedDrafter(MtpDrafter(head), costs, 3)
    stats = DecodeStats()
    out = []
    steps = decode(LocalForward(t.lm.model, hidden=hidden), t.prompt, SamplingParams(),
                   MAX_TOKENS, make_rng(0), gated, 3, stats)
    for token in steps:
        out.append(token)
        if len(out) == 4:
            assert not gated.on and stats.drafted == 0  # off from the first round
            costs.update({w: 1.0 for w in costs})  # the burst passed: every width at one's
    assert out == plain
    assert [e["event"] for e in gated.events][:2] == ["off", "on"]
    assert gated.events[1]["reason"] == "verify costs fell"
    assert gated.events[1]["at_token"] <= REPRICE_EVERY + 2 and stats.drafted > 0
    # The same head drafting from the start at the low costs: same cache at the end.
    reference = MtpDrafter(head)
    t.decode(GatedDrafter(reference, {w: 1.0 for w in dear}, 3), 3, hidden=hidden)
    came_back = gated.inner
    assert came_back.cache.offset == reference.cache.offset
    n = came_back.cache.offset
    for mine, theirs in ((came_back.cache.keys, reference.cache.keys),
                         (came_back.cache.values, reference.cache.values)):
        assert mx.allclose(mine[..., :n, :], theirs[..., :n, :], atol=1e-5).item()
