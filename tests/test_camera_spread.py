"""scripts/measure/camera_spread.py: the within-group split of cam_score into frames placed and placed frames'
accuracy adds up exactly, and the intraclass correlation matches a hand computation."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.measure import camera_spread as cs  # noqa: E402


def test_the_split_adds_up_to_the_within_group_variance():
    rng = np.random.default_rng(0)
    groups = np.repeat(np.arange(20), 4)
    q = rng.uniform(0.3, 1.0, 80)
    a = rng.uniform(0.1, 0.6, 80)
    split = cs.group_split(q * a, q, groups)
    assert split["var_y"] == pytest.approx(split["var_q"] + split["var_a"] + split["var_x"], rel=1e-10)
    s = cs.shares(split)
    assert s["q"] + s["a"] + s["x"] == pytest.approx(1.0)
    # only the placed share varies within groups: all of the spread is "frames placed"
    a_const = np.repeat(rng.uniform(0.1, 0.6, 20), 4)
    s = cs.shares(cs.group_split(q * a_const, q, groups))
    assert s["q"] == pytest.approx(1.0) and s["a"] == pytest.approx(0.0, abs=1e-12)
    # a sample with nothing placed takes its group out
    q2 = q.copy()
    q2[0] = 0.0
    assert len(cs.group_split(q2 * a, q2, groups)["var_y"]) == 19


def test_icc_by_hand():
    values = np.array([1.0, 1.2, 3.0, 3.4, 5.0, 4.6])
    groups = np.array([0, 0, 1, 1, 2, 2])
    means = np.array([1.1, 3.2, 4.8])
    grand = values.mean()
    msb = 2 * ((means - grand) ** 2).sum() / 2
    msw = ((values - np.repeat(means, 2)) ** 2).sum() / 3
    assert cs.icc(values, groups) == pytest.approx((msb - msw) / (msb + msw))
