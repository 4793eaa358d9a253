"""scripts/measure/step_credit.py: per-step reward variance under redraws, and its shares' bootstrap."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from scripts.measure.step_credit import ALL, credit_shares, within_variance

ROOT = Path(__file__).resolve().parents[1]


def test_within_variance_is_the_per_condition_sample_variance_without_nans():
    values = np.array([[1.0, 2.0, 4.0], [np.nan, 3.0, 5.0], [7.0, np.nan, np.nan]])
    out = within_variance(values)
    assert out[0] == pytest.approx(np.var([1.0, 2.0, 4.0], ddof=1))
    assert out[1] == pytest.approx(2.0)  # var of (3, 5), n - 1 = 1
    assert np.isnan(out[2])  # one value has no spread to measure


def test_credit_shares_are_mean_variance_ratios_and_their_interval_covers_the_truth():
    """Steps with known variances: the point share is the ratio of the mean variances over conditions, and over 200
    simulated tables the bootstrap interval holds the true ratio at about its nominal rate."""
    rng = np.random.default_rng(0)
    true = {"step 0": 0.5, "step 1": 0.1, ALL: 1.0}
    hits, trials = 0, 200
    for t in range(trials):
        # each condition's variance estimate from 8 redraws: scaled chi-square with 7 df
        table = {k: v * rng.chisquare(7, size=40) / 7 for k, v in true.items()}
        shares = credit_shares(table, reps=400, seed=t)
        point = np.mean(table["step 0"]) / np.mean(table[ALL])
        assert shares["step 0"][0] == pytest.approx(point)
        assert shares[ALL][:2] == pytest.approx((1.0, 1.0))
        hits += shares["step 0"][1] <= 0.5 <= shares["step 0"][2]
    assert 0.88 <= hits / trials <= 0.99


def test_step_credit_script_tables_every_trained_step():
    p = subprocess.run([sys.executable, "scripts/measure/step_credit.py", "--config", "config/grpo.py:toy",
                        "--config.toy.pretrain_steps=20", "--conditions", "4", "--redraws", "3",
                        "--bootstrap", "200"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [line for line in p.stdout.splitlines() if re.match(r"^\| (step \d+|all) \|", line)]
    from config.grpo import toy

    steps = round(toy().train.timestep_fraction * toy().sample.num_steps)
    assert [r.split("|")[1].strip() for r in rows[: steps + 1]] == [f"step {j}" for j in range(steps)] + [ALL]
    variances = [float(r.split("|")[2]) for r in rows[: steps + 1]]
    assert all(v >= 0 for v in variances) and variances[-1] > 0
