"""The rows' MTP/EAGLE head drafts of a batch in ONE head forward per depth (`HeadRows`).

Each row of a batch drafts with its own `MtpDrafter` (mtp_drafter.py), whose head appends rows
(trunk hidden row, next token) to a per-row head cache: the verified rows after every round,
and one speculative row per draft past the first. Run one row at a time that is one head
forward and one vocabulary projection per row per depth, each with its own evaluation. Here the
rows' head caches live side by side in one `RowsKVCache` (batch_cache.py: each row at its own
length, a rollback is the length going down, rows join from a one-request cache and leave by a
gather, as the trunk's rows do), and a row's head call is handed in instead of run: once every
row of the batch has either handed one in or handed its tokens in for the next trunk step (no
row can still hand one in before that step), the thread that saw it runs all of them as one
forward (rows padded on the right to the widest, each written at its own length), evaluates it,
and each row reads its own last row's logits, chained state and argmax.

The barrier is the scheduler's (`BatchScheduler.heads_ready`): rows that do not draft with
this head (lookup, plain, gated off) count as ready once they submit their trunk tokens, so
they never wait for the head; depth d + 1 is handed in once depth d's results are read, so
every depth is one forward for the rows still going deeper. Pending calls run before the next
trunk step at the latest.

Floats: the batched forward is not bitwise the solo one (padding changes the matmul shapes;
~1e-6 on float32), so a draft may differ where the head's top two logits are that close;
exactness never depends on it (the verifier decides every token).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Protocol, cast

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from skulkp2p.engine.cache.batch_cache import RowLengths, RowsKVCache


class Chained(Protocol):
    """A head's conventions, as far as the batched forward reads them."""

    @property
    def chain(self) -> str:
        """Which head state a deeper draft is fed: "after" or "before" its final norm."""
        ...


class DraftHead(Protocol):
    """What the batched forward runs of a drafting head (engine/model/mtp_head.py: `MtpHead`,
    one room up)."""

    @property
    def conventions(self) -> Chained: ...

    def features(self, hidden: mx.array, tokens: mx.array, cache: RowsKVCache,
                 first: bool = True) -> tuple[mx.array, mx.array]:
        """(pre, post) head states [B, L, H] of rows (hidden[b, i], tokens[b, i]) appended to
        `cache`."""
        ...

    def logits(self, rows: mx.array) -> mx.array:
        """Full-vocabulary logits of head states."""
        ...

    def input_rows(self, hidden: mx.array) -> mx.array:
        """Rows as `features` reads them: a head that fuses several trunk layers fuses the
        trunk's rows here, so they stack beside chained (head) rows."""
        ...


class Barrier(Protocol):
    """What the head rows need of their batch (scheduler.BatchScheduler): its condition (the
    model's lock) and the check that runs the pending calls once no row can hand one in."""
    cond: threading.Condition

    def heads_if_ready(self) -> None: ...


@dataclasses.dataclass
class HeadCall:
    """One row's head call handed in: rows (hidden[i], tokens[i]) to append to its head cache;
    the last row's logits [V], chained state [H] and argmax once the batched forward ran."""
    hidden: mx.array  # [w, H]
    tokens: list[int]
    logits: mx.array | None = None
    chained: mx.array | None = None
    token: int | None = None
    error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self.logits is not None or self.error is not None


class HeadRows:
    """The head caches of one head's drafting rows in a batch, and their batched forward."""

    def __init__(self, head: DraftHead, scheduler: Barrier):
        self.head = head
        self.scheduler = scheduler
        self.rows = RowLengths()
        self.layer = RowsKVCache(self.rows)
        self.members: list[object] = []  # the rows' RowForwards, in buffer order
        self.pending: dict[object, HeadCall] = {}
        self.forwards = 0  # batched head forwards run
        self.calls = 0  # row calls they ran (calls / forwards: rows per forward)
        self.peak = 0  # the most rows one head forward ran

    # -- rows joining and leaving (lock held) --

    def join(self, member: object, cache: KVCache) -> None:
        """Add `member`'s head cache (a one-request cache holding at least one row)."""
        if member in self.members:
            raise RuntimeError("a row joined the head batch twice")
        if cache.offset <= 0:
            raise ValueError("a head cache joins holding rows (position 0 runs alone)")
        self.layer.append_row(cache, cache.offset)
        self.members.append(member)
        self.rows.set([*self.rows.lengths, cache.offset])
        mx.eval(self.layer.arrays())  # built here; the forward may run on another thread

    def leave(self, member: object) -> None:
        if member not in self.members:
            return
        index = self.members.index(member)
        kept = [i for i in range(len(self.members)) if i != index]
        self.pending.pop(member, None)
        self.layer.keep_rows(kept)
        mx.eval(self.layer.arrays())
        self.rows.set([self.rows.lengths[i] for i in kept])
        del self.members[index]

    def length(self, member: object) -> int:
        return self.rows.lengths[self.members.index(member)]

    def trim(self, member: object, n: int) -> None:
        """Forget `member`'s last n rows (its speculative draft rows)."""
        if n <= 0:
            return
        lengths = list(self.rows.lengths)
        i = self.members.index(member)
        if n > lengths[i]:
            raise ValueError(f"trim {n} head rows of a row holding {lengths[i]}")
        lengths[i] -= n
        self.rows.set(lengths)

    def extract(self, member: object) -> KVCache:
        """`member`'s head rows as a one-request cache of its own (copies, evaluated)."""
        self.wait(member)
        i = self.members.index(member)
        single = self.layer.extract(i, self.rows.lengths[i])
        assert isinstance(single, KVCache)  # (a head's layer has no sliding window)
        mx.eval([a for a in (single.keys, single.values) if a is not None])
        return single

    # -- calls --

    def hand_in(self, member: object, hidden: mx.array, tokens: list[int]) -> HeadCall:
        """Queue `member`'s head call for the next batched head forward (run at once when this
        completes the barrier)."""
        if member in self.pending:
            raise RuntimeError("a row handed in a second head call before the first ran")
        if hidden.shape[0] != len(tokens) or not tokens:
            raise ValueError(f"{hidden.shape[0]} hidden rows for {len(tokens)} tokens")
        mx.eval(hidden)  # (built on this row's thread; the forward may run on another)
        call = HeadCall(hidden, list(tokens))
        self.pending[member] = call
        self.scheduler.heads_if_ready()
        return call

    def wait(self, member: object) -> None:
        """Until `member`'s pending call (if any) has run; raises if the forward failed."""
        call = self.pending.get(member)
        if call is None:
            return
        self.scheduler.heads_if_ready()
        self.scheduler.cond.wait_for(lambda: call.done)
        if call.error is not None:
            raise RuntimeError(f"the batched head forward failed: {call.error}") from call.error

    def result(self, member: object, call: HeadCall) -> tuple[mx.array, mx.array, int]:
        """(logits, chained state, argmax) of `call`, waiting for its forward."""
        if not call.done:
            self.wait(member)
        if call.error is not None:
            raise RuntimeError(f"the batched head forward failed: {call.error}") from call.error
        assert call.logits is not None and call.chained is not None and call.token is not None
        return call.logits, call.chained, call.token

    def run(self) -> None:
        """One forward over every row with a pending call (lock held, barrier complete)."""
        if not self.pending:
            return
        calls = dict(self.pending)
        self.pending.clear()
        try:
            self._forward(calls)
        except Exception as e:  # noqa: BLE001 - every calling row fails with it, on its thread
            # (not raised here: this thread may be a row handing in trunk tokens, and the
            # other rows wait for that step)
            for call in calls.values():
                call.error = e
        finally:
            self.scheduler.cond.notify_all()

    def _forward(self, calls: dict[object, HeadCall]) -> None:
        members = self.members
        # Rows without a call this time ride along padded (their writes land past their
        # length, where the mask hides them and their next call overwrites them): one forward
        # over the buffer as it is, no gather of the callers' rows.
        widths = [len(calls[m].tokens) if m in calls else 0 for m in members]
        width = max(widths)
        given = {m: self.head.input_rows(c.hidden) for m, c in calls.items()}
        like = next(iter(given.values()))
        hidden, tokens = [], []
        for m, w in zip(members, widths, strict=True):
            call = calls.get(m)
            if call is None:
                hidden.append(mx.zeros((width, like.shape[-1]), like.dtype))
                tokens.append([0] * width)
                continue
            h = given[m]
            if w < width:  # pad with the row's last row
                h = mx.concatenate([h, mx.repeat(h[-1:], width - w, axis=0)], axis=0)
            hidden.append(h)
            tokens.append(call.tokens + [call.tokens[-1]] * (width - w))
        x = mx.stack(hidden)
        pre, post = self.head.features(x, mx.array(tokens, dtype=mx.int32), self.layer,
                                       first=False)
        last = mx.array([max(w - 1, 0) for w in widths], dtype=mx.int32)
        picked = mx.arange(len(members))
        post_last = post[picked, last]
        chain = post_last if self.head.conventions.chain == "after" else pre[picked, last]
        logits = self.head.logits(post_last)
        argmax = mx.argmax(logits, axis=-1)
        rows = {m: (logits[i], chain[i]) for i, m in enumerate(members) if m in calls}
        # MLX runs a lazy array only on the thread that built it: every row's slices too.
        mx.eval(argmax, *self.layer.arrays(), *(a for pair in rows.values() for a in pair))
        self.rows.set([n + w for n, w in zip(self.rows.lengths, widths, strict=True)])
        tokens_out = cast(list[int], argmax.tolist())  # (mlx types tolist() as any nesting)
        for i, m in enumerate(members):
            if m in rows:
                calls[m].logits, calls[m].chained = rows[m]
                calls[m].token = int(tokens_out[i])
        self.forwards += 1
        self.calls += len(calls)
        self.peak = max(self.peak, len(calls))
