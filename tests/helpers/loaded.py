"""The real SmolLM2-135M loaded once per test process, float32, as an agent opens it (its card:
the EAGLE sidecar head, the card's speculation and runtime settings), for the in-process tests
that only read it (tests/test_suffix.py, test_trees.py, test_batch.py, test_batch_mixed.py,
test_head_batch.py): ``lm = smollm2_float32()``.

Sharing is safe for readers: loading swaps the classes of the model's own modules
(weight_first, table_rope) and routes mlx-lm's family functions once per process
(numpy_verify), all at load; engines, forwards and decodes only read the LoadedModel and keep
their caches and drafter state to themselves. A test must not change the object (no
``monkeypatch.setattr(lm, ...)``, no assigning its fields): ``dataclasses.replace`` it for
that."""

from __future__ import annotations

from tests.helpers.models import test_data_dir

_smollm2: list = []


def smollm2_float32():
    """SmolLM2-135M from the test model cache (pulled the first time), float32, with its
    card; the same object for every caller in this process. Read only (see above)."""
    if not _smollm2:
        from skulkp2p.engine.runner.loader import open_model
        from skulkp2p.models.store import ModelStore

        _smollm2.append(open_model(ModelStore(test_data_dir()), "smollm2-135m",
                                   dtype="float32"))
    return _smollm2[0]
