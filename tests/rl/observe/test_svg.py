"""rl/observe/svg.py: the chart primitives' arithmetic (the report tests check what the charts draw)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from rl.observe.svg import diverging, nice_ticks


@pytest.mark.parametrize("lo,hi", [(0.0, 1.0), (-3.7, 12.2), (1e-4, 3e-4), (5.0, 5.0), (-1e6, 2e7), (0.98, 1.02)])
def test_nice_ticks_cover_the_range_evenly(lo, hi):
    t = nice_ticks(lo, hi)
    assert t[0] <= lo and t[-1] >= hi and 2 <= len(t) <= 12
    steps = np.diff(t)
    np.testing.assert_allclose(steps, steps[0], rtol=1e-6)
    mant = steps[0] / 10 ** math.floor(math.log10(steps[0]))
    assert any(abs(mant - m) < 1e-6 for m in (1, 2, 2.5, 5, 10))


def test_diverging_is_white_at_the_centre_and_saturates_at_4x():
    assert diverging(1.0, 1.0) == "#ffffff"
    assert diverging(4.0, 1.0) == diverging(100.0, 1.0) == "#d7301f"  # log2(4)/2 = 1: full red
    assert diverging(0.25, 1.0) == diverging(0.001, 1.0) == "#2c7bb6"  # full blue
    assert diverging(float("nan"), 1.0) == "#eeeeee"
    # halfway in log space (2x): each channel halfway between white and red
    assert diverging(2.0, 1.0) == "#" + "".join(f"{round(255 + (c - 255) * 0.5):02x}" for c in (215, 48, 31))
