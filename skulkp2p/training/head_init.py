"""The starting head, and the tensors a head is saved as.

A head that starts close to right (or from an earlier head, `--init-from`): the decoder layer is
a copy of the trunk's last layer with its residual output projections (o_proj, down_proj)
zeroed, so it starts as the identity; the final norm is the trunk's; fc is the ridge-regression
solution mapping [norm(embed(x_{t+1})), norm(h_t)] to the trunk's next hidden state, so the
initial head already predicts x_{t+2} as a linear model would instead of starting from a large
loss. Its draft vocabulary is the K most frequent target tokens (covering --coverage of the
training targets): the head scores K rows of the shared lm_head, so a draft costs a small
fraction of a trunk step; it stays exact because the verifier decides every token.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from skulkp2p.engine.model.mtp_conventions import _PARTS, VOCAB_IDS
from skulkp2p.engine.model.mtp_head import MtpHead, load_mtp_head
from skulkp2p.engine.model.trunk import Trunk
from skulkp2p.training.head_options import PREFIXES, HeadError


def _to_file_name(param: str, kind: str) -> str:
    """Head parameter name -> the sidecar's tensor name (the kind's naming)."""
    prefix = PREFIXES[kind]
    if param.startswith("layer."):
        return prefix + "layers.0." + param[len("layer."):]
    part, rest = param.split(".", 1)
    return prefix + _PARTS[kind][part] + "." + rest


def head_tensors(head: MtpHead, dtype: mx.Dtype) -> dict[str, mx.array]:
    kind = head.conventions.style
    out = {_to_file_name(k, kind): v.astype(dtype)
           for k, v in tree_flatten(head.trainable_parameters())}
    if head.vocab_ids is not None:
        out[PREFIXES[kind] + VOCAB_IDS] = head.vocab_ids.astype(mx.int32)
    return out


def initial_tensors(model: nn.Module, fc: np.ndarray, vocab_ids: np.ndarray,
                    kind: str = "eagle", fuse: np.ndarray | None = None
                    ) -> dict[str, mx.array]:
    """The starting head: the trunk's last layer with zeroed residual outputs, unit input norms,
    the trunk's final norm, and fc from the ridge fit (an eagle head's fc bias starts at 0);
    an eagle3 head's fusion is `fuse` (ridge_fuse) after unit per-depth norms."""
    prefix, parts = PREFIXES[kind], _PARTS[kind]
    trunk = Trunk(model)
    last = trunk.body.layers[-1]
    hidden = int(trunk.body.norm.weight.shape[0])
    out: dict[str, mx.array] = {}
    for k, v in tree_flatten(last.parameters()):
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            v = mx.zeros_like(v)  # the layer starts as the identity on the residual stream
        out[prefix + "layers.0." + k] = v.astype(mx.float32)
    out[prefix + parts["proj"] + ".weight"] = mx.array(fc.astype(np.float32))
    if fuse is not None:
        out.update(fuse_tensors(fuse, hidden, kind))
    if kind in ("eagle", "eagle3"):
        out[prefix + parts["proj"] + ".bias"] = mx.zeros((hidden,))
    out[prefix + parts["norm_embed"] + ".weight"] = mx.ones((hidden,))
    out[prefix + parts["norm_hidden"] + ".weight"] = mx.ones((hidden,))
    out[prefix + parts["final_norm"] + ".weight"] = trunk.body.norm.weight.astype(mx.float32)
    out[prefix + VOCAB_IDS] = mx.array(vocab_ids.astype(np.int32))
    return out


def warm_start_tensors(model_path: Path, model: nn.Module, config: dict[str, Any],
                       sidecar: Path, vocab_ids: np.ndarray, kind: str) -> dict[str, mx.array]:
    """The starting head from an earlier trained head (any kind, e.g. the qwen-named first
    head): its weights under this kind's names, a zero fc bias where the kind has one, a
    fusion that passes only the last layer's output through the trunk's final norm where an
    eagle3 head starts from one that fuses nothing (so it starts as that head exactly), and the
    new draft vocabulary (the lm_head rows are the trunk's, so the vocabulary is free to
    change). Training then goes on from what the earlier head learnt."""
    old = load_mtp_head(model_path, model, config, sidecar=Path(sidecar))
    if old is None:
        raise HeadError(f"{sidecar} holds no drafting head")
    out = {_to_file_name(k, kind): v.astype(mx.float32)
           for k, v in tree_flatten(old.trainable_parameters())}
    prefix = PREFIXES[kind]
    if kind == "eagle3" and prefix + "fuse.weight" not in out:
        out.update(_last_layer_fusion(model, kind))
    if kind in ("eagle", "eagle3") and prefix + "fc.bias" not in out:
        out[prefix + "fc.bias"] = mx.zeros((old.proj.weight.shape[0],))
    out[prefix + VOCAB_IDS] = mx.array(vocab_ids.astype(np.int32))
    return out


def _last_layer_fusion(model: nn.Module, kind: str) -> dict[str, mx.array]:
    """An eagle3 fusion that reads only the last of its layers (fused_layers: the trunk's last
    layer) and norms it with the trunk's final norm: its output is the trunk's final feature,
    what an eagle head reads. The other depths start at zero weight in `fuse`."""
    trunk = Trunk(model)
    norm_w = trunk.body.norm.weight.astype(mx.float32)
    hidden = int(norm_w.shape[0])
    prefix = PREFIXES[kind]
    fuse = mx.concatenate([mx.zeros((hidden, 2 * hidden)), mx.eye(hidden)], axis=1)
    norms = mx.concatenate([mx.ones((2, hidden)), norm_w[None]], axis=0)
    return {prefix + "fuse.weight": fuse, prefix + "fuse_norm.weight": norms}


def fuse_tensors(fuse: np.ndarray, hidden: int, kind: str) -> dict[str, mx.array]:
    """An eagle3 head's fusion tensors: unit per-depth norms and the fitted `fuse` [H, n H]."""
    prefix = PREFIXES[kind]
    return {prefix + "fuse.weight": mx.array(fuse.astype(np.float32)),
            prefix + "fuse_norm.weight": mx.ones((fuse.shape[1] // hidden, hidden))}


def ridge_fuse(shards: list[dict[str, np.ndarray]], eps: float, max_rows: int = 60_000,
               lam: float = 1.0) -> np.ndarray:
    """fuse [H, n H] minimising |fuse [n(l_1); ...; n(l_n)] - n(h)|^2 + lam |fuse|^2 over the
    shards' generated rows: the fused layers (each depth normed) start as a linear guess of the
    trunk's final feature, so an eagle3 head starts where an eagle head would."""
    xs, ys, rows = [], [], 0
    hidden = int(shards[0]["hidden"].shape[-1])
    for s in shards:
        for b in range(s["tokens"].shape[0]):
            n = min(int(s["ends"][b]), s["tokens"].shape[1])
            deep = s["layers"][b, :n].astype(np.float32)
            parts = deep.reshape(n, -1, hidden)
            xs.append(_rms(parts, eps).reshape(n, -1))
            ys.append(_rms(s["hidden"][b, :n].astype(np.float32), eps))
            rows += n
            if rows >= max_rows:
                break
        if rows >= max_rows:
            break
    x, y = np.concatenate(xs), np.concatenate(ys)
    gram = (x.T @ x).astype(np.float64) + lam * np.eye(x.shape[1])
    w = np.linalg.solve(gram, (x.T @ y).astype(np.float64))  # [n H, H]
    return w.T.astype(np.float32)


def _rms(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)


def ridge_fc(model: nn.Module, shards: list[dict[str, np.ndarray]], eps: float,
             max_rows: int = 60_000, lam: float = 1.0) -> np.ndarray:
    """fc [H, 2H] minimising |fc [n(e_{t+1}); n(h_t)] - z_{t+1}|^2 + lam |fc|^2, where z is the
    trunk's next hidden state before its final norm's weight (the head's final norm is the
    trunk's, so the initial head predicts as the trunk would from the fitted state)."""
    trunk = Trunk(model)
    embed = np.array(trunk.embed_tokens.weight.astype(mx.float32))
    norm_w = np.array(trunk.body.norm.weight.astype(mx.float32))
    safe = np.where(np.abs(norm_w) < 1e-3, 1e-3, norm_w)
    xs, ys, rows = [], [], 0
    for s in shards:
        for b in range(s["tokens"].shape[0]):
            end = int(s["ends"][b])
            n = min(end, s["tokens"].shape[1]) - 1
            if n < 1:
                continue
            h = s["hidden"][b, :n].astype(np.float32)
            e = embed[s["tokens"][b, 1:n + 1]]
            xs.append(np.concatenate([_rms(e, eps), _rms(h, eps)], -1))
            ys.append(s["hidden"][b, 1:n + 1].astype(np.float32) / safe)
            rows += n
            if rows >= max_rows:
                break
        if rows >= max_rows:
            break
    x, y = np.concatenate(xs), np.concatenate(ys)
    y = _rms(y, eps)  # scale-free target: the final norm removes the scale anyway
    gram = (x.T @ x).astype(np.float64) + lam * np.eye(x.shape[1])
    w = np.linalg.solve(gram, (x.T @ y).astype(np.float64))  # [2H, H]
    return w.T.astype(np.float32)


def kept_vocab(sidecar: Path, shards: list[dict[str, np.ndarray]], vocab_size: int
               ) -> tuple[np.ndarray, float]:
    """An earlier head's draft vocabulary (`--keep-vocab`) and its coverage of these shards'
    greedy targets."""
    ids = next((np.array(v) for k, v in mx.load(str(sidecar)).items()
                if k.endswith("." + VOCAB_IDS)), None)
    if ids is None:
        raise HeadError(f"{sidecar} has no draft vocabulary to keep")
    counts = np.zeros(vocab_size, np.int64)
    for s in shards:
        top1 = s["top_ids"][..., 0]
        for b in range(top1.shape[0]):
            np.add.at(counts, top1[b, :int(s["ends"][b])], 1)
    ids = np.sort(ids.astype(np.int32))
    return ids, float(counts[ids].sum() / max(int(counts.sum()), 1))


def choose_vocab(shards: list[dict[str, np.ndarray]], coverage: float, vocab_size: int,
                 eos: set[int], fixed: int = 0) -> tuple[np.ndarray, float]:
    """The most frequent greedy targets covering `coverage` of the training rows (or `fixed`
    of them), in multiples of 256; EOS always included. Returns (sorted ids, coverage)."""
    counts = np.zeros(vocab_size, np.int64)
    for s in shards:
        top1 = s["top_ids"][..., 0]
        for b in range(top1.shape[0]):
            np.add.at(counts, top1[b, :int(s["ends"][b])], 1)
    order = np.argsort(-counts, kind="stable")
    total = max(int(counts.sum()), 1)
    if fixed:
        k = min(fixed, vocab_size)
    else:
        cum = np.cumsum(counts[order]) / total
        k = int(np.searchsorted(cum, coverage) + 1)
        k = min(vocab_size, max(256, int(math.ceil(k / 256) * 256)))
    ids = set(order[:k].tolist()) | {e for e in eos if e < vocab_size}
    ids_arr = np.array(sorted(ids), np.int32)
    return ids_arr, float(counts[ids_arr].sum() / total)
