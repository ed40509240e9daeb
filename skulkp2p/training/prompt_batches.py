"""What a head is trained on: prompts as token lists, in equal-length batches.

`--data broad` (the default): the chat prompt list of sidecar_prompts.py for training, its
separate hand-written set for the held-out measurement, and optionally its terse numbered
questions (`--terse`), batched apart so adding them leaves the broad batches as they were.
`--data stdlib`: the first head's prompts, built from Python stdlib docstrings and source and
/usr/share/doc texts, one source file in ten held out.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skulkp2p.training.head_options import HeadError
from skulkp2p.training.sidecar_prompts import (
    HELDOUT_PROMPTS,
    TERSE_QUESTIONS,
    terse_prompts,
    train_prompts,
)


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


def chat_ids(tokenizer: Any, content: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                        add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def build_broad_prompts(tokenizer: Any, seed: int
                        ) -> tuple[list[list[int]], list[list[int]], dict[str, int]]:
    """(train prompts, held-out prompts, counts) from sidecar_prompts.py: the broad chat
    list for training, the separate hand-written set of another style for the measurement."""
    texts = train_prompts(seed)
    overlap = set(texts) & set(HELDOUT_PROMPTS)
    if overlap:
        raise HeadError(f"held-out prompts in the training list: {overlap}")
    train = [chat_ids(tokenizer, t) for t in texts]
    held = [chat_ids(tokenizer, t) for t in HELDOUT_PROMPTS]
    return train, held, {"train_prompts": len(train), "heldout_prompts": len(held)}


def build_terse_prompts(tokenizer: Any, seed: int, count: int) -> list[list[int]]:
    """`count` messages of short numbered questions asking for terse answers
    (sidecar_prompts.terse_prompts), as token lists; none shares a question with the
    held-out set."""
    leaked = [q for q in TERSE_QUESTIONS if any(q in h for h in HELDOUT_PROMPTS)]
    if leaked:
        raise HeadError(f"held-out questions in the terse list: {leaked}")
    return [chat_ids(tokenizer, t) for t in terse_prompts(seed, count)]


def tail_length(tokenizer: Any) -> int:
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
        raise HeadError(f"train-terse shards in {manifest.parent} but no {manifest.name} "
                        "saying which --terse made them; write "
                        '{"bounds": [N]} there (N: that run\'s --terse) or remove the shards')
    else:
        bounds = []
    if not bounds or count > bounds[-1]:
        bounds.append(count)
        manifest.write_text(json.dumps({"bounds": bounds}))
    return bounds
