"""Native MTP head drafter: the checkpoint's own multi-token-prediction head (or a trained
EAGLE-style sidecar head; engine/model/mtp_head.py) proposes drafts, following decode.py's Drafter
protocol.

Pairing. Row t of the head's cache holds (h_t, x_{t+1}) at position t, exactly like the trunk's
row t holds x_t. A round's draft 1 guesses the token the verifier will emit from the pending
token x_p; the pair (h_{p-1}, x_p) predicts precisely that, and it is the last pair appended
(by `begin` from the prompt, or by `observe` from the previous round), so draft 1 costs no
extra head call: its logits are kept from that append.

Depth > 1 feeds the head its own output with the token it just drafted, at the next position,
as speculative cache rows that the next `observe` trims. Which output is fed back is
`MtpConventions.chain`: "after" the head's final norm for qwen and mimo, "before" it for
deepseek. That is how vLLM's Qwen3-Next / MiMo / DeepSeek MTP modules return their hidden state
to the proposer (the first two return the final-normed state, DeepSeek's returns the residual
stream and normalises only inside compute_logits); a card can override it (`mtp_chain`).

Context bias (`context_bias`, the card's `mtp_context_bias`): before taking the head's argmax,
tokens already in the request's verified context (prompt and answer so far) get this bonus on
their logits. A small trained head under-predicts repeating the names and words of the question
and of its own answer; on the smollm2-135m head's held-out replay a bonus of 0.5 moved depth-1
acceptance from 49.0% to 49.8% (docs/measurements/mtp-sidecars.md, "A context bias";
`head probe --context-bias`). The drafts stay deterministic (q = None), so greedy
and sampled decoding stay exact whatever the bonus.

Seeded sampled requests (`coupling`). The head's argmax is accepted with the target's probability
of it, which at temperature 0.7 is well below the greedy match rate. Given the request's sampler
(decode/sampling.py's `Coupling`), the head draws each guess from its own distribution, sharpened
(`COUPLED_SHARPEN`), with the very exponentials the target's draw of that position will race
(sampling.py); where the head's distribution is close to the target's the two draws name the same
token. The drafts are still deterministic given those exponentials (q = None), and what is
emitted is plain sampling's own draw, so a seeded request's text is plain decoding's whatever the
head guesses.

Unseeded sampled requests (`draws`). Their text need not be reproducible, so the head draws each
guess from its own distribution q with a Generator of its own and hands q to the verifier, which
accepts with min(1, p/q): Σ min(p, q) of the first drafts are kept, a little more than a coupled
guess keeps (docs/measurements/drafting.md, "Coupled guesses, and drafts drawn from the head's
q"). A draft must then be a plain draw from the q handed over, so the confidence thresholds read
the head's top probability, not that of the token drawn, and the head offers no side branches (a
tree's nodes are deterministic).

In a batch. Once the request's row is in a batch (its forward a joined scheduler row), its head
cache moves into the batch's `HeadRows` (engine/batching/head_batch.py) and every head call (the
verified rows after a round, each draft past the first) is handed in there: the rows' calls run
as one head forward per depth. The drafter's logic is the same; only where its rows live and
when its head calls run change. A drafter switched off for good (`lag`) takes its cache back
out and catches up alone.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, cast

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from skulkp2p.engine.batching.head_batch import HeadCall, HeadRows
from skulkp2p.engine.batching.row_forward import RowForward
from skulkp2p.engine.decode.drafter_seam import DrafterCapabilities
from skulkp2p.engine.decode.loop import DecodeStats
from skulkp2p.engine.decode.sampling import Coupling, DraftDraws, as_floats, as_token, as_tokens
from skulkp2p.engine.drafting.drafter import Branch, InnerDrafter
from skulkp2p.engine.model.mtp_conventions import MtpConventions
from skulkp2p.engine.model.mtp_head import MtpHead
from skulkp2p.engine.model.tree import DraftTree

if TYPE_CHECKING:
    from skulkp2p.engine.model.forward import Forward

# A coupled guess draws from the head's logits scaled by this (its own temperature 0.7 of the
# request's): a small head is less sure than its target where the target is sure, and on the
# smollm2-135m eagle3 head's sampled first drafts at temperature 0.7 the sharper draw matched
# the target's 42.5% of the time, against 39.5% unsharpened and 37.0% for the argmax
# (docs/measurements/drafting.md, "Coupled guesses, and drafts drawn from the head's q").
COUPLED_SHARPEN = 1 / 0.7

# The head offers its second choice at a depth as a side branch when the head gives it at least
# this share of its first choice's probability (gates.build_tree then weighs its width).
HEAD_BRANCH_CLOSE = 0.5


class MtpDrafter(InnerDrafter):
    """Greedy (argmax) drafts from the MTP head (a drafter as engine/drafting/drafter.py declares
    them).

    Deterministic: propose returns q = None, so the decode loop treats q as one-hot and sampled
    decoding stays exact. Needs a forward that keeps the trunk's hidden rows:
    LocalForward(model, hidden=conventions.hidden)."""

    name = "mtp"
    # Its top-2 as side branches; switched off it keeps the verified rows and catches up; in a
    # batch its rows' drafts run as one head forward per depth (engine/batching/head_batch.py),
    # which the gate prices like one forward over the drafting rows (gates.py); it can start
    # its first draft early.
    capabilities = DrafterCapabilities(branches=True, resumes=True, shared_in_batch=True,
                                       prefetches=True, drafts_past_unseen=False)

    def __init__(self, head: MtpHead, conventions: MtpConventions | None = None,
                 prefill_step: int = 2048, context_bias: float = 0.0,
                 min_confidence: float = 0.0, depth_confidence: float = 0.0,
                 coupling: Coupling | None = None, draws: DraftDraws | None = None):
        """`min_confidence`: draft nothing this round when the head gives its own first token
        less than this probability (the card's `mtp_min_confidence`; 0: always draft).
        `depth_confidence`: past the first draft, go one token deeper only while the head gives
        each deeper token at least this probability (the card's `mtp_depth_confidence`; 0: as
        deep as asked). `coupling`: a seeded sampled request's sampler, read ahead to draw the
        guesses with the target's own exponentials. `draws`: an unseeded sampled request's, to
        draw the guesses from the head's q and hand q to the verifier. Neither: argmax guesses, as
        greedy requests take."""
        if not context_bias >= 0.0:
            raise ValueError(f"MTP context_bias must be a number >= 0, got {context_bias!r}")
        for name, value in (("min_confidence", min_confidence),
                            ("depth_confidence", depth_confidence)):
            if not 0.0 <= value < 1.0:
                raise ValueError(f"MTP {name} must be in [0, 1), got {value!r}")
        self.min_confidence = float(min_confidence)
        self.depth_confidence = float(depth_confidence)
        self.unsure = 0  # rounds it drafted nothing for want of confidence
        self.cut = 0  # rounds it drafted fewer tokens than asked for want of confidence
        if coupling is not None and draws is not None:
            raise ValueError("MTP drafts are coupled to the target's draws or drawn from q, "
                             "not both")
        self.coupling = coupling
        self.draws = draws
        self._q: list[np.ndarray] = []  # with draws: the q each guess of the round came from
        if draws is not None:
            self.capabilities = dataclasses.replace(self.capabilities, branches=False)
        self.head = head
        # The head computes with its own conventions; these cap the depth and check the forward.
        self.conventions = conventions or head.conventions
        self.prefill_step = prefill_step
        self._cache: KVCache = head.make_cache()  # the head's rows while not in a batch
        self._next: tuple[mx.array, mx.array] | None = None  # (logits [V], chain hidden [H])
        self._next_token: int | None = None  # argmax of _next's logits, when already known
        # (the biased logits row of _next, its argmax): started early by `prefetch`, unread
        self._ahead: tuple[mx.array, mx.array] | None = None
        # In a batch: the batch's head rows, this row's key there, and its head call handed
        # in whose results become _next once read.
        self._rows: HeadRows | None = None
        self._member: object = None
        self._call: HeadCall | None = None
        self._speculative = 0  # rows propose appended past the verified ones
        # From the prefix cache, for begin: the head's rows, and the trunk's hidden row of the
        # position after them when begin must recompute that row (see restore).
        self._restored: tuple[KVCache | None, mx.array | None] | None = None
        self.last_hidden_row: mx.array | None = None  # the trunk row paired in the last row
        # Verified rows not yet appended while the head is switched off (see lag).
        self._lagging: list[tuple[mx.array, list[int]]] = []
        self.stats = DecodeStats()  # the drafter's own per-position acceptance
        self.context_bias = float(context_bias)
        self._seen: set[int] = set()  # token ids of the verified context (with a context bias)
        self._bias: mx.array | None = None  # the bonus per logits column; None: rebuild

    def _check_forward(self, forward: Forward) -> None:
        kind = forward.hidden
        if kind != self.conventions.hidden:
            raise ValueError(f"MTP head wants the trunk hidden {self.conventions.hidden!r} its "
                             f"final norm; the forward keeps {kind!r}")

    def _see(self, tokens: list[int]) -> None:
        if self.context_bias:
            self._seen.update(tokens)
            self._bias = None

    def _biased(self, logits: mx.array) -> mx.array:
        """The head's logits with the context bias on the tokens seen so far."""
        if not self.context_bias or not self._seen:
            return logits
        if self._bias is None or self._bias.shape[-1] != logits.shape[-1]:
            bonus = np.zeros(logits.shape[-1], np.float32)
            ids = np.fromiter(self._seen, np.int64, len(self._seen))
            bonus[ids[ids < bonus.size]] = self.context_bias
            self._bias = mx.array(bonus)
        return logits + self._bias.astype(logits.dtype)

    @property
    def cache(self) -> KVCache:
        """The head's rows as a one-request cache (a copy out of the batch once it is in one):
        what the prefix cache keeps."""
        if self._rows is None:
            return self._cache
        return self._rows.extract(self._member)

    def _append(self, hidden: mx.array, tokens: list[int]) -> None:
        self.last_hidden_row = hidden[-1]
        self._next_token = None
        self._ahead = None
        if self._rows is not None:  # handed in: runs with the other rows' calls
            self._next = None
            self._call = self._rows.hand_in(self._member, hidden, tokens)
            return
        out = self.head(hidden, mx.array(tokens, dtype=mx.int32), self._cache)
        self._next = (out.logits[-1], out.chain(self.head.conventions.chain)[-1])

    def _read_call(self) -> None:
        """The results of the head call handed in (waiting for its batched forward) as _next."""
        if self._call is None or self._rows is None:
            return
        call, self._call = self._call, None
        logits, chained, token = self._rows.result(self._member, call)
        self._next, self._next_token = (logits, chained), token

    def _join_batch(self, forward: Forward) -> None:
        """Move the head's rows into the batch's head rows once the request's row is in a
        batch (a cache with no rows yet stays alone: position 0 is special for some heads)."""
        if self._rows is not None or self._cache.offset == 0:
            return
        if not isinstance(forward, RowForward):
            return
        rows = forward.head_batch(self.head)
        if rows is None:
            return
        rows.join(forward, self._cache)
        self._rows, self._member = rows, forward
        self._cache = self.head.make_cache()

    def _leave_batch(self) -> None:
        """Take the head's rows back out of the batch (to run alone: `lag`, `catch_up`)."""
        if self._rows is None:
            return
        self._read_call()
        self._cache = self._rows.extract(self._member)
        self._rows.leave(self._member)
        self._rows = self._member = None

    def restore(self, cache: KVCache | None, hidden: mx.array | None = None) -> None:
        """Begin from these rows (a prefix-cache hit: the head's cache over the positions the
        trunk's restored caches hold); the next `begin` appends only the rows after them.
        `hidden`: the trunk's hidden row of the position right after `cache`'s rows (None: a
        fresh cache), which the trunk's restored caches hold but did not recompute; begin
        recomputes that row of the head first."""
        self._restored = (cache, hidden)

    def begin(self, prompt: list[int], forward: Forward) -> None:
        """Fill the head's cache over the prompt: pair (h_i, x_{i+1}) at position i for
        i = 0..n-2 (the prefill covered prompt[:-1]). The last pair, (h_{n-2}, x_{n-1}),
        predicts what the verifier emits from the pending x_{n-1}: round 1's draft 1.

        After a prefix-cache hit the restored rows cover the positions the prefill skipped, and
        the prefill's hidden rows (forward.last_hidden) the ones after them."""
        self._check_forward(forward)
        (cache, row), self._restored = self._restored or (None, None), None
        self._leave_batch()
        self._cache = cache if cache is not None else self.head.make_cache()
        self._next = None
        self._next_token = None
        self._ahead = None
        self._speculative = 0
        self._lagging = []
        self._seen, self._bias = set(), None
        self._see(prompt)
        n = len(prompt) - 1
        first = self._cache.offset
        if n == first:
            return  # a one-token prompt: the first round goes without a draft
        hidden = forward.last_hidden
        if row is not None:
            hidden = row[None] if hidden is None else mx.concatenate([row[None], hidden], 0)
        if hidden is None or hidden.shape[0] != n - first:
            got = None if hidden is None else hidden.shape[0]
            raise ValueError(f"MTP drafter needs the {n - first} prefill hidden rows, got {got}; "
                             f"build the forward with hidden={self.conventions.hidden!r}")
        for start in range(first, n, self.prefill_step):
            stop = min(start + self.prefill_step, n)
            self._append(hidden[start - first:stop - first], prompt[start + 1:stop + 1])
            mx.eval(self._cache.keys, self._cache.values, *(self._next or ()))

    def propose(self, history: list[int], k: int) -> tuple[list[int], list[np.ndarray] | None]:
        drafts = self._drafts(k)[0]
        if self.draws is None or not drafts:
            return drafts, None
        return drafts, self._q[:len(drafts)]

    def _drafts(self, k: int) -> tuple[list[int], list[mx.array]]:
        """The head's chain of up to k guesses (argmax, coupled or drawn) and its logits row at
        each depth."""
        k = min(k, self.conventions.max_depth)
        if k <= 0:
            return [], []
        self._read_call()
        if self._next is None:
            return [], []
        logits, chained = self._next
        # The batch's forward took each row's argmax; the context bias changes it, so then the
        # biased row decides, and a coupled guess is drawn from the row.
        noise = (self.coupling.noise(k, logits.shape[-1]) if self.coupling is not None
                 else None)
        self._q = []
        biased = bool(self.context_bias and self._seen)
        known: int | None  # the first row's argmax, when already taken
        if self._ahead is not None:  # (prefetch started it: the same ops, maybe done by now)
            (first, token), self._ahead = self._ahead, None
            rows, known = [first], as_token(token)
        else:
            rows, known = [self._biased(logits)], None if biased else self._next_token
        drafts = [self._guess(rows[0], known, noise, 0)]
        if self.min_confidence and self._sureness(rows[0], drafts[0]) < self.min_confidence:
            # A guess the head itself doubts is mostly wrong, and a wrong one costs a wider
            # verify and the head's call for nothing (docs/measurements/drafting.md, "The head's
            # confidence").
            self.unsure += 1
            return [], []
        chain = self.head.conventions.chain
        while len(drafts) < k:
            # Speculative row (own output, own draft) at the next position; observe trims it.
            taken: int | None = None  # the batch's argmax of the row, when it ran there
            if self._rows is not None:  # depth d + 1 of every row going deeper: one forward
                call = self._rows.hand_in(self._member, chained[None], drafts[-1:])
                self._speculative += 1
                logits, chained, taken = self._rows.result(self._member, call)
            else:
                out = self.head(chained[None], mx.array(drafts[-1:], dtype=mx.int32),
                                self._cache)
                self._speculative += 1
                logits, chained = out.logits[-1], out.chain(chain)[-1]
            deeper = self._biased(logits)
            guess = self._guess(deeper, None if biased else taken, noise, len(drafts))
            if self.depth_confidence and self._sureness(deeper, guess) < self.depth_confidence:
                # The head's probability of a deeper guess tracks whether it is right, and a
                # wrong one widens the verify for nothing: the depth follows the head's
                # confidence round by round (docs/measurements/mtp-sidecars.md, "Depth from
                # the head's confidence"). Its speculative row is trimmed like the others.
                self.cut += 1
                break
            rows.append(deeper)
            drafts.append(guess)
        return drafts, rows

    def _guess(self, row: mx.array, argmax: int | None, noise: np.ndarray | None,
               depth: int) -> int:
        """The draft at `depth` from the head's (biased) logits row: raced against the target's
        exponentials of that depth when coupled, else its argmax (`argmax`, when already
        taken)."""
        if noise is not None and self.coupling is not None:
            return self.coupling.guess(row * COUPLED_SHARPEN, noise[depth])
        if self.draws is not None:
            token, q = self.draws.draw(row)
            self._q.append(q)
            return token
        return argmax if argmax is not None else as_token(mx.argmax(row))

    def _sureness(self, row: mx.array, guess: int) -> float:
        """What the confidence thresholds compare: the head's probability of its guess, or of
        its top token when the guess is a draw from q (a threshold on the token drawn would
        keep drafts that are no longer distributed as q)."""
        if self.draws is None:
            return _probability(row, guess)
        top = row.astype(mx.float32)  # (the top's probability in one read, no argmax first)
        return cast(float, mx.exp(mx.max(top) - mx.logsumexp(top)).item())

    def prefetch(self) -> None:
        """Start evaluating the head's first draft of the next round now, asynchronously, when
        the caller knows the head will be asked for it (gates.LookupThenModel: lookup has no
        match for the next round). The head's rows of this round were appended lazily
        (`follow`); without this they run only when `propose` reads the draft, after the loop's
        own Python between rounds (text, stop strings, the engine's chunk, the gates), which
        the head's evaluation then overlaps. The draft is the same argmax of the same biased
        row either way. Alone only: in a batch the head's calls run in the batch's forwards."""
        if self._rows is not None or self._next is None or self._ahead is not None:
            return
        row = self._biased(self._next[0])
        token = mx.argmax(row)
        mx.async_eval(token)
        self._ahead = (row, token)

    def propose_branches(self, history: list[int], k: int) -> tuple[list[int], list[Branch]]:
        """The head's chain and, at each depth where its own second choice is close to its
        first (p2 >= HEAD_BRANCH_CLOSE p1), that token as a one-token side branch (its top-2
        at every depth; gates.build_tree keeps those that pay for their width). A side leaf
        needs no head row: nothing more runs than for the chain."""
        drafts, rows = self._drafts(k)
        if not drafts:
            return [], []
        probs = mx.softmax(mx.stack(rows).astype(mx.float32), axis=-1)
        first = mx.array(drafts)[:, None]
        p1 = mx.take_along_axis(probs, first, axis=-1)[:, 0]
        others = mx.where(mx.arange(probs.shape[-1])[None] == first, -1.0, probs)
        second, p2 = mx.argmax(others, axis=-1), mx.max(others, axis=-1)
        branches = []
        for d, (t, a, b) in enumerate(zip(as_tokens(second), as_floats(p1), as_floats(p2),
                                          strict=True)):
            if b >= HEAD_BRANCH_CLOSE * a and b > 0.0:
                branches.append(Branch(d, [t], b / (a + b)))
        return drafts, branches

    def observe_tree(self, tree: DraftTree, path: list[int], emitted: list[int],
                     forward: Forward) -> None:
        """A tree round it drafted: count it per depth, follow the accepted path's rows."""
        self.stats.record_tree(tree, len(path))
        self.follow(len(path), emitted, forward)

    def confidence(self, token: int) -> float:
        """The head's probability of `token` at the first draft position (nothing is run)."""
        self._read_call()
        if self._next is None:
            return 0.0
        return _probability(self._biased(self._next[0]), token)

    def first_choices(self, n: int) -> list[tuple[int, float]]:
        """The head's n likeliest tokens for the first draft position with their probabilities
        (its distribution over what the verifier emits next); nothing is run or appended."""
        if n <= 0:
            return []
        self._read_call()
        if self._next is None:
            return []
        logits = self._biased(self._next[0]).astype(mx.float32)
        probs = mx.softmax(logits, axis=-1)
        top = mx.argsort(-logits)[:n]
        return list(zip(as_tokens(top), as_floats(probs[top]), strict=True))

    @property
    def drafted_at(self) -> list[int]:
        return self.stats.drafted_at

    @property
    def accepted_at(self) -> list[int]:
        return self.stats.accepted_at

    def observe(self, drafted: int, accepted: int, emitted: list[int], forward: Forward) -> None:
        """Trim the speculative rows, then append the verified pairs: row j of the verify
        ([pending, d1..]) is h at the pending position + j, paired with emitted[j]."""
        self.stats.record(drafted, accepted)
        self.follow(accepted, emitted, forward)

    def follow(self, accepted: int, emitted: list[int], forward: Forward) -> None:
        """Keep the head's cache in step after a verify round, whoever drafted it."""
        self.catch_up()
        verified = self._verified(accepted, emitted, forward)
        self._join_batch(forward)
        self._append(*verified)

    def lag(self, accepted: int, emitted: list[int], forward: Forward) -> None:
        """A round while the head is switched off: keep the verified rows (references to the
        trunk rows the verify computed anyway) instead of running the head on them, so that
        `catch_up` can bring its cache in step in one call when it is needed again (the
        prefix cache keeps it at the end of the request)."""
        verified = self._verified(accepted, emitted, forward)
        self._ahead = None  # (its context bias saw fewer tokens than the next draft's)
        self._leave_batch()  # (a head off for good costs the batch's head forwards nothing)
        self._lagging.append(verified)

    def catch_up(self) -> None:
        """Append the rows `lag` kept, in one call per prefill_step rows."""
        if not self._lagging:
            return
        self._leave_batch()
        hidden = mx.concatenate([h for h, _ in self._lagging], axis=0)
        tokens = [t for _, ts in self._lagging for t in ts]
        self._lagging = []
        for start in range(0, len(tokens), self.prefill_step):
            stop = min(start + self.prefill_step, len(tokens))
            self._append(hidden[start:stop], tokens[start:stop])
            mx.eval(self._cache.keys, self._cache.values, *(self._next or ()))

    def _verified(self, accepted: int, emitted: list[int], forward: Forward
                  ) -> tuple[mx.array, list[int]]:
        if self._speculative:
            if self._rows is not None:
                self._read_call()
                self._rows.trim(self._member, self._speculative)
            else:
                self._cache.trim(self._speculative)
            self._speculative = 0
        hidden = forward.last_hidden
        keep = 1 + accepted
        if hidden is None or hidden.shape[0] < keep or len(emitted) != keep:
            raise ValueError(f"MTP drafter: {keep} verified rows expected, got hidden "
                             f"{None if hidden is None else hidden.shape[0]} and "
                             f"{len(emitted)} emitted tokens")
        self._see(emitted)
        return hidden[:keep], list(emitted)


def _probability(logits: mx.array, token: int) -> float:
    """softmax(logits)[token], without normalising every entry."""
    row = logits.astype(mx.float32)
    return cast(float, mx.exp(row[token] - mx.logsumexp(row)).item())
