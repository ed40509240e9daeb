"""Runs a `python -m skulkp2p head` action. Each action's module is imported here, when it runs:
they import mlx, which must load after the CLI has set the engine's CPU switch."""

from __future__ import annotations

import argparse


def run_head(args: argparse.Namespace) -> int:
    """Run `args.action`; a bad input raises head_options.HeadError (one line)."""
    if args.action == "train":
        from skulkp2p.training import train_run
        return train_run.run(args)
    if args.action == "publish":
        from skulkp2p.training import publish
        return publish.run(args)
    if args.action == "probe":
        from skulkp2p.training import vocab_probe
        return vocab_probe.run(args)
    from skulkp2p.training import validation_shards
    return validation_shards.run(args)
