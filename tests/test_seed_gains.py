"""scripts/seed_gains.py on hand-written run logs: the reported checkpoint is the one `selected` names, per-run
changes are paired over conditions, and the mean over runs carries its t-interval over runs (by hand)."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recam.infra.stats import crossed_interval, holm  # noqa: E402
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
    # over the runs: the seeds x conditions table of reported changes (run s1 reports its last epoch)
    table = np.array([[0.1, 0.0, 0.2], [0.1, 0.1, 0.1], [0.0, 0.0, 0.3]])
    over = crossed_interval(table)
    assert f"| over 3 runs (seeds x conditions) | | | {over.mean:+.4f} ± {over.half:.4f} |" in text
    assert "seeds x conditions, 3 x 3" in text
    # a whole-split metric: per-run changes without an interval, over the runs a t over the seeds (said so)
    assert "| +0.1000 | +0.0000 |" in text
    changes = np.array([0.1, 0.0, 0.0])  # the runs' reported R@3 minus their base (rows[0] of each)
    assert f"{changes.mean():+.4f} ± {T2 * changes.std(ddof=1) / np.sqrt(3):.4f}" in text
    assert "the shared conditions' term is not counted" in text
    # no placebo: the changes are the looks; no endpoint in config.json, so every look is Holm-adjusted
    assert "every look below is Holm-adjusted" in text and "family of 4" in text


def test_an_unfinished_run_is_named(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"type": "eval", "tag": "start", "checkpoint": "epoch_0000"}) + "\n")
    with pytest.raises(SystemExit, match="no start or final evaluation"):
        seed_gains.run_evals(run)


def _config(run: Path, seed: int, placebo: bool) -> Path:
    (run / "config.json").write_text(json.dumps({"seed": seed, "advantage": {"placebo": placebo}}))
    return run


def test_grpo_minus_placebo_paired_by_seed_over_conditions_then_seeds(tmp_path):
    g = [_config(_run(tmp_path, f"g{s}", [0.1, 0.2, 0.3], [0.2, 0.2, 0.4], last, None), s, False)
         for s, last in ((0, [0.3, 0.2, 0.5]), (1, [0.2, 0.4, 0.4]))]
    p = [_config(_run(tmp_path, f"p{s}", [0.1, 0.2, 0.3], [0.1, 0.2, 0.3], last, None), s, True)
         for s, last in ((1, [0.1, 0.3, 0.3]), (0, [0.2, 0.2, 0.2]))]  # listed in another order: paired by seed
    text = seed_gains.main([str(g[0]), str(g[1]), "--placebo", str(p[0]), str(p[1]), "--metric", "eval/cam_score"])
    # GRPO's last minus the placebo's, seed by seed and condition by condition
    diff = crossed_interval([[0.1, 0.0, 0.3], [0.1, 0.1, 0.1]])
    assert f"| {diff.mean:+.4f} ± {diff.half:.4f} |" in text and "seeds x conditions, 2 x 3" in text
    # one seed: GRPO's and the placebo's values paired over the conditions
    text = seed_gains.main([str(g[0]), "--placebo", str(p[1]), "--metric", "eval/cam_score"])
    d = np.array([0.1, 0.0, 0.3])
    assert f"| {d.mean():+.4f} ± {T2 * d.std(ddof=1) / np.sqrt(3):.4f} |" in text
    assert "seed 0: one seed, paired over 3 conditions (conditional on this seed)" in text


def test_a_placebo_scored_on_another_held_out_set_is_refused_not_averaged(tmp_path):
    """Per-condition rows of different lengths are two held-out sets: their difference of means would stand for a
    paired difference (it used to, with a row of one value), so the comparison stops and says both counts."""
    g = _config(_run(tmp_path, "g0", [0.1, 0.2, 0.3], [0.2, 0.2, 0.4], [0.3, 0.2, 0.5], None), 0, False)
    p = _config(_run(tmp_path, "p0", [0.1, 0.2], [0.1, 0.2], [0.1, 0.3], None), 0, True)
    with pytest.raises(SystemExit, match=r"different held-out sets \(2 and 3 conditions\)"):
        seed_gains.main([str(g), "--placebo", str(p), "--metric", "eval/cam_score"])
    # a metric over the whole split (no rows) is still a difference of the means
    assert seed_gains.eval_change({"eval/x": 0.25}, {"eval/x": 0.5}, "eval/x")[:1] == (0.25,)


def test_grpo_minus_placebo_without_matching_seeds(tmp_path):
    """Arms whose seeds do not pair: a metric with per-condition values gets the two-way bootstrap over each arm's
    runs and the shared conditions; a metric over the whole split, Welch's interval over the runs."""
    from scipy import stats

    g = [_config(_run(tmp_path, f"g{s}", [0.1, 0.2, 0.3], [0.1, 0.2, 0.3], last, None), s, False)
         for s, last in ((0, [0.3, 0.2, 0.5]), (1, [0.2, 0.4, 0.4]), (2, [0.1, 0.2, 0.4]))]
    p = [_config(_run(tmp_path, f"p{s}", [0.1, 0.2, 0.3], [0.1, 0.2, 0.3], last, None), s, True)
         for s, last in ((5, [0.1, 0.3, 0.3]), (6, [0.2, 0.2, 0.2]))]
    text = seed_gains.main([*map(str, g), "--placebo", *map(str, p), "--metric", "eval/cam_score", "--metric",
                            "eval/r_precision_top3"])
    x = np.array([np.mean([0.2, 0.0, 0.2]), np.mean([0.1, 0.2, 0.1]), np.mean([0.0, 0.0, 0.1])])
    y = np.array([np.mean([0.0, 0.1, 0.0]), np.mean([0.1, 0.0, -0.1])])
    assert f"| {x.mean() - y.mean():+.4f} [" in text and "two-way bootstrap over each arm's runs (3 and 2)" in text
    # R@3 is rows[0] of each evaluation, with no per-condition values: Welch over the runs' changes
    x, y = np.array([0.2, 0.1, 0.0]), np.array([0.0, 0.1])
    vx, vy = x.var(ddof=1) / 3, y.var(ddof=1) / 2
    df = (vx + vy) ** 2 / (vx ** 2 / 2 + vy ** 2 / 1)
    half = stats.t.ppf(0.975, df) * np.sqrt(vx + vy)
    assert f"| {x.mean() - y.mean():+.4f} ± {half:.4f} |" in text and f"Welch over 3 and 2 runs (df {df:.1f})" in text


def test_a_run_without_the_placebo_flag_is_refused_as_placebo(tmp_path):
    g = _config(_run(tmp_path, "g", [0.1], [0.1], [0.2], None), 0, False)
    p = _config(_run(tmp_path, "p", [0.1], [0.1], [0.2], None), 0, False)
    with pytest.raises(SystemExit, match="not a placebo run"):
        seed_gains.main([str(g), "--placebo", str(p), "--metric", "eval/cam_score"])


def _curve_run(root: Path, name: str, seed: int, placebo: bool, evals) -> Path:
    """A run evaluated after (epochs trained, per-condition cam_score) pairs, 64 samples and two optimizer steps an
    epoch (so a grid built on steps would be twice too long)."""
    run = root / name
    run.mkdir(parents=True)
    lines = [json.dumps({"type": "epoch", "epoch": 0, "samples_per_epoch": 64})]
    tags = ["start"] + [f"epoch_{n}" for n, _ in evals[1:-1]] + ["final"]
    lines += [json.dumps({"type": "eval", "tag": tag, "epoch": n - 1, "step": 2 * n,
                          "eval/cam_score": float(np.mean(rows)), "rows/eval/cam_score": rows})
              for tag, (n, rows) in zip(tags, evals, strict=True)]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return _config(run, seed, placebo)


def test_the_held_out_curve_on_the_sample_grid_by_hand(tmp_path):
    base = [0.1, 0.2, 0.3]
    g = [_curve_run(tmp_path, "g0", 0, False, [(0, base), (2, [0.2, 0.2, 0.4]), (4, [0.3, 0.3, 0.3])]),
         _curve_run(tmp_path, "g1", 1, False, [(0, base), (2, [0.1, 0.3, 0.3]), (4, [0.0, 0.0, 0.0]),
                                               (4, [0.2, 0.4, 0.3])])]  # the later of two after epoch 4 is kept
    p = [_curve_run(tmp_path, "p1", 1, True, [(0, base), (2, [0.1, 0.2, 0.3]), (4, [0.1, 0.2, 0.4]), (6, base)]),
         _curve_run(tmp_path, "p0", 0, True, [(0, base), (2, [0.1, 0.1, 0.3]), (4, [0.2, 0.2, 0.2])])]
    rows = seed_gains.curve_rows(g, p, "eval/cam_score")
    assert [r["samples"] for r in rows] == [0, 128, 256]  # epoch 6 is not on every run's grid
    assert rows[0]["grpo"].mean == 0 and rows[0]["difference"].mean == 0
    grpo = crossed_interval([[0.1, 0.0, 0.1], [0.0, 0.1, 0.0]])  # the seeds' changes at 128 samples
    assert (rows[1]["grpo"].mean, rows[1]["grpo"].half) == pytest.approx((grpo.mean, grpo.half))
    diff = crossed_interval([[0.1, 0.1, 0.1], [0.1, 0.2, -0.1]])  # seeds 0, 1: GRPO minus placebo at 256
    assert (rows[2]["difference"].mean, rows[2]["difference"].half) == pytest.approx((diff.mean, diff.half))
    # the placebo of seed 1 went on to epoch 6: 256 samples is not every run's last evaluation, so its own look
    assert rows[2]["key"] == ("eval/cam_score", "256 samples")
    text = seed_gains.main([str(g[0]), str(g[1]), "--placebo", str(p[0]), str(p[1]), "--metric", "eval/cam_score",
                            "--curve", str(tmp_path / "curve")])
    assert "| 256 |" in text and (tmp_path / "curve" / "curve_eval_cam_score.png").stat().st_size > 1000
    with pytest.raises(SystemExit, match="--placebo"):
        seed_gains.main([str(g[0]), "--metric", "eval/cam_score", "--curve", str(tmp_path / "c2")])


def test_batch_means_interval_against_numpy():
    from scipy import stats as sst

    from recam.infra.stats import batch_means_interval

    rng = np.random.default_rng(3)
    series = rng.normal(0.01, 0.02, size=67)  # 67 = 8 blocks of 8 and 3 early values left out
    mean, half, used = batch_means_interval(series, 8)
    blocks = series[3:].reshape(8, 8).mean(axis=1)
    assert used == 64
    assert mean == pytest.approx(blocks.mean(), rel=1e-12)
    assert half == pytest.approx(sst.t.ppf(0.975, 7) * blocks.std(ddof=1) / np.sqrt(8), rel=1e-9)
    m, h, n = batch_means_interval([0.1, 0.3], 8)  # fewer values than blocks: a mean, no interval
    assert m == pytest.approx(0.2) and np.isnan(h) and n == 2
    with pytest.raises(ValueError, match="finite"):
        batch_means_interval([0.1, float("nan")], 2)
    with pytest.raises(ValueError, match="blocks"):
        batch_means_interval([0.1, 0.2], 1)


def _train_run(root: Path, name: str, seed: int, placebo: bool, rewards, indices) -> Path:
    """A finished run whose epoch e trained on conditions indices[e] with per-sample cam_score rewards[e]."""
    run = _run(root, name, [0.1, 0.2], [0.1, 0.2], [0.1, 0.2], None)
    lines = [json.dumps({"type": "epoch", "epoch": e, "samples_per_epoch": len(r), "dataset_indices": idx,
                         "rewards/cam_score": r}) for e, (r, idx) in enumerate(zip(rewards, indices, strict=True))]
    evals = [x for x in (run / "metrics.jsonl").read_text().splitlines() if json.loads(x)["type"] == "eval"]
    (run / "metrics.jsonl").write_text("\n".join(lines + evals) + "\n")
    return _config(run, seed, placebo)


def test_training_reward_gap_epoch_by_epoch_by_hand(tmp_path):
    from scipy import stats as sst

    rng = np.random.default_rng(0)
    epochs, per = 16, 4
    idx = [[int(i)] * per for i in rng.integers(0, 100, size=epochs)]
    g_rw = rng.uniform(0, 1, size=(epochs, per))
    p_rw = rng.uniform(0, 1, size=(epochs, per))
    p_rw[5, 2] = float("nan")  # a failed sample is left out of its epoch's mean
    g = _train_run(tmp_path, "g0", 0, False, g_rw.tolist(), idx)
    p = _train_run(tmp_path, "p0", 0, True, p_rw.tolist(), idx)
    gap = seed_gains.train_reward_gap([g], [p], "cam_score", blocks=4)
    assert "conditional on this run pair" in gap["how"]
    diffs = [g_rw[e].mean() - np.nanmean(p_rw[e]) for e in range(epochs)]  # a loop, epoch by epoch
    block_means = [np.mean(diffs[b * 4:(b + 1) * 4]) for b in range(4)]
    assert gap["overall"][0] == pytest.approx(np.mean(diffs), rel=1e-9)
    assert gap["overall"][1] == pytest.approx(sst.t.ppf(0.975, 3) * np.std(block_means, ddof=1) / 2, rel=1e-9)
    assert [r["difference"] for r in gap["rows"]] == pytest.approx(block_means, rel=1e-9)
    assert gap["rows"][1]["epochs"] == (4, 7) and gap["rows"][1]["samples"] == 8 * per
    later = [np.mean(diffs[8:12]), np.mean(diffs[12:16])]  # the later half in 2 blocks (blocks_for(8))
    assert gap["later_half"][0] == pytest.approx(np.mean(later), rel=1e-9)
    text = seed_gains.main([str(g), "--placebo", str(p), "--metric", "eval/cam_score", "--train-reward", "cam_score"])
    # 16 epochs make 2 blocks of 8 by default: blocks of at least MIN_BLOCK epochs, 2 at least
    assert f"{np.mean(diffs):+.4f} ± " in text and "seed 0, 16 epochs in 2 blocks" in text
    p_rw[9, :] = float("nan")  # an epoch whose samples all failed: left out, and said
    p2 = _train_run(tmp_path, "p0nan", 0, True, p_rw.tolist(), idx)
    gap = seed_gains.train_reward_gap([g], [p2], "cam_score", blocks=5)
    kept = [d for e, d in enumerate(diffs) if e != 9]
    assert gap["overall"][0] == pytest.approx(np.mean(kept), rel=1e-9) and "1 epoch(s)" in gap["how"]


def test_training_reward_gap_refuses_runs_that_drew_other_conditions(tmp_path):
    idx = [[1, 1], [2, 2]]
    g = _train_run(tmp_path, "g0", 0, False, [[0.1, 0.2], [0.3, 0.4]], idx)
    p = _train_run(tmp_path, "p0", 0, True, [[0.1, 0.2], [0.3, 0.4]], [[1, 1], [3, 3]])
    with pytest.raises(SystemExit, match="different conditions at epoch 1"):
        seed_gains.train_reward_gap([g], [p], "cam_score")
    q = _train_run(tmp_path, "p1", 1, True, [[0.1, 0.2], [0.3, 0.4]], idx)
    with pytest.raises(SystemExit, match="same seeds"):
        seed_gains.train_reward_gap([g], [q], "cam_score")
    with pytest.raises(SystemExit, match="no training reward 'fidelity'.*cam_score"):
        seed_gains.train_reward_gap([g], [_train_run(tmp_path, "p0b", 0, True, [[0.1, 0.2], [0.3, 0.4]], idx)],
                                    "fidelity")


def test_training_reward_gap_over_seeds_on_the_epochs_every_seed_has(tmp_path):
    rng = np.random.default_rng(1)
    idx = [[e, e] for e in range(8)]
    diffs = []
    for seed in (0, 1):
        g_rw, p_rw = rng.uniform(0, 1, size=(8, 2)), rng.uniform(0, 1, size=(8, 2))
        if seed == 1:
            p_rw[3, :] = float("nan")  # seed 1 has no epoch 3: both seeds are compared without it
        _train_run(tmp_path, f"g{seed}", seed, False, g_rw.tolist(), idx)
        _train_run(tmp_path, f"p{seed}", seed, True, p_rw.tolist(), idx)
        diffs.append([g_rw[e].mean() - p_rw[e].mean() for e in range(8) if e != 3])
    gap = seed_gains.train_reward_gap([tmp_path / "g0", tmp_path / "g1"], [tmp_path / "p0", tmp_path / "p1"],
                                      "cam_score", blocks=7)
    per_seed = [np.mean(d) for d in diffs]  # 7 epochs each, one block of one epoch each
    assert gap["epochs"] == 7 and gap["overall"][0] == pytest.approx(np.mean(per_seed), rel=1e-9)
    # over seeds: the seeds x blocks interval (the blocks are the same epochs for both seeds)
    assert gap["overall"][1] == pytest.approx(crossed_interval(diffs).half, rel=1e-9)
    assert "2 seeds x 7 blocks" in gap["how"]
    assert [r["epochs"][0] for r in gap["rows"]] == [0, 1, 2, 4, 5, 6, 7]


def _endpoint_config(run: Path, seed: int, placebo: bool, primary="eval/cam_score", time="last",
                     secondary="eval/r_precision_top3") -> Path:
    (run / "config.json").write_text(json.dumps({
        "seed": seed, "advantage": {"placebo": placebo},
        "eval": {"primary_endpoint": primary, "primary_time": time, "secondary_endpoints": secondary}}))
    return run


def test_the_synthetic_three_pairs_whose_difference_is_the_conditions(tmp_path):
    """Three seed pairs on 64 shared conditions whose GRPO-minus-placebo is a condition effect (sd 0.05) shared by
    the seeds plus tiny seed noise, true difference 0: the t over the seeds' means said +0.0034 +- 0.0005; the
    seeds x conditions interval contains 0 and is at least +-0.007 wide."""
    rng = np.random.default_rng(0)
    base = rng.uniform(0.1, 0.3, 64)
    effect = rng.normal(0, 0.05, 64)
    effect -= effect.mean() - 0.0034  # the mean the issue's seeds saw: all of it the conditions'
    g, p = [], []
    for seed in range(3):
        placebo_last = base + rng.normal(0, 0.02, 64)
        grpo_last = placebo_last + effect + rng.normal(0, 0.0005, 64)
        g.append(_endpoint_config(_run(tmp_path, f"g{seed}", base.tolist(), base.tolist(), grpo_last.tolist(),
                                       None), seed, False))
        p.append(_endpoint_config(_run(tmp_path, f"p{seed}", base.tolist(), base.tolist(), placebo_last.tolist(),
                                       None), seed, True))
    est = seed_gains.grpo_minus_placebo(g, p, "eval/cam_score", 2)
    assert abs(est.mean) <= est.half and est.half >= 0.007
    naive = np.array([np.mean(np.array(a) - np.array(b)) for a, b in zip(
        [seed_gains.run_evals(r)[2]["rows/eval/cam_score"] for r in g],
        [seed_gains.run_evals(r)[2]["rows/eval/cam_score"] for r in p], strict=True)])
    assert T2 * naive.std(ddof=1) / np.sqrt(3) < 0.002  # what the t over seeds gave: far too narrow
    # the endpoints come from config.json: cam_score at the last epoch is the primary, unadjusted
    text = seed_gains.main([*map(str, g), "--placebo", *map(str, p), "--power", "0.011"])
    assert "primary, named before the runs: **eval/cam_score at the last epoch**" in text
    assert "does not clear 0" in text and "(primary, unadjusted)" in text
    assert "**eval/r_precision_top3: GRPO against its placebo**" in text  # the secondary, from config.json
    assert "Power for a true difference of +0.0110" in text and "seed pairs for 80% on 64 conditions" in text
    # each condition count once: this design's 64 among the usual sizes
    assert "| seed pairs | 32 conditions | 64 conditions | 128 conditions | 512 conditions |" in text


def test_primary_unadjusted_and_the_rest_holm_adjusted_with_the_curve_counted(tmp_path):
    """Two seeds; every look but the primary goes into one Holm family, and the curve counts its grid points that
    clear 0 after the adjustment."""
    base = [0.1, 0.2, 0.3, 0.4]
    g = [_curve_run(tmp_path, f"g{s}", s, False, [(0, base), (2, [0.15, 0.26, 0.34, 0.47]),
                                                   (4, [0.2, 0.31, 0.39, 0.52])]) for s in (0, 1)]
    p = [_curve_run(tmp_path, f"p{s}", s, True, [(0, base), (2, [0.1, 0.21, 0.3, 0.41]),
                                                  (4, [0.1, 0.2, 0.31, 0.4])]) for s in (0, 1)]
    for run in g + p:
        cfg = json.loads((run / "config.json").read_text())
        _endpoint_config(run, cfg["seed"], cfg["advantage"]["placebo"], secondary="")
    # the curve runs' evaluations carry no selected checkpoint: reported = last
    text = seed_gains.main([*map(str, g), "--placebo", *map(str, p), "--curve", str(tmp_path / "c")])
    looks = {}
    for which in ("reported", "last"):
        looks[which] = seed_gains.grpo_minus_placebo(g, p, "eval/cam_score", seed_gains.TIMES[which])
    mid = crossed_interval([[0.05, 0.05, 0.04, 0.06], [0.05, 0.05, 0.04, 0.06]])
    # the family: the reported checkpoint and the curve's 128-sample point (256 is the last epoch, the primary)
    adjusted = holm([looks["reported"].p, mid.p])
    assert f"{seed_gains.fmt_p(looks['reported'].p)} / {seed_gains.fmt_p(adjusted[0])}" in text
    assert "other looks, Holm-adjusted as one family of 2" in text
    cleared = sum(a < 0.05 for a in adjusted[1:]) + (looks["last"].p < 0.05)
    assert f"clears 0 at {cleared} of 2 grid points after Holm's adjustment" in text


def test_runs_that_name_different_endpoints_are_refused(tmp_path):
    a = _endpoint_config(_run(tmp_path, "a", [0.1], [0.1], [0.2], None), 0, False)
    b = _endpoint_config(_run(tmp_path, "b", [0.1], [0.1], [0.2], None), 1, False, primary="eval/fidelity")
    with pytest.raises(SystemExit, match="different endpoints"):
        seed_gains.main([str(a), str(b)])
    c = _run(tmp_path, "c", [0.1], [0.1], [0.2], None)
    with pytest.raises(SystemExit, match="names no endpoints"):
        seed_gains.main([str(c)])
    text = seed_gains.main([str(c), "--primary", "eval/cam_score:reported"])  # older runs: named on the command
    assert "**eval/cam_score at the reported checkpoint**" in text


def test_the_arms_guard_events_and_step_cosines_are_compared(tmp_path):
    """Beside GRPO minus placebo: each arm's guard events (the placebo was rolled back once here) and GRPO's step
    cosine against the placebo's, as recam.engine.diagnosis.cosine_difference computes it, in the Holm family."""
    from recam.engine.diagnosis import cosine_difference

    rng = np.random.default_rng(9)
    cos = {}
    runs = {}
    for arm, placebo in (("g", False), ("p", True)):
        run = _config(_run(tmp_path, arm, [0.1, 0.2, 0.3], [0.1, 0.2, 0.3], [0.2, 0.2, 0.4], None), 0, placebo)
        cos[arm] = (rng.normal(0.02 if arm == "g" else 0.0, 0.01, 40)).tolist()
        steps = [json.dumps({"type": "step", "step": i + 1, "grad_cosine_prev": c}) for i, c in enumerate(cos[arm])]
        with (run / "metrics.jsonl").open("a") as f:
            f.write("\n".join(steps) + "\n")
        runs[arm] = run
    (runs["p"] / "rolled_back.jsonl").write_text(json.dumps({
        "type": "health", "step": 3, "epoch": 1, "rolled_back": "rollback 1: ratio_explosion",
        "findings": [{"rule": "ratio_explosion", "severity": "critical", "numbers": {}}]}) + "\n")
    text = seed_gains.main([str(runs["g"]), "--placebo", str(runs["p"]), "--metric", "eval/cam_score"])
    d = cosine_difference([cos["g"]], [cos["p"]])
    assert f"{d['difference']:+.4f} ± {d['half']:.4f} (p / adjusted" in text
    assert "**Guard events per arm**" in text and "ratio_explosion" in text
    rows = [line for line in text.splitlines() if line.startswith("| placebo |")]
    assert len(rows) == 1 and "| 1 |" in rows[0]  # the placebo's one rollback
