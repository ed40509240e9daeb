"""A batched forward's ropes rotate from one table of sines and cosines per forward
(engine/batching/step_rope.py). The end-to-end exactness (every request's tokens equal to the request
served alone, prompts prefilled together, ragged and tree steps) is tests/test_batch*.py's, run
with the shared table on (the default); here: the rotation bit for bit against the rope's own,
one step's logits and caches bit for bit with and without the shared table, one table per
forward, and which ropes may share one."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from skulkp2p.engine.batching import scheduler as scheduler_mod
from skulkp2p.engine.batching.step_rope import RopeTables, SharedRope, shared_ropes, shares_tables
from skulkp2p.engine.cpu.table_rope import TableRoPE
from tests.helpers.batch import loaded, rows_joined_by_hand, step_by_hand


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("dims,head_dim", [(64, 64), (32, 64), (16, 16)])
@pytest.mark.parametrize("rows,heads,width", [(4, 9, 1), (4, 3, 7), (1, 2, 5), (3, 2, 130)])
def test_the_shared_table_rotates_bit_for_bit_as_the_rope(dtype, dims, head_dim, rows, heads,
                                                          width):
    rope = nn.RoPE(dims, base=10000.0)
    x = (mx.random.normal((rows, heads, width, head_dim), key=mx.random.key(rows + width)) * 3
         ).astype(dtype)
    offset = mx.array([(97 * i * i + 3) % 4000 for i in range(rows)], dtype=mx.int32)
    tables = RopeTables()
    got = tables.rotate(rope, x, offset)
    again = tables.rotate(rope, x * 2, offset)  # a second projection: the same table
    assert tables.built == 1
    assert got.dtype == dtype and got.shape == x.shape
    assert mx.array_equal(got, rope(x, offset=offset)).item()
    assert mx.array_equal(again, rope(x * 2, offset=offset)).item()
    # another forward's offsets (another array): a table of its own, also exact
    later = offset + 1
    assert mx.array_equal(tables.rotate(rope, x, later), rope(x, offset=later)).item()
    assert tables.built == 2


def test_only_the_plain_half_split_rope_on_the_cpu_shares_tables():
    from mlx_lm.models.rope_utils import SuScaledRoPE

    assert shares_tables(nn.RoPE(64))
    table = nn.RoPE(64)
    table.__class__ = TableRoPE  # as load_model leaves a CPU float32 model's ropes
    assert shares_tables(table)
    assert not shares_tables(nn.RoPE(64, traditional=True))  # interleaved pairs
    assert not shares_tables(SuScaledRoPE(64))  # scales its input: not the plain fallback
    assert not shares_tables(None)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_step_with_the_shared_table_is_bit_for_bit_the_step_without(tiny_models, family,
                                                                      monkeypatch):
    lm = loaded(tiny_models[family])
    layers = list(lm.model.model.layers)
    assert all(shares_tables(la.self_attn.rope) for la in layers)
    built: list[RopeTables] = []

    def counted(layers_, tables=None):
        built.append(RopeTables())
        return shared_ropes(layers_, built[-1])

    monkeypatch.setattr(scheduler_mod, "shared_ropes", counted)
    own_sched, own_rows = rows_joined_by_hand(lm, [20, 9, 14, 3])
    shared_sched, shared_rows = rows_joined_by_hand(lm, [20, 9, 14, 3])
    own_sched.share_rope = False
    for tokens in ([[5], [7], [4], [12]], [[5, 9, 11, 3], [7], [4, 4], [12]], [[2], [3], [6], [1]]):
        want = step_by_hand(own_sched, own_rows, tokens)
        got = step_by_hand(shared_sched, shared_rows, tokens)
        for w, g in zip(want, got, strict=True):
            assert g.shape == w.shape and mx.array_equal(g, w).item()
    assert len(built) == 3 and all(t.built == 1 for t in built)  # one table per forward
    assert shared_sched.rows.lengths == own_sched.rows.lengths
    for a, b in zip(own_sched.layers, shared_sched.layers, strict=True):
        for i, n in enumerate(own_sched.rows.lengths):
            assert mx.array_equal(a.keys[i, :, :n], b.keys[i, :, :n]).item()
            assert mx.array_equal(a.values[i, :, :n], b.values[i, :, :n]).item()
    # the layers' own ropes are back after every forward
    assert all(type(la.self_attn.rope) in (nn.RoPE, TableRoPE) for la in layers)
    assert not any(isinstance(la.self_attn.rope, SharedRope) for la in layers)
