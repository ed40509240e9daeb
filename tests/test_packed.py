"""Ragged batched steps run the layers' MLPs and the head on their real tokens only
(engine/model/packed.py). The end-to-end exactness (every request's tokens equal to the request
alone) is tests/test_batch.py's, which also checks that its lookup batches ran packed steps;
here: the packing's index arithmetic, and one ragged step's logits and caches packed against
padded on a tiny model."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from skulkp2p.engine.drafting.gates import step_cost
from skulkp2p.engine.model.packed import packed_rows, packs_mlps
from tests.helpers.batch import loaded, rows_joined_by_hand, step_by_hand


def test_packed_rows_index_inverse_and_offsets():
    rows = packed_rows([3, 1, 2])
    assert rows is not None
    assert rows.index.tolist() == [0, 1, 2, 3, 6, 7]  # of the flattened [3 x 3] positions
    assert rows.inverse.tolist() == [0, 1, 2, 3, 6, 6, 4, 5, 6]  # 6: the zero row
    assert rows.offsets == (0, 3, 4) and rows.tokens == 6
    x = mx.arange(3 * 3 * 2, dtype=mx.float32).reshape(3, 3, 2)
    packed = rows.gather(x)
    assert packed.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7], [12, 13], [14, 15]]
    back = rows.scatter(packed)
    assert back.tolist() == [[[0, 1], [2, 3], [4, 5]], [[6, 7], [0, 0], [0, 0]],
                             [[12, 13], [14, 15], [0, 0]]]
    assert rows.row(packed, 2).tolist() == [[12, 13], [14, 15]]


def test_rows_of_one_width_are_not_packed():
    assert packed_rows([2, 2, 2]) is None
    assert packed_rows([1]) is None


def test_only_layers_with_an_mlp_module_pack():
    class Layer:
        mlp = None

    assert not packs_mlps([])
    assert not packs_mlps([Layer()])


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_packed_step_gives_the_padded_steps_logits_and_caches(tiny_models, family):
    lm = loaded(tiny_models[family])
    tokens = [[5, 9, 11, 3, 8], [7], [4, 4], [12]]  # one row drafting 4, one 1, two plain
    padded_sched, padded_rows = rows_joined_by_hand(lm, [20, 9, 14, 3])
    packed_sched, packed_rows_ = rows_joined_by_hand(lm, [20, 9, 14, 3])
    assert packed_sched.pack_ragged
    padded_sched.pack_ragged = False
    want = step_by_hand(padded_sched, padded_rows, tokens)
    got = step_by_hand(packed_sched, packed_rows_, tokens)
    assert packed_sched.packed_steps == 1 and padded_sched.packed_steps == 0
    assert packed_sched.padding_skipped == 4 * 5 - 9
    for w, g, t in zip(want, got, tokens, strict=True):
        assert g.shape == w.shape == (len(t), w.shape[-1])
        assert mx.allclose(g, w, atol=1e-4).item()
        assert mx.argmax(g, axis=-1).tolist() == mx.argmax(w, axis=-1).tolist()
    # The next step reads what this one wrote: the real positions' keys agree, and a plain
    # step after it gives the same logits both ways (padded positions never seen).
    assert packed_sched.rows.lengths == padded_sched.rows.lengths
    for a, b in zip(padded_sched.layers, packed_sched.layers, strict=True):
        for i, n in enumerate(packed_sched.rows.lengths):
            assert mx.allclose(a.keys[i, :, :n], b.keys[i, :, :n], atol=1e-4).item()
            assert mx.allclose(a.values[i, :, :n], b.values[i, :, :n], atol=1e-4).item()
    after = [[2], [3], [6], [1]]
    for w, g in zip(step_by_hand(padded_sched, padded_rows, after),
                    step_by_hand(packed_sched, packed_rows_, after), strict=True):
        assert mx.allclose(g, w, atol=1e-4).item()


def test_the_gates_see_the_packing_by_the_models_weights(tiny_models):
    """The shares a ragged step runs packed are the MLPs' and the head's shares of the model's
    weights; every row's batch view carries them (the gates price a ragged step with them),
    and none when the scheduler does not pack or is told to price padded."""
    lm = loaded(tiny_models["llama"])
    sched, rows = rows_joined_by_hand(lm, [5, 9])
    packing = rows[0].batch_view().packing
    assert packing is not None and packing.mlps_from == sched.pack_mlps_from

    def weights(m) -> int:
        return sum(a.size for _, a in tree_flatten(m.parameters()))

    layers = lm.model.model.layers
    mlps = sum(weights(la.mlp) for la in layers)
    body = sum(weights(la) for la in layers)
    head = weights(lm.model.model.embed_tokens if "lm_head" not in dict(lm.model.children())
                   else lm.model.lm_head)
    assert packing.mlps == pytest.approx(mlps / (body + head))
    assert packing.head == pytest.approx(head / (body + head))
    costs = {1: 1.0, 16: 2.0}
    assert step_cost(costs, [8, 1], packing) < step_cost(costs, [8, 1])
    sched.price_packed = False
    assert rows[1].batch_view().packing is None
    sched.price_packed = True
    sched.pack_ragged = False
    assert rows[1].batch_view().packing is None
    sched.pack_ragged = True
    sched.pack_mlps_from = 3
    assert rows[1].batch_view().packing.mlps_from == 3
