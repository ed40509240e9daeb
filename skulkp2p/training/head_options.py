"""The `python -m skulkp2p head` sub-commands' options (train, publish, probe,
validation-shards), the settings they share with the run, and the error a bad input ends with.
No mlx here: the CLI builds its parser before the fast BLAS is set up."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Tensor prefix per kind of head: "eagle" (the default), "eagle3" (it reads a low, a middle and
# a high layer of the trunk, fused) or the first head's qwen naming.
PREFIXES = {"eagle": "eagle.", "eagle3": "eagle3.", "qwen": "mtp."}
GEN_SHARE = 0.5  # of the time budget spent generating (the rest: init, training, evaluation)
EVAL_SHARE = 0.15  # kept back for the held-out replay and writing
PROBE_MODEL = "smollm2-135m"  # the model whose shipped head the probe and validation set chose


class HeadError(Exception):
    """A head command that cannot go on; the message is one line."""


def resolve_model(spec: str, data_dir: Path | None = None) -> tuple[str, Path]:
    """(id, folder) of a card id (pulled into the model store if needed) or a model folder."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path.name, path
    from skulkp2p.models.store import ModelStore
    from skulkp2p.progress import ProgressBar

    store = ModelStore(data_dir) if data_dir else ModelStore()
    resolved = store.resolve(spec)
    return resolved.id, store.pull(spec, progress=lambda label: ProgressBar(label, sys.stderr))


def _gen_share(value: str) -> float:
    try:
        share = float(value)
    except ValueError:
        share = -1.0
    if not 0.0 <= share <= 1.0 - EVAL_SHARE:
        raise argparse.ArgumentTypeError(f"must be between 0 and {1.0 - EVAL_SHARE:g}, got "
                                         f"{value!r}")
    return share


def _indices(value: str) -> list[int]:
    try:
        return [int(x) for x in value.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes whole numbers separated by commas, got "
                                         f"{value!r}") from None


def _whole_numbers(value: str) -> list[int]:
    try:
        return [int(s) for s in value.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes whole numbers, got {value!r}") from None


def _biases(value: str) -> list[float]:
    try:
        biases = [float(b) for b in value.split(",") if b.strip()]
    except ValueError:
        biases = [-1.0]
    if not biases or min(biases) < 0:
        raise argparse.ArgumentTypeError(f"takes numbers >= 0, got {value!r}")
    return biases


def _costs(value: str) -> dict[int, float]:
    try:
        costs = [float(c) for c in value.split(",")]
    except ValueError:
        costs = []
    if len(costs) != 3:
        raise argparse.ArgumentTypeError(f"takes three numbers, got {value!r}")
    return {w + 1: c for w, c in enumerate(costs)}


def add_head_arguments(head: argparse.ArgumentParser) -> None:
    """The `head` command's actions on `head`, each with its options."""
    sub = head.add_subparsers(dest="action", required=True, metavar="ACTION")
    _train_arguments(sub.add_parser(
        "train", help="train a drafting head for a model that has none",
        description="Train a drafting head (a sidecar) for a model that has none, by "
                    "self-distillation, trunk frozen; OUT/mtp.safetensors and "
                    "OUT/mtp.provenance.toml, resumable from OUT/.train/."))
    p = sub.add_parser("publish", help="extract a checkpoint's own MTP head into a sidecar",
                       description="Extract a checkpoint's MTP head into a sidecar: "
                                   "mtp.safetensors and mtp.provenance.toml.")
    p.add_argument("src", type=Path, metavar="SRC", help="full-precision checkpoint folder")
    p.add_argument("out", type=Path, metavar="OUT",
                   help="folder for mtp.safetensors + provenance")
    _probe_arguments(sub.add_parser(
        "probe", help="what a trained head's draft vocabulary and confidence policies cost it",
        description="How a trained EAGLE-style head's draft vocabulary limits it, and what a "
                    "larger one costs, replayed over a training work folder's held-out "
                    "answers; JSON rows on stdout."))
    v = sub.add_parser(
        "validation-shards", help="validation answers for choosing a head's settings",
        description="Validation answers for choosing a head's inference settings without "
                    "fitting them to its held-out set: greedy answers to a broad-list batch "
                    "training never answered and to fresh hand-written prompts, as "
                    "OUT/heldout-*.npz for `head probe --work OUT`.")
    v.add_argument("--out", type=Path, required=True, help="folder for the heldout-*.npz shards")
    v.add_argument("--model", default=PROBE_MODEL, help="card id or model folder")
    v.add_argument("--batch-index", type=int, default=30,
                   help="the batch of `head train`'s shuffled broad list (--batch 64 "
                        "--prompt-tokens 96, seed 0) to answer: one no training shard answered "
                        "(--skip-batches)")
    v.add_argument("--broad", type=int, default=32, help="prompts of that batch to answer")
    v.add_argument("--gen-tokens", type=int, default=192, help="tokens generated per prompt")


def _train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="card id or model folder (full precision)")
    p.add_argument("--out", required=True, type=Path, help="folder for the sidecar")
    p.add_argument("--minutes", type=float, default=30.0, help="time budget (default 30)")
    p.add_argument("--steps", type=int, default=0, help="stop after this many training steps")
    p.add_argument("--resume", action="store_true", help="continue from OUT/.train/")
    p.add_argument("--data-dir", type=Path, default=None, help="model store (default: user's)")
    p.add_argument("--gen-share", type=_gen_share, default=GEN_SHARE,
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
                   help="head to train: eagle (default), eagle3 (reads three depths of the "
                        "trunk, fused; trained on its own multi-step drafts, --ttt-steps) or "
                        "the first head's qwen naming")
    p.add_argument("--ttt-steps", type=int, default=0,
                   help="draft steps unrolled in training, the head fed its own output "
                        "(training-time test; each step's loss counted, the later ones at "
                        "--depth2-weight); default: 3 for eagle3, else 2 with --depth2-weight")
    p.add_argument("--data", choices=("broad", "stdlib"), default="broad",
                   help="prompts: skulkp2p/training/sidecar_prompts.py (default), or texts from "
                        "the Python stdlib and /usr/share/doc (the first head's data)")
    p.add_argument("--sample-share", type=float, default=0.5,
                   help="share of training batches answered by sampling (default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="temperature of the sampled answers (default %(default)s)")
    p.add_argument("--terse", type=int, default=0,
                   help="also answer this many messages of short numbered questions asking for "
                        "terse answers (sidecar_prompts.terse_prompts), generated before the "
                        "rest of the broad list (default 0)")
    p.add_argument("--generate-only", action="store_true",
                   help="stop after generating the data (continue with --resume)")
    p.add_argument("--max-batches", type=int, default=0, help="cap on training batches")
    p.add_argument("--skip-batches", type=_indices, default=[], metavar="I,J",
                   help="broad-list batches never to answer (their prompts are held for "
                        "validation, e.g. head validation-shards --batch-index 30)")
    p.add_argument("--limit-files", type=int, default=None, help="cap on source files read")
    p.add_argument("--train-batch", type=int, default=8, help="sequences per training step")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (cosine schedule)")
    p.add_argument("--feature-noise", type=float, default=0.0,
                   help="uniform noise on the training features, relative to their RMS "
                        "(EAGLE's 0.1-ish; default off)")
    p.add_argument("--feat-weight", type=float, default=0.5,
                   help="weight of the loss's feature term (the head's output against the "
                        "trunk's next feature)")
    p.add_argument("--depth2-weight", type=float, default=0.0,
                   help="weight of the second draft step's loss, the head fed its own output "
                        "(EAGLE's training-time test; default 0: depth 1 only)")
    p.add_argument("--coverage", type=float, default=0.98,
                   help="share of training targets the draft vocabulary covers")
    p.add_argument("--vocab", type=int, default=0, help="fixed draft vocabulary size")
    p.add_argument("--keep-vocab", action="store_true",
                   help="with --init-from: keep that head's draft vocabulary (chosen from its "
                        "own, larger, training data) instead of choosing one from this data")
    p.add_argument("--eval-tokens", type=int, default=6000, help="held-out tokens replayed")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the prompt order, the sampled answers and training")


def _probe_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--work", type=Path, required=True,
                   help="a `head train` OUT/.train folder (its train-*.npz and heldout-*.npz)")
    p.add_argument("--sidecar", type=Path, required=True, help="the head's mtp.safetensors")
    p.add_argument("--model", default=PROBE_MODEL, help="card id or model folder")
    p.add_argument("--sizes", type=_whole_numbers, default="8192,12288,16384,0",
                   help="draft vocabulary sizes to try beside the sidecar's own (0: all)")
    p.add_argument("--depths", type=_whole_numbers, default="1",
                   help="replay depths, e.g. 1,2")
    p.add_argument("--timing-calls", type=int, default=300,
                   help="head calls and trunk steps timed per vocabulary")
    p.add_argument("--context-bias", type=_biases, default="0",
                   help="replay with these MtpDrafter context biases (the card's "
                        "mtp_context_bias), e.g. 0,0.5; each is a row of its own")
    p.add_argument("--policies", action="store_true",
                   help="also simulate confidence policies (the sidecar's own vocabulary)")
    p.add_argument("--costs", type=_costs, default="1.0,1.15,1.3",
                   help="verify cost of 1, 2, 3 tokens for --policies (default: gates.py's)")
    p.add_argument("--head-cost", type=float, default=0.075,
                   help="one head call against one trunk step, for --policies")
    p.add_argument("--json", dest="json_out", type=Path, default=None,
                   help="also write every row to this file")
