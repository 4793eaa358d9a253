"""scripts/measure/base_report.py: a base's held-out samples, the rewards' ceiling and floor and the signal share, and
the comparison table's paired changes (by hand)."""

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from config import grpo  # noqa: E402
from scripts.measure import base_report  # noqa: E402


def test_measure_reads_the_base_its_ceiling_and_the_signal():
    config = grpo.get_config("smoke")
    config.data.num_heldout_conditions = 4
    config.sample.batch_size = config.train.batch_size = 4
    config.sample.k = 2
    r = base_report.measure(config, repeats=3)
    prov = json.loads((ROOT / config.model.pretrained / "provenance.json").read_text())
    steps = prov.get("total_steps", prov["args"]["steps"])  # a staged base counts the steps behind it
    assert r["domain"] == "camera" and r["base"]["total_steps"] == steps and steps >= 3000
    s, ref = r["samples"], r["references"]
    assert s["eval/num_conditions"] == 4 and len(s["rows/eval/cam_score"]) == 4
    assert 0 <= s["eval/cam_score"] <= 1 and 0 <= s["eval/placed_fraction"] <= 1
    # the ground truth against itself: perfect fidelity, the rewards' ceiling; the source clip is another camera
    assert ref["ref_target/fidelity"] == pytest.approx(1.0) and ref["ref_target/psnr"] > 90
    assert ref["ref_source/fidelity"] < 1 and ref["ref_target/cam_score"] > ref["ref_source/cam_score"]
    sig = r["signal"]
    assert sig["repeats"] == 3 and sig["samples_per_epoch"] == 4
    assert math.isfinite(sig["share"]) and sig["share"] <= 1 and sig["ci95"] > 0


def _report(tmp_path, name, steps, values, share):
    report = {"domain": "camera", "base": {"folder": f"/x/{name}", "total_steps": steps},
              "rows": [["cam_score", "eval/cam_score"], ["R@3", "eval/r_precision_top3"]],
              "samples": {"eval/cam_score": float(np.nanmean(np.array(values, dtype=float))),
                          "rows/eval/cam_score": values, "eval/r_precision_top3": 0.5},
              "references": {"ref_target/cam_score": 0.95, "ref_source/cam_score": 0.2},
              "signal": {"share": share, "ci95": 0.01, "repeats": 4, "samples_per_epoch": 128}}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(report))
    return path


def test_table_pairs_each_base_with_the_first_by_hand(tmp_path):
    a = _report(tmp_path, "base_1x", 3000, [0.1, 0.2, 0.4, 0.3], 0.06)
    b = _report(tmp_path, "base_4x", 12000, [0.2, 0.2, 0.7, None], 0.2)
    text = base_report.table([a, b])
    diffs = np.array([0.1, 0.0, 0.3])
    half = 4.302652729911275 * diffs.std(ddof=1) / np.sqrt(3)
    assert "| held-out metric | base_1x (3000 steps) | base_4x (12000 steps) | ref_source | ref_target |" in text
    assert f"| cam_score | 0.2500 | 0.3667 ({diffs.mean():+.4f} ± {half:.4f}) | 0.2000 | 0.9500 |" in text
    assert "| R@3 | 0.5000 | 0.5000 | n/a | n/a |" in text  # a whole-split metric: no pairs, no reference
    assert "0.0600 ± 0.0100 (4 epochs of 128) | 0.2000 ± 0.0100 (4 epochs of 128) |" in text


def test_bases_reported_on_different_held_out_sets_are_refused_by_name(tmp_path):
    a = _report(tmp_path, "base_1x", 3000, [0.1, 0.2, 0.4, 0.3], 0.06)
    b = _report(tmp_path, "base_4x", 12000, [0.2, 0.2, 0.7], 0.2)
    with pytest.raises(SystemExit, match=r"base_1x.json and .*base_4x.json: .*different held-out sets \(4 and 3"):
        base_report.table([a, b])


def test_table_footnote_explains_only_the_references_in_the_reports(tmp_path):
    a = _report(tmp_path, "base_1x", 3000, [0.1, 0.2], 0.06)
    cam = base_report.table([a])
    assert "ref_source: the source clip" in cam and "ref_shuffled" not in cam
    motion = json.loads(a.read_text())
    motion["references"] = {"ref_target/cam_score": 0.95, "ref_shuffled/cam_score": 0.1}
    a.write_text(json.dumps(motion))
    text = base_report.table([a])
    assert "ref_shuffled: each caption given the next condition's ground-truth motion" in text
    assert "ref_source" not in text
