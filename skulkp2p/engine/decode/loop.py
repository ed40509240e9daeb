"""The one decode loop: draft -> verify in one forward -> accept -> roll caches back -> emit.

Plain decoding is this loop with no drafter (every round verifies just the pending token), so
there is a single code path to trust. The loop sees only the `Forward` seam, never where the
layers run, and a drafter only through its `Drafter` protocol (drafter_seam.py). Both are
declared (engine/model/forward.py: `Forward`): what either cannot do is a declared default (no
trees, no lazy steps, never quiet), never a missing attribute.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from skulkp2p.engine.cache import caches
from skulkp2p.engine.decode.sampling import (
    SamplingParams,
    as_token,
    greedy_token,
    greedy_tokens,
    log_probs,
    process_logits,
    sample_from,
    target_probs,
)
from skulkp2p.engine.decode.tree_accept import draw_child, walk_tree
from skulkp2p.engine.decode.value_copy import SpaceBlindLookup
from skulkp2p.engine.model.tree import DraftTree, greedy_walk

if TYPE_CHECKING:
    import mlx.core as mx

    from skulkp2p.engine.decode.drafter_seam import Drafter
    from skulkp2p.engine.decode.grammar import Grammar
    from skulkp2p.engine.model.forward import Forward


@dataclass
class DecodeStats:
    rounds: int = 0  # verify rounds that carried at least one draft token
    drafted: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # per draft position
    drafted_at: list[int] = field(default_factory=list)
    pipelined: int = 0  # tokens emitted pipelined (step n+1 built during step n)
    taken_back: int = 0  # steps built ahead in a quiet stretch, taken back for a draft
    tree_rounds: int = 0  # rounds verified as a tree (more than one branch)
    copied: int = 0  # tokens drafted as a value copied from the text (under a grammar)

    def record(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        while len(self.drafted_at) < drafted:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += int(i < accepted)


    def record_tree(self, tree: DraftTree, accepted: int) -> None:
        """A tree round: every node counts as drafted; per position, the tree's depths."""
        self.tree_rounds += 1
        self.rounds += 1
        self.drafted += len(tree)
        self.accepted += accepted
        depth = max(tree.depths())
        while len(self.drafted_at) < depth:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(depth):
            self.drafted_at[i] += 1
            self.accepted_at[i] += int(i < accepted)


def choose(row: mx.array, params: SamplingParams, rng: np.random.Generator) -> int:
    """The token plain decoding picks from one processed logits row."""
    if params.greedy:
        return greedy_token(row)
    return sample_from(target_probs(row, params), rng)


def verify_one(row: mx.array, draft: int, q: np.ndarray | None, params: SamplingParams,
               rng: np.random.Generator) -> tuple[int, bool]:
    """Decide one draft token against the target row: (token to emit, accepted?).

    Greedy: accept when the draft is the plain choice. Sampled with a deterministic draft (q
    one-hot, q None here): draw the token exactly as plain decoding does, the same race over
    the next exponentials, and accept when it is the draft. That is exact (the emitted token is
    p-distributed and the draft is accepted with probability p(draft), as Leviathan's rule), and
    it is coupled to plain decoding: a seeded request emits the same tokens whatever was drafted,
    so its output does not depend on the gates' timing, the node, or the placement. Sampled with
    a draft distribution q: accept with min(1, p/q) and on rejection draw from
    norm(max(0, p - q)) (Leviathan et al. 2023), exact in distribution but not coupled.
    """
    if params.greedy:
        token = greedy_token(row)
        return token, token == draft
    p = target_probs(row, params)
    if q is None:
        pick, token = draw_child(p, [draft], rng)
        return token, pick is not None
    if rng.random() * q[draft] < p[draft]:  # u < p/q without dividing by a zero q
        return draft, True
    residual = np.maximum(p - q, 0.0)
    total = residual.sum()
    if total <= 0.0:  # p == q on the support: any rejection is measure-zero; fall back to p
        return sample_from(p, rng), False
    return sample_from(residual / total, rng), False


def decode(
    forward: Forward,
    prompt: list[int],
    params: SamplingParams,
    max_tokens: int,
    rng: np.random.Generator,
    drafter: Drafter | None = None,
    depth: int = 0,
    stats: DecodeStats | None = None,
    *,
    cached: int = 0,
    history: list[int] | None = None,
    on_prefill: Callable[[], None] | None = None,
    interrupt: Callable[[], None] | None = None,
    grammar: Grammar | None = None,
) -> Generator[int, None, None]:
    """Yield generated tokens one at a time. The caller stops consuming at EOS or a stop string.

    `cached`: the forward's caches already hold prompt[:cached] (a prefix-cache hit), so only
    the rest of the prompt is prefilled. `history`, when given, is kept equal to the prompt and
    every token emitted so far; between rounds, and once this generator is closed, the caches
    hold all of it but its last token (the pending one). (Pipelined plain greedy holds one step
    more while it runs and takes it back on close: the caller closes before it keeps them.)
    `on_prefill` is called once the prompt is prefilled and the drafter has
    begun, before the first round (the caches then hold prompt[:-1]). `interrupt` (the
    request's cancel check, which raises) is called once the prefill ended and once the drafter
    has begun: the forward checks it between prefill chunks itself, so a request cancelled
    during its prefill runs at most the chunk in flight, never the drafter's pass over the
    prompt nor a first round.

    `grammar` (a structured output, grammar.py): every row's choice, the pending token's and
    each draft position's, is made from that row's logits masked to what the grammar allows
    after the tokens accepted before it, so greedy output is constrained plain decoding's token
    for token and sampled output is its distribution (the accept rule compares the masked,
    renormalised p). Drafts are cut at the first token the grammar refuses, before the verify;
    the tokens it forces are drafted first (`Grammar.forced`). Such rounds run one by one
    (no pipelined stretches, no trees)."""
    if not prompt:
        raise ValueError("empty prompt")
    if not 0 <= cached < len(prompt):
        raise ValueError(f"cached must be in [0, {len(prompt)}), got {cached}")
    stats = stats if stats is not None else DecodeStats()
    forward.prefill(prompt[cached:-1])
    if interrupt is not None:
        interrupt()
    if drafter is not None:
        drafter.begin(prompt, forward)
        if interrupt is not None:
            interrupt()
    if on_prefill is not None:
        on_prefill()
    pending = prompt[-1]
    # Greedy with no logits processor: every row's token is the argmax of its own log-probs,
    # computed for all rows of a round at once (one evaluation, no per-row copies).
    plain_rows = params.greedy and (params.repetition_penalty in (None, 1.0))
    keeps = history is not None  # the caller keeps the caches afterwards (the prefix cache)
    if history is None:
        history = []
    history[:] = prompt
    # Trees where the drafter proposes them and the forward verifies them (attention-only
    # families): greedy requests keep the target's choices, sampled ones the multi-draft
    # rejection rule (tree_accept.py).
    trees = (drafter is not None and drafter.capabilities.trees and forward.trees
             and grammar is None)
    produced = 0
    # Under a grammar with a drafter, values copied from the text are drafted space-blind
    # (value_copy.py): inside a JSON string a copied word follows a quote, not a space.
    copier = SpaceBlindLookup(grammar.tokenizer) \
        if grammar is not None and drafter is not None else None
    # Rounds with nothing to verify run pipelined (_pipelined): plain greedy from its first
    # token, and with a drafter the stretches where it expects to offer nothing for a while (its
    # gate is off: `quiet`). A step built ahead is taken back when a draft turns up, or when
    # the caller keeps the caches (the prefix cache), so then the caches must trim exactly.
    trims = keeps or drafter is not None
    offered: Proposal | None = None
    while produced < max_tokens:
        k = min(depth, max_tokens - produced - 1) if drafter is not None else 0
        if grammar is not None:
            yield from _constrained_round(forward, drafter, pending, history, k, params, rng,
                                          stats, grammar, max_tokens - produced - 1, copier)
            produced = len(history) - len(prompt)
            pending = history[-1]
            continue
        if offered is None:
            offered = _propose(drafter, history, k, trees)
        draft, q, tree = offered
        offered = None
        if (not draft and plain_rows and (drafter is None or drafter.quiet())
                and _may_pipeline(forward, trims)):
            produced, pending, offered = yield from _pipelined(
                forward, drafter, pending, produced, max_tokens, depth, history, keeps, stats,
                trees)
            continue
        emitted: list[int]
        if tree is not None:
            assert drafter is not None  # (a tree comes from the drafter)
            emitted, path = _tree_round(forward, pending, tree, params, history, rng,
                                        plain_rows)
            stats.record_tree(tree, len(path))
            drafter.observe_tree(tree, path, emitted, forward)
            history.extend(emitted)
            pending = emitted[-1]
            for token in emitted:
                produced += 1
                yield token
            continue
        logits = forward([pending, *draft])
        emitted = []
        accepted = 0
        if plain_rows:
            chosen = greedy_tokens(logits[:len(draft) + 1])
            for i, token in enumerate(chosen):
                emitted.append(token)
                if i == len(draft) or token != draft[i]:
                    break
                accepted += 1
        else:
            for i in range(len(draft) + 1):
                row = process_logits(logits[i:i + 1], history + emitted, params)
                if i < len(draft):
                    token, ok = verify_one(row, draft[i], q[i] if q else None, params, rng)
                else:
                    token, ok = choose(row, params, rng), False
                emitted.append(token)
                if not ok:
                    break
                accepted += 1
        _end_round(forward, drafter, stats, len(draft), accepted, emitted, history)
        pending = emitted[-1]
        for token in emitted:
            produced += 1
            yield token


# The most forced tokens one constrained round drafts: a verify this wide still costs less than
# the one-token forwards it replaces (each forced token is kept).
MAX_FORCED = 32


def _constrained_round(forward: Forward, drafter: Drafter | None, pending: int,
                      history: list[int], k: int, params: SamplingParams,
                      rng: np.random.Generator, stats: DecodeStats, grammar: Grammar,
                      room: int = 0, copier: SpaceBlindLookup | None = None
                      ) -> Generator[int, None, None]:
    """One verify round under a grammar; the emitted tokens join `history` and are yielded.

    With a drafter, the draft is the tokens the grammar forces (up to MAX_FORCED and the
    `room` left before max_tokens, whatever the drafter's depth `k`: the mask leaves each of
    them the only choice, so they are always kept), then a value copied from the text where
    `copier` finds one (value_copy.py), else the drafter's proposal, of up to `k` after them,
    then the tokens the grammar forces after that (the copied value's closing and the next
    key), cut at the first token the grammar refuses. Row i's
    logits are masked by the grammar after the tokens kept before it (the matcher consumes
    exactly the emitted tokens, so it never holds a rejected draft). A refused token drawn from a draft distribution q is still decided at its
    row by the accept rule (p of it is 0: rejected, the token drawn from norm(max(0, p - q))),
    so cutting it leaves the output p-distributed; a deterministic draft's row is plain
    sampling's own draw (verify_one)."""
    room = min(max(room, k), MAX_FORCED)
    forced = grammar.forced()[:room] if k > 0 else []
    inner: list[int] = []
    inner_q: Sequence[np.ndarray | None] | None = None
    wanted = min(k, room - len(forced))
    if copier is not None and wanted > 0 and grammar.constrained():
        inner = copier.propose(history + forced, wanted)
        stats.copied += len(inner)
    if drafter is not None and wanted > 0 and not inner:
        # (past forced tokens only a drafter that reads the history drafts: lookup, not a head)
        propose = drafter.propose_past_unseen if forced else drafter.propose
        inner, inner_q = propose(history + forced, wanted)
    after: list[int] = []
    if inner and len(forced) + len(inner) < room:
        after = grammar.forced_after(forced + list(inner))[:room - len(forced) - len(inner)]
    draft = forced + list(inner) + after
    q: list[np.ndarray | None] | None = None
    if inner_q is not None:
        none: list[np.ndarray | None] = [None] * len(forced)
        q = none + list(inner_q) + [None] * len(after)
    cut = grammar.valid_prefix(draft)
    refused: tuple[int, np.ndarray] | None = None
    if cut < len(draft):
        if q is not None and q[cut] is not None:
            q_cut = q[cut]
            assert q_cut is not None
            refused = (draft[cut], q_cut)
        draft = draft[:cut]
        q = q[:cut] if q is not None else None
    logits = forward([pending, *draft])
    emitted: list[int] = []
    accepted = 0
    # Greedy with no logits processor: a row's token is its own greedy token where the grammar
    # allows it (the argmax of the allowed tokens then, as the maximum is among them), else the
    # masked row's. All rows' greedy tokens come from one evaluation, and the mask is built
    # only for a row whose greedy token the grammar refuses: most rows of a JSON output.
    fast = greedy_tokens(logits[:len(draft) + 1]) \
        if params.greedy and params.repetition_penalty in (None, 1.0) else None
    for i in range(len(draft) + 1):
        if fast is not None:
            token = fast[i]
            # (draft[:cut] was checked whole: a row that picks its draft token is allowed)
            if not (i < len(draft) and token == draft[i]) \
                    and grammar.valid_prefix([token]) != 1:
                token = greedy_token(_masked(logits[i:i + 1], grammar))
            ok = i < len(draft) and token == draft[i]
            grammar.accept(token)
            emitted.append(token)
            if not ok:
                break
            accepted += 1
            continue
        row = _masked(process_logits(logits[i:i + 1], history + emitted, params), grammar)
        ok = False
        if i < len(draft):
            token, ok = verify_one(row, draft[i], q[i] if q else None, params, rng)
        elif refused is not None and not params.greedy:
            token, _ = verify_one(row, refused[0], refused[1], params, rng)
        else:
            token = choose(row, params, rng)
        grammar.accept(token)
        emitted.append(token)
        if not ok:
            break
        accepted += 1
    _end_round(forward, drafter, stats, len(draft), accepted, emitted, history)
    yield from emitted


def _masked(row: mx.array, grammar: Grammar) -> mx.array:
    """`row` [1, V] with the tokens the grammar refuses next at -inf (as it is where the
    grammar leaves the row free: None, as before a tool call starts)."""
    import mlx.core as mx

    allowed = grammar.mask()
    if allowed is None:
        return row
    width = row.shape[-1]
    if allowed.shape[0] < width:
        allowed = np.concatenate([allowed, np.zeros(width - allowed.shape[0], dtype=bool)])
    return mx.where(mx.array(allowed[:width])[None, :], row, mx.array(-np.inf, dtype=row.dtype))


def _end_round(forward: Forward, drafter: Drafter | None, stats: DecodeStats, drafted: int,
               accepted: int, emitted: list[int], history: list[int]) -> None:
    """What every chain round ends with: the caches cut to the kept tokens, the counts, the
    drafter told, the emitted tokens in the history."""
    forward.rollback(keep=1 + accepted, dropped=drafted - accepted)
    stats.record(drafted, accepted)
    if drafter is not None:
        drafter.observe(drafted, accepted, emitted, forward)
    history.extend(emitted)


def _tree_round(forward: Forward, pending: int, tree: DraftTree, params: SamplingParams,
                history: list[int], rng: np.random.Generator,
                plain_rows: bool) -> tuple[list[int], list[int]]:
    """Verify a tree in one forward, walk it (greedy: the target's choices; sampled: recursive
    rejection sampling, tree_accept.py), keep the accepted path in the caches: (emitted
    tokens, the path's node indices)."""
    tokens = [pending, *tree.tokens]
    parents = tree.all_parents()
    logits = forward.verify_tree(tokens, parents)
    if plain_rows:
        chosen = greedy_tokens(logits[:len(tokens)])
        path, token = greedy_walk(parents, tokens, chosen)
    else:
        path, token = walk_tree(logits, tokens, parents, tree.q, history, params, rng)
    forward.keep_path(path)
    return [tokens[j] for j in path] + [token], path


def _may_pipeline(forward: Forward, trims: bool) -> bool:
    """Whether greedy steps may run pipelined on `forward`: it has lazy one-token steps, says it
    may run ahead now (a batch row only while it decodes alone), and, when a step built ahead
    may have to be taken back (the caller keeps the caches afterwards, or a draft may turn
    up), its caches trim exactly."""
    if not forward.may_run_ahead():
        return False
    return not trims or caches.exactly_trimmable(forward.cache)


# A round's drafts: the tokens, their q (None: deterministic), the tree when it is not a chain.
Proposal = tuple[list[int], Sequence[np.ndarray | None] | None, DraftTree | None]


def _propose(drafter: Drafter | None, history: list[int], k: int, trees: bool) -> Proposal:
    """A round's drafts: (draft tokens, their q or None, the tree when it is not a chain)."""
    if drafter is None or k <= 0:
        return [], None, None
    if trees:
        tree = drafter.propose_tree(history, k)
        if tree is None:
            return [], None, None
        return tree.tokens, tree.q, None if tree.is_chain else tree
    draft, q = drafter.propose(history, k)
    return draft, q, None


def _pipelined(forward: Forward, drafter: Drafter | None, pending: int, produced: int,
               max_tokens: int, depth: int, history: list[int], keeps: bool,
               stats: DecodeStats, trees: bool
               ) -> Generator[int, None, tuple[int, int, Proposal | None]]:
    """Greedy steps the way mlx-lm's generate_step runs them: the next step's graph is built on
    the current token as an unevaluated array and evaluated asynchronously while the current
    token goes out, so Python's per-token work overlaps the model's. Same ops, same tokens as
    the round loop (tests/test_decode.py, tests/test_quiet_stretch.py check against mlx-lm and
    the loop). Plain greedy is such a stretch with no drafter, from the first token to the last.

    With a drafter (its gate off: `quiet()`), the drafter still sees every token as a
    one-token round would show it (`observe(0, 0, [token])`, `last_hidden` the step's own row)
    and is asked for a draft after every token; when it has one, the step built ahead (on that
    token) is taken back, so the caches hold what the round loop's would, bit for bit, and the
    round loop verifies the draft.

    At every yield `history` holds the tokens handed out; the caches hold one more position
    (the step built ahead) until this generator is closed, which takes that step back when the
    caller keeps the caches, so they end where the round loop's would: all of `history` but
    its last token. It stops running ahead when the forward says so (another request came to
    the batch). Returns (tokens produced so far, the pending token, the draft offered or None
    when the stretch stopped for another reason)."""
    import mlx.core as mx

    def step(token: mx.array) -> tuple[mx.array, mx.array | None]:
        logits, hidden = forward.lazy_step(token)
        y = mx.argmax(log_probs(logits), axis=-1)
        if hidden is None:
            mx.async_eval(y)
        else:
            mx.async_eval(y, hidden)
        return y, hidden

    y, hidden = step(mx.array([pending]))
    token = pending
    while True:
        produced += 1
        ahead = None
        if produced < max_tokens and forward.may_run_ahead():
            ahead = step(y)
        token = as_token(y)
        if drafter is not None:
            if hidden is not None:
                forward.last_hidden = hidden  # the row of the token this step ran, as a round's
            drafter.observe(0, 0, [token], forward)
        history.append(token)
        stats.pipelined += 1
        try:
            yield token
        except GeneratorExit:
            if ahead is not None:
                mx.eval(ahead[0])  # nothing left running once the caller moves on
                if keeps:
                    forward.rollback(keep=0, dropped=1)
            raise
        if ahead is None:
            forward.end_run_ahead()  # (a batch row: an arriving request may go on)
            return produced, token, None
        if drafter is not None:
            offered = _propose(drafter, history, min(depth, max_tokens - produced - 1), trees)
            if offered[0]:
                mx.eval(ahead[0])  # its cache entry is written before it is cut
                forward.rollback(keep=0, dropped=1)
                stats.taken_back += 1
                forward.end_run_ahead()
                return produced, token, offered
        y, hidden = ahead
