"""Write a tiny random-weight model directory that ``mlx_lm.load`` accepts, of any family the
tests serve: the dense ones (tiny_base.py) and Gemma 4 with its assistant (tiny_gemma4.py).

Usage::

    python -m tests.helpers.tiny_model --family llama|qwen2|qwen3|qwen3_5 --out DIR [--seed N]
        [--mtp] [--mtp-style qwen|deepseek|mimo]
    python -m tests.helpers.tiny_model --family gemma4_text --out DIR [--seed N]
        [--assistant ordered|dense --assistant-out DIR2]

Everything is a pure function of the arguments: the same ones give byte-identical files.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tests.helpers import tiny_base, tiny_gemma4

FAMILIES = (*tiny_base.FAMILIES, tiny_gemma4.FAMILY)
MTP_STYLES = tiny_base.MTP_STYLES


def make_tiny_model(
    family: str, out: Path, seed: int = 0, mtp: bool = False, mtp_style: str = "qwen"
) -> Path:
    """Write the tiny model for ``family`` into ``out`` (created if needed); return ``out``."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    if family == tiny_gemma4.FAMILY:
        if mtp:
            raise ValueError("gemma4_text drafts with its assistant (--assistant), not --mtp")
        return tiny_gemma4.make_target(out, seed)
    return tiny_base.write_model(family, out, seed, mtp, mtp_style)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", required=True, choices=FAMILIES)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mtp", action="store_true", help="add a one-layer MTP head")
    parser.add_argument("--mtp-style", choices=MTP_STYLES, default=None)
    parser.add_argument("--assistant", choices=("ordered", "dense"), default=None,
                        help="gemma4_text: also write its assistant drafter (centroid head: "
                        "ordered, as E2B/E4B; tied dense head: dense, as 12B/26B/31B)")
    parser.add_argument("--assistant-out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.mtp_style is not None and not args.mtp:
        parser.error("--mtp-style needs --mtp")
    if (args.assistant is None) != (args.assistant_out is None):
        parser.error("--assistant and --assistant-out go together")
    if args.assistant is not None and args.family != "gemma4_text":
        parser.error("--assistant needs --family gemma4_text")
    try:
        path = make_tiny_model(args.family, args.out, args.seed, args.mtp, args.mtp_style or "qwen")
    except ValueError as e:
        parser.error(str(e))
    print(path)
    if args.assistant is not None:
        print(tiny_gemma4.make_assistant(args.assistant_out, args.assistant, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
