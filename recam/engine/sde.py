"""Stochastic sampling steps with exact Gaussian log-probabilities for GRPO.

All functions are pure functions of tensors. Shapes: B samples in a batch, and an arbitrary per-sample
shape after the batch axis, e.g. videos (B, C, F, H, W) or motion (B, 263, 1, frames).

Flow-matching convention: x_sigma = (1 - sigma) * x0 + sigma * noise with sigma = 1 pure noise and
sigma = 0 data; velocity v = noise - x0; a denoising step goes from sigma to sigma_next < sigma, so
dt = sigma_next - sigma < 0.

Every stochastic step is a Gaussian transition N(mean, std^2 I). Log-probabilities are always computed in
float32 and averaged (not summed) over all non-batch elements, giving shape (B,). A `mask` (B, ...) of the
elements that are real (a motion's frames before its length; padded ones are not) restricts the average to
them; `reduction="sum"` sums instead of averaging, which exists only to reproduce runs that did so (summed over
263 x 196 elements a log-ratio is thousands of times larger and importance ratios explode). A step whose std is 0
(deterministic) has no density; its log-prob is defined as 0 so that it contributes a ratio of exactly 1.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "REDUCTIONS",
    "StepOutput",
    "checked_std",
    "cps_step",
    "ddim_noise_to",
    "ddim_step_with_logprob",
    "ddim_x0_from_output",
    "flow_dpm2_step",
    "flow_sa_step",
    "flow_noise_to",
    "flow_sde_step",
    "flow_sigmas",
    "flow_x0_from_velocity",
    "gaussian_kl_between_means",
    "ode_step",
    "reduce_elements",
]

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


class StepOutput(NamedTuple):
    """Result of one stochastic sampling step.

    prev_sample: (B, ...) the next (less noisy) sample, in the dtype of the input sample.
    log_prob: (B,) float32 mean per-element Gaussian log-density of prev_sample.
    mean: (B, ...) float32 transition mean.
    std: (B, 1, ..., 1) float32 transition standard deviation (broadcastable to the sample).
    """

    prev_sample: Tensor
    log_prob: Tensor
    mean: Tensor
    std: Tensor


def flow_sigmas(num_steps: int, shift: float = 1.0) -> Tensor:
    """Sigma schedule for flow-matching sampling, descending from 1 to 0.

    Uniform s in [1, 0] is warped by the time shift sigma = shift * s / (1 + (shift - 1) * s), which keeps
    the end points fixed and spends more steps at high noise when shift > 1.

    Returns: (num_steps + 1,) float32, sigmas[0] == 1 and sigmas[-1] == 0.
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")
    if not shift > 0:
        raise ValueError(f"shift must be > 0, got {shift!r}")
    s = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    sigmas = shift * s / (1.0 + (shift - 1.0) * s)
    return sigmas.to(torch.float32)


def _batch_column(value: float | Tensor, name: str, sample: Tensor) -> Tensor:
    """A scalar or (B,) value as a float32 (B, 1, ..., 1) tensor on the sample's device."""
    batch = sample.shape[0]
    col_shape = (batch,) + (1,) * (sample.dim() - 1)
    if isinstance(value, Tensor):
        if value.dim() == 0:
            return value.to(sample.device, torch.float32).expand(col_shape)
        if value.shape != (batch,):
            raise ValueError(
                f"{name} must be a float, a 0-dim tensor or shape ({batch},), got {tuple(value.shape)}"
            )
        return value.to(sample.device, torch.float32).reshape(col_shape)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float or a tensor, got {type(value).__name__}")
    return torch.full(col_shape, float(value), dtype=torch.float32, device=sample.device)


def _check_pair(velocity: Tensor, sample: Tensor, prev_sample: Tensor | None, vel_name: str) -> None:
    if sample.dim() < 2:
        raise ValueError(f"sample needs a batch axis and at least one more, got shape {tuple(sample.shape)}")
    if velocity.shape != sample.shape:
        raise ValueError(f"{vel_name} shape {tuple(velocity.shape)} != sample shape {tuple(sample.shape)}")
    if prev_sample is not None and prev_sample.shape != sample.shape:
        raise ValueError(f"prev_sample {tuple(prev_sample.shape)} != sample {tuple(sample.shape)}")


def _flow_sigma_columns(
    sigma: float | Tensor, sigma_next: float | Tensor, sample: Tensor
) -> tuple[Tensor, Tensor]:
    s = _batch_column(sigma, "sigma", sample)
    s_next = _batch_column(sigma_next, "sigma_next", sample)
    if not bool(((s_next >= 0) & (s_next < s) & (s <= 1)).all()):
        raise ValueError(
            "need 0 <= sigma_next < sigma <= 1 for a denoising step, got "
            f"sigma={s.flatten().tolist()}, sigma_next={s_next.flatten().tolist()}"
        )
    return s, s_next


REDUCTIONS = ("mean", "sum")


def reduce_elements(per_element: Tensor, mask: Tensor | None = None, reduction: str = "mean") -> Tensor:
    """(B, ...) -> (B,): mean (or sum) over the non-batch elements, only those where `mask` (broadcastable to
    per_element, bool or 0/1) is set. A sample with no masked-in element gets 0."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    dims = tuple(range(1, per_element.dim()))
    if mask is None:
        return per_element.mean(dim=dims) if reduction == "mean" else per_element.sum(dim=dims)
    weight = torch.broadcast_to(mask.to(per_element.device, per_element.dtype), per_element.shape)
    total = (per_element * weight).sum(dim=dims)
    if reduction == "sum":
        return total
    return total / weight.sum(dim=dims).clamp(min=1.0)


def _gaussian_log_prob(x: Tensor, mean: Tensor, std: Tensor, mask: Tensor | None = None,
                       reduction: str = "mean") -> Tensor:
    """Mean (reduce_elements) over non-batch elements of log N(x; mean, std^2), float32, shape (B,).

    Samples whose std is 0 get log-prob 0: a deterministic step has no density, and 0 keeps the
    importance ratio of such a step at exactly 1.
    """
    x = x.float()
    positive = std > 0
    safe_std = torch.where(positive, std, torch.ones_like(std))
    log_density = -((x - mean) ** 2) / (2.0 * safe_std**2) - torch.log(safe_std) - _LOG_SQRT_2PI
    log_density = torch.where(positive, log_density, torch.zeros_like(log_density))
    return reduce_elements(log_density, mask, reduction)


def _finish_step(
    mean: Tensor,
    std: Tensor,
    sample: Tensor,
    prev_sample: Tensor | None,
    generator: torch.Generator | None,
    deterministic: bool = False,
    mask: Tensor | None = None,
    reduction: str = "mean",
) -> StepOutput:
    if prev_sample is None and deterministic:
        # No noise is drawn, so the generator's state is untouched by an ODE-equivalent step.
        prev_sample = mean.to(sample.dtype)
    elif prev_sample is None:
        noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=torch.float32)
        # Rounded to the caller's dtype BEFORE scoring, so that re-scoring the stored sample later
        # reproduces this log-prob bit for bit (on-policy ratio exactly 1).
        prev_sample = (mean + std * noise).to(sample.dtype)
    log_prob = _gaussian_log_prob(prev_sample, mean, std, mask, reduction)
    return StepOutput(prev_sample=prev_sample, log_prob=log_prob, mean=mean, std=std)


def ode_step(velocity: Tensor, sigma: float | Tensor, sigma_next: float | Tensor, sample: Tensor) -> Tensor:
    """Euler step of the flow ODE: x_next = x + (sigma_next - sigma) * v.

    velocity, sample: (B, ...). sigma, sigma_next: floats or (B,) tensors.
    Returns (B, ...) in sample's dtype; arithmetic in float32.
    """
    _check_pair(velocity, sample, None, "velocity")
    s, s_next = _flow_sigma_columns(sigma, sigma_next, sample)
    return (sample.float() + (s_next - s) * velocity.float()).to(sample.dtype)


def _flow_log_snr(sigma: float) -> float:
    """lambda = log(alpha / sigma) of x_sigma = (1 - sigma) x0 + sigma noise: -inf at pure noise, +inf at data."""
    if sigma >= 1.0:
        return -math.inf
    if sigma <= 0.0:
        return math.inf
    return math.log1p(-sigma) - math.log(sigma)


def flow_dpm2_step(velocity: Tensor, sigma: float, sigma_next: float, sample: Tensor,
                   previous: tuple[Tensor, float] | None = None) -> tuple[Tensor, Tensor]:
    """One deterministic step of DPM-Solver++(2M) on the flow ODE, written with the x0 prediction.

    With alpha = 1 - sigma and lambda = log(alpha / sigma), h = lambda_next - lambda and x0 = x - sigma v:
        x_next = (sigma_next / sigma) x - alpha_next (exp(-h) - 1) D
    D = x0 is first order, which equals the Euler step exactly in exact arithmetic; with the previous step's x0
    prediction x0_prev made at sigma_prev, r = (lambda - lambda_prev) / h and
        D = (1 + 1 / (2 r)) x0 - 1 / (2 r) x0_prev.
    The step falls back to first order without a previous prediction, when that prediction was made at
    sigma_prev = 1 (lambda_prev = -inf, r infinite: the correction vanishes in the limit anyway), and on the final
    step to sigma_next = 0 (h infinite, r 0: the extrapolation diverges, so the step lands on x0 itself, as
    DPM-Solver++'s lower-order final step does).

    velocity, sample: (B, ...); sigma, sigma_next: floats, 0 <= sigma_next < sigma <= 1; previous: (x0_prev
    (B, ...), sigma_prev) or None. Returns (x_next in sample's dtype, this step's x0 prediction float32) so the
    caller can pass (x0, sigma) on as the next step's `previous`.
    """
    _check_pair(velocity, sample, None, "velocity")
    sigma, sigma_next = float(sigma), float(sigma_next)
    if not 0.0 <= sigma_next < sigma <= 1.0:
        raise ValueError(f"need 0 <= sigma_next < sigma <= 1, got sigma={sigma}, sigma_next={sigma_next}")
    x = sample.float()
    x0 = x - sigma * velocity.float()
    if sigma_next == 0.0:
        return x0.to(sample.dtype), x0
    lam, lam_next = _flow_log_snr(sigma), _flow_log_snr(sigma_next)
    h = lam_next - lam
    denoised = x0
    if previous is not None and math.isfinite(lam):
        x0_prev, sigma_prev = previous
        lam_prev = _flow_log_snr(float(sigma_prev))
        if math.isfinite(lam_prev):
            r = (lam - lam_prev) / h
            denoised = (1.0 + 0.5 / r) * x0 - (0.5 / r) * x0_prev.float()
    # -expm1(-h) = 1 - exp(-h), without cancellation when h is small; it is 1 at sigma = 1 (h = inf)
    x_next = (sigma_next / sigma) * x + ((1.0 - sigma_next) * -math.expm1(-h)) * denoised
    return x_next.to(sample.dtype), x0


def flow_sa_step(velocity: Tensor, sigma: float, sigma_next: float, sample: Tensor, tau: float,
                 noise: Tensor) -> Tensor:
    """One first-order step of SA-Solver (stochastic Adams, data prediction) on the flow schedule, stochasticity tau.

    With alpha = 1 - sigma, lambda = log(alpha / sigma), h = lambda_next - lambda and x0 = x - sigma v:
        x_next = e^(-tau^2 h) (sigma_next / sigma) x + alpha_next (1 - e^(-(1 + tau^2) h)) x0
                 + sigma_next sqrt(1 - e^(-2 tau^2 h)) noise
    tau = 0 is DPM-Solver++(1), the Euler step in exact arithmetic; tau = 1 the reverse SDE. At sigma = 1 (h
    infinite) the first term vanishes for tau > 0; on the last step to sigma_next = 0 the step lands on x0.
    velocity, sample, noise: (B, ...); returns x_next in sample's dtype."""
    _check_pair(velocity, sample, None, "velocity")
    sigma, sigma_next, tau = float(sigma), float(sigma_next), float(tau)
    if not 0.0 <= sigma_next < sigma <= 1.0:
        raise ValueError(f"need 0 <= sigma_next < sigma <= 1, got sigma={sigma}, sigma_next={sigma_next}")
    if tau < 0:
        raise ValueError(f"tau must be >= 0, got {tau}")
    x = sample.float()
    x0 = x - sigma * velocity.float()
    if sigma_next == 0.0:
        return x0.to(sample.dtype)
    h = _flow_log_snr(sigma_next) - _flow_log_snr(sigma)
    keep = math.exp(-tau * tau * h) if tau > 0 else 1.0  # e^(-tau^2 h): 0 from pure noise when tau > 0
    x_next = keep * (sigma_next / sigma) * x + ((1.0 - sigma_next) * -math.expm1(-(1.0 + tau * tau) * h)) * x0
    if tau > 0:
        x_next = x_next + sigma_next * math.sqrt(-math.expm1(-2.0 * tau * tau * h)) * noise.float()
    return x_next.to(sample.dtype)


def sa_solver_grid(sigmas: Tensor) -> Tensor:
    """The grid AWM's pipeline hands SA-Solver (sd3_pipeline_with_logprob.py L272-274): the sampling grid (S + 1
    sigmas, the last 0) with its next-to-last point moved to half the one before it and its first to 1 - 1e-3
    (lambda finite there), float64."""
    t = sigmas.detach().double().cpu().clone()
    if t.shape[0] < 3:
        raise ValueError(f"SA-Solver's predictor-corrector needs at least 2 steps, got a grid of {t.shape[0]} points")
    t[-2] = t[-3] / 2
    t[0] = 1 - 1e-3
    return t


def flow_sa_solver_pc(denoise, x: Tensor, times: Tensor, tau_at, draw_noise) -> Tensor:
    """SA-Solver as AWM's pipeline runs it: stochastic Adams predictor and corrector of order 2 in PEC mode (one
    model evaluation per step), data prediction on the flow schedule, the "few steps" coefficients, the first
    corrector skipped and the last step replaced by the data prediction (sa_solver.py L442-559, its defaults
    disable_first_corrector, skip_final_step, lower_order_final).

    times: the S + 1 grid (sa_solver_grid), times[-1] = 0; tau_at(t): the stochasticity of the step that ends at
    time t; draw_noise(i): step i's standard normal draw (i = 1 .. S - 1), shared by its predictor and corrector.
    With D(x, t) = x - t v(x, t), lambda = log((1 - t) / t), k = 1 + tau^2, step i from s = t_{i-1} to t = t_i,
    h = lambda_t - lambda_s, h' = lambda_s - lambda_{t_{i-2}} and m_j the data predictions at the predicted points:
        base = e^(-tau^2 h) (t / s) x + t sqrt(1 - e^(-2 tau^2 h)) noise
        predictor x_p = base + (1 - t) [(1 - e^(-k h)) m_{i-1} + k h^2 / (2 h') (m_{i-1} - m_{i-2})]
            (first order on step 1: without the second term)
        m_i = D(x_p, t)
        corrector x = base + (1 - t) [(1 - e^(-k h)) m_{i-1} + k h / 2 (m_i - m_{i-1})]   (skipped on step 1)
    and the sample is m_{S-1}, the data prediction at the last predicted point. These are the reference's
    Lagrange-interpolated exponential integrals of order 2 with its O(h^3) "few steps" terms added, summed in
    closed form (tests/test_methods_parity.py writes the reference's form out). tau = 0 everywhere is a
    second-order deterministic multistep solver. x: (B, ...) the initial noise; returns the sample in x's dtype."""
    t = [float(v) for v in times]
    S = len(t) - 1
    if S < 2 or t[-1] != 0.0 or not all(a > b for a, b in zip(t, t[1:], strict=False)) or t[0] >= 1.0:
        raise ValueError(f"times must fall from below 1 to 0 over at least 2 steps, got {t}")

    def data(z: Tensor, time: float) -> Tensor:
        return z - time * denoise(z.to(x.dtype), torch.full((z.shape[0],), time, device=z.device)).float()

    z = x.float()
    m_prev, m_older = data(z, t[0]), None
    for i in range(1, S):
        s_, t_ = t[i - 1], t[i]
        tau = float(tau_at(t_))
        if tau < 0:
            raise ValueError(f"tau must be >= 0, got {tau}")
        k = 1.0 + tau * tau
        h = _flow_log_snr(t_) - _flow_log_snr(s_)
        base = math.exp(-tau * tau * h) * (t_ / s_) * z
        if tau > 0:
            base = base + t_ * math.sqrt(-math.expm1(-2.0 * tau * tau * h)) * draw_noise(i).float()
        first = (1.0 - t_) * -math.expm1(-k * h)
        if m_older is None:
            x_p = base + first * m_prev
        else:
            h_prev = _flow_log_snr(s_) - _flow_log_snr(t[i - 2])
            x_p = base + first * m_prev + ((1.0 - t_) * k * h * h / (2.0 * h_prev)) * (m_prev - m_older)
        m_new = data(x_p, t_)
        z = x_p if m_older is None else base + first * m_prev + ((1.0 - t_) * k * h / 2.0) * (m_new - m_prev)
        m_older, m_prev = m_prev, m_new
    return m_prev.to(x.dtype)


def flow_noise_to(x0: Tensor, noise: Tensor, u: Tensor) -> Tensor:
    """The flow forward process at noise level u (B,) in (0, 1): x_u = (1 - u) x0 + u noise, float32."""
    col = _batch_column(u, "u", x0)
    return (1.0 - col) * x0.float() + col * noise.float()


def flow_x0_from_velocity(velocity: Tensor, x_t: Tensor, u: Tensor) -> Tensor:
    """x0 = x_u - u v, the clean sample a velocity v at level u (B,) points to, float32."""
    return x_t.float() - _batch_column(u, "u", x_t) * velocity.float()


def flow_sde_step(
    velocity: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    sample: Tensor,
    noise_level: float,
    prev_sample: Tensor | None = None,
    generator: torch.Generator | None = None,
    mask: Tensor | None = None,
    reduction: str = "mean",
) -> StepOutput:
    """Flow-GRPO SDE step: the reverse-time SDE with the same marginals as the flow ODE.

    sigma_t = a * sqrt(sigma / (1 - sigma)) with a = noise_level, dt = sigma_next - sigma < 0:
        mean = x * (1 + sigma_t^2 / (2 sigma) * dt) + v * (1 + sigma_t^2 (1 - sigma) / (2 sigma)) * dt
        std  = sigma_t * sqrt(|dt|)
    At sigma == 1 the ratio diverges; sigma_next is substituted for sigma inside (1 - sigma) there. A
    schedule only reaches sigma == 1 at its first step, whose sigma_next is the schedule's next-largest
    sigma, so this is exactly Flow-GRPO's substitution without needing the whole schedule.

    Args:
        velocity, sample: (B, ...) predicted velocity and current sample x at level sigma.
        sigma, sigma_next: floats or (B,) tensors with 0 <= sigma_next < sigma <= 1.
        noise_level: a >= 0. a == 0 returns ode_step's result exactly, with std 0 and log_prob 0.
        prev_sample: (B, ...) a given next sample to score; when None one is drawn with generator.
    Returns:
        StepOutput; log_prob (B,) float32 is the per-element mean Gaussian log-density.
    """
    _check_pair(velocity, sample, prev_sample, "velocity")
    if not noise_level >= 0:
        raise ValueError(f"noise_level must be >= 0, got {noise_level!r}")
    s, s_next = _flow_sigma_columns(sigma, sigma_next, sample)
    x = sample.float()
    v = velocity.float()
    dt = s_next - s
    if noise_level == 0:
        mean = x + dt * v
        std = torch.zeros_like(s)
        return _finish_step(mean, std, sample, prev_sample, generator, True, mask, reduction)
    one_minus = 1.0 - torch.where(s == 1, s_next, s)
    sigma_t = noise_level * torch.sqrt(s / one_minus)
    mean = x * (1.0 + sigma_t**2 / (2.0 * s) * dt) + v * (1.0 + sigma_t**2 * (1.0 - s) / (2.0 * s)) * dt
    std = sigma_t * torch.sqrt(-dt)
    return _finish_step(mean, std, sample, prev_sample, generator, False, mask, reduction)


def cps_step(
    velocity: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    sample: Tensor,
    noise_level: float,
    prev_sample: Tensor | None = None,
    generator: torch.Generator | None = None,
    mask: Tensor | None = None,
    reduction: str = "mean",
) -> StepOutput:
    """Coefficients-preserving sampling step (CPS).

    The predicted clean sample and noise are re-mixed at level sigma_next so that the coefficients of
    x0 and noise stay those of the forward process:
        std    = sigma_next * sin(a * pi / 2)
        x0_hat = x - sigma * v,    x1_hat = x + (1 - sigma) * v
        mean   = x0_hat * (1 - sigma_next) + x1_hat * sqrt(sigma_next^2 - std^2)
    sqrt(sigma_next^2 - std^2) is evaluated as sigma_next * cos(a * pi / 2), equal for a in [0, 1] and
    free of negative round-off under the root.

    log_prob is the exact Gaussian log-density, averaged over non-batch elements. Flow-GRPO's CPS returns
    -mean((x' - mean)^2) instead, dropping the 1/(2 std^2) factor along with the constants, so its
    log-ratios are 2 std^2 times these (std depends on the schedule only, so log std cancels in a ratio):
    its clip range eps_F at this step bounds our ratio at (1 - eps_F)^k and (1 + eps_F)^k, k = 1 / (2 std^2),
    about 1 - k eps_F and 1 + k eps_F. Both average over the same elements, so their count does not enter.
    At sigma_next == 0 the step is deterministic (std 0) and log_prob is 0; a == 0 returns ode_step's
    result exactly.

    Args/returns as flow_sde_step, with noise_level a in [0, 1].
    """
    _check_pair(velocity, sample, prev_sample, "velocity")
    if not 0 <= noise_level <= 1:
        raise ValueError(f"noise_level for CPS must be in [0, 1], got {noise_level!r}")
    s, s_next = _flow_sigma_columns(sigma, sigma_next, sample)
    x = sample.float()
    v = velocity.float()
    if noise_level == 0:
        # Algebraically the CPS mean at a = 0 is x + dt * v; using that form makes it bit-equal to ode_step.
        mean = x + (s_next - s) * v
        std = torch.zeros_like(s)
        return _finish_step(mean, std, sample, prev_sample, generator, True, mask, reduction)
    angle = noise_level * math.pi / 2.0
    std = s_next * math.sin(angle)
    x0_hat = x - s * v
    x1_hat = x + (1.0 - s) * v
    mean = x0_hat * (1.0 - s_next) + x1_hat * (s_next * math.cos(angle))
    return _finish_step(mean, std, sample, prev_sample, generator, False, mask, reduction)


def _timestep_column(value: int | Tensor, name: str, sample: Tensor) -> Tensor:
    """An int or (B,) integer tensor as a (B,) int64 tensor on the sample's device."""
    batch = sample.shape[0]
    if isinstance(value, Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got dtype {value.dtype}")
        if value.dim() == 0:
            return value.to(sample.device, torch.int64).expand(batch)
        if value.shape != (batch,):
            raise ValueError(
                f"{name} must be an int, a 0-dim tensor or shape ({batch},), got {tuple(value.shape)}"
            )
        return value.to(sample.device, torch.int64)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int or an integer tensor, got {type(value).__name__}")
    return torch.full((batch,), value, dtype=torch.int64, device=sample.device)


def ddim_step_with_logprob(
    model_output: Tensor,
    timestep: int | Tensor,
    prev_timestep: int | Tensor,
    sample: Tensor,
    alphas_cumprod: Tensor,
    eta: float,
    prediction_type: str = "epsilon",
    prev_sample: Tensor | None = None,
    generator: torch.Generator | None = None,
    mask: Tensor | None = None,
    reduction: str = "mean",
) -> StepOutput:
    """DDIM step from timestep t to prev_timestep s < t as a Gaussian transition (DDPO style).

    With a_t = alphas_cumprod[t], a_s = alphas_cumprod[s] (a_s = 1 when s < 0, i.e. the step to clean
    data), x0_hat and eps_hat from the model output:
        std  = eta * sqrt((1 - a_s) / (1 - a_t)) * sqrt(1 - a_t / a_s)
        mean = sqrt(a_s) * x0_hat + sqrt(1 - a_s - std^2) * eps_hat
    eta = 0 is deterministic DDIM (std 0, log_prob 0).

    Args:
        model_output: (B, ...) predicted noise ("epsilon") or predicted clean sample ("sample").
        timestep, prev_timestep: ints or (B,) integer tensors, prev_timestep < timestep,
            0 <= timestep < len(alphas_cumprod); prev_timestep < 0 means the final step.
        sample: (B, ...) x_t, e.g. motion (B, 263, 1, frames).
        alphas_cumprod: (T_train,) cumulative product of alphas.
        eta: in [0, 1]; above 1 the coefficient under the root can turn negative.
    Returns:
        StepOutput with log_prob (B,) float32 averaged over non-batch elements.
    """
    _check_pair(model_output, sample, prev_sample, "model_output")
    if prediction_type not in ("epsilon", "sample"):
        raise ValueError(f"prediction_type must be 'epsilon' or 'sample', got {prediction_type!r}")
    if not 0 <= eta <= 1:
        raise ValueError(f"eta must be in [0, 1], got {eta!r}")
    if alphas_cumprod.dim() != 1:
        raise ValueError(f"alphas_cumprod must be 1-D, got shape {tuple(alphas_cumprod.shape)}")
    t = _timestep_column(timestep, "timestep", sample)
    t_prev = _timestep_column(prev_timestep, "prev_timestep", sample)
    num_train = alphas_cumprod.shape[0]
    if not bool(((t >= 0) & (t < num_train) & (t_prev < t)).all()):
        raise ValueError(
            f"need prev_timestep < timestep and 0 <= timestep < {num_train}, "
            f"got timestep={t.tolist()}, prev_timestep={t_prev.tolist()}"
        )
    # Coefficients in float64: 1 - a_t is tiny near t = 0 and loses digits in float32.
    alphas = alphas_cumprod.to(sample.device, torch.float64)
    a_t = alphas[t]
    a_s = torch.where(t_prev >= 0, alphas[t_prev.clamp(min=0)], torch.ones_like(a_t))
    variance = (1.0 - a_s) / (1.0 - a_t) * (1.0 - a_t / a_s)
    std64 = eta * torch.sqrt(variance)
    dir_coef = torch.sqrt((1.0 - a_s - std64**2).clamp(min=0.0))

    def column(c: Tensor) -> Tensor:
        return c.to(torch.float32).reshape((-1,) + (1,) * (sample.dim() - 1))

    x = sample.float()
    out = model_output.float()
    if prediction_type == "epsilon":
        eps_hat = out
        x0_hat = (x - column(torch.sqrt(1.0 - a_t)) * eps_hat) / column(torch.sqrt(a_t))
    else:
        x0_hat = out
        eps_hat = (x - column(torch.sqrt(a_t)) * x0_hat) / column(torch.sqrt(1.0 - a_t))
    mean = column(torch.sqrt(a_s)) * x0_hat + column(dir_coef) * eps_hat
    return _finish_step(mean, column(std64), sample, prev_sample, generator, eta == 0, mask, reduction)


def ddim_noise_to(x0: Tensor, noise: Tensor, alpha_bar: Tensor) -> Tensor:
    """The DDPM forward process: x_t = sqrt(abar) x0 + sqrt(1 - abar) noise with abar (B,), float32."""
    a = _batch_column(alpha_bar, "alpha_bar", x0)
    return a.sqrt() * x0.float() + (1.0 - a).sqrt() * noise.float()


def ddim_x0_from_output(output: Tensor, x_t: Tensor, alpha_bar: Tensor, prediction_type: str) -> Tensor:
    """The clean sample a DDPM model's output at x_t points to: the output itself for "sample", else
    (x_t - sqrt(1 - abar) eps) / sqrt(abar) for "epsilon"; float32."""
    if prediction_type == "sample":
        return output.float()
    if prediction_type != "epsilon":
        raise ValueError(f"prediction_type must be 'epsilon' or 'sample', got {prediction_type!r}")
    a = _batch_column(alpha_bar, "alpha_bar", x_t)
    return (x_t.float() - (1.0 - a).sqrt() * output.float()) / a.sqrt()


def checked_std(std: float | Tensor, like: Tensor) -> Tensor:
    """A transition std as float32 on `like`'s device, checked to broadcast to `like`'s shape and to be > 0
    everywhere: a deterministic step (std 0) has no density, so no finite KL or log-ratio."""
    std_t = torch.as_tensor(std, dtype=torch.float32, device=like.device)
    try:
        broadcast_ok = torch.broadcast_shapes(std_t.shape, like.shape) == like.shape
    except RuntimeError:
        broadcast_ok = False
    if not broadcast_ok:
        raise ValueError(f"std of shape {tuple(std_t.shape)} does not broadcast to the means' shape")
    if not bool((std_t > 0).all()):
        raise ValueError("std must be > 0 everywhere: a deterministic step has no density and no finite KL")
    return std_t


def gaussian_kl_between_means(mean_a: Tensor, mean_b: Tensor, std: float | Tensor,
                              mask: Tensor | None = None, reduction: str = "mean") -> Tensor:
    """KL(N(mean_a, std^2 I) || N(mean_b, std^2 I)) per element, averaged over non-batch dims.

    Per element the KL of two equal-variance Gaussians is (mean_a - mean_b)^2 / (2 std^2). `std` here is
    the transition std returned by the step functions, which already contains the sqrt(|dt|) factor, so
    this is the exact per-element KL. Flow-GRPO's KL term divides by sigma_t^2 without |dt|, i.e. it equals
    this value multiplied by |dt| (the mean gap itself scales with dt, so theirs is O(dt^2), this O(|dt|)).

    mean_a, mean_b: (B, ...). std: a positive float, or a tensor broadcastable to (B, ...), e.g. the
    (B, 1, ..., 1) std of a StepOutput. mask: the elements averaged over (reduce_elements); reduction "sum" sums
    them instead, as a scheduler with that reduction sums its log-probs. Returns (B,) float32.
    """
    if mean_a.shape != mean_b.shape:
        raise ValueError(f"mean_a shape {tuple(mean_a.shape)} != mean_b shape {tuple(mean_b.shape)}")
    if mean_a.dim() < 2:
        raise ValueError(f"means need a batch axis and at least one more, got shape {tuple(mean_a.shape)}")
    std_t = checked_std(std, mean_a)
    kl = (mean_a.float() - mean_b.float()) ** 2 / (2.0 * std_t**2)
    return reduce_elements(kl, mask, reduction)
