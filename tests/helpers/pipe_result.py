"""One request run to the end on a loaded model, its result as the JSONL pipe writes it (for the
tests that compare our output with mlx-lm's by the pipe's fields)."""

from __future__ import annotations

from skulkp2p.engine.runner.generate import run
from skulkp2p.formats.pipe_format import result_json


def generate(loaded, req) -> dict:
    return result_json(run(loaded, req), req.id, loaded.id)
