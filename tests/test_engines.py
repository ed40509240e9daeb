"""The engine factory (node/engines.py): --max-batch reaches the MLX engine whether or not its
constructor takes it yet, and is checked in one place."""

from __future__ import annotations

import inspect
import logging

import pytest

from skulkp2p.models.store import ModelStore
from skulkp2p.node.engines import MaxBatchError, check_max_batch, open_engine


@pytest.mark.parametrize("value", [0, -1, 257, 1.5, True, "2"])
def test_check_max_batch_refuses(value):
    with pytest.raises(MaxBatchError, match="--max-batch must be a whole number from 1 to 256"):
        check_max_batch(value)


def test_check_max_batch_passes():
    assert [check_max_batch(v) for v in (None, 1, 4, 256)] == [None, 1, 4, 256]


def test_open_engine_threads_max_batch_to_the_mlx_engine(tiny_models, tmp_path, caplog):
    """With a batching MlxEngine (a `max_batch` keyword) the engine runs that many at once;
    with today's, it still opens and the log says it runs one at a time."""
    from skulkp2p.engine.runner.mlx_engine import MlxEngine

    store = ModelStore(tmp_path)
    with caplog.at_level(logging.WARNING, logger="skulkp2p.node"):
        engine = open_engine(store, str(tiny_models["llama"]), prefix_cache_mb=0, max_batch=3)
    try:
        if "max_batch" in inspect.signature(MlxEngine).parameters:
            assert engine.max_concurrent == 3
        else:
            assert "one request at a time" in caplog.text
            assert getattr(engine, "max_concurrent", 1) == 1
    finally:
        engine.close()
    with pytest.raises(MaxBatchError):
        open_engine(store, str(tiny_models["llama"]), max_batch=0)
