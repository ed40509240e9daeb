"""The test tiers (conftest.py): a test that starts a process must say so with a marker, and
every marked test is ``heavy``, which the quick tier (``-m "not heavy"``) leaves out."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_an_unmarked_test_cannot_start_a_process():
    with pytest.raises(AssertionError, match="mark it"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.mark.process
def test_a_marked_test_can_start_a_process_and_is_heavy(request):
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0
    assert request.node.get_closest_marker("heavy") is not None


def test_an_unmarked_test_is_in_the_quick_tier(request):
    assert request.node.get_closest_marker("heavy") is None


def test_the_real_model_fixture_marks_its_users(request):
    """Tests that use the real SmolLM2 carry ``model`` (and so ``heavy``): checked on what this
    run collected, which for the whole suite includes such tests."""
    users = [item for item in request.session.items
             if "smollm2_path" in getattr(item, "fixturenames", ())]
    for item in users:
        assert item.get_closest_marker("model") and item.get_closest_marker("heavy"), item.nodeid
