"""Which trained steps' noise moves the reward: the camera's credit per step, at a preset's base weights.

    python scripts/measure/step_credit.py --config config/grpo.py:tiny_cpu --conditions 16 --redraws 4
    python scripts/measure/step_credit.py --config config/grpo.py:tiny_cpu --config.model.pretrained=/tmp/base

GRPO's advantages can only credit a step whose noise changes the reward. For each of --conditions training
conditions one noise sequence is fixed; then, for every trained step j of the preset's window, step j's draw alone is
replaced --redraws times (every other draw kept) and the sample re-rolled and scored. The variance of the reward
over those redraws, within each condition, is how much of the reward step j's noise decides; beside it the variance
when every trained step's draw is replaced at once (a group's own spread, what the advantages rank). Reported per
step for the reward (--reward, default the preset's first) and for a detail of it (--detail, default the camera's
RotErr per placed frame), each as a share of the all-steps variance, with a 95% interval from a bootstrap over
conditions. Shares need not sum to 1: steps interact, and each single-step variance is measured with the others
held.

Nothing is trained or written outside a temporary folder.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("WANDB_MODE", "disabled")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from recam.engine.domain import decode, element_mask  # noqa: E402
from recam.engine.rollout import per_sample_noise, rollout  # noqa: E402
from scripts.measure.at_base import trainer_at_base  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The script's flags, defined only when it runs: tests import its functions beside other absl scripts, and
    absl refuses a flag name defined twice in one process."""
    config_flags.DEFINE_config_file("config", "config/grpo.py:tiny_cpu", "preset (config/grpo.py:<name>[+method])")
    flags.DEFINE_integer("conditions", 16, "training conditions, each with its own fixed noise sequence")
    flags.DEFINE_integer("redraws", 4, "redraws of the replaced draw(s) per condition and step")
    flags.DEFINE_integer("seed", 0, "seed of the fixed sequences and of the redraws")
    flags.DEFINE_string("reward", "", "reward key to report (default: the first of the preset's rewards)")
    flags.DEFINE_string("detail", "rot_err_placed_mean", "a per-sample number the reward reports, by its last name")
    flags.DEFINE_integer("bootstrap", 2000, "bootstrap resamples over conditions")

ALL = "all"


def within_variance(values: np.ndarray) -> np.ndarray:
    """(C, R) values per condition and redraw -> (C,) unbiased variance over the redraws, NaNs left out."""
    out = np.full(values.shape[0], np.nan)
    for c, row in enumerate(values):
        row = row[np.isfinite(row)]
        if row.size >= 2:
            out[c] = row.var(ddof=1)
    return out


def credit_shares(per_step: dict, reps: int, seed: int) -> dict:
    """per_step: name -> (C,) within-condition variances, with ALL among them. Returns name -> (share, lo, hi):
    mean variance over conditions relative to ALL's, and its bootstrap interval over conditions."""
    names = list(per_step)
    table = np.stack([per_step[n] for n in names])  # (K, C)
    keep = np.isfinite(table).all(0)
    table = table[:, keep]
    if table.shape[1] < 2:
        raise SystemExit("fewer than 2 conditions scored at every step; nothing to report")
    ref = names.index(ALL)
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, table.shape[1], size=(reps, table.shape[1]))
    boot = table[:, draws].mean(-1)  # (K, reps)
    point = table.mean(1) / table[ref].mean()
    ratio = boot / boot[ref]
    lo, hi = np.nanpercentile(ratio, [2.5, 97.5], axis=1)
    return {n: (float(point[i]), float(lo[i]), float(hi[i])) for i, n in enumerate(names)}


def redraw_table(trainer, conditions: int, redraws: int, seed: int, reward: str, detail: str) -> tuple[dict, dict]:
    """(reward variances, detail variances): name -> (C,) within-condition variance, per trained step and ALL."""
    domain, sched = trainer.domain, trainer.scheduler
    n = min(conditions, len(trainer.train_set))
    stride = max(1, len(trainer.train_set) // n)
    indices = [i * stride for i in range(n)]
    batch = domain.collate(trainer.train_set, indices)
    base = per_sample_noise([(seed, i) for i in range(n)], sched.num_steps + 1, trainer.sample_shape)
    start = trainer.numbers.plan.start(0, trainer.config.seed)
    T = sched.num_train_steps
    if T == 0:
        raise SystemExit("the preset trains no stochastic step (T = 0): there is no step to credit")
    mask = element_mask(domain, batch, trainer.accelerator.device)
    denoise = domain.denoiser(trainer.model, batch, trainer.autocast)
    plans = {f"step {start + j}": [start + j + 1] for j in range(T)}
    plans[ALL] = [start + j + 1 for j in range(T)]
    rewards, details = {}, {}
    with torch.no_grad():
        for name, draws in plans.items():
            rew, det = np.full((n, redraws), np.nan), np.full((n, redraws), np.nan)
            for r in range(redraws):
                noise = base.clone()
                fresh = per_sample_noise([(seed, i, 1 + r, *draws) for i in range(n)], len(draws),
                                         trainer.sample_shape)
                noise[:, draws] = fresh
                out = rollout(denoise, noise.to(trainer.accelerator.device), sched, mask, start=start)
                trainer.runner.submit((name, r), decode(domain, out.final, batch).cpu(), batch.conditions)
                scores = trainer.runner.collect_scores(trainer.accelerator)
                key = reward or next(k for k in scores.rewards if k != "avg")
                values = scores.rewards[key].double().numpy()
                rew[:, r] = np.where(scores.valid.numpy(), values, np.nan)
                found = [k for k in (scores.details.numbers if scores.details else {}) if k.split("/")[-1] == detail]
                if found:
                    det[:, r] = scores.details.numbers[found[0]].double().numpy()
            rewards[name], details[name] = within_variance(rew), within_variance(det)
    return rewards, details


def table_lines(title: str, shares: dict, variances: dict) -> list[str]:
    lines = [f"**{title}**", "", "| noise replaced | within-condition variance | share of all steps' (95%) |",
             "|---|---|---|"]
    for name, (s, lo, hi) in shares.items():
        lines.append(f"| {name} | {np.nanmean(variances[name]):.4g} | {s:.2f} [{lo:.2f}, {hi:.2f}] |")
    return lines


def main(_):
    with trainer_at_base(FLAGS.config) as trainer:
        rewards, details = redraw_table(trainer, FLAGS.conditions, FLAGS.redraws, FLAGS.seed, FLAGS.reward,
                                        FLAGS.detail)
    lines = table_lines(FLAGS.reward or "the reward", credit_shares(rewards, FLAGS.bootstrap, FLAGS.seed), rewards)
    if all(np.isfinite(v).sum() >= 2 for v in details.values()):
        lines += [""] + table_lines(FLAGS.detail, credit_shares(details, FLAGS.bootstrap, FLAGS.seed), details)
    else:
        lines += ["", f"{FLAGS.detail}: not reported by the reward on enough samples; not tabled"]
    print("\n".join(lines))


if __name__ == "__main__":
    define_flags()
    app.run(main)
