"""scripts/seed_gains.py on hand-written run logs: the reported checkpoint is the one `selected` names, per-run
changes are paired over conditions, and the mean over runs carries its t-interval over runs (by hand)."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts import seed_gains  # noqa: E402

T2 = 4.302652729911275  # t_{0.975, 2}


def _run(root: Path, name: str, base, mid, last, selected: str | None) -> Path:
    run = root / name
    (run / "checkpoints").mkdir(parents=True)
    evals = [("start", "epoch_0000", base), ("epoch_2", "epoch_0002", mid), ("final", "epoch_0004", last)]
    lines = [json.dumps({"type": "epoch", "epoch": 0, "reward_avg": 0.1})]
    for tag, ckpt, rows in evals:
        lines.append(json.dumps({"type": "eval", "tag": tag, "checkpoint": ckpt, "eval/cam_score": float(np.mean(rows)),
                                 "rows/eval/cam_score": rows, "eval/r_precision_top3": float(rows[0])}))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if selected:
        (run / "checkpoints" / "selected").write_text(selected)
    return run


def test_per_run_paired_changes_and_the_interval_over_runs(tmp_path):
    a = _run(tmp_path, "s0", [0.1, 0.2, 0.3], [0.2, 0.2, 0.5], [0.1, 0.3, 0.3], "epoch_0002")
    b = _run(tmp_path, "s1", [0.1, 0.2, 0.3], [0.0, 0.2, 0.3], [0.2, 0.3, 0.4], None)  # reports its last epoch
    c = _run(tmp_path, "s2", [0.1, 0.2, 0.3], [0.1, 0.2, 0.3], [0.1, 0.2, 0.6], "epoch_0004")
    base, rep, last = seed_gains.run_evals(a)
    assert base["tag"] == "start" and rep["checkpoint"] == "epoch_0002" and last["tag"] == "final"
    assert seed_gains.run_evals(b)[1]["tag"] == "final"
    text = seed_gains.main([str(a), str(b), str(c), "--metric", "eval/cam_score", "--metric",
                            "eval/r_precision_top3"])
    d = np.array([0.1, 0.0, 0.2])  # run s0's reported (epoch 2) minus its base, condition by condition
    assert f"| {d.mean():+.4f} ± {T2 * d.std(ddof=1) / np.sqrt(3):.4f} |" in text
    reported = np.array([d.mean(), 0.1, 0.1])  # the three runs' reported changes
    assert f"{reported.mean():+.4f} ± {T2 * reported.std(ddof=1) / np.sqrt(3):.4f}" in text
    # a whole-split metric: per-run changes without an interval, the runs' mean with one
    assert "| +0.1000 | +0.0000 |" in text


def test_an_unfinished_run_is_named(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"type": "eval", "tag": "start", "checkpoint": "epoch_0000"}) + "\n")
    with pytest.raises(SystemExit, match="no start or final evaluation"):
        seed_gains.run_evals(run)
