"""The live verify-width table (engine/drafting/call_costs.py): seeded by a probe, it follows the seconds
of the calls a forward really makes, robust to a slow call, and the depth controller drafts
shallower once wide calls turn out dear. Recorded call times, no clock."""

from __future__ import annotations

import pytest

from skulkp2p.engine.drafting.call_costs import LiveWidthCosts
from skulkp2p.engine.drafting.gates import DepthController, width_cost

# A group's probe at formation on a busy CPU: every width's fastest call about the same
# (README, tensor-parallel placements: "flat at 07:01").
FLAT_PROBE = {w: 0.076 for w in (1, 2, 3, 4, 6, 8, 12, 16)}
# What the group's decode calls then cost (measured by call width, same README section).
REAL_CALLS = {1: 0.077, 4: 0.127, 8: 0.214, 16: 0.340}


def _observe(table: LiveWidthCosts, calls: dict[int, float], times: int = 5) -> None:
    for _ in range(times):
        for w, s in calls.items():
            table.observe(w, s)


def test_the_seed_is_the_table_until_calls_are_seen():
    table = LiveWidthCosts({1: 0.010, 2: 0.012, 4: 0.015, 8: 0.020})
    assert dict(table) == {1: 1.0, 2: 1.2, 4: 1.5, 8: 2.0}
    assert table.calls() == {}
    assert width_cost(table, 6) == pytest.approx(1.75)  # gates read it as any table
    table.observe(4, 0.050)  # one call against the probe's two: not yet
    assert table[4] == 1.5


def test_the_table_moves_to_the_observed_call_costs():
    table = LiveWidthCosts(FLAT_PROBE)
    assert set(table.values()) == {1.0}
    _observe(table, REAL_CALLS)
    assert table[1] == 1.0
    assert table[4] == pytest.approx(0.127 / 0.077, abs=1e-3)
    assert table[8] == pytest.approx(0.214 / 0.077, abs=1e-3)
    assert table[16] == pytest.approx(0.340 / 0.077, abs=1e-3)
    # Widths no call was seen at lie between the observed ones, not at the probe's flat 1.0.
    assert table[2] == pytest.approx(1 + (0.127 / 0.077 - 1) / 3, abs=1e-3)
    assert table[12] == pytest.approx((0.214 + 0.340) / 2 / 0.077, abs=1e-3)
    assert table.seconds()[8] == pytest.approx(0.214, abs=1e-4)
    assert table.calls() == {1: 5, 4: 5, 8: 5, 16: 5}


def test_a_slow_call_does_not_swing_the_table():
    table = LiveWidthCosts(FLAT_PROBE)
    _observe(table, REAL_CALLS)
    before = dict(table)
    table.observe(8, 2.0)  # another process took the core for one call
    table.observe(1, 1.5)
    assert dict(table) == before
    table.observe(4, 0.001)  # nor a fast one
    assert dict(table) == before


def test_the_table_follows_a_change_of_load_within_its_window():
    table = LiveWidthCosts(FLAT_PROBE, window=8)
    _observe(table, REAL_CALLS, times=8)
    busier = {w: s * 2 for w, s in REAL_CALLS.items()}
    busier[8] = 0.600  # wide calls got dearer still
    # (a wide call is kept relative to the one-row estimate when it was made; the first calls
    # after the change were priced against an estimate still catching up: they leave the
    # window after `window` more calls)
    _observe(table, busier, times=16)
    assert table.seconds()[1] == pytest.approx(0.154, abs=1e-4)
    assert table[8] == pytest.approx(0.600 / 0.154, abs=1e-3)


def test_wide_calls_are_priced_against_the_one_row_calls_of_their_own_minute():
    """What a group's live table did on the shared CPU: the spec arm's few wide calls fell in a
    busy minute (every call slow), the plain arm's many one-row calls in a quiet one. Kept in
    seconds, w2 read 12.9x w1 and the gates stopped drafting for good; relative to the one-row
    calls around them, the wide calls cost what they cost."""
    table = LiveWidthCosts(FLAT_PROBE)
    busy = {1: 0.700, 2: 0.800, 5: 0.900}  # a busy minute: a spec arm's run
    _observe(table, busy, times=5)
    _observe(table, {1: 0.063}, times=16)  # then a quiet minute of one-row calls
    assert table.seconds()[1] == pytest.approx(0.063)
    assert table[2] == pytest.approx(0.8 / 0.7, abs=1e-3)
    assert table[5] == pytest.approx(0.9 / 0.7, abs=1e-3)
    assert table[2] < 1.5  # (in seconds it read 0.8 / 0.063 = 12.7)


def test_past_the_widest_observed_each_row_costs_what_the_observed_ones_did():
    table = LiveWidthCosts(FLAT_PROBE)
    _observe(table, {1: 0.100, 5: 0.180})
    per_row = (1.8 - 1.0) / 4
    assert table[5] == pytest.approx(1.8)
    assert table[8] == pytest.approx(1.8 + 3 * per_row)
    assert table[16] == pytest.approx(1.8 + 11 * per_row)
    # Never below what the probe said, where it said more.
    steep = LiveWidthCosts({1: 0.1, 2: 0.11, 16: 0.9})
    _observe(steep, {1: 0.1, 2: 0.11})
    assert steep[16] == pytest.approx(9.0)


def test_a_wider_call_never_costs_less():
    table = LiveWidthCosts(FLAT_PROBE)
    _observe(table, {1: 0.10, 2: 0.20, 3: 0.15, 4: 0.25})
    widths = sorted(table)
    assert all(table[a] <= table[b] for a, b in zip(widths, widths[1:], strict=False))
    assert table[3] == table[2] == pytest.approx(2.0)


def test_calls_that_are_not_verify_rounds_are_ignored_and_bad_seeds_refused():
    table = LiveWidthCosts(FLAT_PROBE, max_width=32)
    for _ in range(5):
        table.observe(200, 3.0)  # a prefill chunk
        table.observe(0, 0.1)
        table.observe(4, 0.0)
        table.observe(4, float("nan"))
    assert table.calls() == {} and set(table.values()) == {1.0}
    with pytest.raises(ValueError, match="width 1"):
        LiveWidthCosts({2: 0.1, 4: 0.2})
    with pytest.raises(ValueError, match="positive"):
        LiveWidthCosts({1: 0.1, 2: 0.0})


def test_the_controller_drafts_shallower_once_wide_calls_are_dear():
    """The same table object the controller was built with: what later calls show changes
    the depth of the next rounds of the same request."""
    table = LiveWidthCosts(FLAT_PROBE)
    controller = DepthController(table, max_depth=16, prior_accept=0.8)
    deep, deep_gain = controller.best_depth(16)
    assert deep == 16  # flat: every extra draft looks free
    _observe(table, REAL_CALLS)
    shallow, gain = controller.best_depth(16)
    assert 1 <= shallow <= 4
    assert gain < deep_gain
    # Dearer still: speculation at 40% acceptance stops paying at all.
    low = DepthController(table, max_depth=16, prior_accept=0.4)
    _observe(table, {1: 0.077, 2: 0.160, 4: 0.300, 8: 0.600, 16: 1.2}, times=16)
    assert low.best_depth(16)[0] == 0


def _spec_arms_after_plain_ones(burst: list[float], window: int | None = None
                                ) -> LiveWidthCosts:
    """A code-edit bench's calls as the group's table saw them (README, tensor-parallel
    placements): plain arms' one-row calls (45 ms), two spec arms' two-row MTP rounds (50 ms:
    1.11x), then a third spec arm whose first two-row calls fall in a burst."""
    kw = {} if window is None else {"window": window}
    table = LiveWidthCosts({1: 0.048, 2: 0.053, 4: 0.056, 8: 0.062, 16: 0.070}, **kw)
    for _ in range(2):
        _observe(table, {1: 0.045}, times=64)
        _observe(table, {2: 0.050}, times=10)
    _observe(table, {1: 0.045}, times=64)
    for s in burst:
        table.observe(2, s)
    return table


BURST = [0.086, 0.153, 0.136, 0.079, 0.104, 0.111, 0.182, 0.125, 0.120, 0.106, 0.093, 0.094,
         0.098]  # recorded two-row calls of bursts (1.7-4x the quiet ones)


def test_a_burst_on_the_few_wide_calls_does_not_price_them_dear():
    """What switched the group's MTP head off on code-edit: 13 of the last 16 two-row calls
    from bursts. Priced by the median of the last 16, w2 read 2.3x; by the median of the last
    32 it stays the quiet 1.11x, and a head at 40% acceptance keeps drafting."""
    table = _spec_arms_after_plain_ones(BURST)
    assert table[2] == pytest.approx(0.050 / 0.045, abs=0.01)
    assert DepthController(table, max_depth=1, prior_accept=0.4,
                           draft_cost=0.05).best_depth(1)[0] == 1
    of_16 = _spec_arms_after_plain_ones(BURST, window=16)
    assert of_16[2] > 2.0  # (the old estimate: the head's gate then switched it off)
    assert DepthController(of_16, max_depth=1, prior_accept=0.4,
                           draft_cost=0.05).best_depth(1)[0] == 0


def test_a_lasting_change_still_moves_the_table():
    """When wide calls stay dearer (half the window and more), the table follows."""
    table = _spec_arms_after_plain_ones([0.090] * 20)
    assert table[2] == pytest.approx(0.090 / 0.045, abs=0.01)


def test_two_calls_in_a_burst_do_not_outvote_the_probe():
    """At load 4-7 the first two two-row calls (in bursts) set w2 to 1.58x with the probe
    counted as 2 calls (the median of four values is the probe's and the calls' midpoint),
    and the MTP head went off at token 0 for every later request. Counted as 3, two calls
    move nothing; four do."""
    probe = {1: 0.048, 2: 0.048, 4: 0.056, 8: 0.062, 16: 0.070}
    table = LiveWidthCosts(probe)
    _observe(table, {1: 0.045}, times=32)
    table.observe(2, 0.100)
    table.observe(2, 0.110)
    assert table[2] == 1.0
    as_two = LiveWidthCosts(probe, prior_calls=2)
    _observe(as_two, {1: 0.045}, times=32)
    as_two.observe(2, 0.100)
    as_two.observe(2, 0.110)
    assert as_two[2] > 1.5
    table.observe(2, 0.090)
    table.observe(2, 0.095)
    assert table[2] == pytest.approx(0.090 / 0.045)


def test_a_width_no_longer_called_goes_stale():
    """A width priced dear and then never drafted again (the gates stopped drafting it) does
    not stay dear for good: once enough wider calls came after its calls, it is forgotten and
    lies between its neighbours again. One-row calls, the reference, never go stale."""
    table = LiveWidthCosts(FLAT_PROBE, stale_calls=40)
    _observe(table, {1: 0.050, 2: 0.100}, times=16)
    assert table[2] == pytest.approx(2.0)
    _observe(table, {5: 0.070}, times=24)  # 39 wide calls after the first two-row one
    assert table[2] == pytest.approx(2.0)  # not yet
    _observe(table, {5: 0.070}, times=16)  # 40 after the last
    assert table[2] == pytest.approx(1 + (0.070 / 0.050 - 1) / 4)
    assert table.seconds()[1] == pytest.approx(0.050)
    assert table.calls()[2] == 16  # (counted all the same)
    with pytest.raises(ValueError, match="stale_calls"):
        LiveWidthCosts(FLAT_PROBE, stale_calls=0)
