"""Rollouts with log-probs, and the re-scoring of stored transitions under the current policy.

Notation: N samples, S denoising steps, T trained steps (the first T of S, the noisiest), C x F x H x W video.
The policy is any `velocity_fn(x (N, C, F, H, W), sigma (N,)) -> v (N, C, F, H, W)`; conditioning lives in
the closure, so these functions know nothing about models or configs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from recam.sde import StepOutput, cps_step, flow_sde_step, ode_step

STEP_FNS = {"sde": flow_sde_step, "cps": cps_step}


@dataclass
class Rollout:
    """What training needs from one sampling batch, and nothing more.

    videos: (N, C, F, H, W) final samples (x at sigma = 0).
    states: (N, T + 1, C, F, H, W) x before each trained step, plus the state after the last trained one.
    log_probs: (N, T) float32 log-prob of each trained transition under the sampling policy.
    """

    videos: torch.Tensor
    states: torch.Tensor
    log_probs: torch.Tensor


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


def transition(step_fn, velocity, sigma, sigma_next, state, noise_level, next_state=None, noise=None) -> StepOutput:
    """One stochastic step. Draws next_state = mean + std * noise when next_state is None, else scores it."""
    if next_state is None:
        probe = step_fn(velocity, sigma, sigma_next, state, noise_level, prev_sample=state)
        next_state = (probe.mean + probe.std * noise.float()).to(state.dtype)
    return step_fn(velocity, sigma, sigma_next, state, noise_level, prev_sample=next_state)


@torch.no_grad()
def rollout(velocity_fn, noise: torch.Tensor, sigmas: torch.Tensor, num_train_steps: int, noise_level: float,
            sde_type: str = "sde") -> Rollout:
    """Sample N videos; the first T steps are stochastic (SDE/CPS) with log-probs, the rest ODE.

    The untrained tail is deterministic: in pixel space the SDE's last steps would leave visible noise in
    the output that no trained step is responsible for.

    Args:
        noise: (N, S + 1, C, F, H, W) standard normal draws: [:, 0] the initial x, [:, j + 1] step j's noise.
        sigmas: (S + 1,) descending from 1 to 0.
    """
    step_fn = STEP_FNS[sde_type]
    x = noise[:, 0]
    n = x.shape[0]
    states, log_probs = [x], []
    for j in range(len(sigmas) - 1):
        sigma = sigmas[j].expand(n)
        v = velocity_fn(x, sigma)
        if j < num_train_steps:
            out = transition(step_fn, v, sigmas[j], sigmas[j + 1], x, noise_level, noise=noise[:, j + 1])
            x = out.prev_sample
            states.append(x)
            log_probs.append(out.log_prob)
        else:
            x = ode_step(v, sigmas[j], sigmas[j + 1], x)
    return Rollout(videos=x, states=torch.stack(states, 1), log_probs=torch.stack(log_probs, 1))


@torch.no_grad()
def ode_sample(velocity_fn, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """Deterministic Euler sampling from noise (N, C, F, H, W); used for evaluation."""
    x = noise
    for j in range(len(sigmas) - 1):
        x = ode_step(velocity_fn(x, sigmas[j].expand(x.shape[0])), sigmas[j], sigmas[j + 1], x)
    return x


def rescore(velocity_fn, states: torch.Tensor, sigmas: torch.Tensor, j: int, noise_level: float,
            sde_type: str = "sde") -> StepOutput:
    """Log-prob (N,) of the stored transition states[:, j] -> states[:, j + 1] under `velocity_fn`.

    Gradients flow through the velocity into the log-prob and the mean (for the KL between means).
    """
    x = states[:, j]
    v = velocity_fn(x, sigmas[j].expand(x.shape[0]))
    return STEP_FNS[sde_type](v, sigmas[j], sigmas[j + 1], x, noise_level, prev_sample=states[:, j + 1])
