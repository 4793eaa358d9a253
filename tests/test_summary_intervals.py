"""scripts/measure/summary_intervals.py on published tables: the bound over seeds, Holm over a curve's points, and
merged batch-means blocks, each against a hand computation."""

import math
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.measure import summary_intervals as si  # noqa: E402


def test_parse_accepts_the_docs_forms():
    assert si.parse("+0.0187 ± 0.0338") == (0.0187, 0.0338)
    assert si.parse("-0.01 +- 0.02") == (-0.01, 0.02)
    m, h = si.parse("+0.0054")
    assert m == 0.0054 and math.isnan(h)
    with pytest.raises(SystemExit, match="mean ± half-width"):
        si.parse("about 0.02")


def test_seeds_bound_by_hand():
    C, vals = 32, [(0.0166, 0.0142), (0.0010, 0.0211), (0.0110, 0.0156)]
    text = si.main(["seeds", "--conditions", str(C), *[f"{m:+.4f} ± {h:.4f}" for m, h in vals]])
    t = stats.t.ppf(0.975, C - 1)
    sds = np.array([h / t * np.sqrt(C) for _, h in vals])
    means = np.array([m for m, _ in vals])
    a, b = (sds ** 2).mean() / C, means.var(ddof=1) / 3
    df = (a + b) ** 2 / (a ** 2 / (3 * (C - 1)) + b ** 2 / 2)
    half = max(stats.t.ppf(0.975, df) * np.sqrt(a + b), stats.t.ppf(0.975, 2) * np.sqrt(b))
    assert f"{means.mean():+.4f} ± {half:.4f} at most" in text


def test_holm_over_a_curve_by_hand():
    text = si.main(["holm", "--conditions", "128", "+0.0148 ± 0.0508", "+0.0711 ± 0.0533", "+0.0922 ± 0.0512"])
    t = stats.t.ppf(0.975, 127)
    p = [2 * stats.t.sf(abs(m) / (h / t), 127) for m, h in ((0.0148, 0.0508), (0.0711, 0.0533), (0.0922, 0.0512))]
    order = np.argsort(p)
    adj = np.maximum.accumulate([min(1, (3 - i) * p[j]) for i, j in enumerate(order)])
    assert f"clear 0: {sum(x < 0.05 for x in p)} of 3 unadjusted, {sum(adj < 0.05)} of 3 after Holm" in text


def test_blocks_merged():
    text = si.main(["blocks", "--merge", "2", "0.1", "0.3", "0.2", "0.2"])
    merged = np.array([0.2, 0.2])
    assert f"{merged.mean():+.4f} ± 0.0000" in text
