"""Train a drafting head (a sidecar) for a model that has none, by self-distillation, trunk frozen.

Usage::

    python tools/train_sidecar.py --model ID|DIR --out DIR [--minutes 30] [--steps N] [--resume]
        [--kind eagle|qwen] [--data broad|stdlib] [--init-from SIDECAR]

What it trains (the README's "MTP sidecars"; read by skulkp2p.engine.drafting.mtp_head.load_mtp_head): by
default an EAGLE-style head (``--kind eagle``, tensors ``eagle.*``: fc with a bias, one decoder
layer of the trunk's own family, final norm, reduced vocabulary), or the first head's layout in
qwen naming ``mtp.*`` (``--kind qwen``, no fc bias). Either way: from the trunk's hidden state
h_t (after its final norm) and the embedding of token t+1, predict what the trunk itself
predicts for t+2. The targets are the trunk's top-k distribution at t+1, so the head learns
what the verifier accepts.

How (the lessons of the first attempt):

1. Data: the model's own answers, in batches, in float32 through our own trunk (so the features
   are what serving computes; measured on this 2-core CPU, this batched generation with features
   ran at 275 tok/s at batch 64 against llama-server's 251 tok/s with 32 slots on the Q4_1 GGUF,
   which would still need a feature pass). ``--data broad`` (default): the chat prompt list of
   tools/sidecar_prompts.py (questions, explanations, instructions, stories, poems, letters,
   code), half the batches answered greedily and half sampled (``--sample-share``,
   ``--temperature``); held out: its separate hand-written prompts of another style, answered
   greedily one at a time (equal-length batches would cut their content). ``--data stdlib``: the
   first head's prompts, built from Python stdlib docstrings/source and /usr/share/doc texts, one
   source file in ten held out. Training rows are mostly generated text: what the head drafts on.
2. A reduced draft vocabulary: the K most frequent target tokens (covering --coverage of the
   training targets). The head scores K rows of the shared lm_head, so a draft costs a small
   fraction of a trunk step; it stays exact because the verifier decides every token.
3. A head that starts close to right (or from an earlier head, ``--init-from``): the decoder
   layer is a copy of the trunk's last layer with its residual output projections (o_proj,
   down_proj) zeroed, so it starts as the identity; the final norm is the trunk's; fc is the
   ridge-regression solution mapping [norm(embed(x_{t+1})), norm(h_t)] to the trunk's next
   hidden state, so the initial head already predicts x_{t+2} as a linear model would instead
   of starting from a large loss.
4. Loss: cross-entropy against the trunk's top-k distribution at t+1 (over the draft vocabulary)
   plus a feature term pulling the head's normed output towards the trunk's h_{t+1}, which is what
   the head is fed back at depth > 1 (EAGLE's lesson).
5. Held-out acceptance is measured by replaying the held-out generations through the engine's
   own decode loop and MtpDrafter (the trunk's stored outputs stand in for the verifier): per
   position at depths 1-3, beside the baseline of a (token, token) -> next-label table.

The run is bounded (--minutes, shared between generation and training), shows progress, and is
resumable (--resume): generated shards and a checkpoint (head + optimizer + step) live in
OUT/.train/. The result is OUT/mtp.safetensors (bf16, the shared lm_head is not stored) and
OUT/mtp.provenance.toml.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import json
import math
import random
import re
import shutil
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `skulkp2p` and `tools` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if __name__ == "__main__":  # before mlx loads: the fast float32 path on Linux CPUs
    from skulkp2p.engine.cpu import blas

    blas.ensure_fast_blas()

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten, tree_unflatten  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from skulkp2p.engine.decode.loop import DecodeStats, decode  # noqa: E402
from skulkp2p.engine.decode.sampling import SamplingParams, make_rng  # noqa: E402
from skulkp2p.engine.drafting.mtp_conventions import _PARTS, VOCAB_IDS  # noqa: E402
from skulkp2p.engine.drafting.mtp_drafter import MtpDrafter  # noqa: E402
from skulkp2p.engine.drafting.mtp_head import MtpHead, load_mtp_head  # noqa: E402
from skulkp2p.engine.model.trunk import Trunk  # noqa: E402
from skulkp2p.progress import ProgressBar  # noqa: E402
from tools.publish_sidecar import sha256_file, write_sidecar  # noqa: E402

# Tensor prefix per kind of head: "eagle" (the default) or the first head's qwen naming.
PREFIXES = {"eagle": "eagle.", "qwen": "mtp."}
TOP_K = 8  # teacher distribution kept per position
PROMPT_ROW_WEIGHT = 0.5  # rows inside the prompt count less: drafts happen on generated text
GEN_SHARE = 0.5  # of the time budget spent generating (the rest: init, training, evaluation)
EVAL_SHARE = 0.15  # kept back for the held-out replay and writing
CHECKPOINT_EVERY_S = 60.0
DATA_NOTES = {  # the provenance's word on where the training text came from
    "broad": "float32 generations of the base, greedy and sampled ({share:.0%} of batches, "
             "temperature {t}), answering the broad chat prompt list of "
             "tools/sidecar_prompts.py; held out: its separate hand-written prompts of another "
             "style, answered greedily",
    "stdlib": "float32 generations of the base, greedy and sampled ({share:.0%} of batches, "
              "temperature {t}), from prompts built from Python stdlib docstrings/source and "
              "/usr/share/doc texts; 1 in 10 source files held out",
}


# --- offline text and prompts ------------------------------------------------------------------


@dataclass(frozen=True)
class Snippet:
    source: str  # file it came from (decides the train / held-out split)
    kind: str  # "doc" | "code" | "text"
    name: str
    text: str


def _stdlib_snippets(limit_files: int | None) -> list[Snippet]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if not {"test", "tests", "site-packages", "idlelib", "lib2to3"}
                   & set(p.relative_to(root).parts))
    out: list[Snippet] = []
    for path in files[:limit_files]:
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = path.relative_to(root).with_suffix("").as_posix().replace("/", ".")
        for node in ast.walk(tree):
            if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef):
                continue
            name = module if isinstance(node, ast.Module) else f"{module}.{node.name}"
            doc = ast.get_docstring(node)
            if doc and 80 <= len(doc) <= 1500:
                out.append(Snippet(str(path), "doc", name, doc))
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                seg = ast.get_source_segment(text, node)
                if seg and 4 <= seg.count("\n") <= 30 and len(seg) <= 1500:
                    out.append(Snippet(str(path), "code", name, seg))
    return out


def _doc_snippets(limit_files: int | None) -> list[Snippet]:
    root = Path("/usr/share/doc")
    if not root.is_dir():
        return []
    files = sorted(p for p in root.glob("*/*") if p.is_file() and re.match(
        r"(?i)(readme|news|changelog\.Debian|.*\.txt)", p.name))
    out: list[Snippet] = []
    for path in files[:limit_files]:
        try:
            raw = path.read_bytes()
            if path.suffix == ".gz":
                raw = gzip.decompress(raw)[:200_000]
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
            continue
        for para in re.split(r"\n\s*\n", text):
            para = para.strip()
            if 120 <= len(para) <= 1200 and sum(c.isalpha() for c in para) > 0.6 * len(para):
                out.append(Snippet(str(path), "text", path.parent.name, para))
    return out


_DOC_TASKS = (
    "Explain this Python documentation in simple words:\n\n{text}",
    "Summarize the following in a few sentences:\n\n{text}",
    "What is `{name}` used for? Here is its documentation:\n\n{text}",
    "Write a short Python example that uses `{name}`.",
    "Answer in one paragraph: what does `{name}` do?",
)
_CODE_TASKS = (
    "Add a docstring and type hints to this function:\n\n```python\n{text}\n```",
    "Explain what this code does:\n\n```python\n{text}\n```",
    "Rename the variables in this function to be more descriptive:\n\n```python\n{text}\n```",
    "Is there a bug in this function? Answer and show the fixed code.\n\n```python\n{text}\n```",
    "Rewrite this function to be shorter:\n\n```python\n{text}\n```",
)
_TEXT_TASKS = (
    "Summarize this text:\n\n{text}",
    "Explain this to a beginner:\n\n{text}",
    "Write three questions a reader might ask about this text, and answer them:\n\n{text}",
    "Rewrite this more clearly:\n\n{text}",
)
RAW_SHARE = 0.15  # plain continuations (no chat template)
CONTENT_CHARS = 700


def build_prompts(tokenizer: Any, seed: int, limit_files: int | None = None
                  ) -> tuple[list[list[int]], list[list[int]], dict[str, int]]:
    """(train prompts, held-out prompts, counts) as token lists. The split is by source file
    (one in ten files is held out), so held-out prompts are about things training never saw."""
    rng = random.Random(seed)
    snippets = _stdlib_snippets(limit_files) + _doc_snippets(limit_files)
    rng.shuffle(snippets)
    chat = bool(getattr(tokenizer, "chat_template", None))
    train: list[list[int]] = []
    held: list[list[int]] = []
    for s in snippets:
        text = s.text[:CONTENT_CHARS]
        if not chat or rng.random() < RAW_SHARE:
            ids = tokenizer.encode(text)
        else:
            tasks = {"doc": _DOC_TASKS, "code": _CODE_TASKS, "text": _TEXT_TASKS}[s.kind]
            content = rng.choice(tasks).format(text=text, name=s.name)
            ids = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict):
                ids = ids["input_ids"]
        bucket = int(hashlib.sha1(s.source.encode()).hexdigest(), 16) % 10
        (held if bucket == 0 else train).append(list(ids))
    counts = {"snippets": len(snippets), "train_prompts": len(train), "heldout_prompts": len(held)}
    return train, held, counts


def _chat_ids(tokenizer: Any, content: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                        add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def build_broad_prompts(tokenizer: Any, seed: int
                        ) -> tuple[list[list[int]], list[list[int]], dict[str, int]]:
    """(train prompts, held-out prompts, counts) from tools/sidecar_prompts.py: the broad chat
    list for training, the separate hand-written set of another style for the measurement."""
    from tools.sidecar_prompts import HELDOUT_PROMPTS, train_prompts
    texts = train_prompts(seed)
    overlap = set(texts) & set(HELDOUT_PROMPTS)
    if overlap:
        raise SystemExit(f"train_sidecar: held-out prompts in the training list: {overlap}")
    train = [_chat_ids(tokenizer, t) for t in texts]
    held = [_chat_ids(tokenizer, t) for t in HELDOUT_PROMPTS]
    return train, held, {"train_prompts": len(train), "heldout_prompts": len(held)}


def build_terse_prompts(tokenizer: Any, seed: int, count: int) -> list[list[int]]:
    """`count` messages of short numbered questions asking for terse answers
    (tools/sidecar_prompts.terse_prompts), as token lists; none shares a question with the
    held-out set."""
    from tools.sidecar_prompts import HELDOUT_PROMPTS, TERSE_QUESTIONS, terse_prompts
    leaked = [q for q in TERSE_QUESTIONS if any(q in h for h in HELDOUT_PROMPTS)]
    if leaked:
        raise SystemExit(f"train_sidecar: held-out questions in the terse list: {leaked}")
    return [_chat_ids(tokenizer, t) for t in terse_prompts(seed, count)]


def _tail_length(tokenizer: Any) -> int:
    """Tokens the chat template puts after the user's content (end of turn, assistant header):
    equalising prompt lengths cuts content, never these."""
    if not getattr(tokenizer, "chat_template", None):
        return 0
    a, b = (tokenizer.apply_chat_template([{"role": "user", "content": c}],
                                          add_generation_prompt=True, tokenize=True)
            for c in ("alpha", "omega"))
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


def _length_groups(prompts: list[list[int]], batch: int, tail: int
                   ) -> tuple[list[list[int]], list[int]]:
    """Indices of `prompts` in groups of `batch` of near-equal length (sorted by length), and
    the indices left over (the longest, too few for one more group); prompts too short to cut
    are in neither."""
    order = sorted((i for i, p in enumerate(prompts) if len(p) > tail + 4),
                   key=lambda i: len(prompts[i]))
    full = len(order) - len(order) % batch
    return [order[i:i + batch] for i in range(0, full, batch)], order[full:]


def _cut(group: list[list[int]], max_len: int, tail: int) -> list[list[int]]:
    """A batch cut to its shortest member by dropping content tokens just before the template
    tail."""
    n = min(min(len(p) for p in group), max_len)
    return [p[:n - tail] + p[len(p) - tail:] if tail else p[:n] for p in group]


def batches_of(prompts: list[list[int]], batch: int, max_len: int, tail: int
               ) -> list[list[list[int]]]:
    """Equal-length batches (batched decoding needs no padding then): sorted by length, each
    batch cut to its shortest member by dropping content tokens just before the template tail."""
    groups, _ = _length_groups(prompts, batch, tail)
    return [_cut([prompts[i] for i in g], max_len, tail) for g in groups]


def terse_batches(prompts: list[list[int]], bounds: list[int], batch: int, max_len: int,
                  tail: int, seed: int) -> list[list[list[int]]]:
    """The terse list's batches when it was extended to each count in `bounds` in turn (the
    first run's --terse, then each larger one): a round batches only the messages it added (and
    those the rounds before left over), sorted by length within itself, shuffled with a seed of
    its own. So a larger --terse appends batches of new messages after the ones already made,
    which stay as they were; re-sorting the whole list would mix answered messages into the
    new batches. A one-round list is batched as before rounds existed (work folders made then
    keep their shards)."""
    out: list[list[list[int]]] = []
    carried: list[int] = []
    start = 0
    for r, end in enumerate(bounds):
        pool = carried + list(range(start, min(end, len(prompts))))
        groups, left = _length_groups([prompts[i] for i in pool], batch, tail)
        made = [_cut([prompts[pool[i]] for i in g], max_len, tail) for g in groups]
        random.Random(seed + 2 + 1000 * r).shuffle(made)
        out += made
        carried, start = [pool[i] for i in left], max(start, end)
    return out


def terse_bounds(manifest: Path, count: int, shards_made: bool) -> list[int]:
    """The counts the terse list was extended to so far, with `count` added when larger, kept
    in `manifest` (the work folder's terse.json)."""
    if manifest.exists():
        bounds = [int(b) for b in json.loads(manifest.read_text())["bounds"]]
    elif shards_made:
        raise SystemExit(f"train_sidecar: train-terse shards in {manifest.parent} but no "
                         f"{manifest.name} saying which --terse made them; write "
                         '{"bounds": [N]} there (N: that run\'s --terse) or remove the shards')
    else:
        bounds = []
    if not bounds or count > bounds[-1]:
        bounds.append(count)
        manifest.write_text(json.dumps({"bounds": bounds}))
    return bounds


# --- generation: the trunk's own greedy answers, with its hidden states and top-k ---------------


def generate_shard(model: nn.Module, prompts: list[list[int]], gen_tokens: int,
                   eos: set[int], deadline: float | None = None,
                   temperature: float = 0.0) -> dict[str, np.ndarray]:
    """Continuations of equal-length prompts, batched, float32: greedy, or sampled at
    `temperature` (more varied text; the targets stay the trunk's top-k at every position,
    which is what the verifier decides by). Returns, per sample and position: tokens, the hidden
    state after the final norm, the trunk's top-k logits; `ends` is the first EOS position (or
    the length). Past `deadline` (time.monotonic) the answers are cut short: a batch takes
    minutes on a busy CPU and must not overrun the budget."""
    trunk = Trunk(model)
    cache = make_prompt_cache(model)
    batch, plen = len(prompts), len(prompts[0])
    hidden, top_ids, top_vals, tokens = [], [], [], [mx.array(prompts, dtype=mx.int32)]

    def step(x: mx.array) -> mx.array:
        h = trunk.body(x, cache)
        logits = trunk.head(h).astype(mx.float32)
        ids = mx.argpartition(-logits, TOP_K - 1, axis=-1)[..., :TOP_K]
        vals = mx.take_along_axis(logits, ids, -1)
        order = mx.argsort(-vals, axis=-1)  # top-1 first: it is the greedy token
        ids, vals = mx.take_along_axis(ids, order, -1), mx.take_along_axis(vals, order, -1)
        mx.eval(h, ids, vals)
        hidden.append(np.array(h.astype(mx.float16)))
        top_ids.append(np.array(ids.astype(mx.int32)))
        top_vals.append(np.array(vals.astype(mx.float16)))
        if temperature > 0:
            return mx.random.categorical(logits[:, -1] / temperature)[:, None].astype(mx.int32)
        return ids[:, -1:, 0]

    nxt = step(tokens[0])
    for i in range(gen_tokens):
        tokens.append(nxt)
        nxt = step(nxt)  # the last step gives the final token's hidden state and targets too
        if i % 16 == 15:
            seen = np.concatenate([np.array(t) for t in tokens[1:]], axis=1)
            if all(any(int(x) in eos for x in row) for row in seen):
                break
            if deadline is not None and time.monotonic() > deadline:
                break
    toks = np.concatenate([np.array(t) for t in tokens], axis=1).astype(np.int32)
    ends = np.full(batch, toks.shape[1], np.int32)
    for b in range(batch):
        hits = [j for j in range(plen, toks.shape[1]) if int(toks[b, j]) in eos]
        if hits:
            ends[b] = hits[0]
    return {"tokens": toks, "hidden": np.concatenate(hidden, axis=1),
            "top_ids": np.concatenate(top_ids, axis=1),
            "top_vals": np.concatenate(top_vals, axis=1),
            "prompt_len": np.array(plen, np.int32), "ends": ends,
            "temperature": np.array(temperature, np.float32)}


# --- the head -----------------------------------------------------------------------------------


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
                    kind: str = "eagle") -> dict[str, mx.array]:
    """The starting head: the trunk's last layer with zeroed residual outputs, unit input norms,
    the trunk's final norm, and fc from the ridge fit (an eagle head's fc bias starts at 0)."""
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
    if kind == "eagle":
        out[prefix + parts["proj"] + ".bias"] = mx.zeros((hidden,))
    out[prefix + parts["norm_embed"] + ".weight"] = mx.ones((hidden,))
    out[prefix + parts["norm_hidden"] + ".weight"] = mx.ones((hidden,))
    out[prefix + parts["final_norm"] + ".weight"] = trunk.body.norm.weight.astype(mx.float32)
    out[prefix + VOCAB_IDS] = mx.array(vocab_ids.astype(np.int32))
    return out


def warm_start_tensors(model_path: Path, model: nn.Module, config: dict[str, Any],
                       sidecar: Path, vocab_ids: np.ndarray, kind: str) -> dict[str, mx.array]:
    """The starting head from an earlier trained head (any kind, e.g. the qwen-named first
    head): its weights under this kind's names, a zero fc bias where the kind has one, and the
    new draft vocabulary (the lm_head rows are the trunk's, so the vocabulary is free to
    change). Training then goes on from what the earlier head learnt."""
    old = load_mtp_head(model_path, model, config, sidecar=Path(sidecar))
    if old is None:
        raise SystemExit(f"train_sidecar: {sidecar} holds no drafting head")
    out = {_to_file_name(k, kind): v.astype(mx.float32)
           for k, v in tree_flatten(old.trainable_parameters())}
    prefix = PREFIXES[kind]
    if kind == "eagle" and prefix + "fc.bias" not in out:
        out[prefix + "fc.bias"] = mx.zeros((old.proj.weight.shape[0],))
    out[prefix + VOCAB_IDS] = mx.array(vocab_ids.astype(np.int32))
    return out


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


# --- training -----------------------------------------------------------------------------------


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


# --- held-out acceptance: replay through the engine's own decode loop --------------------------


class ReplayForward:
    """A Forward over a stored greedy generation: the verifier's rows are the trunk's recorded
    top-1 and hidden states, so decode() with an MtpDrafter counts exactly the acceptance the
    engine would see on that text (at the drafter's position in it)."""

    def __init__(self, tokens: np.ndarray, hidden: np.ndarray, top1: np.ndarray, vocab: int):
        self.hidden = "after"
        self.tokens, self.h, self.top1, self.vocab = tokens, hidden, top1, vocab
        self.offset = 0
        self.last_hidden: mx.array | None = None

    def prefill(self, tokens: list[int]) -> None:
        self.offset = len(tokens)
        self.last_hidden = mx.array(self.h[:self.offset].astype(np.float32))

    def __call__(self, tokens: list[int]) -> mx.array:
        pos = np.arange(self.offset, self.offset + len(tokens))
        rows = np.zeros((len(tokens), self.vocab), np.float32)
        rows[np.arange(len(tokens)), self.top1[pos]] = 1.0
        self.last_hidden = mx.array(self.h[pos].astype(np.float32))
        self.offset += len(tokens)
        return mx.array(rows)

    def rollback(self, keep: int, dropped: int) -> None:
        self.offset -= dropped


def heldout_acceptance(head: MtpHead, shards: list[dict[str, np.ndarray]], vocab: int,
                       max_tokens: int | None = None, depths: tuple[int, ...] = (1, 2, 3),
                       context_bias: float = 0.0) -> dict[str, Any]:
    """Per-position acceptance at each of `depths` over the held-out generations (the drafter
    with this `context_bias`, the card's mtp_context_bias)."""
    result: dict[str, Any] = {}
    for depth in depths:
        stats = DecodeStats()
        emitted = 0
        for s in shards:
            plen = int(s["prompt_len"])
            for b in range(s["tokens"].shape[0]):
                end = int(s["ends"][b])
                n_gen = min(end + 1, s["tokens"].shape[1]) - plen
                if n_gen < 2:
                    continue
                fwd = ReplayForward(s["tokens"][b], s["hidden"][b], s["top_ids"][b, :, 0], vocab)
                prompt = [int(t) for t in s["tokens"][b, :plen]]
                out = list(decode(fwd, prompt, SamplingParams(), n_gen, make_rng(0),
                                  MtpDrafter(head, context_bias=context_bias), depth, stats))
                want = [int(t) for t in s["tokens"][b, plen:plen + n_gen]]
                if out != want:
                    raise RuntimeError("replay diverged from the stored generation")
                emitted += len(out)
                if max_tokens and emitted >= max_tokens:
                    break
            if max_tokens and emitted >= max_tokens:
                break
        per = [round(a / d, 4) if d else 0.0 for a, d in zip(stats.accepted_at, stats.drafted_at,
                                                               strict=True)]
        result[f"depth{depth}"] = {
            "per_position": per,
            "rounds": stats.rounds,
            "tokens_per_round": round(emitted / max(stats.rounds, 1), 4),
        }
    return result


def pair_table_baseline(train: list[dict[str, np.ndarray]], held: list[dict[str, np.ndarray]]
                        ) -> float:
    """The baseline: the most frequent next label per (x_t, x_{t+1}) pair, learnt on the
    training generations, scored on the held-out generated positions (a miss when unseen)."""
    from collections import Counter, defaultdict
    table: dict[tuple[int, int], Counter] = defaultdict(Counter)
    for s in train:
        for b in range(s["tokens"].shape[0]):
            toks, top1, end = s["tokens"][b], s["top_ids"][b, :, 0], int(s["ends"][b])
            for t in range(end - 1):
                table[int(toks[t]), int(toks[t + 1])][int(top1[t + 1])] += 1
    best = {k: c.most_common(1)[0][0] for k, c in table.items()}
    hits = total = 0
    for s in held:
        plen = int(s["prompt_len"])
        for b in range(s["tokens"].shape[0]):
            toks, top1, end = s["tokens"][b], s["top_ids"][b, :, 0], int(s["ends"][b])
            for t in range(plen - 2, end - 1):
                total += 1
                hits += int(best.get((int(toks[t]), int(toks[t + 1]))) == int(top1[t + 1]))
    return hits / max(total, 1)


# --- the run ------------------------------------------------------------------------------------


def _resolve_model(spec: str, data_dir: Path | None) -> tuple[str, Path]:
    path = Path(spec).expanduser()
    if path.is_dir():
        return path.name, path
    from skulkp2p.models.store import ModelStore
    store = ModelStore(data_dir) if data_dir else ModelStore()
    resolved = store.resolve(spec)
    return resolved.id, store.pull(spec, progress=lambda label: ProgressBar(label, sys.stderr))


def _save_shard(path: Path, shard: dict[str, np.ndarray]) -> None:
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **shard)
    tmp.replace(path)


def _load_shards(work: Path, kind: str) -> list[dict[str, np.ndarray]]:
    return [dict(np.load(p)) for p in sorted(work.glob(f"{kind}-*.npz"))]


def _temperatures(shards: list[dict[str, np.ndarray]], default: float) -> str:
    """The sampling temperatures the shards were generated at (a resumed generation may use
    another one), e.g. "0.6 and 0.8"; shards that do not record theirs count as `default`."""
    temps = sorted({float(s["temperature"]) if "temperature" in s else default
                    for s in shards} - {0.0})
    return " and ".join(f"{t:g}" for t in temps) or f"{default:g}"


def _log(msg: str) -> None:
    print(f"train_sidecar: {msg}", file=sys.stderr, flush=True)


def train(args: argparse.Namespace) -> Path:
    t_start = time.monotonic()
    budget = args.minutes * 60.0
    out = Path(args.out)
    work = out / ".train"
    if work.exists() and not args.resume:
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    model_id, model_path = _resolve_model(args.model, args.data_dir)
    from skulkp2p.engine.model.loaded import load_model
    lm = load_model(model_path, model_id, dtype="float32")
    config = json.loads((model_path / "config.json").read_text())
    if config.get("quantization"):
        raise SystemExit("train_sidecar: train on a full-precision base (the sidecar is "
                         "quantised on load beside a quantised one)")
    vocab = int(Trunk(lm.model).embed_tokens.weight.shape[0])
    eps = float(config.get("rms_norm_eps", 1e-6))
    eos = set(int(e) for e in lm.tokenizer.eos_token_ids)

    # 1. prompts and generations (held-out first: it is needed whatever the budget)
    if args.data == "broad":
        train_p, held_p, counts = build_broad_prompts(lm.tokenizer, args.seed)
    else:
        train_p, held_p, counts = build_prompts(lm.tokenizer, args.seed, args.limit_files)
    tail = _tail_length(lm.tokenizer)
    # Batches are length buckets: shuffle them, so neither set is only the shortest prompts.
    # Held-out batches of 1 keep every prompt whole (equal-length batches cut content).
    held_b = batches_of(held_p, args.heldout_batch or args.batch, args.prompt_tokens, tail)
    random.Random(args.seed + 1).shuffle(held_b)
    held_b = held_b[:args.heldout_batches or None]
    train_b = batches_of(train_p, args.batch, args.prompt_tokens, tail)
    random.Random(args.seed).shuffle(train_b)
    if args.max_batches:
        train_b = train_b[:args.max_batches]
    skip = set(args.skip_batches)
    if any(not 0 <= i < len(train_b) for i in skip):
        raise SystemExit(f"train_sidecar: --skip-batches must be below {len(train_b)} "
                         f"(the training batches), got {sorted(skip)}")
    made = [i for i in sorted(skip) if (work / f"train-{i:04d}.npz").exists()]
    if made:
        raise SystemExit(f"train_sidecar: --skip-batches {made} already answered in {work} "
                         f"(train-{made[0]:04d}.npz): a skipped batch must stay out of training")
    # Terse numbered answers (--terse) are a list of their own, in shards train-terse-*: adding
    # them leaves the broad list's batches, and so the shards already generated, as they were.
    terse_b: list[list[list[int]]] = []
    if args.terse:
        if args.data != "broad":
            raise SystemExit("train_sidecar: --terse goes with --data broad")
        # A larger --terse than before adds batches of the messages not yet answered.
        bounds = terse_bounds(work / "terse.json", args.terse, any(work.glob("train-terse-*")))
        terse_b = terse_batches(build_terse_prompts(lm.tokenizer, args.seed, bounds[-1]),
                                bounds, args.batch, args.prompt_tokens, tail, args.seed)
        counts["terse_prompts"] = bounds[-1]
    if not held_b or not train_b:
        raise SystemExit("train_sidecar: too few prompts for one batch; lower --batch")
    gen_deadline = t_start + budget * args.gen_share
    # Generation runs until its share of the time is spent (or the prompts run out): the bar
    # shows the larger of the two fractions.
    bar = ProgressBar("generating", sys.stderr)
    # The terse batches come before the rest of the broad list: a resumed run with --terse
    # spends its generation time on them first.
    jobs = [("heldout", i, b) for i, b in enumerate(held_b)] + \
           [("train-terse", i, b) for i, b in enumerate(terse_b)] + \
           [("train", i, b) for i, b in enumerate(train_b)]
    for j, (kind, i, prompts) in enumerate(jobs):
        path = work / f"{kind}-{i:04d}.npz"
        if path.exists():
            continue
        if kind == "train" and i in skip:
            continue  # held for validation (tools/validation_shards.py): never trained on
        training = kind != "heldout"
        if training and time.monotonic() > gen_deadline and any(work.glob("train-*")):
            break
        deadline = gen_deadline if training else None
        # Training batches alternate greedy and sampled answers (--sample-share of them
        # sampled, by batch index); held-out answers are greedy, as the bench decodes.
        sampled = training and int((i + 1) * args.sample_share) > int(i * args.sample_share)
        temperature = args.temperature if sampled else 0.0
        # A batch's samples do not depend on resuming (terse batches draw from seeds of their own).
        mx.random.seed(args.seed * 100_003 + i + (50_000 if kind == "train-terse" else 0))
        _save_shard(path, generate_shard(lm.model, prompts, args.gen_tokens, eos, deadline,
                                         temperature))
        spent = (time.monotonic() - t_start) / max(gen_deadline - t_start, 1e-9)
        bar(max(int(1000 * spent), int(1000 * (j + 1) / len(jobs))), 1000)
        _log(f"{kind} batch {i}: {len(prompts)} x {len(prompts[0])} prompt tokens, "
             f"{time.monotonic() - t_start:.0f}s")
    bar(1, 1)
    if args.generate_only:
        _log(f"generated; {time.monotonic() - t_start:.0f}s")
        return work
    held = _load_shards(work, "heldout")
    shards = _load_shards(work, "train")
    gen_rows = sum(int(np.minimum(s["ends"], s["tokens"].shape[1]).sum()) for s in shards)
    _log(f"{len(shards)} training shards ({gen_rows} rows), {len(held)} held-out shards, "
         f"{time.monotonic() - t_start:.0f}s")

    # 2. the starting head (or the checkpoint)
    ckpt, state_file = work / "checkpoint.safetensors", work / "state.json"
    state: dict[str, Any] = json.loads(state_file.read_text()) if (
        args.resume and state_file.exists()) else {}
    if state:
        head_file = ckpt
        vocab_ids = np.array(mx.load(str(ckpt))[PREFIXES[args.kind] + VOCAB_IDS])
        coverage = state["coverage"]
    else:
        vocab_ids, coverage = choose_vocab(shards, args.coverage, vocab, eos, args.vocab)
        head_file = work / "init.safetensors"
        if args.init_from:
            start = warm_start_tensors(model_path, lm.model, config, args.init_from, vocab_ids,
                                       args.kind)
        else:
            start = initial_tensors(lm.model, ridge_fc(lm.model, shards, eps), vocab_ids,
                                    args.kind)
        mx.save_safetensors(str(head_file), start)
    head = load_mtp_head(model_path, lm.model, config, sidecar=head_file)
    head.set_dtype(mx.float32)
    batches = Batches(shards, vocab_ids, vocab, args.train_batch, args.seed + len(state),
                      args.feature_noise)
    acc0, second0 = teacher_forced_accuracy(head, batches, held)
    _log(f"draft vocabulary {len(vocab_ids)} tokens ({coverage:.1%} of training targets); "
         f"held-out teacher-forced accuracy at start: depth-1 {acc0:.1%}, second step "
         f"{second0:.1%}")

    # 3. training
    loss_and_grad = nn.value_and_grad(head, make_loss(args.feat_weight, args.depth2_weight))
    step = int(state.get("step", 0))
    train_deadline = t_start + budget * (1.0 - EVAL_SHARE)
    # Each run has its own time budget: a resumed run starts a new schedule from its step.
    total, start = 0, step
    opt = optim.AdamW(learning_rate=args.lr, weight_decay=0.01)
    opt.init(head.trainable_parameters())
    if state:
        opt.state = tree_unflatten(list(mx.load(str(work / "optimizer.safetensors")).items()))
    bar = ProgressBar("training", sys.stderr)
    last_ckpt = time.monotonic()
    t_train = time.monotonic()
    losses: list[float] = []
    steps_here = 0
    runs: list[str] = list(state.get("runs", []))  # earlier runs of a resumed training

    def this_run() -> str:
        return (f"{args.minutes:g} min budget, {time.monotonic() - t_start:.0f} s, steps "
                f"{start}-{step}, lr {args.lr:g}, {len(shards)} shards")
    while True:
        if args.steps and step >= args.steps:
            break
        if total and step >= total:
            break
        if time.monotonic() > train_deadline and steps_here > 0:
            break
        if not total and steps_here == 5:
            # Fix the schedule's length from the measured step time and the time left.
            per = (time.monotonic() - t_train) / steps_here
            total = step + max(1, int((train_deadline - time.monotonic()) / per))
            if args.steps:
                total = min(total, args.steps)
        span = max((total or args.steps or 1000) - start, 1)
        warm = min(20, max(1, span // 10))
        frac = min((step - start) / span, 1.0)
        opt.learning_rate = args.lr * min(1.0, (step - start + 1) / warm) * (
            0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        (loss, ce), grads = loss_and_grad(head, *batches.sample())
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(head, grads)
        mx.eval(head.trainable_parameters(), opt.state, loss, ce)
        losses.append(float(ce))
        step += 1
        steps_here += 1
        bar(step, max(total or args.steps or step, step))
        if step % 50 == 0:
            acc, second = teacher_forced_accuracy(head, batches, held)
            _log(f"step {step}: ce {np.mean(losses[-50:]):.3f}, held-out teacher-forced "
                 f"depth-1 {acc:.1%}, second step {second:.1%}")
        if time.monotonic() - last_ckpt > CHECKPOINT_EVERY_S:
            _checkpoint(work, head, opt, step, total, start, coverage, runs + [this_run()])
            last_ckpt = time.monotonic()
    bar(1, 1)
    _checkpoint(work, head, opt, step, total, start, coverage, runs + [this_run()])
    train_s = time.monotonic() - t_train

    # 4. held-out acceptance through the real drafter, and the sidecar
    acc1, second1 = teacher_forced_accuracy(head, batches, held)
    acceptance = heldout_acceptance(head, held, vocab, args.eval_tokens)
    baseline = pair_table_baseline(shards, held)
    _log("held-out acceptance per position: " + "; ".join(
        f"depth {d}: {acceptance[f'depth{d}']['per_position']}" for d in (1, 2, 3)) +
        f" (pair-table baseline {baseline:.1%})")
    tensors = head_tensors(head, mx.bfloat16)
    model_files = sorted(model_path.glob("*.safetensors"))
    provenance = {
        "format": "skulkp2p mtp sidecar 1",
        "made_by": "tools/train_sidecar.py",
        "base_model": model_id,
        "model_type": str(config.get("model_type")),
        "licence": "as the base model's",
        "conventions": {
            "style": args.kind, "prefix": PREFIXES[args.kind], "hidden": "after",
            "concat": "embed_first",
            "norm_offset": 0.0, "chain": "after", "zero_first_embed": False, "layers": 1,
            "dtype": "bfloat16", "vocab_ids": len(vocab_ids),
            "shared_lm_head": "not stored: the base's lm_head rows for vocab_ids are used",
        },
        "acceptance": {
            "measured_on": "held-out greedy generations of the base (float32), replayed through "
                           "the engine's decode loop and MtpDrafter",
            "depth1_per_position": acceptance["depth1"]["per_position"],
            "depth2_per_position": acceptance["depth2"]["per_position"],
            "depth3_per_position": acceptance["depth3"]["per_position"],
            "depth3_tokens_per_round": acceptance["depth3"]["tokens_per_round"],
            "teacher_forced_depth1_start": round(acc0, 4),
            "teacher_forced_depth1_end": round(acc1, 4),
            "teacher_forced_second_step_start": round(second0, 4),
            "teacher_forced_second_step_end": round(second1, 4),
            "pair_table_baseline": round(baseline, 4),
        },
        "training": {
            "steps": step, "runs": runs + [this_run()],
            "batch_sequences": args.train_batch, "lr": args.lr,
            "feat_weight": args.feat_weight, "depth2_weight": args.depth2_weight,
            "feature_noise": args.feature_noise,
            "init_from": (f"{args.init_from.name} (sha256 {sha256_file(args.init_from)})"
                          if args.init_from else "ridge fit"),
            "optimizer": "AdamW (wd 0.01), cosine, clip 1.0",
            "train_seconds": round(train_s, 1),
            "total_seconds_this_run": round(time.monotonic() - t_start, 1),
            "minutes_budget": args.minutes, "seed": args.seed,
            "generation_batch": args.batch, "prompt_tokens_max": args.prompt_tokens,
            "gen_tokens": args.gen_tokens, "train_shards": len(shards),
            "heldout_shards": len(held), "train_rows": gen_rows,
            "draft_vocab_coverage": round(coverage, 4),
            "data": DATA_NOTES[args.data].format(share=args.sample_share,
                                                 t=_temperatures(shards, args.temperature)),
            **counts,
        },
        "source": {f.name: {"sha256": sha256_file(f), "bytes": f.stat().st_size}
                   for f in [model_path / "config.json", *model_files]},
    }
    return write_sidecar(out, tensors, provenance,
                         f"MTP head for {model_id} trained by tools/train_sidecar.py")


def _checkpoint(work: Path, head: MtpHead, opt: optim.Optimizer, step: int, total: int,
                start: int, coverage: float, runs: list[str]) -> None:
    mx.save_safetensors(str(work / "checkpoint.tmp.safetensors"), head_tensors(head, mx.float32))
    mx.save_safetensors(str(work / "optimizer.tmp.safetensors"), dict(tree_flatten(opt.state)))
    (work / "checkpoint.tmp.safetensors").replace(work / "checkpoint.safetensors")
    (work / "optimizer.tmp.safetensors").replace(work / "optimizer.safetensors")
    (work / "state.json").write_text(json.dumps({"step": step, "total_steps": total,
                                                 "schedule_start": start,
                                                 "coverage": coverage, "runs": runs}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="card id or model folder (full precision)")
    p.add_argument("--out", required=True, type=Path, help="folder for the sidecar")
    p.add_argument("--minutes", type=float, default=30.0, help="time budget (default 30)")
    p.add_argument("--steps", type=int, default=0, help="stop after this many training steps")
    p.add_argument("--resume", action="store_true", help="continue from OUT/.train/")
    p.add_argument("--data-dir", type=Path, default=None, help="model store (default: user's)")
    p.add_argument("--gen-share", type=float, default=GEN_SHARE,
                   help="share of the budget spent generating data (default %(default)s); a "
                        "resumed run can spend its budget mostly generating, or mostly training")
    p.add_argument("--batch", type=int, default=48, help="sequences per generation batch")
    p.add_argument("--prompt-tokens", type=int, default=112, help="longest prompt")
    p.add_argument("--gen-tokens", type=int, default=160, help="tokens generated per prompt")
    p.add_argument("--heldout-batches", type=int, default=0, help="cap (default: all)")
    p.add_argument("--heldout-batch", type=int, default=1,
                   help="sequences per held-out generation batch (1 keeps prompts whole)")
    p.add_argument("--init-from", type=Path, default=None,
                   help="start from this earlier trained head (sidecar file) instead of the "
                        "ridge-fitted initial head")
    p.add_argument("--kind", choices=tuple(PREFIXES), default="eagle",
                   help="head to train: eagle (default) or the first head's qwen naming")
    p.add_argument("--data", choices=("broad", "stdlib"), default="broad",
                   help="prompts: tools/sidecar_prompts.py (default), or texts from the "
                        "Python stdlib and /usr/share/doc (the first head's data)")
    p.add_argument("--sample-share", type=float, default=0.5,
                   help="share of training batches answered by sampling (default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="temperature of the sampled answers (default %(default)s)")
    p.add_argument("--terse", type=int, default=0,
                   help="also answer this many messages of short numbered questions asking for "
                        "terse answers (tools/sidecar_prompts.terse_prompts), generated before "
                        "the rest of the broad list (default 0)")
    p.add_argument("--generate-only", action="store_true",
                   help="stop after generating the data (continue with --resume)")
    p.add_argument("--max-batches", type=int, default=0, help="cap on training batches")
    p.add_argument("--skip-batches", type=lambda v: [int(x) for x in v.split(",") if x],
                   default=[], metavar="I,J",
                   help="broad-list batches never to answer (their prompts are held for "
                        "validation, e.g. tools/validation_shards.py --batch-index 30)")
    p.add_argument("--limit-files", type=int, default=None, help="cap on source files read")
    p.add_argument("--train-batch", type=int, default=8, help="sequences per training step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--feature-noise", type=float, default=0.0,
                   help="uniform noise on the training features, relative to their RMS "
                        "(EAGLE's 0.1-ish; default off)")
    p.add_argument("--feat-weight", type=float, default=0.5)
    p.add_argument("--depth2-weight", type=float, default=0.0,
                   help="weight of the second draft step's loss, the head fed its own output "
                        "(EAGLE's training-time test; default 0: depth 1 only)")
    p.add_argument("--coverage", type=float, default=0.98,
                   help="share of training targets the draft vocabulary covers")
    p.add_argument("--vocab", type=int, default=0, help="fixed draft vocabulary size")
    p.add_argument("--eval-tokens", type=int, default=6000, help="held-out tokens replayed")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not 0.0 <= args.gen_share <= 1.0 - EVAL_SHARE:
        p.error(f"--gen-share must be between 0 and {1.0 - EVAL_SHARE:g}")
    mx.random.seed(args.seed)
    path = train(args)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
