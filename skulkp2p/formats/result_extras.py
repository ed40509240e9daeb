"""Our own objects beside every API's standard fields: `timing` and `speculation` (the pipe's
result carries them too; docs/pipe.md says what each field means)."""

from __future__ import annotations

from skulkp2p.engine.json_types import JSONObject
from skulkp2p.engine.results import DrafterCounts, GenerationResult, SpeculationStats, Timing


def timing_json(timing: Timing) -> JSONObject:
    out: JSONObject = {"ttft_s": timing.ttft_s, "total_s": timing.total_s,
                       "decode_tok_s": timing.decode_tok_s}
    if timing.engine is not None:
        out["engine"] = timing.engine
        out["child_prompt_ms"] = timing.child_prompt_ms
        out["child_predicted_per_second"] = timing.child_predicted_per_second
    return out


def _counts_json(counts: DrafterCounts) -> JSONObject:
    return {"rounds": counts.rounds, "drafted": counts.drafted, "accepted": counts.accepted}


def speculation_json(s: SpeculationStats) -> JSONObject:
    out: JSONObject = {"drafter": s.drafter, "mode": s.mode}
    if s.max_depth is not None:
        out["max_depth"] = s.max_depth
    if s.rounds is not None:
        out["rounds"] = s.rounds
    out.update(drafted=s.drafted, accepted=s.accepted, acceptance=s.acceptance)
    if s.acceptance_per_position is not None:
        out["acceptance_per_position"] = list(s.acceptance_per_position)
    if s.accepted_per_position is not None:
        out["drafted_per_position"] = list(s.drafted_per_position or [])
        out["accepted_per_position"] = list(s.accepted_per_position)
    if s.gate_fired is not None:
        out["gate_fired"] = s.gate_fired
        out["gate_events"] = list(s.gate_events or [])
    if s.by_drafter is not None:
        out["by_drafter"] = {k: _counts_json(v) for k, v in s.by_drafter.items()}
    if s.tree_rounds is not None:
        out["tree_rounds"] = s.tree_rounds
    return out


def extras(result: GenerationResult) -> JSONObject:
    """`timing`, and `speculation` when a drafter was chosen."""
    out: JSONObject = {"timing": timing_json(result.timing)}
    if result.speculation is not None:
        out["speculation"] = speculation_json(result.speculation)
    return out
