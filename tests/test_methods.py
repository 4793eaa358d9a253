"""config/methods.py (policy-optimisation methods over presets) and the time-to-reward benchmark's statistics."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from config.grpo import get_config  # noqa: E402
from config.methods import METHODS, apply_method  # noqa: E402
from config.validate import step_plan, validate  # noqa: E402
from recam.engine.rollout import rollout  # noqa: E402
from scripts.bench.bench_time_to_reward import (  # noqa: E402
    first_reach,
    mean_interval,
    read_run,
    run_command,
    seed_mean_curve,
    step_curve,
    summarize,
    write_markdown,
)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_validates_on_the_camera_preset(method):
    c = get_config(f"tiny_cpu+{method}")
    validate(c, 1)
    assert c.run_name.endswith(f"+{method}")


def test_methods_change_only_the_algorithm():
    base = get_config("tiny_cpu")
    for name in METHODS:
        c = get_config(f"tiny_cpu+{name}")
        for field in ("seed", "domain"):
            assert c[field] == base[field]
        fixed = {"sample": ("batch_size", "k", "num_batches_per_epoch", "num_steps", "eval_num_steps"),
                 "reward": ("weights",), "data": ("num_train_conditions", "num_heldout_conditions")}
        for section, keys in fixed.items():
            for k in keys:
                assert c[section][k] == base[section][k], (name, section, k)


def test_baseline_trains_every_step_but_the_last_and_fast_windows_are_short():
    c = get_config("tiny_cpu+flow_grpo")
    assert c.sample.window_size == c.sample.num_steps - 1 and c.sample.window_start == 0
    balanced = get_config("tiny_cpu+flow_grpo_balanced")
    assert balanced.sample.window_size == c.sample.window_size and balanced.train.step_weighting == "score_balanced"
    assert c.train.step_weighting == "uniform"
    fast = get_config("tiny_cpu+flow_grpo_fast")
    assert fast.sample.window_size == 2 and fast.sample.window_mode == "random"
    # the reference draws randint(0, num_steps // 2 - window): the whole window in the noisier half
    for steps in (6, 10, 16):
        c = get_config("tiny_cpu")
        c.sample.num_steps = steps
        apply_method(c, "flow_grpo_fast")
        assert c.sample.window_max_start == steps // 2 - 2
        assert c.sample.window_max_start + c.sample.window_size <= steps // 2
    mix = get_config("tiny_cpu+mixgrpo")
    assert mix.sample.window_max_start == -1  # the latest start that fits, read when the run starts
    assert step_plan(mix).latest_window_start + mix.sample.window_size == mix.sample.num_steps - 1 == 9
    mix.sample.num_steps = 20  # a preset or command line changing the steps afterwards: the window still slides
    assert step_plan(mix).latest_window_start == 15  # to the end
    validate(mix, 1)


def test_mixgrpo_flash_spends_under_0_8_of_mixgrpo_s_sampling_evaluations_per_epoch():
    """Counted over the window starts of a run's epochs, with the rollout the trainer calls."""
    from recam.engine.scheduler import FlowMatchScheduler

    per_epoch = {}
    for name in ("mixgrpo", "mixgrpo_flash"):
        c = get_config(f"tiny_cpu+{name}")
        validate(c, 1)
        s = c.sample
        sched = FlowMatchScheduler(s.num_steps, s.shift, s.noise_level, s.sde_type, s.window_size)
        counts = []
        calls = []
        for epoch in range(c.num_epochs):
            calls.clear()
            start = step_plan(c).start(epoch, c.seed)
            rollout(lambda x, t, calls=calls: calls.append(1) or torch.zeros_like(x),
                    torch.zeros(1, s.num_steps + 1, 2), sched, start=start, ode_solver=s.ode_solver,
                    solver_scope=s.ode_solver_scope, post_window_compress=s.post_window_compress)
            counts.append(len(calls))
        per_epoch[name] = counts
    assert all(n == 10 for n in per_epoch["mixgrpo"])
    ratios = [f / m for f, m in zip(per_epoch["mixgrpo_flash"], per_epoch["mixgrpo"], strict=True)]
    assert sum(ratios) / len(ratios) < 0.8 and max(ratios) <= 1.0, per_epoch
    flash = get_config("tiny_cpu+mixgrpo_flash")
    assert (flash.sample.ode_solver_scope, flash.sample.post_window_compress) == ("after_window", 0.4)
    motion = get_config("motion_tiny_cpu+mixgrpo_flash")  # DDIM: MixGRPO as it is
    assert (motion.sample.ode_solver, motion.sample.post_window_compress) == ("euler", 1.0)


def test_motion_preset_takes_the_ddim_methods_and_refuses_the_flow_only_one():
    for name in METHODS:
        c = get_config(f"motion_tiny_cpu+{name}")
        if name == "grpo_guard":
            with pytest.raises(ValueError, match="train.objective"):
                validate(c, 1)
        else:
            validate(c, 1)
            assert c.sample.ode_solver == "euler"  # DPM-Solver++ on x0 is written for flow matching here


def test_unknown_method_is_named():
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        get_config("tiny_cpu+nope")


def test_mean_interval_matches_hand_computation():
    m, h = mean_interval([1.0, 2.0, 4.0])
    sd = math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2)
    assert m == pytest.approx(7 / 3)
    assert h == pytest.approx(4.303 * sd / math.sqrt(3), rel=2e-4)  # t_{0.975, 2} printed to 3 decimals
    assert math.isnan(mean_interval([3.0])[1]) and mean_interval([3.0])[0] == 3.0
    assert math.isnan(mean_interval([None, float("nan")])[0])


def test_curves_and_first_reach():
    curves = [{0.0: 0.1, 30.0: 0.2, 60.0: 0.3}, {0.0: 0.1, 30.0: 0.4}]
    assert seed_mean_curve(curves) == {0.0: pytest.approx(0.1), 30.0: pytest.approx(0.3)}
    assert first_reach(curves[0], 0.25) == 60.0
    assert first_reach(curves[0], 0.5) is None


def _run(curve, final):
    return {"curve": curve, "nfe": {t: (int(t) * 10, int(t) * 20) for t in curve},
            "epochs": [{"seconds_sampling": 1.0, "seconds_rewards": 0.5, "seconds_training": 2.0, "epoch_seconds": 3.5,
                        "nfe_sampling": 100, "nfe_training": 200}], "final": final}


def test_step_curve_carries_the_latest_evaluation_forward():
    assert step_curve({0.0: 0.1, 30.0: 0.3}, [0.0, 15.0, 30.0, 45.0]) == {0.0: 0.1, 15.0: 0.1, 30.0: 0.3, 45.0: 0.3}
    assert step_curve({10.0: 0.2}, [0.0, 10.0]) == {10.0: 0.2}


def test_summary_of_a_baseline_that_never_improved_reports_no_speedup():
    runs = {"base": {0: _run({0.0: 0.3, 30.0: 0.2}, 0.2)}, "fast": {0: _run({0.0: 0.3, 30.0: 0.5}, 0.5)}}
    s = summarize(runs, "base")
    assert not s["baseline_improved"] and s["methods"]["fast"]["speedup_vs_baseline"] is None


def test_a_baseline_gain_inside_its_interval_gives_no_speedup():
    """Best gains 0.2 and 0.4 over two seeds: 0.3 +- 12.706 x 0.1414 / sqrt(2) = 1.27, which includes zero."""
    runs = {"base": {0: _run({0.0: 0.1, 60.0: 0.3}, 0.3), 1: _run({0.0: 0.1, 60.0: 0.5}, 0.5)},
            "fast": {0: _run({0.0: 0.1, 30.0: 0.5}, 0.5), 1: _run({0.0: 0.1, 30.0: 0.5}, 0.5)}}
    s = summarize(runs, "base")
    assert s["baseline_improved"] and not s["baseline_gain_significant"]
    assert s["methods"]["fast"]["seconds_to_target"] == 30.0  # still measured and reported
    assert s["methods"]["fast"]["speedup_vs_baseline"] is None and s["methods"]["base"]["speedup_vs_baseline"] is None


def test_summary_target_speedup_and_reach_counts():
    runs = {"base": {0: _run({0.0: 0.1, 30.0: 0.2, 60.0: 0.3, 90.0: 0.25}, 0.25),
                     1: _run({0.0: 0.1, 30.0: 0.2, 60.0: 0.5, 90.0: 0.3}, 0.3),
                     2: _run({0.0: 0.1, 30.0: 0.2, 60.0: 0.37, 90.0: 0.3}, 0.3)},  # best gains 0.2, 0.4, 0.27
            "fast": {0: _run({0.0: 0.1, 30.0: 0.45, 60.0: 0.3, 90.0: 0.3}, 0.3),
                     1: _run({0.0: 0.1, 30.0: 0.4, 60.0: 0.45, 90.0: 0.5}, 0.5)},
            "slow": {0: _run({0.0: 0.1, 30.0: 0.1, 60.0: 0.1, 90.0: 0.1}, 0.1),
                     1: _run({0.0: 0.1, 30.0: 0.5, 60.0: 0.1, 90.0: 0.1}, 0.1)}}
    s = summarize(runs, "base")
    assert s["target"] == pytest.approx(0.39) and s["baseline_best_at_s"] == 60.0
    fast, base, slow = s["methods"]["fast"], s["methods"]["base"], s["methods"]["slow"]
    assert base["seconds_to_target"] == 60.0 and base["speedup_vs_baseline"] == pytest.approx(1.0)
    assert fast["seconds_to_target"] == 30.0 and fast["speedup_vs_baseline"] == pytest.approx(2.0)  # mean 0.425
    assert fast["reached"] == "2/2" and fast["seconds_to_target_per_seed"] == [30.0, 30.0]
    assert s["baseline_gain_significant"]  # 0.29 +- 4.303 x 0.1015 / sqrt(3) = 0.252
    assert base["reached"] == "1/3"  # a baseline seed alone may miss the seed-mean best
    assert slow["seconds_to_target"] is None and slow["speedup_vs_baseline"] is None and slow["reached"] == "1/2"
    assert fast["nfe_to_target_sampling"][0] == pytest.approx(300.0)
    assert fast["nfe_to_target_training"][0] == pytest.approx(600.0)
    assert fast["gain_best"][0] == pytest.approx((0.35 + 0.4) / 2)
    assert fast["final"][0] == pytest.approx(0.4)
    assert fast["epoch_timing_median"]["seconds_training"] == 2.0


def test_update_agreement_is_read_from_the_steps_and_averaged_per_seed_then_over_seeds(tmp_path):
    lines = [{"type": "step", "step": 1}, {"type": "step", "step": 2, "grad_cosine_prev": 0.01},
             {"type": "step", "step": 3, "grad_cosine_prev": 0.03},
             {"type": "eval", "tag": "start", "eval/r": 0.1}, {"type": "eval", "tag": "final", "eval/r": 0.2}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    read = read_run(tmp_path, "r")
    assert read["cosines"] == [0.01, 0.03]
    runs = {"base": {0: {**_run({0.0: 0.1, 30.0: 0.3}, 0.3), "cosines": read["cosines"]},
                     1: {**_run({0.0: 0.1, 30.0: 0.3}, 0.3), "cosines": [0.05]}},
            "old": {0: _run({0.0: 0.1, 30.0: 0.2}, 0.2)}}  # logged before the trainer wrote the cosine
    s = summarize(runs, "base")
    mean, half = s["methods"]["base"]["update_agreement"]
    assert mean == pytest.approx(0.035) and half == pytest.approx(12.706 * 0.015, rel=1e-3)  # std 0.0212 / sqrt 2
    assert s["methods"]["old"]["update_agreement"] == (None, None)
    assert s["methods"]["base"]["update_agreement_seeds"] == 2
    import types

    args = types.SimpleNamespace(preset="toy", seeds=[0, 1], parallel=1, threads=1, budget_s=60.0, eval_every_s=30.0,
                                 report_only=False, reused=0, runs_dir="runs/x")
    write_markdown(tmp_path / "report.md", s, "r", "python scripts/bench/bench_time_to_reward.py", args)
    rows = {line.split(" | ")[0].strip("| "): line for line in (tmp_path / "report.md").read_text().splitlines()
            if line.startswith("| base | 1.0") or line.startswith("| old | 1.0")}
    assert rows["base"].endswith("| 0.035 ± 0.191 |") and rows["old"].endswith("| n/a |")


def test_run_command_sets_budget_grid_and_method():
    cmd = run_command("tiny_cpu", "nft", 2, Path("/tmp/x"), 120.0, 15.0, 1)
    text = " ".join(cmd)
    assert "grpo.py:tiny_cpu+nft" in text and "--config.seed=2" in text
    assert "--config.max_train_seconds=120.0" in text and "--config.eval.every_seconds=15.0" in text
