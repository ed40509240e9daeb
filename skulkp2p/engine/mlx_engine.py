"""The MLX engine behind the Engine protocol: a loaded model (all its layers, or the last stage
of a pipeline ring) that generates with the one speculative decode loop."""

from __future__ import annotations

from skulkp2p.engine.generate import prompt_tokens, stream
from skulkp2p.engine.model import LoadedModel
from skulkp2p.engine.prefix_cache import DEFAULT_PREFIX_CACHE_MB, MB, PrefixCache
from skulkp2p.engine.protocol import EngineInfo, Generation
from skulkp2p.engine.request import GenerationRequest, RequestError
from skulkp2p.engine.suffix import SuffixMemory

# Default bound of the draft memory (earlier requests' prompts and outputs, for the suffix
# drafter), in tokens: about 660 bytes each in the automaton (docs/architecture.md).
DEFAULT_MEMORY_TOKENS = 65536


class MlxEngine:
    """`prefix_cache_mb`: the model's prefix cache (engine/prefix_cache.py), in memory, bounded
    in MB; 0 turns it off. The engine's generations run one at a time on one thread (the
    model's worker), which is what lets them share the cache without a lock."""

    runs_on_loop = False

    def __init__(self, loaded: LoadedModel, prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB,
                 memory_tokens: int | None = None):
        """`prefix_cache_mb`: the prefix cache's bound (0 = off). `memory_tokens`: bound of the
        draft memory of earlier requests (0 = off); None takes the card's
        `[speculation.lookup] memory_tokens`, else DEFAULT_MEMORY_TOKENS."""
        self.loaded = loaded
        self.id = loaded.id
        self.context_length = loaded.context_length
        self.prefix_cache = PrefixCache(int(prefix_cache_mb * MB)) if prefix_cache_mb > 0 \
            else None
        if memory_tokens is None:
            memory_tokens = int(loaded.speculation.get("lookup", {}).get(
                "memory_tokens", DEFAULT_MEMORY_TOKENS))
        # Both live as long as the model is loaded; one worker thread runs its requests in turn.
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
        if self.prefix_cache is not None:
            detail["prefix_cache"] = self.prefix_cache.stats()
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
        prompt = prompt_tokens(self.loaded, req)  # once: the stream and the memory share it
        result = yield from stream(self.loaded, req, interrupt, self.prefix_cache, prompt,
                                   memory=memory)
        if memory is not None:
            memory.add(prompt + list(result.tokens))
        return result

    def close(self) -> None:
        """MLX frees the weights with the last reference; nothing runs in the background."""
