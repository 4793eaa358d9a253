"""How much of a GRPO update is signal: agreement between independent epochs' gradients, per trained step.

    python scripts/measure/gradient_agreement.py --config config/grpo.py:motion_tiny_cpu --repeats 6
    python scripts/measure/gradient_agreement.py --config config/grpo.py:tiny_cpu --repeats 4 \\
        --config.sample.num_batches_per_epoch=32

At the preset's base weights (nothing is trained), --repeats epochs are sampled and scored as the trainer does
(epochs 0, 1, ... of the run: their own conditions and noise), and for each the epoch's GRPO gradient is taken
over all its samples, split by trained step j. With g_r = s + n_r (s the expected gradient, n_r the noise of
epoch r's samples, independent between epochs), the mean dot product of two different epochs' gradients
estimates |s|^2 and the mean squared norm |s|^2 + var / N, so

    cosine  ~ |s|^2 / (|s|^2 + var / N)        (mean pairwise cosine, printed with its spread)
    samples for a cosine of 1/2  ~ N (|g|^2 - |s|^2) / |s|^2

for the whole update and for each step j's term. A step with a large squared norm and no agreement adds noise
and no direction. The signal share comes with a 95% jackknife interval (leave one epoch out), and the "at least"
column extrapolates from its upper end: a share near 0 is too uncertain to extrapolate from its value alone (on the
motion job, 64 samples' share of 0.01 read as ~6,300 samples for 1/2; measured at 1,024 samples: at least 8,400).
The trainer logs the same cosine between consecutive optimizer steps (grad_cosine_prev) in
every run; this measures it at the base, per step, on as many epochs as asked. Nothing is written outside a
temporary folder, except --out's record of the whole update (with the wall seconds per sample, and so the seconds
an update whose cosine is 1/2 would take); --table prints several records side by side (scripts/measure/signal_sweep.sh
runs the settings of docs/results.md's table).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("WANDB_MODE", "disabled")

import torch  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from recam.engine.advantages import step_sample_weights, trajectory_ids  # noqa: E402
from recam.engine.trainer import GRPOTrainer  # noqa: E402
from recam.infra.stats import t975  # noqa: E402
from scripts.measure.at_base import trainer_at_base  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command line's flags, defined when this file runs as the script (scripts/measure/base_report.py imports the
    measurement and defines its own)."""
    config_flags.DEFINE_config_file("config", "config/grpo.py:motion_tiny_cpu",
                                    "preset (config/grpo.py:<name>[+method])")
    flags.DEFINE_integer("repeats", 6, "independent epochs sampled at the base (>= 2)")
    flags.DEFINE_string("out", "", "also write the whole update's numbers and seconds per sample to this JSON file")
    flags.DEFINE_string("label", "", "the setting's name in the JSON record (--table's first column)")
    flags.DEFINE_string("table", "", "comma-separated JSON files from --out: print their table and exit")


def agreement(grads: torch.Tensor) -> dict:
    """grads (R, D): R independent estimates of one expected gradient. Mean and standard deviation of the pairwise
    cosines, |s|^2 (mean pairwise dot product), mean |g|^2, and the signal's share |s|^2 / mean |g|^2."""
    R = grads.shape[0]
    if R < 2:
        raise ValueError(f"need at least 2 gradients to compare, got {R}")
    g = grads.double()
    pairs = list(itertools.combinations(range(R), 2))
    dots = torch.stack([g[a] @ g[b] for a, b in pairs])
    norms = g.norm(dim=1)
    cos = torch.stack([dots[i] / (norms[a] * norms[b]) for i, (a, b) in enumerate(pairs)])
    signal, total = float(dots.mean()), float((norms ** 2).mean())
    return {"cosine": float(cos.mean()), "cosine_std": float(cos.std()) if len(pairs) > 1 else 0.0,
            "signal_sq": signal, "total_sq": total, "signal_share": signal / total if total > 0 else math.nan}


def share_interval(grads: torch.Tensor) -> tuple[float, float]:
    """grads (R, D), R >= 3: the signal share and the half-width of its 95% jackknife interval (leaving one epoch
    out at a time; t with R - 1 degrees of freedom). The pairwise cosines share epochs, so their spread is not an
    interval; the jackknife's is."""
    R = grads.shape[0]
    if R < 3:
        raise ValueError(f"a jackknife interval needs at least 3 gradients, got {R}")
    share = agreement(grads)["signal_share"]
    loo = [agreement(torch.cat([grads[:r], grads[r + 1:]]))["signal_share"] for r in range(R)]
    centre = sum(loo) / R
    se = math.sqrt((R - 1) / R * sum((x - centre) ** 2 for x in loo))
    return share, t975(R - 1) * se


def samples_for_half(share: float, n: int) -> float:
    """Samples per gradient that bring the expected cosine to 1/2, from the signal share at n samples."""
    return n * (1 - share) / share if share > 0 else math.inf


def _split_backward(out: torch.Tensor, params: list, T: int):
    """An objective's backward(loss, last) that adds the k-th call's gradient to out[k % T]: the objectives call
    it once per trained step, in order, for each micro-batch."""
    calls = itertools.count()

    def backward(loss, last_piece):
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        out[next(calls) % T] += torch.cat([(g if g is not None else torch.zeros_like(p)).flatten().double()
                                           for g, p in zip(grads, params, strict=True)])
    return backward


def epoch_gradients(trainer: GRPOTrainer, epoch: int, seconds: dict | None = None) -> tuple[torch.Tensor, int]:
    """(T, D) the gradient of epoch `epoch`'s GRPO loss (mean over its kept samples) split by trained step, and
    the number of samples. The trainer's own sampling, rewards, advantages and objective; no optimizer step.
    `seconds`, when given, receives the wall seconds of sampling and scoring ("sample") and of the objective's
    forward and backward passes ("train")."""
    trainer.epoch = epoch
    t0 = time.perf_counter()
    rollouts = trainer.sample(epoch)
    groups = trainer.advantages(rollouts, trainer.score())
    t1 = time.perf_counter()
    params = [p for p in trainer.policy.parameters() if p.requires_grad]
    T = max(1, trainer.scheduler.num_train_steps)
    out = torch.zeros(T, sum(p.numel() for p in params), dtype=torch.float64)
    n = len(rollouts.states)
    keep = groups.keep.view(1, -1)
    weight = step_sample_weights(keep, torch.arange(n), 0)
    adv, traj = groups.advantages, trajectory_ids(groups.index)
    bs = trainer.config.train.batch_size
    trainer.model.train()
    for first in range(0, n, bs):
        mb = trainer.micro_batch(rollouts, torch.arange(first, min(first + bs, n)), adv, traj, weight, 0)
        trainer.objective.accumulate(mb, _split_backward(out, params, T))
    trainer.objective.end_epoch()
    if seconds is not None:
        seconds.update(sample=t1 - t0, train=time.perf_counter() - t1)
    return out, int(groups.keep.sum())


def update_record(G: torch.Tensor, n: int, seconds: list[dict], label: str, argv: list[str]) -> dict:
    """The whole update's numbers from G (R, T, D), R epochs of n samples each and their timings: signal share with
    its 95% interval, cosine, samples for a cosine of 1/2, and the seconds an update of that many samples takes at
    this setting's measured wall seconds per sample (sampling, scoring and one backward pass over each sample): the
    cost of signal, comparable across settings that differ in per-sample cost (k, objectives, steps) when they were
    timed on equally loaded cores."""
    whole = G.sum(1)
    a = agreement(whole)
    share, half = share_interval(whole) if len(whole) >= 3 else (a["signal_share"], math.nan)
    per_sample = sum(s["sample"] + s["train"] for s in seconds) / (len(seconds) * n)
    half_signal = samples_for_half(share, n)
    return {"label": label, "command": " ".join(argv), "repeats": len(whole), "samples": n,
            "share": share, "ci95": half, "cosine": a["cosine"], "cosine_std": a["cosine_std"],
            "samples_for_half": half_signal, "samples_for_half_at_least": samples_for_half(share + half, n),
            "seconds_per_sample": per_sample, "seconds_sample": [s["sample"] for s in seconds],
            "seconds_train": [s["train"] for s in seconds], "seconds_for_half": half_signal * per_sample}


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) else ("n/a" if math.isnan(x) else f"{x:.3g}")


def table(paths: list[str]) -> str:
    """A markdown table of --out records: one row each, in the given order."""
    rows = ["| setting | signal share (95%) | cosine | wall s / sample | samples for cosine 1/2 (at least) | "
            "wall s for cosine 1/2 |", "|---|---|---|---|---|---|"]
    for path in paths:
        try:
            r = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"[recam] {path}: not a gradient_agreement record ({e})") from None
        rows.append(f"| {r['label']} | {r['share']:.3f} ± {r['ci95']:.3f} | {r['cosine']:.3f} | "
                    f"{r['seconds_per_sample']:.3f} | {_fmt(r['samples_for_half'])} "
                    f"({_fmt(r['samples_for_half_at_least'])}) | {_fmt(r['seconds_for_half'])} |")
    return "\n".join(rows)


def main(_):
    if FLAGS.table:
        print(table([p for p in FLAGS.table.split(",") if p]))
        return
    if FLAGS.repeats < 2:
        sys.exit("[recam] --repeats must be at least 2")
    with trainer_at_base(FLAGS.config) as trainer:
        per_epoch, sizes, seconds = [], [], []
        for e in range(FLAGS.repeats):
            seconds.append({})
            grads, n = epoch_gradients(trainer, e, seconds[-1])
            per_epoch.append(grads)
            sizes.append(n)
            print(f"epoch {e}: {n} samples, gradient norm {float(grads.sum(0).norm()):.3e}, "
                  f"{seconds[-1]['sample']:.1f} s sampling and scoring, {seconds[-1]['train']:.1f} s backward",
                  flush=True)
    G = torch.stack(per_epoch)  # (R, T, D)
    n = int(sum(sizes) / len(sizes))
    start = trainer.numbers.plan.start(0, trainer.config.seed)
    print(f"\n{FLAGS.repeats} epochs of {n} samples at the base; cosine = mean over pairs of epochs (+- their std); "
          "signal share with its 95% jackknife interval (3 epochs or more)\n")
    print("| trained step | cosine | signal share | squared norm | samples for cosine 1/2 | at least |")
    print("|---|---|---|---|---|---|")
    steps = [(f"{start + j}", G[:, j]) for j in range(G.shape[1])] + [("all", G.sum(1))]
    for name, grads in steps:
        a = agreement(grads)
        share, half = share_interval(grads) if len(grads) >= 3 else (a["signal_share"], math.nan)
        high = share + half
        at_least = samples_for_half(high, n) if math.isfinite(high) else math.nan
        print(f"| {name} | {a['cosine']:.4f} +- {a['cosine_std']:.4f} | {share:.4f} +- {half:.4f} | "
              f"{a['total_sq']:.3e} | {samples_for_half(share, n):.3g} | {at_least:.3g} |")
    if FLAGS.out:
        record = update_record(G, n, seconds, FLAGS.label or FLAGS.out, [Path(sys.argv[0]).name] + sys.argv[1:])
        Path(FLAGS.out).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(FLAGS.out + ".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(FLAGS.out)


if __name__ == "__main__":
    define_flags()
    app.run(main)
