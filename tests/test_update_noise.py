"""How much of an update is signal: grad_cosine_prev, the update_noise finding, scripts/measure/gradient_agreement.py,
and sample.same_initial_noise."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recam.engine.diagnosis import diagnose_run, rule_update_noise  # noqa: E402
from recam.engine.health import (  # noqa: E402
    GradientCosine,
    Thresholds,
    flat_cosine,
)
from recam.infra.stats import mean_interval, t975  # noqa: E402
from scripts.measure.gradient_agreement import (  # noqa: E402
    agreement,
    epoch_gradients,
    samples_for_half,
    share_interval,
    table,
    update_record,
)


def test_flat_cosine_is_the_cosine_of_the_concatenated_vectors():
    g = torch.Generator().manual_seed(0)
    a = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g)]
    b = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g)]
    expected = torch.nn.functional.cosine_similarity(torch.cat([x.flatten() for x in a]),
                                                     torch.cat([x.flatten() for x in b]), dim=0)
    assert flat_cosine(a, b) == pytest.approx(float(expected), abs=1e-6)
    assert flat_cosine(a, [-x for x in a]) == pytest.approx(-1.0)
    assert math.isnan(flat_cosine(a, [torch.zeros_like(x) for x in a]))


def test_sharded_cosine_sums_over_the_shards_and_a_zero_gradient_gives_none():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(10, generator=g), torch.randn(10, generator=g)
    # two processes' shards (FSDP): this one holds the first 4 elements, reduce adds the other's three sums
    other = torch.stack([(a[4:] * b[4:]).sum(), (a[4:] ** 2).sum(), (b[4:] ** 2).sum()])
    assert flat_cosine([a[:4]], [b[:4]], reduce=lambda t: t + other) == pytest.approx(
        float(torch.nn.functional.cosine_similarity(a, b, dim=0)), abs=1e-6)
    cosine = GradientCosine()
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.zeros(3)
    assert cosine([p]) is None  # the first step
    p.grad = torch.ones(3)
    assert cosine([p]) is None  # the previous gradient was zero: no direction, not NaN (the guard reads NaN)
    p.grad = torch.full((3,), 2.0)
    assert cosine([p]) == pytest.approx(1.0)


def _steps(cosines, samples=32):
    return [{"step": i + 1, "epoch": i // 2, "grad_cosine_prev": c, "step_samples": samples}
            for i, c in enumerate(cosines)]


def test_update_noise_fires_with_the_samples_a_cosine_of_one_half_would_take():
    # mean 0.01; the blocks of 5 steps drift (-0.003, -0.001, +0.001, +0.003), as correlated steps do
    cos = [0.01 + 0.002 * ((i % 5) - 2) + 0.002 * (i // 5 - 1.5) for i in range(20)]
    [f] = rule_update_noise(_steps(cos), Thresholds())
    # batch means by hand: 4 blocks of 5 steps, a t-interval over the 4 block means (t_{0.975, 3} = 3.182)
    blocks = [statistics.fmean(cos[5 * b:5 * b + 5]) for b in range(4)]
    mean, half = statistics.fmean(cos), 3.182 * statistics.stdev(blocks) / math.sqrt(4)
    assert half > 2.093 * statistics.stdev(cos) / math.sqrt(20)  # wider than the t over steps would be
    assert f.rule == "update_noise" and f.severity == "info"
    assert f.numbers["mean_grad_cosine"] == pytest.approx(mean)
    assert f.numbers["interval_95"] == pytest.approx(half, rel=3e-4)  # t printed to 3 decimals
    assert f.numbers["interval"] == "batch means over 4 blocks" and f.numbers["steps_used"] == 20
    assert f.numbers["samples_for_cosine_half"] == pytest.approx(32 * (1 - mean) / mean)  # 3168
    assert f.numbers["samples_for_cosine_half_at_least"] == pytest.approx(32 * (1 - mean - half) / (mean + half),
                                                                          rel=3e-4)
    assert "3168 samples per step" in f.explanation
    # a run whose steps agree, too few steps, and cosines that could not be computed: no finding
    assert rule_update_noise(_steps([0.4] * 20), Thresholds()) == []
    assert rule_update_noise(_steps(cos[:9]), Thresholds()) == []
    assert rule_update_noise(_steps([float("nan")] * 20), Thresholds()) == []


def test_the_step_cosine_s_interval_drops_the_earliest_steps_that_fill_no_block_and_falls_back_to_t():
    from recam.engine.diagnosis import cosine_interval

    cos = [0.5, -0.5] + [0.01 + 0.001 * (i % 3) + 0.0005 * (i // 5) for i in range(20)]  # 22 steps, 2 left over
    [f] = rule_update_noise(_steps(cos), Thresholds())
    blocks = [statistics.fmean(cos[2 + 5 * b:7 + 5 * b]) for b in range(4)]
    assert f.numbers["mean_grad_cosine"] == pytest.approx(statistics.fmean(cos[2:]))
    assert f.numbers["interval_95"] == pytest.approx(3.182 * statistics.stdev(blocks) / 2, rel=3e-4)
    assert f.numbers["steps"] == 22 and f.numbers["steps_used"] == 20
    assert "batch means over 4 blocks, the last 20 of 22 steps" in f.explanation
    # fewer than 8 steps: the t over steps, said to be too narrow
    few = [0.01, 0.012, 0.008, 0.011, 0.009, 0.01, 0.012]
    mean, half, used, how = cosine_interval(few)
    assert (mean, used) == (pytest.approx(statistics.fmean(few)), 7) and "t over steps" in how and "narrow" in how
    assert half == pytest.approx(2.447 * statistics.stdev(few) / math.sqrt(7), rel=3e-4)  # t_{0.975, 6}
    [f] = rule_update_noise(_steps(few), Thresholds(update_noise_min_steps=5))
    assert "t over steps" in f.explanation


def test_update_noise_without_agreement_gives_only_a_lower_bound_and_reaches_diagnose_run():
    cos = [0.02 * (-1) ** i for i in range(30)]  # mean 0: no signal measurable
    [f] = rule_update_noise(_steps(cos, samples=64), Thresholds())
    assert "samples_for_cosine_half" not in f.numbers and "at least" in f.explanation
    records = [{"type": "step", **s} for s in _steps(cos, samples=64)]
    found = {x.rule: x for x in diagnose_run(records)}
    assert found["update_noise"].severity == "info"  # a run stays healthy; the report says why it learns slowly
    # steps that oppose each other (an oscillating update): no number is extrapolated from them
    [f] = rule_update_noise(_steps([-0.3 + 0.01 * (i % 2) for i in range(20)]), Thresholds())
    assert "No agreement is measurable" in f.explanation
    assert not any(k.startswith("samples_for") for k in f.numbers)


def test_agreement_against_a_loop_and_a_known_signal_share():
    g = torch.Generator().manual_seed(1)
    small = torch.randn(3, 7, generator=g)
    a = agreement(small)
    pairs = [(0, 1), (0, 2), (1, 2)]
    cos = [float(small[i] @ small[j] / (small[i].norm() * small[j].norm())) for i, j in pairs]
    assert a["cosine"] == pytest.approx(sum(cos) / 3, abs=1e-6)
    assert a["signal_sq"] == pytest.approx(sum(float(small[i] @ small[j]) for i, j in pairs) / 3, abs=1e-5)
    assert a["total_sq"] == pytest.approx(float((small ** 2).sum(1).mean()), abs=1e-5)
    # s with |s|^2 = 1 plus noise of total variance 0.8: share 1 / 1.8
    D, R = 4000, 40
    s = torch.randn(D, generator=g)
    s = s / s.norm()
    draws = s + torch.randn(R, D, generator=g) * math.sqrt(0.8 / D)
    assert agreement(draws)["signal_share"] == pytest.approx(1 / 1.8, abs=0.03)
    assert samples_for_half(0.5, 64) == 64 and samples_for_half(0.01, 64) == pytest.approx(6336)
    assert samples_for_half(-0.01, 64) == math.inf
    with pytest.raises(ValueError, match="at least 2"):
        agreement(small[:1])


def test_share_interval_is_the_jackknife_of_a_loop():
    g = torch.randn(5, 40, generator=torch.Generator().manual_seed(3), dtype=torch.float64) + 0.4

    def share(rows):  # mean pairwise dot product over mean squared norm, by hand
        dots = [float(rows[a] @ rows[b]) for a in range(len(rows)) for b in range(a + 1, len(rows))]
        return (sum(dots) / len(dots)) / (sum(float(r @ r) for r in rows) / len(rows))

    loo = [share([g[i] for i in range(5) if i != r]) for r in range(5)]
    centre = sum(loo) / 5
    se = math.sqrt(4 / 5 * sum((x - centre) ** 2 for x in loo))
    got, half = share_interval(g)
    assert got == pytest.approx(share(list(g)), rel=1e-9) and half == pytest.approx(2.776 * se, rel=2e-4)
    with pytest.raises(ValueError, match="at least 3"):
        share_interval(g[:2])


def test_update_record_prices_the_signal_in_seconds(tmp_path):
    # 4 epochs of 2 trained steps: the record is about the whole update (the steps summed)
    G = torch.randn(4, 2, 30, generator=torch.Generator().manual_seed(5), dtype=torch.float64) + 0.3
    seconds = [{"sample": 3.0 + e, "train": 1.0} for e in range(4)]
    r = update_record(G, 16, seconds, "nft", ["gradient_agreement.py", "--repeats", "4"])
    share, half = share_interval(G.sum(1))
    assert r["share"] == pytest.approx(share) and r["ci95"] == pytest.approx(half) and r["repeats"] == 4
    per_sample = (4.0 + 5.0 + 6.0 + 7.0) / (4 * 16)  # seconds per sample by hand: 22 s over 64 samples
    assert r["seconds_per_sample"] == pytest.approx(per_sample)
    assert r["samples_for_half"] == pytest.approx(16 * (1 - share) / share)
    assert r["seconds_for_half"] == pytest.approx(16 * (1 - share) / share * per_sample)
    assert r["samples_for_half_at_least"] == pytest.approx(samples_for_half(share + half, 16))
    path = tmp_path / "nft.json"
    path.write_text(json.dumps(r))
    rows = table([str(path)]).splitlines()
    assert len(rows) == 3 and rows[2].startswith(f"| nft | {share:.3f} ± {half:.3f} |")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(SystemExit, match="bad.json: not a gradient_agreement record"):
        table([str(tmp_path / "bad.json")])


def test_t_quantiles_and_mean_interval():
    # printed tables of Student's t (two-sided 95%), not the scipy call t975 makes
    for df, printed in ((1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (19, 2.093), (30, 2.042), (120, 1.980)):
        assert t975(df) == pytest.approx(printed, abs=5e-4)
    assert 1.96 < t975(10_000) < 1.961
    with pytest.raises(ValueError, match="degrees of freedom"):
        t975(0)
    mean, half = mean_interval([1.0, 2.0, 4.0, None, float("nan")])
    assert mean == pytest.approx(7 / 3) and half == pytest.approx(4.303 * statistics.stdev([1, 2, 4]) / math.sqrt(3),
                                                                        rel=2e-4)


def _toy_trainer(tmp_path: Path, **sample):
    from tests.toy_trainer import toy_trainer

    settings = {"toy.pretrain_steps": 50, "sample.num_batches_per_epoch": 2,  # 64 samples = 8 conditions x k 8
                "train.gradient_accumulation_steps": 1}
    return toy_trainer(tmp_path, "toy", {**settings, **{f"sample.{k}": v for k, v in sample.items()}})


def test_same_initial_noise_starts_a_condition_s_copies_together(tmp_path):
    shared = _toy_trainer(tmp_path / "a", same_initial_noise=True)
    own = _toy_trainer(tmp_path / "b")
    for trainer, together in ((shared, True), (own, False)):
        r = trainer.sample(0)
        trainer.runner.collect()
        start = r.states[:, 0]  # the window starts at step 0: the initial noise
        for i in r.index.unique():
            group = start[r.index == i]
            assert len(group) == trainer.config.sample.k
            assert bool((group == group[0]).all()) is together
        assert len({tuple(x.tolist()) for x in start}) == (len(r.index.unique()) if together else len(start))
        trainer.runner.close()


def test_the_script_s_per_step_split_sums_to_the_trainer_s_gradient_and_runs_log_the_cosine(tmp_path):
    trainer = _toy_trainer(tmp_path)
    per_step, n = epoch_gradients(trainer, 0)
    assert per_step.shape[0] == trainer.scheduler.num_train_steps and n == 64
    # the same epoch through the trainer's own update, its gradient read at the one optimizer step
    trainer2 = _toy_trainer(tmp_path / "again")
    trainer2.config.train.gradient_accumulation_steps = 2  # the epoch's 2 micro-batches in one step
    captured = []

    def capture(acc_metrics, signal, kept=0):
        captured.append(torch.cat([p.grad.flatten().double() for p in trainer2.policy.parameters()]))
        trainer2.optimizer.zero_grad(set_to_none=True)
        from recam.engine.containers import StepStats
        return StepStats(1, {}, [], True)
    trainer2.optimizer_step = capture
    rollouts = trainer2.sample(0)
    trainer2.update(rollouts, trainer2.advantages(rollouts, trainer2.score()), {})
    # fp32 gradients summed in two orders: agree to fp32 rounding of the largest entry, not of each tiny one
    torch.testing.assert_close(per_step.sum(0), captured[0], rtol=1e-5, atol=1e-6 * float(captured[0].abs().max()))
    for t in (trainer, trainer2):
        t.runner.close()
    # a real run logs the cosine from its second optimizer step on, and the samples each step averaged
    trainer3 = _toy_trainer(tmp_path / "run")
    trainer3.config.num_epochs, trainer3.config.eval.freq = 2, 100
    import contextlib
    import io
    with contextlib.redirect_stdout(io.StringIO()):
        trainer3.train()
    steps = list(trainer3.history)
    assert "grad_cosine_prev" not in steps[0] and len(steps) == 4
    assert all(-1 <= s["grad_cosine_prev"] <= 1 for s in steps[1:])
    assert [s["step_samples"] for s in steps] == [32] * 4


def test_signal_sweep_runs_each_setting_once_and_resumes(tmp_path):
    """scripts/measure/signal_sweep.sh with a stand-in for python that records its arguments and writes each --out:
    every setting is run once with its overrides, a rerun skips the finished ones, and the table gets every record."""
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "fake_python"
    fake.write_text(f"""#!/usr/bin/env bash
echo "$*" >> {calls}
args=("$@")
for i in "${{!args[@]}}"; do
  if [ "${{args[$i]}}" = --out ]; then echo '{{}}' > "${{args[$((i + 1))]}}"; fi
done
""")
    fake.chmod(0o755)
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "motion"

    def sweep(*extra, folder=out):
        return subprocess.run(["bash", str(root / "scripts/measure/signal_sweep.sh"), "motion", str(folder), "3",
                               *extra],
                              env={**os.environ, "PYTHON": str(fake)}, capture_output=True, text=True,
                              check=True)

    sweep()
    lines = calls.read_text().splitlines()
    runs = [x for x in lines if "--out" in x]
    tables = [x for x in lines if x.startswith("scripts/measure/gradient_agreement.py --table")]
    assert len(runs) == 11 and len(tables) == 1 and len(tables[0].split(",")) == 11
    assert all("--config.num_threads=1" in x and "--repeats 3" in x for x in runs)
    k16 = next(x for x in runs if "--label k 16" in x)
    assert "--config.sample.k=16 --config.sample.batch_size=16 --config.sample.num_batches_per_epoch=4" in k16
    assert any("config/grpo.py:motion_tiny_cpu+nft" in x for x in runs)
    assert json.loads((out / "nft.json").read_text()) == {}
    calls.write_text("")
    sweep()  # resumed: nothing left to run, the table again
    assert [x for x in calls.read_text().splitlines() if "--out" in x] == []
    calls.write_text("")
    sweep("motion_tiny_gpu", folder=tmp_path / "gpu")  # a GPU preset: its own threads, its batches hold 16
    gpu = [x for x in calls.read_text().splitlines() if "--out" in x]
    assert len(gpu) == 11 and not any("num_threads" in x for x in gpu)
    assert all("config/grpo.py:motion_tiny_gpu" in x for x in gpu)
    assert next(x for x in gpu if "--label k 16" in x).endswith("--config.sample.k=16")


def test_step_cosines_are_the_finite_cosines_of_step_records_in_order():
    from recam.engine.diagnosis import step_cosines

    records = [{"type": "step", "step": 1}, {"type": "step", "step": 2, "grad_cosine_prev": 0.2},
               {"type": "epoch", "epoch": 0, "grad_cosine_prev": 0.9},  # not a step
               {"step": 3, "grad_cosine_prev": -0.1},  # untyped: a step, as diagnose_run reads it
               {"type": "step", "step": 4, "grad_cosine_prev": float("nan")},
               {"type": "step", "step": 5, "grad_cosine_prev": None},
               {"type": "step", "step": 6, "grad_cosine_prev": True},  # JSON true is no number
               {"type": "step", "step": 7, "grad_cosine_prev": 0.05}]
    assert step_cosines(records) == [0.2, -0.1, 0.05]


def _welch_by_hand(a, b):
    """mean(a) - mean(b) and its 95% Welch half-width, written out, the quantile from scipy."""
    from scipy import stats

    va, vb = np.var(a, ddof=1) / len(a), np.var(b, ddof=1) / len(b)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    return np.mean(a) - np.mean(b), stats.t.ppf(0.975, df) * math.sqrt(va + vb), df


def test_the_cosine_difference_of_one_run_per_arm_is_welch_over_their_block_means():
    from scipy import stats

    from recam.engine.diagnosis import cosine_difference

    grpo = [0.05, 0.03, 0.04, 0.06, 0.02, 0.04, 0.05, 0.07, 0.03]  # 9 steps: the first fills no block of 2
    placebo = [0.01, -0.01, 0.0, 0.02, -0.02, 0.01, 0.0, 0.01]
    g_blocks = [(0.03 + 0.04) / 2, (0.06 + 0.02) / 2, (0.04 + 0.05) / 2, (0.07 + 0.03) / 2]
    p_blocks = [0.0, 0.01, -0.005, 0.005]
    d = cosine_difference([grpo], [placebo])
    diff, half, df = _welch_by_hand(g_blocks, p_blocks)
    assert d["difference"] == pytest.approx(diff) and d["half"] == pytest.approx(half) and d["df"] == pytest.approx(df)
    assert (d["low"], d["high"]) == (pytest.approx(diff - half), pytest.approx(diff + half))
    assert d["grpo_mean"] == pytest.approx(np.mean(grpo[1:])) and d["placebo_mean"] == pytest.approx(0.0025)
    assert d["grpo_n"] == d["placebo_n"] == 4 and "block means" in d["grpo_unit"]
    ci = stats.ttest_ind(g_blocks, p_blocks, equal_var=False).confidence_interval(0.95)  # scipy's own Welch
    assert (d["low"], d["high"]) == (pytest.approx(ci.low), pytest.approx(ci.high))
    # a run too short for blocks of 2 enters as its steps, and says so
    short = cosine_difference([grpo[:5]], [placebo])
    assert "steps" in short["grpo_unit"] and short["grpo_n"] == 5
    assert short["difference"] == pytest.approx(np.mean(grpo[:5]) - 0.0025)


def test_the_cosine_difference_over_seeds_is_welch_over_the_seeds_mean_cosines():
    from recam.engine.diagnosis import cosine_difference

    rng = np.random.default_rng(5)
    grpo = [list(0.03 + 0.02 * rng.standard_normal(n)) for n in (12, 10, 12)]
    placebo = [list(0.0 + 0.02 * rng.standard_normal(n)) for n in (12, 11)]
    placebo[1][3] = float("nan")  # a step whose cosine could not be computed is left out
    d = cosine_difference(grpo, placebo)
    g_means = [np.mean(s) for s in grpo]
    p_means = [np.mean(placebo[0]), np.nanmean(placebo[1])]
    diff, half, df = _welch_by_hand(g_means, p_means)
    assert d["difference"] == pytest.approx(diff) and d["half"] == pytest.approx(half) and d["df"] == pytest.approx(df)
    assert d["grpo_n"] == 3 and d["placebo_n"] == 2 and "seeds" in d["grpo_unit"] and "seeds" in d["placebo_unit"]
    # one run against several seeds: its block means against the seeds' means
    mixed = cosine_difference(grpo[:1], placebo)
    blocks = [np.mean(grpo[0][3 * b:3 * b + 3]) for b in range(4)]
    diff, half, _ = _welch_by_hand(blocks, p_means)
    assert mixed["difference"] == pytest.approx(diff) and mixed["half"] == pytest.approx(half)
    # an arm without cosines: no difference
    assert math.isnan(cosine_difference([[]], placebo)["difference"])
