"""Schedulers: the sampling transitions a domain's model is rolled out with, and which steps are trained.

A scheduler owns its time grid. For step j it gives the time the denoiser is called with (`model_time`),
the stochastic transition with its Gaussian log-prob, mean and std (`transition`), and the deterministic
step used outside the trained steps and for evaluation (`deterministic`). Rollouts store only `num_train_steps`
transitions: a window of consecutive steps that starts where the rollout says (recam.engine.rollout; step 0, the
noisiest, unless a window is configured). The engine knows nothing else about a scheduler, so flow matching
(SDE / CPS / ODE) and DDPM/DDIM models (epsilon or x0 prediction) share one loop.

Objectives that train on re-noised final samples (recam.engine.extensions.fast_objectives) use the forward process:
`noise_to(x0, noise, u)` puts a clean sample at noise level u in (0, 1) and gives the time the model is called
with there, `output_target` is what the model is trained to output, `x0_from_output` inverts it.

Every transition's log-prob is float32 and averaged over a sample's elements (recam.engine.sde), over those a
`mask` marks as real when one is given (a padded motion's frames are not); `reduction="sum"` sums instead, only to
reproduce runs that did.
"""

from __future__ import annotations

import copy
from typing import Protocol

import torch
from torch import Tensor

from recam.engine.sde import (
    StepOutput,
    cps_step,
    ddim_noise_to,
    ddim_step_with_logprob,
    ddim_x0_from_output,
    flow_dpm2_step,
    flow_noise_to,
    flow_sa_step,
    flow_sde_step,
    flow_sigmas,
    flow_x0_from_velocity,
    gaussian_kl_between_means,
    ode_step,
)

FLOW_STEPS = {"sde": flow_sde_step, "cps": cps_step}
# the noise level a each flow step accepts: (low, high), low exclusive, high inclusive (None: unbounded), and why
FLOW_NOISE_RANGE = {"sde": (0.0, None, "the SDE needs noise for a stochastic policy"),
                    "cps": (0.0, 1.0, "coefficients-preserving sampling needs a in (0, 1]: its angle is a pi / 2")}


class Scheduler(Protocol):
    num_steps: int  # S denoising steps of a rollout
    num_train_steps: int  # T: the stochastic, stored and trained steps (a window of them, see rollout)
    is_flow: bool  # flow matching (velocity output, sigma time) rather than DDPM/DDIM

    def model_time(self, j: int, n: int) -> Tensor:
        """(n,) time the denoiser is called with at step j."""

    def transition(self, j: int, output: Tensor, x: Tensor, next_state: Tensor | None = None,
                   noise: Tensor | None = None, mask: Tensor | None = None) -> StepOutput:
        """Step j as a Gaussian: draws next_state = mean + std * noise, or scores a given next_state; the
        log-prob reduces over the elements `mask` (broadcastable to x) marks, all when None."""

    def deterministic(self, j: int, output: Tensor, x: Tensor) -> Tensor:
        """Step j without noise (the probability-flow ODE / DDIM with eta 0)."""

    def output_coefficient(self, j: int) -> float:
        """|d mean / d output| of step j's transition (every step is affine in the model output)."""

    def transition_kl(self, mean_a: Tensor, mean_b: Tensor, std, mask: Tensor | None = None) -> Tensor:
        """(N,) KL between step distributions centred on mean_a and mean_b with this step's std, over the coordinates
        the log-probs reduce over (every element, or a noise subspace's coordinates) and with their reduction: the
        mean of log p_b - log p_a of a draw from p_a is minus this, whatever the coordinates."""

    def step_std(self, j: int) -> float:
        """The standard deviation of step j's transition."""

    def with_steps(self, num_steps: int) -> Scheduler:
        """The same scheduler on another number of steps (evaluation), nothing trained."""

    def with_train_steps(self, num_train_steps: int) -> Scheduler:
        """The same scheduler with another number of trained steps (a window's size; 0: none)."""

    def noise_to(self, x0: Tensor, noise: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
        """The forward process at noise level u (n,) in (0, 1): (x_u, the time the model is called with)."""

    def x0_from_output(self, output: Tensor, x_t: Tensor, u: Tensor) -> Tensor:
        """The clean sample a model output at (x_u, u) points to."""

    def output_target(self, x0: Tensor, noise: Tensor, u: Tensor) -> Tensor:
        """What the model is trained to output at x_u = noise_to(x0, noise, u)."""

    def grid_levels(self) -> Tensor:
        """(S,) float64: the noise level u (noise_to's) of each sampling step's input, noisiest first; re-noising at
        these is re-noising at the sampling grid (DiffusionNFT, AWM)."""


def _draw_or_score(step, next_state: Tensor | None, noise: Tensor | None, x: Tensor) -> StepOutput:
    """Shared by the schedulers: draw from the step's Gaussian with the given noise, then score the draw.

    The draw is rounded to x's dtype before it is scored, so re-scoring the stored state later gives the
    same log-prob bit for bit (an on-policy ratio of exactly 1)."""
    if next_state is None:
        probe = step(x)
        next_state = (probe.mean + probe.std * noise.float()).to(x.dtype)
    return step(next_state)


def _with_train_steps(scheduler, num_train_steps: int):
    """A shallow copy: the time grid and its tensors are shared, bit for bit, only T differs."""
    if isinstance(num_train_steps, bool) or not isinstance(num_train_steps, int) \
            or not 0 <= num_train_steps <= scheduler.num_steps:
        raise ValueError(f"num_train_steps must be an int in [0, {scheduler.num_steps}], got {num_train_steps!r}")
    out = copy.copy(scheduler)
    out.num_train_steps = num_train_steps
    return out


class FlowMatchScheduler:
    """Flow matching, x_sigma = (1 - sigma) x0 + sigma noise, model output = velocity (recam.engine.sde).

    sde_type "sde" is Flow-GRPO's SDE, "cps" coefficients-preserving sampling; noise_level a scales the noise."""

    is_flow = True

    def __init__(self, num_steps: int, shift: float, noise_level: float, sde_type: str = "sde",
                 num_train_steps: int = 0, device: torch.device | str = "cpu", reduction: str = "mean"):
        if sde_type not in FLOW_STEPS:
            raise ValueError(f"sde_type must be one of {sorted(FLOW_STEPS)}, got {sde_type!r}")
        self.sigmas = flow_sigmas(num_steps, shift).to(device)
        self.num_steps, self.num_train_steps = num_steps, num_train_steps
        self.shift, self.noise_level, self.sde_type, self.device = shift, noise_level, sde_type, device
        self.reduction = reduction

    def model_time(self, j: int, n: int) -> Tensor:
        return self.sigmas[j].expand(n)

    def transition(self, j, output, x, next_state=None, noise=None, mask=None) -> StepOutput:
        fn, s, s_next = FLOW_STEPS[self.sde_type], self.sigmas[j], self.sigmas[j + 1]
        return _draw_or_score(lambda prev: fn(output, s, s_next, x, self.noise_level, prev_sample=prev, mask=mask,
                                              reduction=self.reduction), next_state, noise, x)

    def deterministic(self, j, output, x) -> Tensor:
        return ode_step(output, self.sigmas[j], self.sigmas[j + 1], x)

    def deterministic_2m(self, j: int, output: Tensor, x: Tensor, previous: tuple[Tensor, float] | None):
        """Step j with DPM-Solver++(2M) (recam.engine.sde.flow_dpm2_step): returns (x_next, (x0, sigma_j)), the
        second item being the next step's `previous`; None starts first order."""
        s, s_next = float(self.sigmas[j]), float(self.sigmas[j + 1])
        x_next, x0 = flow_dpm2_step(output, s, s_next, x, previous)
        return x_next, (x0, s)

    def dpm2_history(self, j: int, output: Tensor, x: Tensor) -> tuple[Tensor, float]:
        """The `previous` that step j leaves for the 2M solver when another step moved x (a stochastic one): its x0
        prediction x - sigma_j v and sigma_j, so the next 2M step is second order (MixGRPO-Flash keeps the history
        through its window)."""
        s = float(self.sigmas[j])
        return x.float() - s * output.float(), s

    def stochastic_adams(self, j: int, output: Tensor, x: Tensor, eta: float, sigma_range: tuple[float, float],
                         noise: Tensor) -> Tensor:
        """Step j with SA-Solver's first-order stochastic step (recam.engine.sde.flow_sa_step): stochasticity eta
        where the step ends at a sigma inside sigma_range (AWM's pipeline: 0.4 on [0.3, 0.9]), 0 (Euler) elsewhere."""
        s, s_next = float(self.sigmas[j]), float(self.sigmas[j + 1])
        tau = eta if sigma_range[0] <= s_next <= sigma_range[1] else 0.0
        return flow_sa_step(output, s, s_next, x, tau, noise)

    def transition_kl(self, mean_a: Tensor, mean_b: Tensor, std, mask: Tensor | None = None) -> Tensor:
        """(N,) KL between this step's Gaussians centred on mean_a and on mean_b, in the coordinates and with the
        reduction its log-probs use (here every element)."""
        return gaussian_kl_between_means(mean_a, mean_b, std, mask, self.reduction)

    def compressed_after(self, step: int, ratio: float) -> FlowMatchScheduler:
        """This grid up to `step`, then the rest on max(int(points x ratio), 2) points from sigmas[step] to 0, where
        points = num_steps - step + 1 (MixGRPO-Flash's dpm_post_compress_ratio; its sampling_utils.py counts the
        points the same way): uniform in the unshifted time, then time-shifted like the whole grid. The reference
        allows a single point, which would end sampling above sigma 0; two points always reach it. Deterministic
        steps only: nothing is trained on the new grid."""
        if not 0 < ratio <= 1:
            raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")
        if not 0 < step < self.num_steps:
            raise ValueError(f"step must be in (0, {self.num_steps}), got {step!r}")
        points = max(int((self.num_steps - step + 1) * ratio), 2)
        unshifted = torch.linspace(1.0 - step / self.num_steps, 0.0, points, dtype=torch.float64)
        tail = (self.shift * unshifted / (1.0 + (self.shift - 1.0) * unshifted)).to(torch.float32)
        out = copy.copy(self)
        out.sigmas = torch.cat([self.sigmas[:step], tail.to(self.sigmas.device)])
        out.num_steps = step + points - 1
        return out

    def step_dt(self, j: int) -> float:
        """|dt| of step j: sigmas[j] - sigmas[j + 1] > 0."""
        return float(self.sigmas[j] - self.sigmas[j + 1])

    def noise_to(self, x0, noise, u) -> tuple[Tensor, Tensor]:
        # the model is called with sigma itself (model_time), and sigma = u
        return flow_noise_to(x0, noise, u).to(x0.dtype), u.to(self.sigmas.device, self.sigmas.dtype)

    def x0_from_output(self, output, x_t, u) -> Tensor:
        return flow_x0_from_velocity(output, x_t, u)

    def output_target(self, x0, noise, u) -> Tensor:
        return noise.float() - x0.float()  # the velocity d x_u / d u, whatever u

    def grid_levels(self) -> Tensor:
        return self.sigmas[: self.num_steps].double()

    def output_coefficient(self, j: int) -> float:
        """|d mean / d output| of step j's transition (the step is affine in the model output)."""
        one, zero = torch.ones(1, 1), torch.zeros(1, 1)
        fn, s, s_next = FLOW_STEPS[self.sde_type], self.sigmas[j].cpu(), self.sigmas[j + 1].cpu()
        a = fn(one, s, s_next, zero, self.noise_level, prev_sample=zero).mean
        b = fn(zero, s, s_next, zero, self.noise_level, prev_sample=zero).mean
        return float((a - b).abs())

    def step_std(self, j: int) -> float:
        """The standard deviation of step j's transition (the same for every element)."""
        zero = torch.zeros(1, 1)
        fn, s, s_next = FLOW_STEPS[self.sde_type], self.sigmas[j].cpu(), self.sigmas[j + 1].cpu()
        return float(fn(zero, s, s_next, zero, self.noise_level, prev_sample=zero).std.flatten()[0])

    def with_steps(self, num_steps: int) -> FlowMatchScheduler:
        return FlowMatchScheduler(num_steps, self.shift, self.noise_level, self.sde_type, 0, self.device,
                                  self.reduction)

    def with_train_steps(self, num_train_steps: int):
        return _with_train_steps(self, num_train_steps)


class DDIMScheduler:
    """DDPM-trained models sampled with DDIM (DDPO's log-prob step): model output is the predicted noise
    ("epsilon") or the clean sample ("sample"); eta in (0, 1] makes the trained steps stochastic.

    alphas_cumprod: (T_train,) from the model's training schedule (e.g. diffusers' DDPMScheduler); the S
    sampling timesteps are evenly spaced over it, descending."""

    is_flow = False

    def __init__(self, alphas_cumprod: Tensor, num_steps: int, eta: float, prediction_type: str = "epsilon",
                 num_train_steps: int = 0, device: torch.device | str = "cpu", reduction: str = "mean"):
        self.alphas_cumprod = alphas_cumprod.to(device, torch.float64)
        train_len = self.alphas_cumprod.shape[0]
        if not 1 <= num_steps <= train_len:
            raise ValueError(f"num_steps must be in [1, {train_len}], got {num_steps!r}")
        # evenly spaced ("leading") timesteps, noisiest first; the last step goes to clean data (-1)
        ts = (torch.arange(num_steps) * (train_len // num_steps)).flip(0)
        self.timesteps = ts.to(device)
        self.prev = torch.cat([ts[1:], torch.tensor([-1])]).to(device)
        self.num_steps, self.num_train_steps = num_steps, num_train_steps
        self.eta, self.prediction_type, self.device = eta, prediction_type, device
        self.reduction = reduction

    def model_time(self, j: int, n: int) -> Tensor:
        return self.timesteps[j].expand(n)

    def _step(self, j, output, x, eta, prev_sample, mask=None):
        return ddim_step_with_logprob(output, int(self.timesteps[j]), int(self.prev[j]), x, self.alphas_cumprod,
                                      eta, self.prediction_type, prev_sample=prev_sample, mask=mask,
                                      reduction=self.reduction)

    def transition(self, j, output, x, next_state=None, noise=None, mask=None) -> StepOutput:
        return _draw_or_score(lambda prev: self._step(j, output, x, self.eta, prev, mask), next_state, noise, x)

    def deterministic(self, j, output, x) -> Tensor:
        return self._step(j, output, x, 0.0, None).prev_sample

    def transition_kl(self, mean_a: Tensor, mean_b: Tensor, std, mask: Tensor | None = None) -> Tensor:
        """(N,) KL between this step's Gaussians centred on mean_a and on mean_b (every element, its reduction)."""
        return gaussian_kl_between_means(mean_a, mean_b, std, mask, self.reduction)

    def output_coefficient(self, j: int) -> float:
        one, zero = torch.ones(1, 1), torch.zeros(1, 1)
        a = self._step(j, one, zero, self.eta, zero).mean
        b = self._step(j, zero, zero, self.eta, zero).mean
        return float((a - b).abs())

    def step_std(self, j: int) -> float:
        """The standard deviation of step j's transition at the scheduler's eta."""
        zero = torch.zeros(1, 1)
        return float(self._step(j, zero, zero, self.eta, zero).std.flatten()[0])

    def with_steps(self, num_steps: int) -> DDIMScheduler:
        return DDIMScheduler(self.alphas_cumprod.float(), num_steps, self.eta, self.prediction_type, 0, self.device,
                             self.reduction)

    def with_train_steps(self, num_train_steps: int):
        return _with_train_steps(self, num_train_steps)

    def training_timestep(self, u: Tensor) -> Tensor:
        """(n,) int64 index into alphas_cumprod for noise level u (n,) in (0, 1): round(u * (len - 1))."""
        last = self.alphas_cumprod.shape[0] - 1
        return torch.round(u.double() * last).long().clamp(0, last).to(self.alphas_cumprod.device)

    def alpha_bar(self, u: Tensor) -> Tensor:
        return self.alphas_cumprod[self.training_timestep(u)].float()

    def noise_to(self, x0, noise, u) -> tuple[Tensor, Tensor]:
        t = self.training_timestep(u)
        return ddim_noise_to(x0, noise, self.alphas_cumprod[t].float()).to(x0.dtype), t

    def x0_from_output(self, output, x_t, u) -> Tensor:
        return ddim_x0_from_output(output, x_t, self.alpha_bar(u), self.prediction_type)

    def output_target(self, x0, noise, u) -> Tensor:
        return (x0 if self.prediction_type == "sample" else noise).float()

    def grid_levels(self) -> Tensor:
        # training_timestep rounds u * (len - 1) back to these very timesteps
        return self.timesteps.double() / (self.alphas_cumprod.shape[0] - 1)
