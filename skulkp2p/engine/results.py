"""What a generation returns, typed: every engine fills these, every front end reads them.

No mlx here: the API, the pipe, the bench and the served engine import these without the MLX
engine. `to_dict` gives the JSON shapes the README documents (pipe results, the `timing` and
`speculation` objects that ride along on HTTP responses).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """A function call the model made: its id, the function's name and its arguments (a JSON
    object, as text)."""
    id: str
    name: str
    arguments: str

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's shape (also the pipe's)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallDelta:
    """A streamed piece of a tool call: the first of a call carries its id and name (with empty
    arguments), the next ones fragments of its arguments, in order."""
    index: int  # the call's position among this generation's calls
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class Chunk:
    """One step of a generation: newly final text and the tokens behind it (empty where the
    engine does not see token ids, e.g. llama-server), or a piece of a tool call."""
    text: str
    tokens: list[int] = field(default_factory=list)
    tool_call: ToolCallDelta | None = None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    # Prompt tokens whose caches came from the prefix cache (not prefilled by this request).
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict[str, int]:
        """The pipe's shape (also /v1/cluster/generate)."""
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens, "cached_tokens": self.cached_tokens}

    def openai_dict(self) -> dict[str, Any]:
        """OpenAI's shape: cached prompt tokens under prompt_tokens_details."""
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass(frozen=True)
class Timing:
    ttft_s: float
    total_s: float
    decode_tok_s: float | None
    # Set by engines other than the MLX one (the MLX engine's timing has only the three above).
    engine: str | None = None
    child_prompt_ms: float | None = None
    child_predicted_per_second: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ttft_s": self.ttft_s, "total_s": self.total_s,
                               "decode_tok_s": self.decode_tok_s}
        if self.engine is not None:
            out["engine"] = self.engine
            out["child_prompt_ms"] = self.child_prompt_ms
            out["child_predicted_per_second"] = self.child_predicted_per_second
        return out


@dataclass(frozen=True)
class DrafterCounts:
    """One drafter's share of a combined drafter's rounds (`auto` with lookup and a head)."""
    rounds: int
    drafted: int
    accepted: int

    def to_dict(self) -> dict[str, int]:
        return {"rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted}


@dataclass(frozen=True)
class SpeculationStats:
    drafter: str
    mode: str  # "auto" (gated) | "explicit"
    drafted: int
    accepted: int
    # The MLX decode loop reports these; llama-server's timings do not.
    max_depth: int | None = None
    rounds: int | None = None
    acceptance_per_position: list[float | None] | None = None
    gate_fired: bool | None = None
    gate_events: list[dict[str, Any]] | None = None
    by_drafter: dict[str, DrafterCounts] | None = None
    # Counts behind acceptance_per_position: drafts that reached position i, and accepted there.
    drafted_per_position: list[int] | None = None
    accepted_per_position: list[int] | None = None
    tree_rounds: int | None = None  # rounds verified as a token tree (engine/model/tree.py)

    @property
    def acceptance(self) -> float | None:
        return round(self.accepted / self.drafted, 4) if self.drafted else None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"drafter": self.drafter, "mode": self.mode}
        if self.max_depth is not None:
            out["max_depth"] = self.max_depth
        if self.rounds is not None:
            out["rounds"] = self.rounds
        out.update(drafted=self.drafted, accepted=self.accepted, acceptance=self.acceptance)
        if self.acceptance_per_position is not None:
            out["acceptance_per_position"] = list(self.acceptance_per_position)
        if self.accepted_per_position is not None:
            out["drafted_per_position"] = list(self.drafted_per_position or [])
            out["accepted_per_position"] = list(self.accepted_per_position)
        if self.gate_fired is not None:
            out["gate_fired"] = self.gate_fired
            out["gate_events"] = list(self.gate_events or [])
        if self.by_drafter is not None:
            out["by_drafter"] = {k: v.to_dict() for k, v in self.by_drafter.items()}
        if self.tree_rounds is not None:
            out["tree_rounds"] = self.tree_rounds
        return out


@dataclass(frozen=True)
class GenerationResult:
    text: str
    tokens: list[int]  # generated ids without the end-of-sequence token (empty: llama-server)
    finish_reason: str  # "stop" | "length" | "tool_calls"
    usage: Usage
    timing: Timing
    speculation: SpeculationStats | None = None
    stop_sequence: str | None = None  # which stop string ended the text, if one did
    # The calls the model made (finish_reason "tool_calls"); `text` is what it said beside them.
    tool_calls: tuple[ToolCall, ...] = ()

    def to_pipe_dict(self, req_id: Any, model: str) -> dict[str, Any]:
        """The JSONL pipe's result object (also POST /v1/cluster/generate's)."""
        out: dict[str, Any] = {"id": req_id, "model": model, "text": self.text,
                               "tokens": list(self.tokens), "finish_reason": self.finish_reason,
                               "usage": self.usage.to_dict(), "timing": self.timing.to_dict()}
        if self.tool_calls:
            out["tool_calls"] = [call.to_dict() for call in self.tool_calls]
        if self.speculation is not None:
            out["speculation"] = self.speculation.to_dict()
        return out

    def extras(self) -> dict[str, Any]:
        """Our own fields beside an HTTP response's standard ones: timing and speculation."""
        out: dict[str, Any] = {"timing": self.timing.to_dict()}
        if self.speculation is not None:
            out["speculation"] = self.speculation.to_dict()
        return out
