"""The suffix drafter: an online suffix automaton over the prompt and the output so far, and a
per-model memory of earlier requests searched when the request's own text has no longer match.

A suffix automaton over a token sequence T has one state per class of substrings with the same
set of end positions; appending a token costs O(1) amortised (Blumer et al. 1985). After each
append, the suffix link of the newest state is the state of the longest suffix of T that also
occurred earlier, so the longest match is read off without any scan, however long it is. Each
state keeps one end position of an earlier occurrence (moved to the most recent one whenever the
state is the longest match) and counts of the tokens that followed it each time it was the
longest match; a draft walks the automaton from the match, taking at each step the token that
followed most often (the most recent continuation breaks ties and stands in where there are no
counts), for up to `match length` tokens (a long match predicts a long run, a 2-token match a
short one) and the depth the gate asked for.

The memory is one more automaton over earlier requests' prompts and outputs on this node (each
entry ends with its own separator, so no match spans two entries), bounded in tokens: the least
recently used entries go when it is full (the automaton is rebuilt from the rest). A request
walks it as it goes (matching statistics: the longest suffix of its text that occurs in the
memory, O(1) amortised per token) and drafts from it only where its own text has no longer
match. It holds text of earlier requests in memory only, never on disk.

Edits (`edits=True`, the default; docs/architecture.md, "Drafting edits"): a copy cursor follows
the text position the drafts come from; after an edit, below an own match of CURSOR_TRUST
tokens, the draft copies from the occurrence of the last 2 tokens nearest the cursor. A match
of m tokens drafts up to max(m, MIN_CAP); `context` tells long matches (LONG_MATCH+) from short
ones so that the gate keeps an estimate for each; `continue_after` continues another drafter's
one-token guess where the guess makes a match.

Pure Python: no mlx, no numpy. Drafts never change what is emitted (the verifier decides), so
nothing here can make output wrong, only slower or faster.
"""

from __future__ import annotations

import threading
from bisect import bisect_left, bisect_right
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from skulkp2p.engine.decode.drafter_seam import DrafterCapabilities
from skulkp2p.engine.drafting.drafter import Branch, InnerDrafter

if TYPE_CHECKING:
    from skulkp2p.engine.json_types import JSONObject
    from skulkp2p.engine.model.forward import Forward

# The copy cursor (SuffixDrafter): below an own match of CURSOR_TRUST tokens, the occurrence of
# the text's last 2 tokens nearest the cursor (at most CURSOR_WINDOW past it) is drafted from
# instead of the longest match's latest one. One-token occurrences and resuming at the cursor
# after a new token were tried too and lost (docs/measurements/drafting.md, "Drafting edits").
CURSOR_TRUST = 8
CURSOR_WINDOW = 64
# A match of m tokens drafts at most max(m, MIN_CAP), not m: a 2-token match drafting only 2
# left copyable tokens undrafted (docs/measurements/drafting.md, "Drafting edits").
MIN_CAP = 4
# A match this long is its own context for the gate, starting from a belief of LONG_PRIOR.
LONG_MATCH = 16
LONG_PRIOR = 0.95
# continue_after drafts at most this many tokens past another drafter's guess: more lost on echo
# in the replay (docs/measurements/drafting.md, "Drafting edits").
CONTINUE_CAP = 2


class SuffixAutomaton:
    """Online suffix automaton over int tokens (negative tokens are separators: never drafted)."""

    __slots__ = ("nxt", "link", "length", "pos", "counts", "tokens", "last", "match",
                 "match_len")

    def __init__(self) -> None:
        self.nxt: list[dict[int, int]] = [{}]
        self.link: list[int] = [-1]
        self.length: list[int] = [0]
        self.pos: list[int] = [-1]  # end index of an earlier occurrence of the state's strings
        self.counts: list[dict[int, int] | None] = [None]
        self.tokens: list[int] = []
        self.last = 0
        self.match = 0  # state of the longest suffix of `tokens` that occurred earlier
        self.match_len = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, c: int) -> None:
        nxt, link, length, pos = self.nxt, self.link, self.length, self.pos
        n = len(self.tokens)
        m = self.match
        if self.match_len and c >= 0:
            # c followed the longest match: count it, and the match's latest occurrence ends at
            # n - 1 now (an occurrence earlier than any later query's own end).
            counts = self.counts[m]
            if counts is None:
                counts = self.counts[m] = {}
            counts[c] = counts.get(c, 0) + 1
            pos[m] = n - 1
        self.tokens.append(c)
        cur = len(length)
        nxt.append({})
        link.append(0)
        length.append(length[self.last] + 1)
        pos.append(n)
        self.counts.append(None)
        p = self.last
        while p != -1 and c not in nxt[p]:
            nxt[p][c] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][c]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = len(length)
                nxt.append(dict(nxt[q]))
                link.append(link[q])
                length.append(length[p] + 1)
                pos.append(pos[q])
                cq = self.counts[q]
                self.counts.append(dict(cq) if cq else None)
                while p != -1 and nxt[p].get(c) == q:
                    nxt[p][c] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.last = cur
        self.match = link[cur]
        self.match_len = length[self.match] if c >= 0 else 0

    def walk(self, state: int, k: int) -> list[int]:
        """Up to k tokens continuing the strings of `state`: at each step the token that most
        often followed (counts), else the continuation of its latest earlier occurrence."""
        out: list[int] = []
        nxt, pos, tokens, counts_of = self.nxt, self.pos, self.tokens, self.counts
        end = len(tokens)
        while len(out) < k and state > 0:
            p = pos[state] + 1
            recent = tokens[p] if p < end else -1
            counts = counts_of[state]
            token = recent
            if counts:
                best = counts.get(recent, 0) + (recent >= 0)
                for t, n in counts.items():
                    if n > best:
                        token, best = t, n
            if token < 0:
                break
            out.append(token)
            state = nxt[state].get(token, 0)
        return out

    def alternatives(self, state: int, k: int, taken: list[int], hops: int = 4
                     ) -> list[tuple[int, int, float, int]]:
        """Where the walk of `taken` from `state` could have gone otherwise: (depth, token,
        share, state after it); depth d means the token would stand in for taken[d].

        A state's transitions are exactly the tokens that followed its strings somewhere, each
        weighing its counts + 1 (counts are kept only where the state was the longest match).
        The longest context often saw one follower only (the text it matched), so the shorter
        contexts on its suffix links are asked too (up to `hops` of them), each hop halving
        the share: "return a" may continue otherwise than "def add(a, b): return a" did."""
        out: list[tuple[int, int, float, int]] = []
        nxt, counts_of, link = self.nxt, self.counts, self.link
        for d, token in enumerate(taken[:k]):
            if state <= 0:
                break
            seen = {token}
            s, weight = state, 1.0
            for _ in range(hops + 1):
                if s <= 0:
                    break
                moves = nxt[s]
                if len(moves) > 1:
                    counts = counts_of[s] or {}
                    total = sum(counts.get(t, 0) + 1 for t in moves if t >= 0)
                    for t, after in moves.items():
                        if t not in seen and t >= 0:
                            seen.add(t)
                            out.append((d, t, weight * (counts.get(t, 0) + 1) / total, after))
                s, weight = link[s], weight * 0.5
            state = nxt[state].get(token, 0)
        return out

    def step(self, state: int, matched: int, c: int) -> tuple[int, int]:
        """Matching statistics: from (state, matched length) of some text's longest suffix that
        occurs here, the pair for that text with c appended."""
        nxt, link, length = self.nxt, self.link, self.length
        while state and c not in nxt[state]:
            state = link[state]
            matched = length[state]
        t = nxt[state].get(c)
        if t is None:
            return 0, 0
        return t, matched + 1


SHARED_SEQUENCES = 32  # finished sequences waiting to go to, or come from, other replicas


@dataclass(frozen=True)
class MemoryIndex:
    """The memory's automaton with the start offset and key of each entry in its text."""
    sam: SuffixAutomaton
    starts: list[int]
    keys: list[int]


class SuffixMemory:
    """Earlier requests' prompts and outputs on this node, for drafting: bounded in tokens,
    least recently used out first. Text lives in this process's memory only, and in the memory
    of the model's other replicas: what this one adds waits in a bounded outbox for them
    (`take_finished`), what they send waits in an inbox (`offer`) until the engine's next
    request takes it in (`absorb`, on the thread that adds)."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max(0, int(max_tokens))
        self._outbox: deque[tuple[int, ...]] = deque(maxlen=SHARED_SEQUENCES)
        self._inbox: deque[tuple[int, ...]] = deque(maxlen=SHARED_SEQUENCES)
        self.received = 0  # sequences other replicas offered
        self.shared = 0  # sequences handed out for the other replicas
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # LRU order
        self._starts: list[int] = []  # start offset of each entry in the automaton's text
        self._keys: list[int] = []
        self.sam = SuffixAutomaton()
        self.hits = 0  # requests that drafted from memory
        self._from_replicas: set[int] = set()  # keys of entries another replica sent
        self.drafted = 0  # tokens drafted from memory
        self.drafted_received = 0  # of those, tokens drafted from entries another replica sent

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    @property
    def tokens(self) -> int:
        return sum(len(e) for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._from_replicas.clear()
            self._rebuild()

    def take_finished(self) -> list[list[int]]:
        """What this node added since the last call, for the model's other replicas."""
        with self._lock:
            out = [list(e) for e in self._outbox]
            self._outbox.clear()
            self.shared += len(out)
        return out

    def offer(self, sequences: list[list[int]]) -> None:
        """Sequences another replica finished: taken in at this engine's next request."""
        if not self.enabled:
            return
        with self._lock:
            got = [tuple(s[-self.max_tokens:]) for s in sequences if s]
            self._inbox.extend(got)
            self.received += len(got)

    def stats(self) -> JSONObject:
        """What it holds, what other replicas sent it and what it handed out for them, and the
        tokens drafted from it (all of it, and from what other replicas sent)."""
        with self._lock:
            return {"sequences": len(self._entries), "tokens": self.tokens,
                    "received": self.received, "shared": self.shared,
                    "to_share": len(self._outbox),
                    "drafted_tokens": self.drafted,
                    "drafted_received_tokens": self.drafted_received}

    def absorb(self) -> int:
        """Take in what other replicas offered (on the thread that adds); how many."""
        with self._lock:
            got = list(self._inbox)
            self._inbox.clear()
        for entry in got:
            self.add(list(entry), shared=False, received=True)
        return len(got)

    def add(self, tokens: list[int], shared: bool = True, received: bool = False) -> None:
        """Remember one request's prompt + output (a repeat only moves to most recent);
        ``shared``: also offer it to the model's other replicas; ``received``: another replica
        sent it (drafts from it are counted apart)."""
        if not self.enabled or not tokens:
            return
        entry = tuple(tokens[-self.max_tokens:])
        key = hash(entry)
        with self._lock:
            if shared:
                self._outbox.append(entry)
            if key in self._entries:
                self._entries.move_to_end(key)
                return
            self._entries[key] = entry
            if received:
                self._from_replicas.add(key)
            if self.tokens > self.max_tokens:
                # Drop to 3/4 of the bound so that the rebuild is amortised over many adds.
                target = self.max_tokens * 3 // 4
                total = self.tokens
                while self._entries and total > target:
                    old_key, old = self._entries.popitem(last=False)
                    self._from_replicas.discard(old_key)
                    total -= len(old)
                if key not in self._entries:  # one entry larger than the target: keep it
                    self._entries[key] = entry
                    if received:
                        self._from_replicas.add(key)
                self._rebuild()
            else:
                self._append(key, entry)

    def index(self) -> MemoryIndex:
        """The automaton as it is now with the start and key of each entry in it: a drafter
        keeps this view for its request (a later rebuild makes a new automaton and new lists;
        an append extends all three alike), so a position it drafts from names its entry."""
        with self._lock:
            return MemoryIndex(self.sam, self._starts, self._keys)

    def drew(self, view: MemoryIndex, position: int, tokens: int) -> None:
        """A draft of `tokens` tokens came from automaton position `position` of `view`: its
        entry becomes most recent, and the tokens are counted (apart where another replica
        sent the entry)."""
        with self._lock:
            self.drafted += tokens
            i = bisect_right(view.starts, position) - 1
            key = view.keys[i] if 0 <= i < len(view.keys) else None
            if key is not None and key in self._entries:
                self._entries.move_to_end(key)
                if key in self._from_replicas:
                    self.drafted_received += tokens

    def _append(self, key: int, entry: tuple[int, ...]) -> None:
        sam = self.sam
        self._starts.append(len(sam))
        self._keys.append(key)
        for t in entry:
            sam.extend(t)
        sam.extend(-1 - len(self._keys))  # a separator of its own: no match spans two entries

    def _rebuild(self) -> None:
        self.sam = SuffixAutomaton()
        self._starts, self._keys = [], []
        for key, entry in self._entries.items():
            self._append(key, entry)


class SuffixDrafter(InnerDrafter):
    """Drafts the continuation of the longest suffix match in the request's own text, else in
    the memory of earlier requests. Deterministic (q is one-hot)."""

    name = "lookup"
    capabilities = DrafterCapabilities(branches=True)

    def __init__(self, min_match: int = 1, memory: SuffixMemory | None = None,
                 long_enough: int = 32, edits: bool = True):
        """`edits`: the copy cursor, drafts of at least MIN_CAP and the long-match context
        (off: each draft continues the longest match, capped at its length, as before the
        copy cursor; the card's `[speculation.lookup] edits = false`, the bench's
        `spec_noedits` arm)."""
        self.min_match = max(1, min_match)
        self.edits = edits
        self._min_cap = MIN_CAP if edits else 0
        self.memory = memory if memory is not None and memory.enabled else None
        self.long_enough = long_enough  # an own match this long is not compared with memory
        self.sam = SuffixAutomaton()
        self._mem_index: MemoryIndex | None = None  # the memory as this request walks it
        self._mem_sam: SuffixAutomaton | None = None
        self._mem_state = 0
        self._mem_len = 0
        self.from_memory = 0  # drafted tokens that came from memory
        self._used_memory = False
        self._prompt_len = -1
        self._ends: dict[tuple[int, int], list[int]] = {}  # 2-grams -> their end positions
        self.cursor: int | None = None  # where in the text the copy being followed stands
        self._following = False  # the text still agrees with the source at the cursor
        self.from_cursor = 0  # drafted tokens that came from the cursor
        self._last_kind = "none"

    def prepare(self, prompt: list[int]) -> None:
        """Index the prompt (done before decoding so the prompt gate can ask about memory)."""
        if self._prompt_len == len(prompt) and len(self.sam) == len(prompt):
            return
        self.sam = SuffixAutomaton()
        self._ends = {}
        self.cursor = None
        self._following = False
        self._mem_index = self.memory.index() if self.memory is not None else None
        self._mem_sam = self._mem_index.sam if self._mem_index is not None else None
        self._mem_state = self._mem_len = 0
        self._feed(prompt)
        self._prompt_len = len(prompt)

    @property
    def memory_match(self) -> int:
        """Tokens of the text so far matched, at its end, by memory."""
        return self._mem_len

    def _feed(self, tokens: list[int]) -> None:
        sam = self.sam
        mem = self._mem_sam
        text, ends = sam.tokens, self._ends
        for t in tokens:
            if self._following:
                assert self.cursor is not None  # (a copy is followed from the cursor)
                # The copy goes on while the text says what its source said next; at the
                # first token that differs (an edit) the cursor stays where the source was.
                if text[self.cursor] == t:
                    self.cursor += 1
                else:
                    self._following = False
            if text:
                ends.setdefault((text[-1], t), []).append(len(text))
            sam.extend(t)
        if mem is not None:
            state, matched = self._mem_state, self._mem_len
            for t in tokens:
                state, matched = mem.step(state, matched, t)
            self._mem_state, self._mem_len = state, matched

    def begin(self, prompt: list[int], forward: Forward) -> None:
        self.prepare(prompt)

    def _catch_up(self, history: list[int]) -> None:
        if len(history) != len(self.sam):  # not in step (e.g. observe skipped): catch up
            if len(history) > len(self.sam) and history[:len(self.sam)] == self.sam.tokens:
                self._feed(history[len(self.sam):])
            else:
                self._prompt_len = -1
                self.prepare(history)

    def _plan(self) -> tuple[str, int]:
        """Where this round's draft comes from: ("cursor", start in the text), ("own", match
        length), ("memory", match length) or ("none", 0)."""
        own = self.sam.match_len
        mem = self._mem_len if self._mem_sam is not None else 0
        if self.edits and 2 <= own < CURSOR_TRUST and self.cursor is not None:
            at = self._near_cursor()
            if at is not None:
                return "cursor", at
        if own >= self.min_match and (own >= mem or own >= self.long_enough):
            return "own", own
        if mem >= self.min_match:
            return "memory", mem
        return "none", 0

    # The gate's starting belief per context: a long match's 16 drafts were all right at 215
    # of 283 such points of the bench's echo, code-edit and agent outputs (draft_trace.py).
    context_priors = {1: LONG_PRIOR}

    def context(self, history: list[int]) -> int:
        """Which kind of draft this round's would be, for the gate to keep a separate
        acceptance estimate per kind (gates.GatedDrafter): 0 a short match (or the copy
        cursor), 1 a match of LONG_MATCH tokens or more, whose drafts run far longer."""
        if not self.edits:
            return 0
        self._catch_up(history)
        kind, n = self._plan()
        return int(kind in ("own", "memory") and n >= LONG_MATCH)

    def propose(self, history: list[int], k: int) -> tuple[list[int], list[np.ndarray] | None]:
        if k <= 0:
            return [], None
        self._catch_up(history)
        sam = self.sam
        kind, n = self._plan()
        self._last_kind = kind
        if kind == "cursor":
            draft = sam.tokens[n:n + k]
            self.cursor, self._following = n, True
            self.from_cursor += len(draft)
            return draft, None
        if kind == "own":
            self.cursor, self._following = sam.pos[sam.match] + 1, True
            return sam.walk(sam.match, min(k, max(n, self._min_cap))), None
        if kind == "memory":
            # (a match in memory: there is one)
            assert self._mem_sam is not None and self.memory is not None \
                and self._mem_index is not None
            draft = self._mem_sam.walk(self._mem_state, min(k, n))
            if draft:
                self.from_memory += len(draft)
                if not self._used_memory:
                    self._used_memory = True
                    self.memory.hits += 1
                self.memory.drew(self._mem_index, self._mem_sam.pos[self._mem_state],
                                 len(draft))
            return draft, None
        return [], None

    def offers_draft(self) -> bool:
        """Whether `propose` would find a source for a draft now (the text observed so far
        has a match: own, memory or the copy cursor). A hint for other drafters (an MTP head
        starts its own draft early where this one has none: gates.LookupThenModel)."""
        return self._plan()[0] != "none"

    def continue_after(self, history: list[int], token: int, k: int) -> list[int]:
        """Up to k tokens that would follow `history` + [token], where `token` is another
        drafter's guess of the next token (an MTP head's, in a round where this drafter has no
        match of its own): the continuation of the longest match of the text with `token`
        appended, when that match is 2 tokens or more, at most max(match - 1, CONTINUE_CAP)
        tokens. After an edit the head's token often picks up a copy that lookup had lost.
        Empty otherwise (the guess then goes alone)."""
        if not self.edits or k <= 0:
            return []
        self._catch_up(history)
        sam = self.sam
        state, matched = sam.step(sam.match, sam.match_len, token)
        if matched < max(2, self.min_match):
            return []
        draft = sam.walk(state, min(k, max(matched - 1, CONTINUE_CAP)))
        if draft:
            self.cursor, self._following = sam.pos[state], True
        return draft

    def _near_cursor(self) -> int | None:
        """Where the continuation of the text's last 2 tokens starts at their occurrence
        nearest the cursor (at or after it, within CURSOR_WINDOW): an edit copies its source in
        order, so after an insertion or a change the copy resumes there, not at the most
        recent occurrence elsewhere. None: no such occurrence."""
        text = self.sam.tokens
        if len(text) < 2:
            return None
        ends = self._ends.get((text[-2], text[-1]))
        if not ends:
            return None
        cursor = self.cursor
        assert cursor is not None  # (asked only with a cursor: _plan)
        i = bisect_left(ends, cursor - 1)
        if i < len(ends) and ends[i] < len(text) - 1 and ends[i] <= cursor + CURSOR_WINDOW:
            return ends[i] + 1
        return None

    def propose_branches(self, history: list[int], k: int) -> tuple[list[int], list[Branch]]:
        """The chain `propose` gives, and the branches beside it where the continuation counts
        disagree (another token followed the same or a shorter context: see
        SuffixAutomaton.alternatives) and where the memory's continuation differs from the
        request's own: each a `Branch` the gate may add to the tree (gates.build_tree)."""
        main, _ = self.propose(history, k)
        if not main or self._last_kind == "cursor":  # (the cursor's copy has no counts)
            return main, []
        sam = self.sam
        own = sam.match_len
        mem = self._mem_len if self._mem_sam is not None else 0
        from_own = own >= self.min_match and (own >= mem or own >= self.long_enough)
        source, state = (sam, sam.match) if from_own else (self._mem_sam, self._mem_state)
        assert source is not None
        branches: list[Branch] = []
        for d, t, share, after in source.alternatives(state, len(main), main):
            rest = source.walk(after, max(0, len(main) - d - 1))
            branches.append(Branch(d, [t, *rest], share))
        taken = {b.tokens[0] for b in branches if b.depth == 0}
        other = self._mem_sam if from_own else sam
        if other is not None:
            o_state = self._mem_state if from_own else sam.match
            o_len = mem if from_own else own
            if o_len >= self.min_match:
                alt = other.walk(o_state, min(len(main), o_len))
                if alt and alt[0] != main[0] and alt[0] not in taken:
                    branches.append(Branch(0, alt, 0.5))
        return main, branches

    def observe(self, drafted: int, accepted: int, emitted: list[int], forward: Forward) -> None:
        self._feed(emitted)
