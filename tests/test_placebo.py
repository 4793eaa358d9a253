"""The placebo control (advantage.placebo): each group's advantages permuted among its own samples. The permutation
keeps every group's values and is uniform; a placebo run is the same loop (same samples and rewards) with permuted
advantages, says PLACEBO where a reader looks, and its verification checks the permutation."""

import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

from recam import verify
from recam.engine.advantages import permute_within_groups
from tests.test_verify import make_records, report_of, status

ROOT = Path(__file__).resolve().parents[1]
TOY = [sys.executable, "scripts/train_recam.py", "--config", "config/grpo.py:toy",
       "--config.logging.wandb_mode=disabled", "--config.num_threads=1", "--config.num_epochs=1",
       "--config.eval.freq=2"]


def test_each_group_keeps_its_values_and_excluded_samples_stay():
    values = torch.arange(12, dtype=torch.float32)
    groups = torch.tensor([3, 3, 3, 1, 1, 1, 3, 1, 5, 5, 5, 5])
    keep = torch.ones(12, dtype=torch.bool)
    keep[[2, 9]] = False
    out = permute_within_groups(values, groups, keep, torch.Generator().manual_seed(0))
    assert out[2] == 2 and out[9] == 9
    for g in groups.unique():
        rows = (groups == g) & keep
        assert sorted(out[rows].tolist()) == sorted(values[rows].tolist())
    assert not torch.equal(out, values)


def test_the_permutation_is_uniform_and_ignores_the_values():
    # a group of 3: each of the 6 orders about equally often over 3,000 draws (chi-square), and the same draw
    # moves positions the same way whatever the values are
    counts = Counter()
    groups, keep = torch.zeros(3, dtype=torch.long), torch.ones(3, dtype=torch.bool)
    for seed in range(3000):
        a = permute_within_groups(torch.tensor([0.0, 1.0, 2.0]), groups, keep, torch.Generator().manual_seed(seed))
        b = permute_within_groups(torch.tensor([5.0, -1.0, 9.0]), groups, keep, torch.Generator().manual_seed(seed))
        assert b.tolist() == [[5.0, -1.0, 9.0][int(i)] for i in a]
        counts[tuple(a.int().tolist())] += 1
    assert len(counts) == 6
    assert stats.chisquare(list(counts.values())).pvalue > 1e-3


def _placebo_records(seed=0):
    """make_records' log with each epoch's advantages permuted within groups, as a placebo run logs them."""
    records = make_records()
    for rec in records:
        if rec.get("type") != "epoch":
            continue
        adv = torch.tensor(rec["advantages"])
        keep = ~torch.tensor(rec["excluded"])
        col = permute_within_groups(adv[:, 0].contiguous(), torch.tensor(rec["dataset_indices"]), keep,
                                    torch.Generator().manual_seed(seed + rec["epoch"]))
        rec["advantages"] = col[:, None].repeat(1, adv.shape[1]).tolist()
        rec["placebo"] = True
    return records


def test_verification_passes_a_placebo_log_and_says_placebo():
    report = report_of(_placebo_records())
    assert report.status != verify.FAIL
    check = status(report, "advantage_recompute", 0)
    assert check.status == verify.PASS and check.detail.startswith("PLACEBO")
    assert check.numbers["groups_reordered"] > 0
    text = verify.render_markdown(report)
    assert text.startswith("# GRPO verification report — PLACEBO run")


def test_verification_fails_advantages_that_are_neither_exact_nor_a_permutation():
    records = _placebo_records()
    rec = next(r for r in records if r.get("type") == "epoch" and r["epoch"] == 1)
    rec["advantages"] = (np.array(rec["advantages"]) * 1.5).tolist()  # same order as a permutation, wrong values
    report = report_of(records)
    assert status(report, "advantage_recompute", 1).status == verify.FAIL
    assert status(report, "advantage_recompute", 0).status == verify.PASS
    # a permuted log that does not say placebo is not GRPO's: it fails the exact check
    plain = _placebo_records()
    for r in plain:
        r.pop("placebo", None)
    assert status(report_of(plain), "advantage_recompute", 0).status == verify.FAIL


def test_a_record_and_a_config_that_disagree_fail():
    records = _placebo_records()
    config = {"advantage": {"std_mode": "group", "eps": 1e-4, "placebo": False}}
    check = status(report_of(records, config=config), "advantage_recompute", 0)
    assert check.status == verify.FAIL and "config says advantage.placebo=False" in check.detail


@pytest.fixture(scope="module")
def toy_pair(tmp_path_factory):
    out = {}
    for name, flag in (("grpo", False), ("placebo", True)):
        run = tmp_path_factory.mktemp(name)
        p = subprocess.run([*TOY, f"--config.advantage.placebo={flag}", f"--config.run_dir={run}"], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        out[name] = (run, p.stdout)
    return out


def _epoch0(run: Path) -> dict:
    return next(r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                if r["type"] == "epoch" and r["epoch"] == 0)


def test_a_placebo_run_draws_and_scores_the_same_samples_and_trains_on_permuted_advantages(toy_pair):
    g, p = _epoch0(toy_pair["grpo"][0]), _epoch0(toy_pair["placebo"][0])
    assert g["dataset_indices"] == p["dataset_indices"]
    assert g["rewards/avg"] == p["rewards/avg"]  # the same samples: sampling happens before any update
    assert p.get("placebo") is True and "placebo" not in g
    a, b = np.array(g["advantages"])[:, 0], np.array(p["advantages"])[:, 0]
    idx = np.array(g["dataset_indices"])
    assert not np.allclose(a, b)
    for c in np.unique(idx):
        np.testing.assert_allclose(np.sort(a[idx == c]), np.sort(b[idx == c]), rtol=0, atol=1e-6)
    # placebo or not, a group's advantages and the step's mean advantage are the same numbers
    assert math.isclose(a.mean(), b.mean(), abs_tol=1e-6)


def test_a_placebo_run_says_so_in_its_config_summary_console_and_verification(toy_pair):
    run, stdout = toy_pair["placebo"]
    assert json.loads((run / "config.json").read_text())["advantage"]["placebo"] is True
    summary = (run / "summary.md").read_text().strip().splitlines()
    assert summary[0].startswith("PLACEBO") and summary[-1].startswith("PLACEBO")
    assert stdout.strip().splitlines()[-1].startswith("PLACEBO")
    report = (run / "grpo_verification.md").read_text()
    assert report.startswith("# GRPO verification report — PLACEBO run")
    assert "**Result: FAIL**" not in report
    assert "PLACEBO" not in (toy_pair["grpo"][0] / "summary.md").read_text()
