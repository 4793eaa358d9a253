"""scripts/measure/ablate.py: the rows as the variant presets and methods applied to motion, the sample budget, the
resumable runs, and the report on hand-written run folders checked against the seeds x conditions interval and
Holm's adjustment computed here; then one end-to-end run of GRPO, its placebo and the EMA on motion_smoke."""

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from config.grpo import get_config  # noqa: E402
from recam.infra.stats import (  # noqa: E402
    crossed_interval,
    crossed_power,
    detectable_effect,
    mean_interval,
    seeds_for_power,
    t975,
)
from scripts.measure import ablate  # noqa: E402

METRIC = "eval/r_precision_top3"
PER_EPOCH = 64


def test_rows_are_the_variant_presets_and_methods_applied_to_motion():
    rows = {r.name: r for r in ablate.ablation_rows("motion_tiny_cpu")}
    assert list(rows) == list(ablate.ROW_NAMES)
    # the EMA's two off-policy visits: motion's pass takes two optimizer steps, so two passes (tiny_cpu's three)
    ema = dict(rows["ema"].overrides)
    assert ema == {"train.policy_loss": "grpo_variants", "train.use_ema_smoothing": True,
                   "train.num_inner_epochs": 2}
    assert dict(ablate.variant_overrides("ema", "tiny_cpu"))["train.num_inner_epochs"] == \
        get_config("ema").train.num_inner_epochs == 3
    assert dict(rows["ema_control"].overrides) == {"train.policy_loss": "grpo_variants", "train.num_inner_epochs": 2}
    assert dict(rows["aggressive"].overrides) == {"train.policy_loss": "grpo_variants", "train.use_amic": True,
                                                  "train.use_gradient_adaptive_weighting": True, "train.use_ptrw": True}
    assert rows["balanced"].own == ("ema/variance_reduction_ratio", "ema/smoothed_fraction",
                                    "gradient_adaptive/weight_variance", "asymmetric/clipfrac_pos",
                                    "asymmetric/clipfrac_neg")
    assert rows["placebo"].overrides == (("advantage.placebo", True),)
    assert rows["nft"].preset == "motion_tiny_cpu+nft" and rows["nft"].overrides == ()
    # GRPO-Guard is derived for the flow SDE: refused on motion's DDIM with the validation's reason, the rest run
    assert "train.objective='grpo_guard'" in rows["grpo_guard"].refused
    assert [n for n, r in rows.items() if r.refused] == ["grpo_guard"]
    # MixGRPO-Flash changes only flow domains' solver: on motion its config is MixGRPO's, so it is not run twice;
    # on the flow toy it is its own row
    assert [(n, r.same_as) for n, r in rows.items() if r.same_as] == [("mixgrpo_flash", "mixgrpo")]
    assert not rows["mixgrpo_flash"].runs and rows["mixgrpo"].runs and not rows["grpo_guard"].runs
    assert ablate.fingerprint(get_config("motion_tiny_cpu+mixgrpo_flash")) == \
        ablate.fingerprint(get_config("motion_tiny_cpu+mixgrpo"))
    assert not [r.name for r in ablate.ablation_rows("tiny_cpu") if r.same_as]
    # named alone, it is still the earlier row's config
    assert ablate.ablation_rows("motion_tiny_cpu", ["mixgrpo_flash"])[-1].same_as == "mixgrpo"
    c = ablate.resolve("motion_tiny_cpu", rows["ptrw"].overrides)
    assert c.train.use_ptrw and c.domain == "motion" and c.train.num_inner_epochs == 1
    assert [r.name for r in ablate.ablation_rows("motion_tiny_cpu", ["ptrw"])] == ["grpo", "placebo", "ptrw"]


def test_budget_command_and_resumable_runs(tmp_path, monkeypatch):
    assert ablate.samples_per_epoch("motion_tiny_cpu") == PER_EPOCH
    assert ablate.budget(4096, 1024, PER_EPOCH) == (64, 16)
    assert ablate.budget(100, 10, PER_EPOCH) == (2, 1)  # whole epochs, at least the budget
    with pytest.raises(ValueError, match="positive"):
        ablate.budget(0, 1024, PER_EPOCH)
    with pytest.raises(SystemExit, match="sets config.sample.num_batches_per_epoch itself"):
        ablate.main(["--estimate", "--config.sample.num_batches_per_epoch=2"])  # would change the budget
    row = {r.name: r for r in ablate.ablation_rows("motion_tiny_cpu", ["ema"])}["ema"]
    folder = tmp_path / "ema" / "seed1"
    cmd = ablate.run_command(row, 1, folder, 64, 16, 1, ["--config.data.num_train_conditions=128"])
    assert cmd[2:] == ["--config=config/grpo.py:motion_tiny_cpu", "--config.seed=1", f"--config.run_dir={folder}",
                       "--config.num_epochs=64", "--config.eval.freq=16", "--config.num_threads=1",
                       "--config.logging.wandb_mode=disabled", "--config.eval.num_videos=0",
                       "--config.train.policy_loss=grpo_variants", "--config.train.use_ema_smoothing=True",
                       "--config.train.num_inner_epochs=2", "--config.data.num_train_conditions=128"]
    calls = []

    class Done:
        returncode = 3

    monkeypatch.setattr(ablate.subprocess, "run", lambda c, **kw: calls.append((c, kw["env"])) or Done())
    assert ablate.run_one(cmd, folder, 1) == 3  # an unfinished folder: launched (train_recam.py resumes it)
    assert calls[0][0] == cmd and calls[0][1]["OMP_NUM_THREADS"] == "1"
    assert (folder / "command.txt").read_text() == "python " + " ".join(cmd[1:]) + "\n"
    (folder / "summary.md").write_text("done\n")
    assert ablate.run_one(cmd, folder, 1) == 0 and len(calls) == 1  # a finished one is skipped


def test_a_runs_cost_own_metrics_and_draws_by_hand():
    epochs = [{"samples_per_epoch": 64, "epoch_seconds": 14.0, "nfe_sampling": 1280, "nfe_training": 768},
              {"samples_per_epoch": 64, "epoch_seconds": 16.0, "nfe_sampling": 1280, "nfe_training": 1536}]
    cost = ablate.run_cost(epochs)
    assert cost["seconds_per_sample"] == pytest.approx(30.0 / 128)
    paused = [*epochs, {"samples_per_epoch": 64, "epoch_seconds": 800.0, "nfe_sampling": 1280, "nfe_training": 768}]
    assert ablate.run_cost(paused)["seconds_per_sample"] == pytest.approx(16.0 / 64)  # the median epoch's pace
    assert cost["nfe_per_sample"] == pytest.approx((2560 + 2304) / 128)
    assert cost["nfe_training_per_sample"] == pytest.approx(2304 / 128)
    steps = [{"clipfrac": 0.1}, {"clipfrac": 0.3, "ema/variance_reduction_ratio": 1.2},
             {"clipfrac": float("nan"), "ema/variance_reduction_ratio": 1.1}]
    means = ablate.step_means(steps, ("ema/variance_reduction_ratio", "clipfrac", "ptrw/trust_weights_mean"))
    assert means["ema/variance_reduction_ratio"] == pytest.approx(1.15)  # only the steps that smoothed
    assert means["clipfrac"] == pytest.approx(0.2) and math.isnan(means["ptrw/trust_weights_mean"])
    assert ablate.same_draws([[1, 2], [3, 4]], [[1, 2], [3, 4], [5, 6]]) is True
    assert ablate.same_draws([[1, 2], [3, 4]], [[1, 2], [4, 3]]) is False
    assert ablate.same_draws([None], [[1]]) is None


def test_the_cpu_time_estimate_by_hand():
    base = get_config("motion_tiny_cpu")
    rows = {r.name: r for r in ablate.ablation_rows("motion_tiny_cpu")}

    def factor(name):
        return ablate.training_factor(ablate.resolve(rows[name].preset, rows[name].overrides), base)

    assert factor("grpo") == 1.0 and factor("ptrw") == 1.0
    assert factor("ema") == pytest.approx(2 * 1.25)  # two passes, and the no-grad pass over the trained steps
    assert factor("balanced") == pytest.approx(2 * 2 * 1.25)  # two passes, and the gradient norms' backward
    assert factor("flow_grpo_fast") == pytest.approx(2 / 6)  # a window of 2 trained steps against 6
    cost = ablate.Cost(seconds_per_sample=0.2, training_share=0.5, eval_seconds=10.0, overhead_seconds=5.0)
    secs = ablate.estimate_seconds([1.0, 3.0], seeds=2, samples=100, evaluations=3, cost=cost)
    assert secs == pytest.approx(2 * ((100 * 0.2 + 30 + 5) + (100 * 0.2 * (0.5 + 1.5) + 30 + 5)))
    text = ablate.main(["--estimate"])  # the real run's: 16 runnable rows x 3 seeds
    assert text.startswith("16 rows x 3 seeds = 48 runs of 64 epochs")
    hours = text.split("about ")[1].split(" core-hours")[0]
    assert f"about {hours} core-hours" in ablate.__doc__  # the docstring states the estimate the script makes


# ---------------------------------------------------------------------------------------------------------------
# the report on hand-written runs


def fake_run(folder: Path, seed: int, placebo: bool, evals: list, own_steps=(), draws=None, finished=True) -> Path:
    """A run of 4 epochs of 64 samples (14 s each) evaluated at 0, 128 and 256 samples with the per-condition R@3 of
    `evals`, its step records `own_steps`, the training conditions `draws` per epoch, as train_recam.py writes them."""
    folder.mkdir(parents=True)
    draws = draws or [[e, e + 1] for e in range(4)]
    lines = [{"type": "step", "step": i + 1, "epoch": i // 2, **s} for i, s in enumerate(own_steps)]
    lines += [{"type": "epoch", "epoch": e, "samples_per_epoch": PER_EPOCH, "epoch_seconds": 14.0,
               "nfe_sampling": 1280, "nfe_training": 768, "dataset_indices": draws[e]} for e in range(4)]
    for tag, epoch, rows in zip(("start", "epoch_2", "final"), (-1, 1, 3), evals, strict=True):
        lines.append({"type": "eval", "tag": tag, "epoch": epoch, "step": 2 * (epoch + 1),
                      "checkpoint": f"epoch_{epoch + 1:04d}", "train_seconds": 14.0 * (epoch + 1),
                      METRIC: float(np.mean(rows)), f"rows/{METRIC}": [float(x) for x in rows]})
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    (folder / "config.json").write_text(json.dumps({
        "seed": seed, "advantage": {"placebo": placebo},
        "eval": {"primary_endpoint": METRIC, "primary_time": "last", "secondary_endpoints": ""}}))
    if finished:
        (folder / "summary.md").write_text("done\n")
    return folder


def holm_by_hand(ps: list[float]) -> list[float]:
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    out, running = [0.0] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        out[i] = running
    return out


@pytest.fixture
def fake_ablation(tmp_path):
    """Three seeds x 8 shared held-out conditions: GRPO gains 0.05 then 0.10, EMA 0.15 then 0.20, the placebo and
    PTRW nothing (PTRW's difference from the placebo alternates +-0.01 over the conditions); AMIC lacks seed 2."""
    rng = np.random.default_rng(0)
    seeds, C = (0, 1, 2), 8
    base = rng.uniform(0.2, 0.4, C)
    swing = 0.01 * (-1.0) ** np.arange(C)
    values = {}
    for s in seeds:
        placebo = [base + rng.normal(0, 0.02, C) for _ in range(2)]
        values[("placebo", s)] = [base, *placebo]
        values[("grpo", s)] = [base, base + 0.05 + rng.normal(0, 0.02, C), base + 0.10 + rng.normal(0, 0.02, C)]
        values[("ema", s)] = [base, base + 0.15 + rng.normal(0, 0.02, C), base + 0.20 + rng.normal(0, 0.02, C)]
        values[("ptrw", s)] = [base, *(p + swing + rng.normal(0, 0.002, C) for p in placebo)]
        values[("amic", s)] = values[("grpo", s)]
    steps = {"grpo": lambda s: [{"clipfrac": 0.01 * (s + 1), "ratio_max": 1.0 + 3e-4 * (s + 1), "ratio_min": 0.9995},
                                {"clipfrac": 0.03, "ratio_max": 1.0002, "ratio_min": 1.0 - 1e-4 * (s + 1)}],
             "placebo": lambda s: [{"clipfrac": 0.02}],
             "ema": lambda s: [{"clipfrac": 0.0, "ema/smoothed_fraction": 0.0},
                               {"clipfrac": 0.02, "ema/smoothed_fraction": 0.5,
                                "ema/variance_reduction_ratio": 1.1 + 0.01 * s},
                               {"clipfrac": 0.04, "ema/smoothed_fraction": 1.0,
                                "ema/variance_reduction_ratio": 1.2 + 0.02 * s}],
             "ptrw": lambda s: [{"clipfrac": 0.0, "ptrw/trust_weights_mean": 0.96 - 0.01 * s}],
             "amic": lambda s: [{"clipfrac": 0.0}]}
    out = tmp_path / "abl"
    for (name, s), evals in values.items():
        draws = [[e, e + 1] for e in range(4)]
        if name == "ptrw":
            draws[2] = [9, 9]  # PTRW drew other conditions at epoch 2
        fake_run(out / name / f"seed{s}", s, name == "placebo", evals, steps[name](s), draws,
                 finished=not (name == "amic" and s == 2))
    return out, values, seeds


def test_the_report_on_hand_written_runs_by_hand(fake_ablation):
    out, values, seeds = fake_ablation
    text = ablate.main(["--report-only", "--out", str(out), "--samples", "256", "--eval-every", "128",
                        "--rows", "ema", "ptrw", "amic", "grpo_guard"])
    res = {r["name"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert (out / "report.md").read_text() == text

    def table(a, b, point=2):  # a minus b, seeds x conditions, at an evaluation point
        return [values[(a, s)][point] - values[(b, s)][point] for s in seeds]

    # each row minus the placebo and minus GRPO at the last epoch: the seeds x conditions interval of the
    # differences paired by seed and condition
    minus_placebo = {n: crossed_interval(table(n, "placebo")) for n in ("grpo", "ema", "ptrw")}
    minus_grpo = {n: crossed_interval(table(n, "grpo")) for n in ("ema", "ptrw")}
    for n, c in minus_placebo.items():
        assert res[n]["minus_placebo"]["mean"] == pytest.approx(c.mean, abs=1e-12)
        assert res[n]["minus_placebo"]["half"] == pytest.approx(c.half, rel=1e-9)
        assert f"{c.mean:+.4f} ± {c.half:.4f}" in text
    for n, c in minus_grpo.items():
        assert res[n]["minus_grpo"]["mean"] == pytest.approx(c.mean, abs=1e-12)
        assert res[n]["minus_grpo"]["half"] == pytest.approx(c.half, rel=1e-9)
    # GRPO minus its placebo is the gate, unadjusted; behind it the rows are Holm-adjusted among themselves, a row
    # minus the placebo never below the gate's p (AMIC unfinished and GRPO-Guard refused are in neither family)
    gate = minus_placebo["grpo"].p
    assert res["grpo"]["minus_placebo"]["p_holm"] == pytest.approx(gate, rel=1e-9)
    for col, ests, floor in (("minus_placebo", minus_placebo, gate), ("minus_grpo", minus_grpo, 0.0)):
        names = [n for n in ests if n != "grpo"]
        for n, adj in zip(names, holm_by_hand([ests[n].p for n in names]), strict=True):
            assert res[n][col]["p_holm"] == pytest.approx(max(adj, floor), rel=1e-9)
    change = crossed_interval([values[("ema", s)][2] - values[("ema", s)][0] for s in seeds])
    assert res["ema"]["change"]["mean"] == pytest.approx(change.mean, abs=1e-12)
    assert res["ema"]["against_placebo"] == res["grpo"]["against_placebo"] == "clears the placebo"
    assert res["ema"]["against_grpo"] == "beats GRPO"
    # PTRW: its difference from the placebo's interval holds 0 at both evaluation points
    for point in (1, 2):
        assert crossed_interval(table("ptrw", "placebo", point)).mean - crossed_interval(
            table("ptrw", "placebo", point)).half < 0
    assert res["ptrw"]["against_placebo"].startswith("never cleared the placebo")
    assert "| ptrw | variant |" in text and "never cleared the placebo (at no evaluation point" in text
    assert [p["samples"] for p in res["ptrw"]["curve_minus_placebo"]] == [128, 256]
    # own metrics: the mean over the steps that logged them, a t-interval over the seeds
    ratios = [np.mean([1.1 + 0.01 * s, 1.2 + 0.02 * s]) for s in seeds]
    own = res["ema"]["own"]["ema/variance_reduction_ratio"]
    assert own["per_seed"] == pytest.approx(ratios)
    assert own["mean"] == pytest.approx(np.mean(ratios))
    assert own["half"] == pytest.approx(t975(2) * np.std(ratios, ddof=1) / math.sqrt(3))
    assert res["ptrw"]["own"]["ptrw/trust_weights_mean"]["mean"] == pytest.approx(0.95)
    assert res["grpo"]["own"]["clipfrac"]["mean"] == pytest.approx(mean_interval([0.02, 0.025, 0.03])[0])
    assert f"ptrw/trust_weights_mean {0.95:.4g} ±" in text
    # how far a ratio got from 1: each run's farthest over its steps (GRPO's seed 0 reaches 5e-4 below 1, seeds 1
    # and 2 6e-4 and 9e-4 above it; nothing for the rows that logged no ratios)
    reach = res["grpo"]["own"]["ratio_reach"]
    assert reach["per_seed"] == pytest.approx([5e-4, 6e-4, 9e-4], abs=1e-12)
    assert (reach["mean"], reach["half"]) == pytest.approx(mean_interval([5e-4, 6e-4, 9e-4]), rel=1e-9)
    assert res["ema"]["own"]["ratio_reach"]["mean"] is None
    grpo_line = next(line for line in text.splitlines() if line.startswith("| grpo | — |"))
    assert f"| {reach['mean']:.4g} ± {reach['half']:.2g} |" in grpo_line and "| no ratios |" in text
    assert "beside the preset's clip range of 0.001" in text
    # cost: 14 s and 2,048 denoiser evaluations per epoch of 64
    assert res["ema"]["cost"]["seconds_per_sample"] == pytest.approx(14 / 64)
    assert res["ema"]["cost"]["nfe_per_sample"] == pytest.approx(32.0)
    assert res["ema"]["drew_grpo_conditions"] is True and res["ptrw"]["drew_grpo_conditions"] is False
    # time to GRPO's final gain: GRPO's seed-mean change at 256 samples; EMA passes it at 128 (28 training s)
    target = np.mean([np.mean(values[("grpo", s)][2]) - np.mean(values[("grpo", s)][0]) for s in seeds])
    assert json.loads((out / "results.json").read_text())["target"] == pytest.approx(target)
    assert res["ema"]["time_to_grpo_gain"] == {"samples": 128, "seconds": 28.0}
    assert res["grpo"]["time_to_grpo_gain"]["samples"] == 256
    assert res["ptrw"]["time_to_grpo_gain"] is None and "not reached in 256 samples" in text
    # what is not compared, and why
    assert res["amic"]["status"].startswith("not finished: seed 2")
    assert res["grpo_guard"]["status"].startswith("not run: train.objective='grpo_guard'")
    assert "below the 4,096 at which motion GRPO first cleared its placebo" in text
    assert ("- ema: `config/grpo.py:motion_tiny_cpu` `--config.train.policy_loss=grpo_variants` "
            "`--config.train.use_ema_smoothing=True` `--config.train.num_inner_epochs=2`") in text


def test_nothing_is_compared_before_grpo_and_its_placebo_finish(tmp_path):
    base = [0.2, 0.3]
    fake_run(tmp_path / "grpo" / "seed0", 0, False, [base, base, base])
    fake_run(tmp_path / "placebo" / "seed0", 0, True, [base, base, base], finished=False)
    text = ablate.main(["--report-only", "--out", str(tmp_path), "--seeds", "0", "--rows", "ptrw"])
    assert "nothing is compared yet" in text and "- placebo: seed 0" in text and "- ptrw: seed 0" in text


@pytest.mark.slow
def test_end_to_end_on_motion_smoke(tmp_path):
    """GRPO, its placebo and the EMA on motion_smoke for one epoch of 8 samples: the runs finish, the report
    compares them and carries the EMA's variance-reduction ratio from its third pass; a second call runs nothing."""
    out = tmp_path / "abl"
    args = ["--preset", "motion_smoke", "--seeds", "0", "--samples", "8", "--eval-every", "8", "--rows", "ema",
            "--parallel", "2", "--threads", "1", "--out", str(out)]
    text = ablate.main(args)
    res = {r["name"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert [res[n]["status"] for n in ("grpo", "placebo", "ema")] == ["finished"] * 3, text
    ratio = res["ema"]["own"]["ema/variance_reduction_ratio"]["mean"]
    assert ratio is not None and ratio > 0
    assert res["ema"]["cost"]["seconds_per_sample"] > 0 and res["ema"]["minus_placebo"]["mean"] is not None
    assert "| ema | variant |" in text
    mtimes = [p.stat().st_mtime for p in sorted(out.rglob("metrics.jsonl"))]
    ablate.main(args)  # resumable: every run has its summary.md, so nothing runs again
    assert [p.stat().st_mtime for p in sorted(out.rglob("metrics.jsonl"))] == mtimes
    # kept small and restored elsewhere, the real runs' logs report the same numbers
    keep, fresh = tmp_path / "kept", tmp_path / "fresh"
    first = ablate.main([*args, "--report-only", "--keep", str(keep)])
    sizes = {f: (f.stat().st_size, (keep / f.relative_to(out).parent / "metrics.jsonl.gz").stat().st_size)
             for f in out.rglob("metrics.jsonl")}
    assert all(kept < whole / 2 for whole, kept in sizes.values()), sizes
    again = [a if a != str(out) else str(fresh) for a in args]
    assert ablate.main([*again, "--report-only", "--keep", str(keep)]).replace(str(fresh), str(out)) == first


def test_time_to_reward_on_hand_written_runs_by_hand(fake_ablation, tmp_path):
    """The time-to-reward document reads the same runs: EMA reaches GRPO's final gain at 128 samples (28 training s)
    where GRPO takes 256 (56 s), a speed-up of 2; PTRW never does, and its placebo verdict stands beside it."""
    out, values, seeds = fake_ablation
    doc = tmp_path / "time_to_reward.md"
    ablate.main(["--report-only", "--out", str(out), "--samples", "256", "--eval-every", "128",
                 "--rows", "ema", "ptrw", "--time-to-reward", str(doc)])
    text = doc.read_text()
    target = np.mean([np.mean(values[("grpo", s)][2]) - np.mean(values[("grpo", s)][0]) for s in seeds])
    assert f"{target:+.4f}" in text
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| row")}
    assert rows["grpo"][3:6] == ["256", "56", f"{1.0:.2f}"]
    assert rows["ema"][3:6] == ["128", "28", f"{56 / 28:.2f}"]
    assert rows["ptrw"][3].startswith("not reached in 256") and rows["ptrw"][2].startswith("never cleared")
    assert rows["ema"][6] == f"{14 / 64:.3f}" and rows["ema"][7].rstrip(" |") == "32.0"


def test_time_to_reward_says_when_grpo_gained_nothing(tmp_path):
    base = [0.2, 0.3]
    for name, placebo in (("grpo", False), ("placebo", True)):
        fake_run(tmp_path / name / "seed0", 0, placebo, [base, base, [0.19, 0.29]])
    doc = tmp_path / "ttr.md"
    ablate.main(["--report-only", "--out", str(tmp_path), "--seeds", "0", "--rows", "ptrw", "--samples", "256",
                 "--eval-every", "128", "--time-to-reward", str(doc)])
    assert "it gained nothing, so there is no gain to time" in doc.read_text()


def test_what_the_seeds_resolve_against_grpo_by_hand(fake_ablation):
    """Each row minus GRPO gets the smallest difference its design finds 80% of the time and the seed pairs the
    measured difference needs, both from that difference's own seeds x conditions variance components."""
    out, values, seeds = fake_ablation
    text = ablate.main(["--report-only", "--out", str(out), "--samples", "256", "--eval-every", "128",
                        "--rows", "ema", "ptrw"])
    res = {r["name"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    for name in ("ema", "ptrw"):
        c = crossed_interval([values[(name, s)][2] - values[("grpo", s)][2] for s in seeds])
        comps = (c.var_seed, c.var_condition, c.var_residual)
        mde = detectable_effect(*comps, 3, 8)
        assert crossed_power(mde, *comps, 3, 8) == pytest.approx(0.8, abs=1e-6)
        assert res[name]["resolves_vs_grpo"]["detectable_80"] == pytest.approx(mde, rel=1e-9)
        assert res[name]["resolves_vs_grpo"]["seeds_for_measured"] == seeds_for_power(c.mean, *comps, 8)
        assert f"| {name} | {c.mean:+.4f} ± {c.half:.4f} | {mde:.4f} |" in text
    assert res["grpo"]["resolves_vs_grpo"]["detectable_80"] is None  # GRPO is not compared with itself


def test_control_seeds_run_grpo_and_its_placebo_only_and_rows_pair_on_their_own(fake_ablation):
    """--control-seeds: GRPO and the placebo on a fourth seed; GRPO minus placebo is over all four, a row minus GRPO
    over the row's three; the estimate counts the two extra runs; a missing control seed is reported unfinished."""
    out, values, seeds = fake_ablation
    rng = np.random.default_rng(7)
    base = values[("grpo", 0)][0]
    values[("grpo", 3)] = [base, base + 0.04, base + 0.09 + rng.normal(0, 0.02, len(base))]
    values[("placebo", 3)] = [base, base + rng.normal(0, 0.02, len(base)), base + rng.normal(0, 0.02, len(base))]
    args = ["--report-only", "--out", str(out), "--samples", "256", "--eval-every", "128", "--rows", "ema"]
    text = ablate.main([*args, "--control-seeds", "3"])
    assert "- grpo: seed 3" in text and "- placebo: seed 3" in text and "- ema: seed 3" not in text
    for name in ("grpo", "placebo"):
        fake_run(out / name / "seed3", 3, name == "placebo", values[(name, 3)])
    text = ablate.main([*args, "--control-seeds", "3"])
    res = {r["name"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    four = crossed_interval([values[("grpo", s)][2] - values[("placebo", s)][2] for s in (0, 1, 2, 3)])
    assert res["grpo"]["minus_placebo"]["mean"] == pytest.approx(four.mean, abs=1e-12)
    assert res["grpo"]["minus_placebo"]["half"] == pytest.approx(four.half, rel=1e-9)
    three = crossed_interval([values[("ema", s)][2] - values[("grpo", s)][2] for s in seeds])
    assert res["ema"]["minus_grpo"]["mean"] == pytest.approx(three.mean, abs=1e-12)
    assert res["ema"]["minus_grpo"]["half"] == pytest.approx(three.half, rel=1e-9)
    assert "GRPO and its placebo on 4 (0, 1, 2, 3" in text and "(the gate: 4 seed pairs)" in text
    # GRPO's change from the base, and the gain every row's time is read against, are on the rows' three seeds:
    # seed 3 (a gain of 0.09 where the others gain about 0.10) has no partner in any row
    change = crossed_interval([values[("grpo", s)][2] - values[("grpo", s)][0] for s in seeds])
    assert res["grpo"]["change"]["mean"] == pytest.approx(change.mean, abs=1e-12)
    target = np.mean([np.mean(values[("grpo", s)][2]) - np.mean(values[("grpo", s)][0]) for s in seeds])
    assert json.loads((out / "results.json").read_text())["target"] == pytest.approx(target)
    assert len(res["grpo"]["own"]["clipfrac"]["per_seed"]) == 3  # and its own metrics
    plain = ablate.main(["--preset", "motion_tiny_cpu", "--estimate", "--rows", "ptrw"])
    more = ablate.main(["--preset", "motion_tiny_cpu", "--estimate", "--rows", "ptrw", "--control-seeds", "3", "4"])
    assert plain.startswith("3 rows x 3 seeds = 9 runs") and more.startswith("3 rows x 3 seeds + GRPO and its "
                                                                             "placebo on 2 more = 13 runs")
    hours = [float(t.split("about ")[1].split(" core-hours")[0]) for t in (plain, more)]
    assert hours[1] == pytest.approx(hours[0] * 13 / 9, rel=0.1)


def test_rows_with_the_controls_passes_are_compared_with_it_by_hand(fake_ablation):
    """ema_control is GRPO with the EMA's two passes: a row with those passes (the EMA, conservative) gets its
    difference from it, paired by seed and condition, Holm-adjusted among those rows; a one-pass row (PTRW) and the
    control itself get none. The control's own passes are read from its config, not its name."""
    out, values, seeds = fake_ablation
    rows = {r.name: r for r in ablate.ablation_rows("motion_tiny_cpu")}
    assert [n for n, r in rows.items() if r.passes == rows["ema_control"].passes == 2] == \
        ["ema", "conservative", "balanced", "ema_control"]
    rng = np.random.default_rng(3)
    for s in seeds:
        base = values[("grpo", s)][0]
        values[("ema_control", s)] = [base, base + 0.12 + rng.normal(0, 0.02, 8), base + 0.17 + rng.normal(0, 0.02, 8)]
        values[("conservative", s)] = [base, base + 0.1, values[("ema_control", s)][2] + rng.normal(0, 0.03, 8)]
        for name in ("ema_control", "conservative"):
            fake_run(out / name / f"seed{s}", s, False, values[(name, s)])
    text = ablate.main(["--report-only", "--out", str(out), "--samples", "256", "--eval-every", "128",
                        "--rows", "ema", "ptrw", "conservative", "ema_control"])
    res = {r["name"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    ests = {n: crossed_interval([values[(n, s)][2] - values[("ema_control", s)][2] for s in seeds])
            for n in ("ema", "conservative")}
    for (n, c), adj in zip(ests.items(), holm_by_hand([c.p for c in ests.values()]), strict=True):
        assert res[n]["minus_control"]["mean"] == pytest.approx(c.mean, abs=1e-12)
        assert res[n]["minus_control"]["half"] == pytest.approx(c.half, rel=1e-9)
        assert res[n]["minus_control"]["p_holm"] == pytest.approx(adj, rel=1e-9)
        assert f"| {n} | {c.mean:+.4f} ± {c.half:.4f} |" in text.split("Against the two-pass control")[1]
    assert res["ema"]["against_control"] == "beats the two-pass control"  # +0.03 on 3 x 8, noise 0.02
    assert res["conservative"]["against_control"] == "not separated from the two-pass control"
    for n in ("ptrw", "ema_control", "grpo", "placebo"):
        assert res[n]["minus_control"] is None and res[n]["against_control"] is None
    # the control minus GRPO is the extra pass's own share, in the rows minus GRPO
    pass_share = crossed_interval([values[("ema_control", s)][2] - values[("grpo", s)][2] for s in seeds])
    assert res["ema_control"]["minus_grpo"]["mean"] == pytest.approx(pass_share.mean, abs=1e-12)


def test_rows_behind_the_gate_by_hand():
    """Serial gatekeeping: GRPO minus placebo at p 0.03 is the gate; rows at 0.001, 0.02 and 0.5 are Holm-adjusted
    to 0.003, 0.04 and 0.5 among themselves, and none may fall below the gate's 0.03."""
    assert ablate.gated_holm(0.03, [0.001, 0.02, 0.5]) == pytest.approx([0.03, 0.04, 0.5])
    assert ablate.gated_holm(0.001, [0.001, 0.02, 0.5]) == pytest.approx([0.003, 0.04, 0.5])
    # a gate that failed keeps every row from clearing; one that could not be evaluated rejects nothing
    assert all(p >= 0.2 for p in ablate.gated_holm(0.2, [0.0001, 0.01]))
    assert all(math.isnan(p) for p in ablate.gated_holm(float("nan"), [0.0001, 0.01]))
    assert math.isnan(ablate.gated_holm(0.01, [float("nan"), 0.01])[0])


def test_a_row_that_trains_grpos_parameters_is_reported_identical(tmp_path):
    """A row whose every held-out value equals GRPO's on each seed (a variant whose update rounds to GRPO's) is
    identical to GRPO, not a zero difference with an interval; one value off on one seed and it is compared."""
    rng = np.random.default_rng(1)
    base = rng.uniform(0.2, 0.4, 8)
    for s in (0, 1, 2):
        grpo = [base, base + 0.05 + rng.normal(0, 0.02, 8), base + 0.08 + rng.normal(0, 0.02, 8)]
        fake_run(tmp_path / "grpo" / f"seed{s}", s, False, grpo)
        fake_run(tmp_path / "placebo" / f"seed{s}", s, True, [base, *(base + rng.normal(0, 0.02, 8) for _ in "ab")])
        fake_run(tmp_path / "amic" / f"seed{s}", s, False, grpo)
        off = [g.copy() for g in grpo]
        if s == 1:
            off[1][3] += 1e-6  # one held-out value at one evaluation point
        fake_run(tmp_path / "ptrw" / f"seed{s}", s, False, off)
        # a later row equal to PTRW on every seed (not to GRPO), and one equal to it on two seeds of three
        fake_run(tmp_path / "temporal_decay" / f"seed{s}", s, False, off)
        fake_run(tmp_path / "asymmetric" / f"seed{s}", s, False, off if s != 2 else [base, base, base + 0.01])
    text = ablate.main(["--report-only", "--out", str(tmp_path), "--samples", "256", "--eval-every", "128",
                        "--rows", "amic", "ptrw", "temporal_decay", "asymmetric"])
    res = {r["name"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    assert res["amic"]["identical_to_grpo"] is True and res["ptrw"]["identical_to_grpo"] is False
    assert [res[n]["identical_to"] for n in ("amic", "ptrw", "temporal_decay", "asymmetric")] == \
        ["grpo", None, "ptrw", None]
    assert "answer as one): temporal_decay identical to ptrw." in text
    assert res["amic"]["against_grpo"].startswith("identical to GRPO")
    assert res["ptrw"]["against_grpo"] == "not separated from GRPO"
    assert res["amic"]["resolves_vs_grpo"] == {"detectable_80": None, "seeds_for_measured": None}
    assert "| amic | identical | — | none: it trains GRPO's parameters |" in text


def test_a_run_the_guard_stopped_is_named_with_the_samples_it_trained(fake_ablation):
    """A run the health guard stopped short of the budget enters the comparison where it stopped; the report names
    it with the samples it trained (its epoch records), and counts the rollbacks summary.md states."""
    out, values, seeds = fake_ablation
    run = out / "ptrw" / "seed1"
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if not (r.get("type") == "epoch" and r["epoch"] == 3)]  # 3 of 4 epochs trained
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    (run / "summary.md").write_text("done\nhealth guard: stopped early: health guard, reward_term_collapse at step 6; "
                                    "rollbacks: 2\n")
    text = ablate.main(["--report-only", "--out", str(out), "--samples", "256", "--eval-every", "128",
                        "--rows", "ptrw", "ema"])
    res = {r["name"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert res["ptrw"]["guard"] == {"rollbacks": 2, "stops": [
        {"seed": 1, "samples": 3 * PER_EPOCH, "reason": "reward_term_collapse at step 6"}]}
    assert res["ema"]["guard"] == {"rollbacks": 0, "stops": []}
    assert f"- ptrw seed 1: stopped by the health guard at {3 * PER_EPOCH:,} samples (reward_term_collapse" in text
    assert f"| 2 rollback(s); seed 1 stopped at {3 * PER_EPOCH:,} samples |" in text


def test_kept_runs_report_as_the_runs_did_and_restore_nothing_over_a_run(fake_ablation, tmp_path):
    """A session's finished runs kept small (--keep) and restored on a machine without them: the same report, every
    number equal; a kept copy is never unpacked over a run folder that holds a log, and a torn one names its file."""
    out, _, _ = fake_ablation
    keep = tmp_path / "kept"
    rows = ["--samples", "256", "--eval-every", "128", "--rows", "ema", "ptrw", "amic"]
    first = ablate.main(["--report-only", "--out", str(out), "--keep", str(keep), *rows])
    assert (keep / "grpo" / "seed0" / "metrics.jsonl.gz").is_file()
    assert not (keep / "amic" / "seed2").exists()  # unfinished: nothing to keep
    fresh = tmp_path / "fresh"
    second = ablate.main(["--report-only", "--out", str(fresh), "--keep", str(keep), *rows])
    assert second.replace(str(fresh), str(out)) == first
    a, b = (json.loads((d / "results.json").read_text())["rows"] for d in (out, fresh))
    assert [{k: v for k, v in r.items() if k != "runs"} for r in a] == [
        {k: v for k, v in r.items() if k != "runs"} for r in b]
    # a run folder with its own log is the run's: a kept copy does not replace it
    assert not ablate.restore_run(keep / "grpo" / "seed0", out / "grpo" / "seed0")
    (keep / "ptrw" / "seed1" / "metrics.jsonl.gz").write_bytes(b"\x1f\x8b torn")
    with pytest.raises(SystemExit, match=r"ptrw/seed1/metrics\.jsonl\.gz is not a readable gzip file"):
        ablate.restore_run(keep / "ptrw" / "seed1", tmp_path / "again")
    assert not (tmp_path / "again" / "summary.md").exists()


def test_a_kept_log_drops_the_per_sample_lists_and_keeps_what_the_report_reads():
    epoch = {"type": "epoch", "epoch": 3, "samples_per_epoch": 64, "epoch_seconds": 14.0, "dataset_indices": [4, 5],
             "rewards/avg": [0.1] * 64, "advantages": [0.0] * 64, "reward_avg": 0.1}
    assert ablate.slim_record(epoch) == {"type": "epoch", "epoch": 3, "samples_per_epoch": 64, "epoch_seconds": 14.0,
                                         "dataset_indices": [4, 5], "reward_avg": 0.1}
    ev = {"type": "eval", "eval/r_precision_top3": 0.3, "rows/eval/r_precision_top3": [0.25, 0.35],
          "val/r_precision_top3": 0.2, "rows/val/r_precision_top3": [0.2]}
    assert ablate.slim_record(ev) == {k: v for k, v in ev.items() if k != "rows/val/r_precision_top3"}
    step = {"type": "step", "clipfrac": 0.0, "ratio_max": 1.0, "per_group": [1, 2]}
    assert ablate.slim_record(step) == step
