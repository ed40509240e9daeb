"""Fitting a head: training rows from the shards, the loss, and a quick teacher-forced check.

Loss: cross-entropy against the trunk's top-k distribution at t+1 (over the draft vocabulary)
plus a feature term pulling the head's normed output towards the trunk's h_{t+1}, which is what
the head is fed back at depth > 1 (EAGLE's lesson); optionally the second draft step's
cross-entropy too, the head fed its own output (EAGLE's training-time test).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from skulkp2p.engine.model.mtp_head import MtpHead

PROMPT_ROW_WEIGHT = 0.5  # rows inside the prompt count less: drafts happen on generated text


class Batches:
    """Training batches from generated shards: B sequences of one shard (equal lengths)."""

    def __init__(self, shards: list[dict[str, np.ndarray]], vocab_ids: np.ndarray,
                 vocab_size: int, batch: int, seed: int, feature_noise: float = 0.0):
        self.shards = shards
        self.batch = batch
        self.feature_noise = feature_noise
        self.rng = np.random.default_rng(seed)
        self.local = np.full(vocab_size, -1, np.int64)
        self.local[vocab_ids] = np.arange(len(vocab_ids))

    def sample(self) -> tuple[mx.array, ...]:
        s = self.shards[int(self.rng.integers(len(self.shards)))]
        n_seq = s["tokens"].shape[0]
        pick = self.rng.choice(n_seq, size=min(self.batch, n_seq), replace=False)
        rows = self.rows(s, pick)
        if self.feature_noise <= 0:
            return rows
        # EAGLE's trick against exposure bias: at depth > 1 and on novel text the head reads
        # features that are not exactly the trunk's, so training sees them jittered (uniform,
        # relative to each row's RMS). Only training batches; evaluation reads them clean.
        hidden = rows[0]
        rms = mx.sqrt(mx.mean(hidden * hidden, axis=-1, keepdims=True))
        noise = mx.random.uniform(-self.feature_noise, self.feature_noise, hidden.shape)
        return (hidden + noise * rms,) + rows[1:]

    def rows(self, s: dict[str, np.ndarray], pick: np.ndarray) -> tuple[mx.array, ...]:
        """Row t pairs (h_t, x_{t+1}); its targets are the trunk's top-k and h at t+1."""
        n = s["tokens"].shape[1]
        hidden = s["hidden"][pick, :n - 1].astype(np.float32)
        tokens = s["tokens"][pick, 1:n]
        tid = s["top_ids"][pick, 1:n]
        tval = s["top_vals"][pick, 1:n].astype(np.float32)
        local = self.local[tid]
        w = np.exp(tval - tval.max(-1, keepdims=True)) * (local >= 0)
        w = w / np.maximum(w.sum(-1, keepdims=True), 1e-9)
        feat = s["hidden"][pick, 1:n].astype(np.float32)
        t = np.arange(n - 1)[None, :]
        valid = (t + 1) < s["ends"][pick][:, None]
        plen = int(s["prompt_len"])
        weight = np.where(t + 1 < plen, PROMPT_ROW_WEIGHT, 1.0) * valid
        return (mx.array(hidden), mx.array(tokens), mx.array(np.maximum(local, 0)),
                mx.array(w.astype(np.float32)), mx.array(feat),
                mx.array(weight.astype(np.float32)))


class _KeptKeys:
    """Stands in for a KV cache in one training forward of the head's layer: rotary positions
    from `offset`, keys and values of `prefix` (an earlier forward's) in front of the new ones,
    and the new ones kept for a later forward."""

    def __init__(self, offset: int, prefix: tuple[mx.array, mx.array] | None = None):
        self.offset = offset
        self.prefix = prefix
        self.kept: tuple[mx.array, mx.array] | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.kept = (keys, values)
        if self.prefix is None:
            return keys, values
        return (mx.concatenate([self.prefix[0], keys], axis=2),
                mx.concatenate([self.prefix[1], values], axis=2))


def two_step_features(head: MtpHead, hidden: mx.array, tokens: mx.array
                      ) -> tuple[mx.array, mx.array]:
    """EAGLE's training-time test for a second draft step, all positions in two forwards.
    Step 1 is the usual teacher-forced rows (h_t, x_{t+1}) at positions t. Step 2 is what the
    drafter computes for its second draft: at position t+1 the head's own chained output of row t
    with the token x_{t+2}, attending to the step-1 rows at positions <= t (the verified ones at
    decode time) and to itself, not to the trunk's row t+1 that it stands in for. Returns the
    (post-norm) states [B, L, H] of step 1 and [B, L-1, H] of step 2; step-2 row t predicts what
    step-1 row t+1 predicts (same targets, shifted by one)."""
    step1 = _KeptKeys(0)
    pre, post = head.features(hidden, tokens, step1, attn_mask="causal")
    chained = post if head.conventions.chain == "after" else pre
    n = tokens.shape[1] - 1
    rows = mx.arange(n)[:, None]
    mask = mx.concatenate([mx.arange(n + 1)[None, :] <= rows,  # step-1 rows up to t
                           mx.arange(n)[None, :] == rows], axis=1)  # and itself
    _, post2 = head.features(chained[:, :-1], tokens[:, 1:], _KeptKeys(1, step1.kept),
                             first=False, attn_mask=mask)
    return post, post2


def _soft_ce(head: MtpHead, post: mx.array, tids: mx.array, tw: mx.array) -> mx.array:
    logits = head.draft_logits(post).astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return -(mx.take_along_axis(logp, tids, -1) * tw).sum(-1)


def make_loss(feat_weight: float, depth2_weight: float = 0.0):
    """Loss: depth-1 cross-entropy against the trunk's top-k plus the feature term; with
    `depth2_weight`, plus that weight times the second step's cross-entropy (the head fed its
    own output, two_step_features). Returns (loss, depth-1 ce)."""
    def loss_fn(head: MtpHead, hidden, tokens, tids, tw, feat, weight):
        two = depth2_weight > 0 and tokens.shape[1] > 2
        if two:
            post, post2 = two_step_features(head, hidden, tokens)
        else:
            _, post = head.features(hidden, tokens)
        ce = _soft_ce(head, post, tids, tw)
        scale = mx.mean(feat * feat, axis=-1) + 1e-6
        fl = mx.mean((post.astype(mx.float32) - feat) ** 2, axis=-1) / scale
        total = mx.maximum(weight.sum(), 1.0)
        loss = ((ce + feat_weight * fl) * weight).sum() / total
        if two:
            ce2 = _soft_ce(head, post2, tids[:, 1:], tw[:, 1:])
            w2 = weight[:, 1:]
            loss = loss + depth2_weight * (ce2 * w2).sum() / mx.maximum(w2.sum(), 1.0)
        return loss, (ce * weight).sum() / total
    return loss_fn


def teacher_forced_accuracy(head: MtpHead, batches: Batches,
                            shards: list[dict[str, np.ndarray]], max_seqs: int = 16
                            ) -> tuple[float, float]:
    """Teacher-forced accuracy on generated rows of the first draft step and of the second
    (fed the head's own first output, two_step_features): a quick check during training."""
    hits, total = [0, 0], [0, 0]
    for s in shards:
        pick = np.arange(min(max_seqs, s["tokens"].shape[0]))
        hidden, tokens, _, _, _, weight = batches.rows(s, pick)
        want = batches.local[s["top_ids"][pick, 1:, 0]]
        plen = int(s["prompt_len"])
        gen = (np.array(weight) > 0) & (np.arange(weight.shape[1])[None] + 1 >= plen)
        if tokens.shape[1] > 2:
            post, post2 = two_step_features(head, hidden, tokens)
            steps = [(post, want, gen), (post2, want[:, 1:], gen[:, 1:])]
        else:
            steps = [(head.features(hidden, tokens)[1], want, gen)]
        for i, (rows, w, g) in enumerate(steps):
            ok = (np.array(mx.argmax(head.draft_logits(rows), -1)) == w) & g
            hits[i] += int(ok.sum())
            total[i] += int(g.sum())
    return hits[0] / max(total[0], 1), hits[1] / max(total[1], 1)
