"""The MLX engine behind the Engine protocol: a loaded model (all its layers, or the last stage
of a pipeline ring) that generates with the one speculative decode loop."""

from __future__ import annotations

from skulkp2p.engine.generate import prompt_tokens, stream
from skulkp2p.engine.model import LoadedModel
from skulkp2p.engine.protocol import EngineInfo, Generation
from skulkp2p.engine.request import GenerationRequest, RequestError
from skulkp2p.engine.suffix import SuffixMemory

# Default bound of the draft memory (earlier requests' prompts and outputs, for the suffix
# drafter), in tokens: about 660 bytes each in the automaton (docs/architecture.md).
DEFAULT_MEMORY_TOKENS = 65536


class MlxEngine:
    runs_on_loop = False

    def __init__(self, loaded: LoadedModel, memory_tokens: int | None = None):
        """`memory_tokens`: bound of the draft memory of earlier requests (0 = off); None takes
        the card's `[speculation.lookup] memory_tokens`, else DEFAULT_MEMORY_TOKENS."""
        self.loaded = loaded
        self.id = loaded.id
        self.context_length = loaded.context_length
        if memory_tokens is None:
            memory_tokens = int(loaded.speculation.get("lookup", {}).get(
                "memory_tokens", DEFAULT_MEMORY_TOKENS))
        # Lives as long as the model is loaded; one worker thread runs its requests in turn.
        self.memory = SuffixMemory(memory_tokens)

    def info(self) -> EngineInfo:
        loaded = self.loaded
        detail: dict = {"layers_here": len(loaded.model.layers)}
        if loaded.span is not None:
            detail["layers"] = [loaded.span.start, loaded.span.end]
        if loaded.mtp is not None:
            detail["mtp_head"] = loaded.mtp.conventions.style
        if loaded.draft is not None:
            detail["draft_model"] = loaded.draft.id
        return EngineInfo(loaded.id, "mlx", loaded.dtype, loaded.context_length, detail)

    def prompt_length(self, req: GenerationRequest) -> int:
        """Tokenise once more up front (cheap next to a forward) so the client learns the
        prompt size, and an over-long prompt is refused before a stream commits to a 200."""
        n = len(prompt_tokens(self.loaded, req))
        if n >= self.context_length:
            raise RequestError(f"prompt is {n} tokens; model {self.id} takes at most "
                               f"{self.context_length - 1}", "messages" if req.messages
                               else "prompt")
        return n

    def generate(self, req: GenerationRequest) -> Generation:
        return Generation(lambda interrupt: self._remembered(req, interrupt))

    def _remembered(self, req: GenerationRequest, interrupt):
        """The stream, and its prompt and output into the draft memory when it ends."""
        memory = self.memory if self.memory.enabled else None
        result = yield from stream(self.loaded, req, interrupt, memory)
        if memory is not None:
            memory.add(prompt_tokens(self.loaded, req) + list(result.tokens))
        return result

    def close(self) -> None:
        """MLX frees the weights with the last reference; nothing runs in the background."""
