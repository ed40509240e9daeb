"""Draft-model drafter: a smaller model with the same tokenizer proposes the next k tokens.

The draft model keeps its own cache over the request's history. Each `propose` finds the longest
common prefix of what that cache holds and the history the decode loop passes, rewinds the cache
to it, feeds only the missing tokens (after a verify round: the verifier's own token, plus the last
draft when every draft was accepted), then runs k - 1 single-token steps. Drafts the target kept
are therefore never run through the draft model twice.

Rewinding: plain KV caches trim. Any other cache (recurrent gated-delta state, rotating windows
that may wrap, chunked caches) is checkpointed before the drafts are fed and restored on the next
propose; the accepted drafts are then re-fed together with the verifier's token in one call.

Exactness never rests on this cache being right: under sampling each draft is drawn from q, the
draft's own processed distribution, and q is returned for the min(1, p/q) test; under greedy the
verifier compares with its own argmax. A stale draft cache can only lower acceptance, which is why
the tests check acceptance (100% for a model drafting for itself) as well as the output.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import TYPE_CHECKING, Protocol

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from skulkp2p.engine.cache import caches
from skulkp2p.engine.decode.sampling import (
    SamplingParams,
    greedy_token,
    process_logits,
    sample_from,
    target_probs,
)
from skulkp2p.engine.drafting.drafter import InnerDrafter
from skulkp2p.engine.model.forward import LocalForward
from skulkp2p.engine.model.loaded import LoadedModel
from skulkp2p.engine.request import RequestError

if TYPE_CHECKING:
    from skulkp2p.engine.model.forward import Forward

log = logging.getLogger("skulkp2p.engine")

# Tails longer than this are fed with the chunked prefill (no logits rows) plus one last step.
_LONG_FEED = 64


def vocab_size(model: nn.Module) -> int:
    """Width of the model's logits rows (the embedding's row count, padding included)."""
    # (any family's mlx-lm model: its config, nested or not, may name the width)
    args = getattr(model, "args", None)
    for obj in (args, getattr(args, "text_config", None)):
        n = obj.get("vocab_size") if isinstance(obj, dict) else getattr(obj, "vocab_size", None)
        if isinstance(n, int) and n > 0:
            return n
    # Unknown layout: one token through a throwaway cache says it exactly.
    out = model(mx.array([[0]]), cache=make_prompt_cache(model))
    return int(out.shape[-1])


def _tokenizer_size(vocab: dict[str, int]) -> int:
    return max(vocab.values(), default=-1) + 1


class Vocabulary(Protocol):
    """What the check reads of a tokenizer (mlx-lm's TokenizerWrapper)."""

    @property
    def eos_token_ids(self) -> Collection[int] | None: ...

    def get_vocab(self) -> dict[str, int]: ...


def check_compatible(target_tokenizer: Vocabulary, draft_tokenizer: Vocabulary,
                     target_vocab: int, draft_vocab: int, draft_id: str = "draft") -> None:
    """Refuse a draft model whose token ids do not mean what the target's mean.

    The two tokenizers must map the same strings to the same ids (added tokens included) and end
    sequences on the same ids. The models' logits widths may then differ (embedding matrices are
    padded to round sizes): q is padded with zeros, or cut, to the target's width; neither changes
    any real token's probability since no string maps to a padding id.
    """
    tv, dv = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if tv != dv:
        differ = sum(1 for s, i in tv.items() if dv.get(s) != i) + sum(
            1 for s in dv if s not in tv)
        raise RequestError(
            f"draft model {draft_id} has a different tokenizer than the target: {differ} of "
            f"{max(len(tv), len(dv))} vocabulary entries differ", "speculation")
    t_eos = set(target_tokenizer.eos_token_ids or ())
    d_eos = set(draft_tokenizer.eos_token_ids or ())
    if t_eos != d_eos:
        raise RequestError(
            f"draft model {draft_id} has a different tokenizer than the target: end-of-sequence "
            f"ids {sorted(d_eos)} vs the target's {sorted(t_eos)}", "speculation")
    n = _tokenizer_size(tv)
    if n > draft_vocab or n > target_vocab:
        raise RequestError(
            f"draft model {draft_id}: the tokenizer has {n} ids but the target's logits have "
            f"{target_vocab} and the draft's {draft_vocab}", "speculation")


class DraftModelDrafter(InnerDrafter):
    """A drafter (engine/drafting/drafter.py) over a draft model.

    `params` must be the request's sampling parameters: the draft then samples from the same
    kind of distribution as the target, which is what makes acceptance high. `rng` draws the
    draft tokens (the request's generator may be shared). `target_vocab` is the width the q
    vectors must have (the target's logits width); None means the draft's own width.
    """

    name = "draft"

    def __init__(self, draft: LoadedModel, params: SamplingParams, rng: np.random.Generator,
                 target_vocab: int | None = None, prefill_step: int | None = None):
        step = prefill_step or int(draft.runtime.get("prefill_step", 2048))
        self.draft = draft
        self.params = params
        self.rng = rng
        self.target_vocab = target_vocab
        self.forward = LocalForward(draft.model, step)
        self.exact_trim = caches.exactly_trimmable(self.forward.cache)
        self.cached: list[int] = []  # tokens whose state the draft cache holds, in order
        self._checkpoint: tuple[int, caches.Snapshot] | None = None  # (length, state)
        self._draft_vocab: int | None = None
        # Counters for stats and tests: tokens run through the draft model, restores, rebuilds.
        self.fed_tokens = 0
        self.restores = 0
        self.rebuilds = 0

    @classmethod
    def for_target(cls, target: LoadedModel, draft: LoadedModel, params: SamplingParams,
                   rng: np.random.Generator) -> DraftModelDrafter:
        """Check the draft against the target and build the drafter (what generate.py calls)."""
        t_vocab, d_vocab = vocab_size(target.model), vocab_size(draft.model)
        check_compatible(target.tokenizer, draft.tokenizer, t_vocab, d_vocab, draft.id)
        return cls(draft, params, rng, target_vocab=t_vocab)

    # --- Drafter protocol -----------------------------------------------------------------

    def begin(self, prompt: list[int], forward: Forward) -> None:
        self._reset()
        self._feed(prompt[:-1], want_row=False)

    def propose(self, history: list[int], k: int) -> tuple[list[int], list[np.ndarray] | None]:
        if k <= 0 or not history:
            return [], None
        row = self._sync(history)
        if row is None:
            return [], None
        if not self.exact_trim and k > 1:
            # The k - 1 drafts fed below are undone next round by restoring this state (any
            # number of them: a rotating cache is copied even before it would wrap).
            self._checkpoint = (len(self.cached), caches.snapshot(self.forward.cache, None))
        greedy = self.params.greedy
        # The penalty looks back repetition_context tokens; a suffix that long gives the same rows
        # (slicing as process_logits does, so a context of 0 means the whole history there too).
        ctx = self.params.repetition_context
        recent = history[-ctx:] if ctx > 0 else list(history)
        drafts: list[int] = []
        qs: list[np.ndarray] = []
        for i in range(k):
            row = self._fit_width(row)
            row = process_logits(row, recent + drafts, self.params)
            if greedy:
                token = greedy_token(row)
            else:
                q = self._pad(target_probs(row, self.params))
                token = sample_from(q, self.rng)
                qs.append(q)
            drafts.append(token)
            if i + 1 < k:  # the last draft is fed next round, together with the verifier's token
                row = self._step([token])
        return drafts, (None if greedy else qs)

    def observe(self, drafted: int, accepted: int, emitted: list[int], forward: Forward) -> None:
        # Nothing to do: the next propose compares its history with `cached` and keeps whatever
        # accepted drafts the cache already holds.
        pass

    # --- cache bookkeeping ----------------------------------------------------------------

    def _sync(self, history: list[int]) -> mx.array | None:
        """Make the cache hold exactly `history`; return the logits row after its last token."""
        common = 0
        for a, b in zip(self.cached, history, strict=False):
            if a != b:
                break
            common += 1
        # Feed at least one token: its row is the distribution of the first draft.
        self._rewind(min(common, len(history) - 1))
        missing = history[len(self.cached):]
        limit = self._draft_vocab
        if limit is not None and any(t >= limit for t in missing):
            # The target emitted an id the draft cannot embed (a padding id): no drafts from
            # here on; the loop still decodes exactly without them.
            return None
        return self._feed(missing, want_row=True)

    def _rewind(self, length: int) -> None:
        """Drop cached tokens beyond `length` (or further back, when only a checkpoint allows)."""
        if length >= len(self.cached):
            return
        if self.exact_trim:
            caches.trim(self.forward.cache, len(self.cached) - length)
            del self.cached[length:]
            return
        # A checkpoint of length L stays valid while cached[:L] is untouched: rewinds below L
        # reset, and everything else only appends.
        cp = self._checkpoint
        if cp is not None and cp[0] <= length:
            # The checkpoint may be restored again later: reuse=True hands out copies.
            caches.restore(self.forward.cache, cp[1], reuse=True)
            del self.cached[cp[0]:]
            self.restores += 1
            return
        # History diverged before the checkpoint: start over (never happens in the decode loop).
        self._reset()
        self.rebuilds += 1

    def _reset(self) -> None:
        self.forward.reset()
        self.cached = []
        self._checkpoint = None

    def _feed(self, tokens: list[int], want_row: bool) -> mx.array | None:
        if not tokens:
            return None
        if not want_row:
            self.forward.prefill(tokens)
            self._account(tokens)
            return None
        if len(tokens) > _LONG_FEED:
            self.forward.prefill(tokens[:-1])
            self._account(tokens[:-1])
            tokens = tokens[-1:]
        return self._step(tokens)

    def _step(self, tokens: list[int]) -> mx.array:
        logits = self.forward(tokens)
        self._account(tokens)
        if self._draft_vocab is None:
            self._draft_vocab = int(logits.shape[-1])
        return logits[-1:]

    def _account(self, tokens: list[int]) -> None:
        self.cached.extend(tokens)
        self.fed_tokens += len(tokens)

    # --- vocabulary widths ----------------------------------------------------------------

    def _fit_width(self, row: mx.array) -> mx.array:
        # A draft wider than the target must never propose an id the target has no row for.
        if self.target_vocab is not None and row.shape[-1] > self.target_vocab:
            return row[:, : self.target_vocab]
        return row

    def _pad(self, q: np.ndarray) -> np.ndarray:
        if self.target_vocab is None or q.shape[0] == self.target_vocab:
            return q
        out = np.zeros(self.target_vocab, dtype=np.float64)
        out[: q.shape[0]] = q
        return out
