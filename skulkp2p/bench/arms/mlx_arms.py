"""The MLX bench's arms and one generation of each, timed as a client sees it.

* `plain` (speculation "off") — the baseline every speedup is measured against;
* `spec` (speculation "auto") — whatever the engine decides on its own;
* explicit drafters, e.g. `lookup:4`, `mtp:1`, `draft:3`;
* peers: `mlx_lm` (mlx_lm.stream_generate on the same model object and prompt tokens) and
  `mlx_lm_draft` (mlx-lm's speculative generate with `--draft-model`).

Decode tok/s is measured the same way for every arm: generated tokens after the first / time
from first to last token. No mlx at module level (the CLI imports this before the BLAS is set).
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from skulkp2p.bench.bench_error import BenchError
from skulkp2p.bench.report import round_or_none

if TYPE_CHECKING:
    from skulkp2p.engine.model.loaded import LoadedModel
    from skulkp2p.models.store import ModelStore

MLX_LM_DRAFT_TOKENS = 2  # mlx-lm's own default num_draft_tokens

# --------------------------------------------------------------------------------------------
# Arms


PEERS = ("mlx_lm", "mlx_lm_draft")
DRAFTER_NAMES = ("lookup", "mtp", "draft", "assistant")


@dataclass(frozen=True)
class Arm:
    name: str
    kind: str  # "engine" | "mlx_lm" | "mlx_lm_draft" | "llama" (peers.py)
    speculation: Any = None  # the request's `speculation` field, for engine arms
    memory: bool = True  # engine arms: the draft memory of earlier requests (else off)
    lookup: str | None = None  # engine arms: card's speculation.lookup.drafter for this arm
    # With --nodes N --one-node: the arm runs on the whole model loaded in the bench's own
    # process, beside the ring's or group's arms in the same run (the single-node reference).
    one_node: bool = False
    trees: bool = False  # engine arms: token trees on (card's speculation.lookup.trees)
    edits: bool = True  # engine arms: the suffix drafter's copy cursor etc. (lookup.edits)
    # The structured set: the request carries its case's schema (free_plain does not).
    constrained: bool = True

    @property
    def peer(self) -> bool:
        return self.kind != "engine"


PLAIN = Arm("plain", "engine", "off")
SPEC = Arm("spec", "engine", "auto")
# bench --structured: plain decoding of the same prompt without the schema, the reference of
# what the grammar's masks cost.
FREE_PLAIN = Arm("free_plain", "engine", "off", constrained=False)
ONE_NODE_PLAIN = Arm("one_node_plain", "engine", "off", one_node=True)
ONE_NODE_SPEC = Arm("one_node_spec", "engine", "auto", one_node=True)
# The ablation of the model-free drafter, in "auto" mode beside the MTP head: the older n-gram
# scan without memory, the suffix drafter alone (no memory), suffix + memory + token trees
# (spec is suffix + memory, chains unless the card turns trees on).
ABLATIONS = {"spec_scan": Arm("spec_scan", "engine", "auto", memory=False, lookup="scan"),
             "spec_nomem": Arm("spec_nomem", "engine", "auto", memory=False),
             "spec_trees": Arm("spec_trees", "engine", "auto", trees=True),
             "spec_noedits": Arm("spec_noedits", "engine", "auto", edits=False)}


def drafts_deterministic(arm: Arm, loaded: LoadedModel) -> bool:
    """Whether the arm's sampled requests draft deterministically (lookup, an MTP head), so
    that a seeded request emits plain sampling's text (the engine's own decision); draft
    models and the Gemma assistant draw their drafts from a q, and then the text depends on
    the drafts."""
    from skulkp2p.engine.runner.generate import drafts_sampled
    from skulkp2p.formats.body_fields import speculation

    return arm.kind == "engine" and not drafts_sampled(loaded, speculation(arm.speculation))


def parse_arm(text: str) -> Arm:
    """One arm name: plain, spec, mlx_lm, mlx_lm_draft, or DRAFTER:DEPTH (lookup:4)."""
    text = text.strip()
    if text == "plain":
        return PLAIN
    if text == "spec":
        return SPEC
    if text in PEERS:
        return Arm(text, text)
    if text in ABLATIONS:
        return ABLATIONS[text]
    m = re.fullmatch(r"([a-z_]+):(\d+)", text)
    if not m or m.group(1) not in DRAFTER_NAMES:
        raise ValueError(f"unknown arm {text!r} (expected plain, spec, spec_scan, spec_nomem, "
                         "spec_trees, spec_noedits, "
                         "mlx_lm, mlx_lm_draft or "
                         f"DRAFTER:DEPTH with DRAFTER one of {', '.join(DRAFTER_NAMES)})")
    depth = int(m.group(2))
    if not 1 <= depth <= 32:
        raise ValueError(f"arm {text!r}: depth must be 1..32")
    return Arm(text, "engine", {"drafter": m.group(1), "depth": depth})


def select_arms(extra: Sequence[Arm], peers: bool, draft_model: str | None
                ) -> tuple[list[Arm], list[dict[str, str]]]:
    """plain first (the baseline), spec, the extra arms, then the peers; and the skipped peers
    with the reason (the JSON says why a peer is missing rather than leaving it out silently)."""
    wanted = [PLAIN, SPEC, *extra]
    if peers:
        wanted += [Arm("mlx_lm", "mlx_lm"), Arm("mlx_lm_draft", "mlx_lm_draft")]
    arms = list({a.name: a for a in wanted}.values())  # first mention wins, order kept
    skipped: list[dict[str, str]] = []
    if not draft_model and any(a.kind == "mlx_lm_draft" for a in arms):
        arms = [a for a in arms if a.kind != "mlx_lm_draft"]
        skipped.append({"arm": "mlx_lm_draft", "reason": "no --draft-model given"})
    for name in PEERS:
        if not peers and all(a.name != name for a in arms):
            skipped.append({"arm": name, "reason": "--no-peers"})
    return arms, skipped


# --------------------------------------------------------------------------------------------
# One generation per arm kind


@dataclass
class Run:
    tokens: list[int]
    ttft_s: float
    decode_s: float
    drafted: int | None = None
    accepted: int | None = None
    acceptance_per_position: list[float | None] | None = None
    text: str = ""
    ring: dict[str, Any] | None = None  # --nodes: where the time went (ring.py)
    tree_rounds: int | None = None  # rounds verified as a token tree (engine arms)
    # The gates' switches (engine arms): {"drafter", "event", "at_token", "reason"}, in order.
    gate_events: list[dict[str, Any]] | None = None
    valid: bool | None = None  # the structured set: the text is valid against the schema

    @property
    def tok_s(self) -> float | None:
        if len(self.tokens) < 2 or self.decode_s <= 0:
            return None
        return (len(self.tokens) - 1) / self.decode_s

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tok_s": round_or_none(self.tok_s, 2),
                               "ttft_s": round(self.ttft_s, 4),
                               "decode_s": round(self.decode_s, 4), "tokens": len(self.tokens)}
        if self.drafted is not None:
            out.update(drafted=self.drafted, accepted=self.accepted)
        if self.tree_rounds is not None:
            out["tree_rounds"] = self.tree_rounds
        if self.gate_events:
            out["gate_events"] = self.gate_events
        if self.valid is not None:
            out["valid"] = self.valid
        if self.ring is not None:
            out["ring"] = self.ring
        return out


class SkipArm(Exception):
    """This arm cannot run on this model (the reason goes into the JSON)."""


@dataclass(frozen=True)
class Sampling:
    """bench --temperature T --seed S: every engine request samples at T with seed S (the
    run's: S + run index, the same for every arm of that run); None: unseeded (--unseeded)."""
    temperature: float
    seed: int | None


def engine_request(messages: list[dict[str, str]], max_tokens: int, speculation: Any,
                   sampling: Sampling | None = None, schema: dict | None = None,
                   ignore_eos: bool = False):
    """A chat request as a client of the engine would send it: greedy, or sampled; with
    `schema`, its output constrained to that JSON Schema (response_format json_schema);
    `ignore_eos`: it runs to max_tokens (bench --ignore-eos; no front end's field)."""
    import dataclasses

    from skulkp2p.formats.pipe_format import parse_request

    body: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                            "speculation": speculation}
    if sampling is not None:
        body.update(temperature=sampling.temperature)
        if sampling.seed is not None:
            body["seed"] = sampling.seed
    if schema is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "bench", "schema": schema}}
    req = parse_request(body)
    return dataclasses.replace(req, ignore_eos=True) if ignore_eos else req


def run_engine(loaded: LoadedModel, messages: list[dict[str, str]], max_tokens: int,
               speculation: Any, engine: Any = None,
               setup: Sequence[list[dict[str, str]]] = (),
               sampling: Sampling | None = None, schema: dict | None = None,
               ignore_eos: bool = False) -> Run:
    """One measured request on `engine` (default: a fresh MlxEngine, so an empty draft
    memory), after the session's earlier requests `setup`, unmeasured. Engines here run without
    the prefix cache: every run is a cold prefill (`--agent` measures the cache). `sampling`:
    the requests sample (bench --temperature)."""
    from skulkp2p.engine.request import RequestError
    from skulkp2p.engine.runner.mlx_engine import MlxEngine

    engine = engine if engine is not None else MlxEngine(loaded, prefix_cache_mb=0)
    for earlier in setup:
        try:
            for _ in engine.generate(engine_request(earlier, max_tokens, speculation,
                                                    sampling, schema)):
                pass
        except RequestError as e:
            raise SkipArm(e.message) from None
    req = engine_request(messages, max_tokens, speculation, sampling, schema, ignore_eos)
    generation = engine.generate(req)
    t_first = t_last = None
    t0 = time.perf_counter()
    try:
        for chunk in generation:
            if chunk.tokens:  # timed at receipt, as a client would see it
                t_last = time.perf_counter()
                t_first = t_first or t_last
    except RequestError as e:
        raise SkipArm(e.message) from None
    end = t_last or time.perf_counter()
    result = generation.result
    assert result is not None
    spec = result.speculation
    return Run(tokens=list(result.tokens), ttft_s=(t_first or end) - t0,
               decode_s=end - (t_first or end), drafted=spec.drafted if spec else None,
               accepted=spec.accepted if spec else None,
               acceptance_per_position=spec.acceptance_per_position if spec else None,
               text=result.text, tree_rounds=spec.tree_rounds if spec else None,
               gate_events=list(spec.gate_events or []) if spec else None)


def run_mlx_lm(loaded: LoadedModel, messages: list[dict[str, str]], max_tokens: int,
               draft: LoadedModel | None = None, draft_tokens: int = MLX_LM_DRAFT_TOKENS) -> Run:
    """mlx-lm's stream_generate on the same model object and the same prompt tokens."""
    import mlx.core as mx
    from mlx_lm import stream_generate

    from skulkp2p.engine.cpu import table_rope
    from skulkp2p.engine.runner.generate import prompt_tokens

    prompt = prompt_tokens(loaded, engine_request(messages, max_tokens, "off"))
    eos = set(loaded.tokenizer.eos_token_ids)
    kwargs: dict[str, Any] = {"prefill_step_size": int(loaded.runtime.get("prefill_step", 2048))}
    if draft is not None:
        kwargs.update(draft_model=draft.model, num_draft_tokens=draft_tokens)
    tokens: list[int] = []
    from_draft: list[bool] = []
    t_first = t_last = None
    t0 = time.perf_counter()
    try:
        # mlx-lm as it ships: its own rope, not the engine's table (engine/cpu/table_rope.py)
        with table_rope.stock():
            for resp in stream_generate(loaded.model, loaded.tokenizer, mx.array(prompt),
                                        max_tokens=max_tokens, **kwargs):
                if resp.finish_reason == "stop" and resp.token in eos:
                    break  # mlx-lm reports the EOS token in its last response; not output
                t_last = time.perf_counter()
                t_first = t_first or t_last
                tokens.append(int(resp.token))
                from_draft.append(bool(resp.from_draft))
    except ValueError as e:  # e.g. "Speculative decoding requires a trimmable prompt cache"
        raise SkipArm(f"mlx-lm: {e}") from None
    end = t_last or time.perf_counter()
    run = Run(tokens=tokens, ttft_s=(t_first or end) - t0, decode_s=end - (t_first or end),
              text=loaded.tokenizer.decode(tokens))
    if draft is not None:
        run.drafted, run.accepted, run.acceptance_per_position = mlx_lm_acceptance(
            from_draft, max_tokens, draft_tokens)
    return run


def mlx_lm_acceptance(from_draft: list[bool], max_tokens: int, k: int
                      ) -> tuple[int, int, list[float | None]]:
    """Drafted/accepted counts of mlx-lm's speculative loop, rebuilt from its from_draft flags:
    each round drafts min(k, tokens left), yields the accepted drafts, then one verifier token."""
    drafted_at = [0] * k
    accepted_at = [0] * k
    produced = 0
    i = 0
    while i < len(from_draft):
        n_draft = min(k, max_tokens - produced)
        n_acc = 0
        while i < len(from_draft) and from_draft[i]:
            n_acc += 1
            i += 1
        i += 1  # the verifier's own token ends the round
        produced += n_acc + 1
        for j in range(n_draft):
            drafted_at[j] += 1
            accepted_at[j] += int(j < n_acc)
    per_pos = [round(a / d, 4) if d else None for a, d in zip(accepted_at, drafted_at,
                                                              strict=True)]
    return sum(drafted_at), sum(accepted_at), per_pos


# --------------------------------------------------------------------------------------------
# Runs of an arm


@dataclass
class Cell:
    """The runs of one arm on one workload, or why it was skipped."""

    runs: list[Run] = field(default_factory=list)
    skip: str | None = None


def execute(arm: Arm, loaded: LoadedModel, draft: LoadedModel | None, messages, max_tokens: int,
            draft_tokens: int, setup: Sequence[list[dict[str, str]]] = (),
            memory_tokens: int | None = None, peer: Any = None,
            sampling: Sampling | None = None, schema: dict | None = None,
            ignore_eos: bool = False) -> Run:
    """One generation of `arm` on `messages`, after the session's earlier requests `setup` on
    the same fresh engine (or server). `memory_tokens`: the engine's draft memory bound (None:
    the card's or the default); `peer`: (llama-server binary, GGUF) for llama arms;
    `sampling`: engine arms sample (the peers are greedy only: the bench drops them);
    `schema`: the output is constrained to it (engine arms but an unconstrained one, and
    llama-server as its json_schema); `ignore_eos`: engine arms run to max_tokens."""
    if not arm.constrained:
        schema = None
    if arm.kind == "engine":
        from skulkp2p.engine.runner.mlx_engine import MlxEngine

        saved = loaded.speculation
        lookup = dict(saved.get("lookup", {}))
        if arm.lookup is not None:
            lookup["drafter"] = arm.lookup
        if arm.trees:
            lookup["trees"] = True
        if not arm.edits:
            lookup["edits"] = False
        if lookup != saved.get("lookup", {}):
            loaded.speculation = {**saved, "lookup": lookup}
        try:
            engine = MlxEngine(loaded, prefix_cache_mb=0,
                               memory_tokens=memory_tokens if arm.memory else 0)
            return run_engine(loaded, messages, max_tokens, arm.speculation, engine, setup,
                              sampling, schema, ignore_eos)
        finally:
            loaded.speculation = saved
    if arm.kind == "llama":
        from skulkp2p.bench.arms.peers import run_llama

        gen = run_llama(*peer, arm.name, list(setup), messages, max_tokens, schema)
        # Token ids are not streamed: placeholders of the right count (tok/s); text compares.
        return Run(tokens=list(range(gen.tokens)), ttft_s=gen.ttft_s, decode_s=gen.decode_s,
                   drafted=gen.drafted, accepted=gen.accepted, text=gen.text)
    if arm.kind == "mlx_lm":
        return run_mlx_lm(loaded, messages, max_tokens)
    return run_mlx_lm(loaded, messages, max_tokens, draft, draft_tokens)


def open_draft(store: ModelStore, spec: str, loaded: LoadedModel) -> LoadedModel:
    """Load --draft-model in the target's dtype. It drafts for mlx-lm's speculative peer and,
    unless the card already names one, becomes the engine's draft model too (draft:k arms and
    spec), as a card's speculation.draft_model would."""
    from skulkp2p.engine.request import RequestError
    from skulkp2p.engine.runner.loader import open_model

    draft = open_model(store, spec, loaded.dtype)
    if hasattr(loaded, "draft") and loaded.draft is None:
        try:
            from skulkp2p.engine.drafting.draft_model import check_compatible
            from skulkp2p.engine.model.trunk import Trunk

            vocab = [int(Trunk(m.model).embed_tokens.weight.shape[0]) for m in (loaded, draft)]
            check_compatible(loaded.tokenizer, draft.tokenizer, *vocab, draft_id=draft.id)
        except RequestError as e:
            raise BenchError(str(e)) from None
        except ImportError:  # an engine without draft-model support: the peer still runs
            return draft
        loaded.draft = draft
    return draft


def prompt_len(loaded: LoadedModel, messages: list[dict[str, str]]) -> int:
    """A workload's prompt length in tokens, chat template applied."""
    from skulkp2p.engine.runner.generate import prompt_tokens

    return len(prompt_tokens(loaded, engine_request(messages, 1, "off")))

