"""Rollouts with log-probs, deterministic sampling, and re-scoring stored transitions under the current policy.

The policy is any `denoise(x (N, *sample_shape), t (N,)) -> model output (N, *sample_shape)` closure: the
domain closes the conditioning over its model, the scheduler says what the output means. These functions know
nothing about models, domains or configs.
"""

from __future__ import annotations

import numpy as np
import torch

from recam.engine.containers import Rollout
from recam.engine.sde import StepOutput


def per_sample_noise(keys: list[tuple[int, ...]], num_draws: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Standard normal noise (N, num_draws, *shape), sample i drawn from its own stream seeded by keys[i].

    Keying noise by a sample's global position (not by process) makes a run's samples independent of how
    many processes share the batch: 1 process x 8 samples and 2 x 4 draw identical noise.
    """
    out = torch.empty(len(keys), num_draws, *shape)
    for i, key in enumerate(keys):
        seed = int(np.random.SeedSequence([int(k) for k in key]).generate_state(1, dtype=np.uint64)[0])
        out[i] = torch.randn(num_draws, *shape, generator=torch.Generator().manual_seed(seed % (2**63)))
    return out


@torch.no_grad()
def rollout(denoise, noise: torch.Tensor, scheduler, mask: torch.Tensor | None = None) -> Rollout:
    """Sample N outputs; the first T steps are stochastic with log-probs, the rest deterministic.

    The untrained tail is deterministic: noise there would stay visible in the output while no trained step
    is responsible for it.

    noise: (N, S + 1, *sample_shape) standard normal draws: [:, 0] the initial x, [:, j + 1] step j's noise.
    mask: the elements the log-probs average over (broadcastable to a sample batch), all when None.
    """
    x = noise[:, 0]
    states, log_probs = [x], []
    for j in range(scheduler.num_steps):
        out = denoise(x, scheduler.model_time(j, x.shape[0]))
        if j < scheduler.num_train_steps:
            step = scheduler.transition(j, out, x, noise=noise[:, j + 1], mask=mask)
            x = step.prev_sample
            states.append(x)
            log_probs.append(step.log_prob)
        else:
            x = scheduler.deterministic(j, out, x)
    return Rollout(final=x, states=torch.stack(states, 1), log_probs=torch.stack(log_probs, 1))


@torch.no_grad()
def deterministic_sample(denoise, noise: torch.Tensor, scheduler) -> torch.Tensor:
    """Noise-free sampling from noise (N, *sample_shape); used for evaluation."""
    x = noise
    for j in range(scheduler.num_steps):
        x = scheduler.deterministic(j, denoise(x, scheduler.model_time(j, x.shape[0])), x)
    return x


def rescore(denoise, states: torch.Tensor, scheduler, j: int, mask: torch.Tensor | None = None) -> StepOutput:
    """The stored transition states[:, j] -> states[:, j + 1] under `denoise`: log-prob (N,), mean and std.

    Gradients flow through the model output into the log-prob and the mean.
    """
    x = states[:, j]
    return scheduler.transition(j, denoise(x, scheduler.model_time(j, x.shape[0])), x, next_state=states[:, j + 1],
                                mask=mask)
