"""What a generation returns, typed: every engine fills these, every front end reads them.

No mlx here and no JSON: the front ends (skulkp2p/formats/) write these in their own shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from skulkp2p.engine.json_types import JSONObject


@dataclass(frozen=True)
class ToolCall:
    """A function call the model made (or made earlier, in a chat's history): its id, the
    function's name and its arguments (a JSON object, as text)."""
    id: str
    name: str
    arguments: str


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


@dataclass(frozen=True)
class Timing:
    ttft_s: float
    total_s: float
    decode_tok_s: float | None
    # Set by engines other than the MLX one (the MLX engine's timing has only the three above).
    engine: str | None = None
    child_prompt_ms: float | None = None
    child_predicted_per_second: float | None = None


@dataclass(frozen=True)
class DrafterCounts:
    """One drafter's share of a combined drafter's rounds (`auto` with lookup and a head)."""
    rounds: int
    drafted: int
    accepted: int


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
    gate_events: list[JSONObject] | None = None
    by_drafter: dict[str, DrafterCounts] | None = None
    # Counts behind acceptance_per_position: drafts that reached position i, and accepted there.
    drafted_per_position: list[int] | None = None
    accepted_per_position: list[int] | None = None
    tree_rounds: int | None = None  # rounds verified as a token tree (engine/model/tree.py)

    @property
    def acceptance(self) -> float | None:
        return round(self.accepted / self.drafted, 4) if self.drafted else None


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
