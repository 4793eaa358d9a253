"""How big each trained step's share of a GRPO update is, for a preset's base model.

    python scripts/measure/step_gradients.py --config config/grpo.py:motion_tiny_cpu+flow_grpo
    python scripts/measure/step_gradients.py --config config/grpo.py:toy --conditions 16 --seed 3

One rollout of --conditions training conditions (the preset's sampler, window and noise), then for every trained
step j the norm over the policy's parameters of the gradient of mean_i(A_i log p_ij), A_i a fixed standard-normal
draw per sample (the size of a step's score term is what is measured; its direction would need real advantages).
Printed per step: the model time, the transition's std_j, c_j = |d mean_j / d output|, the gradient norm, and the
norm times the train.step_weighting="score_balanced" weight. An unweighted GRPO update (train.step_weighting
"uniform") sums these terms, so a step whose norm is orders of magnitude above the others is most of the update.
Nothing is trained or written outside a temporary folder.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("WANDB_MODE", "disabled")

import torch  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from recam.engine.domain import element_mask  # noqa: E402
from recam.engine.objective import step_weights  # noqa: E402
from recam.engine.rollout import per_sample_noise, rescore, rollout  # noqa: E402
from scripts.measure.at_base import trainer_at_base  # noqa: E402

config_flags.DEFINE_config_file("config", "config/grpo.py:motion_tiny_cpu", "preset (config/grpo.py:<name>[+method])")
flags.DEFINE_integer("conditions", 8, "training conditions in the rollout (one sample each)")
flags.DEFINE_integer("seed", 0, "seed of the rollout's noise and of the stand-in advantages")
FLAGS = flags.FLAGS


def step_gradient_table(trainer, conditions: int, seed: int) -> list[dict]:
    """Rows per trained step: step, time, std, coefficient, grad_norm, weight, weighted_norm."""
    domain, sched = trainer.domain, trainer.scheduler
    n = min(conditions, len(trainer.train_set))
    stride = max(1, len(trainer.train_set) // n)
    batch = domain.collate(trainer.train_set, [i * stride for i in range(n)])
    noise = per_sample_noise([(seed, i) for i in range(n)], sched.num_steps + 1, trainer.sample_shape)
    mask = element_mask(domain, batch, trainer.accelerator.device)
    start = trainer.numbers.plan.start(0, trainer.config.seed)
    denoise = domain.denoiser(trainer.model, batch, trainer.autocast)
    out = rollout(denoise, noise.to(trainer.accelerator.device), sched, mask, start=start)
    advantages = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(out.final.device)
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    T = out.log_probs.shape[1]
    weights = step_weights(sched, start, T, "score_balanced")
    rows = []
    for j in range(T):
        log_prob = rescore(denoise, out.states, sched, j, mask, start).log_prob
        grads = torch.autograd.grad((advantages * log_prob).mean(), params, allow_unused=True)
        norm = float(torch.sqrt(sum((g.float() ** 2).sum() for g in grads if g is not None)))
        k = start + j
        rows.append({"step": k, "time": float(sched.model_time(k, 1)[0]), "std": sched.step_std(k),
                     "coefficient": sched.output_coefficient(k), "grad_norm": norm, "weight": float(weights[j]),
                     "weighted_norm": norm * float(weights[j])})
    return rows


def main(_):
    with trainer_at_base(FLAGS.config) as trainer:
        rows = step_gradient_table(trainer, FLAGS.conditions, FLAGS.seed)
    print("| step | model time | std | c = d mean / d output | grad norm | score_balanced weight | weighted norm |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['step']} | {r['time']:.4g} | {r['std']:.4g} | {r['coefficient']:.4g} | {r['grad_norm']:.3e} | "
              f"{r['weight']:.3g} | {r['weighted_norm']:.3e} |")
    norms = [r["grad_norm"] for r in rows]
    weighted = [r["weighted_norm"] for r in rows]
    if norms and min(norms) > 0:
        print(f"\nlargest / smallest step: {max(norms) / min(norms):.3g} unweighted, "
              f"{max(weighted) / min(weighted):.3g} score_balanced")


if __name__ == "__main__":
    app.run(main)
