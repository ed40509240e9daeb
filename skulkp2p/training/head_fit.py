"""Fitting a head: training rows from the shards, the loss, and a quick teacher-forced check.

Loss: cross-entropy against the trunk's top-k distribution at t+1 (over the draft vocabulary)
plus a feature term pulling the head's normed output towards the trunk's h_{t+1}, which is what
the head is fed back at depth > 1 (EAGLE's lesson); optionally the second draft step's
cross-entropy too, the head fed its own output (EAGLE's training-time test), or several such
steps unrolled (`steps`, an eagle3 head: EAGLE-3's multi-step training-time test).

An eagle3 head reads the shards' "layers" (a low, a middle and a high layer's outputs side by
side) as its trunk feature instead of "hidden" (the trunk's final feature, still the feature
term's target).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from skulkp2p.engine.model.mtp_head import MtpHead

PROMPT_ROW_WEIGHT = 0.5  # rows inside the prompt count less: drafts happen on generated text


class Batches:
    """Training batches from generated shards: B sequences of one shard (equal lengths)."""

    def __init__(self, shards: list[dict[str, np.ndarray]], vocab_ids: np.ndarray,
                 vocab_size: int, batch: int, seed: int, feature_noise: float = 0.0,
                 fused: bool = False):
        """`fused`: the rows' feature is the shards' "layers" (an eagle3 head's input)."""
        self.shards = shards
        self.fused = fused
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
        # (per depth for fused layers: each depth's residual stream has a scale of its own)
        width = int(self.shards[0]["hidden"].shape[-1])
        parts = hidden.reshape(*hidden.shape[:-1], -1, width)
        rms = mx.sqrt(mx.mean(parts * parts, axis=-1, keepdims=True))
        noise = mx.random.uniform(-self.feature_noise, self.feature_noise, parts.shape)
        return ((parts + noise * rms).reshape(hidden.shape),) + rows[1:]

    def rows(self, s: dict[str, np.ndarray], pick: np.ndarray) -> tuple[mx.array, ...]:
        """Row t pairs (h_t, x_{t+1}); its targets are the trunk's top-k and h at t+1."""
        n = s["tokens"].shape[1]
        hidden = s["layers" if self.fused else "hidden"][pick, :n - 1].astype(np.float32)
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


def unrolled_features(head: MtpHead, hidden: mx.array, tokens: mx.array, steps: int
                      ) -> list[mx.array]:
    """EAGLE's training-time test for `steps` draft steps, all positions in `steps` forwards.
    Step 1 is the usual teacher-forced rows (h_t, x_{t+1}) at positions t. Step k > 1 is what
    the drafter computes for its k-th draft: at position t+k-1 the head's own chained output of
    step k-1's row t with the token x_{t+k}, attending to the step-1 rows at positions <= t (the
    verified ones at decode time), to the rows of its own chain at steps 2..k-1 and to itself,
    not to the trunk rows it stands in for. Returns the (post-norm) states of each step, step k
    [B, L-k+1, H]; step-k row t predicts what step-1 row t+k-1 predicts (targets shifted by
    k-1)."""
    kept = [_KeptKeys(0)]
    pre, post = head.features(hidden, tokens, kept[0], attn_mask="causal")
    posts = [post]
    length = tokens.shape[1]
    for k in range(2, steps + 1):
        n = length - k + 1
        if n < 1:
            break
        chained = (post if head.conventions.chain == "after" else pre)[:, :n]
        rows = mx.arange(n)[:, None]
        # keys: step 1's L rows, then each later step's rows (step m has L-m+1), then its own
        blocks = [mx.arange(length)[None, :] <= rows]
        blocks += [mx.arange(length - m + 1)[None, :] == rows for m in range(2, k + 1)]
        prefix = None
        if len(kept) > 1 or kept[0].kept is not None:
            keys = [c.kept for c in kept if c.kept is not None]
            prefix = (mx.concatenate([kv[0] for kv in keys], axis=2),
                      mx.concatenate([kv[1] for kv in keys], axis=2))
        cache = _KeptKeys(k - 1, prefix)
        pre, post = head.features(chained, tokens[:, k - 1:], cache, first=False,
                                  attn_mask=mx.concatenate(blocks, axis=1))
        kept.append(_KeptKeys(0))
        kept[-1].kept = cache.kept
        posts.append(post)
    return posts


def two_step_features(head: MtpHead, hidden: mx.array, tokens: mx.array
                      ) -> tuple[mx.array, mx.array]:
    """The first two steps of unrolled_features: states [B, L, H] and [B, L-1, H]."""
    post, post2 = unrolled_features(head, hidden, tokens, 2)
    return post, post2


def _soft_ce(head: MtpHead, post: mx.array, tids: mx.array, tw: mx.array) -> mx.array:
    logits = head.draft_logits(post).astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return -(mx.take_along_axis(logp, tids, -1) * tw).sum(-1)


def make_loss(feat_weight: float, depth2_weight: float = 0.0, steps: int = 0):
    """Loss: depth-1 cross-entropy against the trunk's top-k plus the feature term; with
    `depth2_weight`, plus that weight times each later step's cross-entropy (the head fed its
    own output, unrolled_features; `steps` of them, default 2). Returns (loss, depth-1 ce)."""
    steps = steps or (2 if depth2_weight > 0 else 1)

    def loss_fn(head: MtpHead, hidden, tokens, tids, tw, feat, weight):
        unrolled = depth2_weight > 0 and steps > 1 and tokens.shape[1] > 2
        if unrolled:
            posts = unrolled_features(head, hidden, tokens, steps)
        else:
            posts = [head.features(hidden, tokens)[1]]
        post = posts[0]
        ce = _soft_ce(head, post, tids, tw)
        scale = mx.mean(feat * feat, axis=-1) + 1e-6
        fl = mx.mean((post.astype(mx.float32) - feat) ** 2, axis=-1) / scale
        total = mx.maximum(weight.sum(), 1.0)
        loss = ((ce + feat_weight * fl) * weight).sum() / total
        for k, later in enumerate(posts[1:], start=1):
            ce_k = _soft_ce(head, later, tids[:, k:], tw[:, k:])
            w_k = weight[:, k:]
            loss = loss + depth2_weight * (ce_k * w_k).sum() / mx.maximum(w_k.sum(), 1.0)
        return loss, (ce * weight).sum() / total
    return loss_fn


def teacher_forced_accuracy(head: MtpHead, batches: Batches,
                            shards: list[dict[str, np.ndarray]], max_seqs: int = 16,
                            steps: int = 2) -> list[float]:
    """Teacher-forced accuracy on generated rows of each of `steps` draft steps (step k > 1 fed
    the head's own earlier outputs, unrolled_features): a quick check during training."""
    hits, total = [0] * steps, [0] * steps
    for s in shards:
        pick = np.arange(min(max_seqs, s["tokens"].shape[0]))
        hidden, tokens, _, _, _, weight = batches.rows(s, pick)
        want = batches.local[s["top_ids"][pick, 1:, 0]]
        plen = int(s["prompt_len"])
        gen = (np.array(weight) > 0) & (np.arange(weight.shape[1])[None] + 1 >= plen)
        posts = unrolled_features(head, hidden, tokens, steps)
        for k, rows in enumerate(posts):
            ok = (np.array(mx.argmax(head.draft_logits(rows), -1)) == want[:, k:]) & gen[:, k:]
            hits[k] += int(ok.sum())
            total[k] += int(gen[:, k:].sum())
    return [h / max(t, 1) for h, t in zip(hits, total, strict=True)]
