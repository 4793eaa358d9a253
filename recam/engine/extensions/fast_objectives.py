"""Objectives from the faster policy-optimisation papers, registered next to "grpo" (recam.engine.objective).

- "grpo_guard": GRPO-Guard (Wang et al. 2025, arXiv 2510.22319), RatioNorm plus 1/dt step reweighting on top of
  the GRPO clipped loss; flow-matching SDE steps only.
- "nft": DiffusionNFT (Zheng et al. 2025, arXiv 2509.16117), negative-aware fine-tuning on the forward process:
  no log-probs, any sampler.
- "awm": Advantage Weighted Matching (Xue et al. 2025, arXiv 2509.25050), a PPO ratio built from the
  flow-matching loss on re-noised final samples, with velocity-MSE pulls to the reference and the EMA old policy.

The maths lives in pure functions of tensors; each class only binds train.* to them and walks a micro-batch.
"nft" and "awm" re-noise each final sample at train.fp_num_timesteps noise levels and backpropagate one noise
level at a time (one graph alive), like "grpo" does per timestep.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from recam.engine.extensions.old_policy import KeepsOldPolicy
from recam.engine.losses import (
    StepLossInputs,
    get_kl_estimator,
    get_policy_loss,
    grpo_policy_loss,
    loss_settings,
    weighted_terms,
)
from recam.engine.objective import MicroBatch, Objective, register_objective
from recam.engine.rollout import rescore
from recam.engine.sde import checked_std, reduce_elements

__all__ = [
    "AWMObjective",
    "GRPOGuardObjective",
    "NFTObjective",
    "awm_matching_loss",
    "awm_weighted_loss",
    "fp_level_count",
    "grid_indices",
    "forward_noise",
    "guard_step_weights",
    "nft_implicit_outputs",
    "nft_loss",
    "nft_optimality",
    "output_mse",
    "ratio_norm_log_ratio",
    "sample_noise_levels",
    "self_normalized_sq_error",
]

# Floor of DiffusionNFT's adaptive weight: a sample whose implicit x0 is already exact would divide by ~0.
NFT_WEIGHT_FLOOR = 1e-5
# Keeps the forward-process noise streams apart from the rollout's (recam.engine.rollout.per_sample_noise keys).
_FORWARD_NOISE_SALT = 0x4E4654


# ---------------------------------------------------------------- GRPO-Guard


def _per_sample_std(std: float | Tensor, like: Tensor) -> Tensor:
    """A transition std as (b,) float32: RatioNorm rescales a whole sample's log-ratio, so it needs one std per
    sample (a scalar or a (b, 1, ..., 1) column, as every recam step returns); like: any (b, ...) tensor."""
    s = checked_std(std, like)
    column = (like.shape[0],) + (1,) * (like.dim() - 1)
    try:
        s = torch.broadcast_to(s, column)
    except RuntimeError as err:
        raise ValueError(f"RatioNorm needs one std per sample, got std of shape {tuple(s.shape)}") from err
    return s.reshape(like.shape[0])


def ratio_norm_log_ratio(log_prob: Tensor, old_log_prob: Tensor, bias: Tensor, std: float | Tensor,
                         mean: Tensor) -> Tensor:
    """GRPO-Guard's RatioNorm: the normalised log-ratio (b,) = (log_prob - old_log_prob + bias) * s.

    For a Gaussian step x' = mu_old + s eps scored under mu_theta, the log-ratio in each of the log-prob's
    coordinates is -eps d / s - d^2 / (2 s^2) with d = mu_old - mu_theta: its mean is negative, so ratios sit below
    1 and the upper clip rarely binds. RatioNorm adds the bias back, b = KL(p_old || p_theta) in the SAME
    coordinates and reduction as the log-probs (the scheduler's transition_kl: every element, or a noise
    subspace's coordinates, where a bias averaged over every element would not cancel), and multiplies by s:
        normalised = mean_coordinates(eps (mu_theta - mu_old)).
    The paper's code takes the element mean, as Flow-GRPO's log-probs are element means. The bias carries the
    gradient (it is part of the ratio, not a constant). The gradient, mean(eps grad mu_theta), has lost the raw
    log-ratio's 1 / s: on-policy it is s times GRPO's, and it still scales with the step's d mu / d output,
    proportional to |dt| on the flow SDE, which guard_step_weights undoes. mean: any (b, ...) tensor of the step,
    for the shape of std's column.
    """
    return (log_prob - old_log_prob + bias) * _per_sample_std(std, mean)


def guard_step_weights(dts: Tensor) -> Tensor:
    """GRPO-Guard's per-step weights 1 / |dt_j| over the trained steps, rescaled to mean 1.

    The paper divides step j's loss by |dt_j| (sqrt(dt)^2 in its code) to even out the gradient scale across
    noise levels; the rescaling keeps the loss on the scale of "grpo" (the paper's absolute 1 / |dt| multiplies
    the step size by mean(1 / |dt|), about the number of sampling steps)."""
    dts = dts.abs().double()
    if not bool((dts > 0).all()):
        raise ValueError(f"every trained step needs dt > 0, got {dts.tolist()}")
    inv = 1.0 / dts
    return (inv / inv.mean()).float()


@register_objective("grpo_guard")
class GRPOGuardObjective(Objective):
    """GRPO-Guard (arXiv 2510.22319): GRPO with RatioNorm and 1/dt step reweighting; flow SDE steps only.

    Per trained step j: the registered policy loss (train.policy_loss, default "grpo_clip") gets
    log_prob = old_log_prob + (log_prob - old_log_prob + KL(p_old || p_theta)) * s (ratio_norm_log_ratio, the KL in
    the log-probs' coordinates; mu_old from mb.old_means), so its ratio averages 1 and clipping is symmetric again; with
    train.guard_dt_weighting (default True) the policy term is multiplied by guard_step_weights (1 / |dt_j|,
    mean 1 over the trained steps); the KL to the reference (train.kl_type, train.beta) is added unweighted as in
    the paper's code. Step loss = mean over trained steps; clip_range etc. as "grpo", but the normalised log-ratio
    mean_e(eps (mu_theta - mu_old)) is s times the raw one's noise part, so train.clip_range wants retuning (smaller).
    """

    needs_log_probs = True
    needs_old_means = True
    needs_old_policy = False

    def __init__(self, train_config, scheduler):
        if not scheduler.is_flow:
            raise ValueError("grpo_guard needs a flow-matching scheduler (RatioNorm's 1/dt reweighting is Flow-SDE's)")
        t = train_config
        self.t, self.scheduler = t, scheduler
        self.policy_loss = get_policy_loss(t.policy_loss)
        # beta 0 here: the KL is added outside the policy loss so that only the policy term is dt-weighted
        self.settings = loss_settings(t.policy_loss, t, beta=0.0)
        self.kl_estimator = get_kl_estimator(t.kl_type)

    def step_weights(self, start: int, num_steps: int) -> Tensor:
        if not self.t.guard_dt_weighting:
            return torch.ones(num_steps)
        return guard_step_weights(torch.tensor([self.scheduler.step_dt(start + j) for j in range(num_steps)]))

    def accumulate(self, mb: MicroBatch, backward: Callable[[Tensor, bool], None]) -> list[dict]:
        t, sched, T = self.t, self.scheduler, mb.old_log_probs.shape[1]
        if mb.old_means is None:
            raise ValueError("grpo_guard needs the sampling means (mb.old_means)")
        if t.beta > 0 and mb.reference is None:
            raise ValueError("train.beta > 0 needs a reference policy")
        device = mb.states.device
        weight = mb.sample_weight.to(device)
        step_w = self.step_weights(mb.step_offset, T).to(device)
        out = []
        for j in range(T):
            cur = rescore(mb.policy, mb.states, sched, j, mb.element_mask, mb.step_offset)
            old = mb.old_log_probs[:, j].contiguous().to(device)
            bias = sched.transition_kl(mb.old_means[:, j].to(device), cur.mean, cur.std, mb.element_mask)
            norm = ratio_norm_log_ratio(cur.log_prob, old, bias, cur.std, cur.mean)
            inputs = StepLossInputs(old + norm, old, mb.advantages[:, j].to(device), weight, None, j, T)
            policy, metrics = self.policy_loss(inputs, self.settings)
            loss, logged = step_w[j] * policy, step_w[j] * metrics["policy_loss"]
            if t.beta > 0:
                with torch.no_grad():
                    ref = rescore(mb.reference, mb.states, sched, j, mb.element_mask, mb.step_offset)
                kl = self.kl_estimator(cur.mean, ref.mean, cur.std, mb.states[:, j + 1], mb.element_mask,
                                        getattr(sched, "reduction", "mean"))
                kl_term, kl_metric = weighted_terms(kl, weight)
                loss, logged = loss + t.beta * kl_term, logged + t.beta * kl_metric
                metrics["kl_penalty"] = kl_metric
            metrics.update(loss=logged, guard_step_weight=step_w[j], ratio_norm_bias=bias.mean(),
                           raw_log_ratio=(cur.log_prob - old).mean())
            backward(loss / T, j == T - 1)
            out.append({k: v.detach() for k, v in metrics.items()})
        return out


# ---------------------------------------------------------------- forward-process noise


# How a final sample's re-noising levels are drawn (train.fp_timestep_sampling): continuous levels in
# [fp_min_noise, fp_max_noise], or levels of the sampling grid (scheduler.grid_levels), as the papers' code draws them.
CONTINUOUS_LEVELS = ("stratified", "uniform")
GRID_LEVELS = ("grid", "grid_stratified")
FP_TIMESTEP_SAMPLING = CONTINUOUS_LEVELS + GRID_LEVELS
AWM_WEIGHTINGS = ("uniform", "ghuber")
# added inside and subtracted outside the power of the generalised Huber weighting, as AWM's code does, so that a
# zero loss has a finite gradient
_GHUBER_OFFSET = 1e-10


def fp_level_count(mode: str, num: int, num_steps: int, grid_fraction: float) -> int:
    """Re-noised levels per final sample: num, or with "grid" and num = 0, int(grid_fraction x num_steps)
    (DiffusionNFT trains int(timestep_fraction x S) of the S grid levels, 9 of 10 at 0.99)."""
    if mode not in FP_TIMESTEP_SAMPLING:
        raise ValueError(f"fp_timestep_sampling must be one of {FP_TIMESTEP_SAMPLING}, got {mode!r}")
    if not (isinstance(num, int) and num >= 0):
        raise ValueError(f"train.fp_num_timesteps must be an int >= 0, got {num!r}")
    if mode in GRID_LEVELS and not 0 < grid_fraction <= 1:
        raise ValueError(f"train.fp_grid_fraction must be in (0, 1], got {grid_fraction!r}")
    count = int(grid_fraction * num_steps) if mode == "grid" and num == 0 else num
    if count < 1:
        raise ValueError(f"train.fp_num_timesteps={num} gives {count} re-noised levels: need at least 1 "
                         "(0 is only 'int(fp_grid_fraction x num_steps)' with fp_timestep_sampling='grid')")
    if mode == "grid" and count > num_steps:
        raise ValueError(f"train.fp_num_timesteps={num}: 'grid' draws distinct levels of the {num_steps}-step grid")
    if mode == "grid_stratified" and int(grid_fraction * num_steps) < 1:
        raise ValueError(f"train.fp_grid_fraction={grid_fraction} leaves no grid index above 0 in {num_steps} steps")
    return count


def grid_indices(num_steps: int, count: int, mode: str, grid_fraction: float, generator: torch.Generator) -> Tensor:
    """(count,) int64 sampling-grid steps to re-noise at.

    "grid": count distinct steps in random order (DiffusionNFT permutes the grid per sample and trains the first
    int(timestep_fraction x S)); "grid_stratified": one index per bin of linspace(1, int(grid_fraction x S),
    count + 1) truncated to integers, uniform within its bin (AWM's "discrete_wo_init": never step 0, pure noise)."""
    if mode == "grid":
        return torch.randperm(num_steps, generator=generator)[:count]
    top = int(grid_fraction * num_steps)
    bounds = torch.linspace(1, top, count + 1).long()
    lower, upper = bounds[:-1], bounds[1:]
    return lower + (torch.rand(count, generator=generator) * (upper - lower)).long()


def sample_noise_levels(num: int, low: float, high: float, mode: str, generator: torch.Generator) -> Tensor:
    """(num,) noise levels in [low, high): "stratified" puts one in each of num equal bins (random offset),
    "uniform" draws them iid."""
    if not 0.0 <= low < high <= 1.0:
        raise ValueError(f"need 0 <= fp_min_noise < fp_max_noise <= 1, got {low!r}, {high!r}")
    offset = torch.rand(num, generator=generator, dtype=torch.float64)
    if mode == "stratified":
        unit = (torch.arange(num, dtype=torch.float64) + offset) / num
    elif mode == "uniform":
        unit = offset
    else:
        raise ValueError(f"fp_timestep_sampling must be 'stratified' or 'uniform', got {mode!r}")
    return (low + (high - low) * unit).float()


def forward_noise(keys: list[tuple[int, ...]], num: int, shape: tuple[int, ...], low: float, high: float,
                  mode: str, grid: Tensor | None = None, grid_fraction: float = 1.0) -> tuple[Tensor, Tensor]:
    """(noise levels (b, num), standard normal noise (b, num, *shape)), sample i from its own stream keyed by
    keys[i]: the draws of a sample do not depend on which micro-batch or process it lands in, and a resumed run
    redraws them exactly. The grid modes pick levels of `grid` (S,) (scheduler.grid_levels) by grid_indices."""
    if mode in GRID_LEVELS and grid is None:
        raise ValueError(f"fp_timestep_sampling={mode!r} needs the sampling grid's levels")
    levels, noise = torch.empty(len(keys), num), torch.empty(len(keys), num, *shape)
    grid = None if grid is None else grid.cpu()
    for i, key in enumerate(keys):
        seed = int(np.random.SeedSequence([int(k) for k in key]).generate_state(1, dtype=np.uint64)[0])
        gen = torch.Generator().manual_seed(seed % (2**63))
        if mode in GRID_LEVELS:
            levels[i] = grid[grid_indices(grid.shape[0], num, mode, grid_fraction, gen)].float()
        else:
            levels[i] = sample_noise_levels(num, low, high, mode, gen)
        noise[i] = torch.randn(num, *shape, generator=gen)
    return levels, noise


def _forward_keys(mb: MicroBatch) -> list[tuple[int, ...]]:
    return [(_FORWARD_NOISE_SALT, mb.epoch, mb.inner_epoch, *(int(v) for v in row)) for row in mb.traj_ids.tolist()]


def output_mse(output: Tensor, target: Tensor, mask: Tensor | None = None) -> Tensor:
    """(b,) mean over (masked) elements of (output - target)^2, float32: the velocity-MSE "KL" of the
    forward-process papers and the flow-matching loss."""
    return reduce_elements((output.float() - target.float()) ** 2, mask)


class _ForwardProcess(KeepsOldPolicy):
    """What "nft" and "awm" share: train.fp_*, the re-noising of a micro-batch's final samples, and the old policy
    (recam.engine.extensions.old_policy), which is this method's own state."""

    def __init__(self, train_config, scheduler):
        t = train_config
        mode = t.fp_timestep_sampling
        self.grid = scheduler.grid_levels() if mode in GRID_LEVELS else None
        self.num_levels = fp_level_count(mode, t.fp_num_timesteps, 0 if self.grid is None else self.grid.shape[0],
                                         t.fp_grid_fraction)
        if mode in CONTINUOUS_LEVELS:
            sample_noise_levels(1, t.fp_min_noise, t.fp_max_noise, mode, torch.Generator())
        self.t, self.scheduler = t, scheduler

    def draws(self, mb: MicroBatch) -> tuple[Tensor, Tensor]:
        t = self.t
        levels, noise = forward_noise(_forward_keys(mb), self.num_levels, tuple(mb.final.shape[1:]),
                                      t.fp_min_noise, t.fp_max_noise, t.fp_timestep_sampling, self.grid,
                                      t.fp_grid_fraction)
        return levels.to(mb.final.device), noise.to(mb.final.device, mb.final.dtype)

    def check(self, mb: MicroBatch) -> None:
        if mb.old_policy is None:
            raise ValueError(f"{type(self).__name__} needs the old policy (mb.old_policy)")
        if getattr(self, "needs_sampling_policy", False) and mb.sampling_policy is None:
            raise ValueError(f"{type(self).__name__} needs the weights that sampled (mb.sampling_policy)")
        if self.t.beta > 0 and mb.reference is None:
            raise ValueError("train.beta > 0 needs a reference policy")

    def add_reference_kl(self, mb: MicroBatch, o: Tensor, x_t: Tensor, time: Tensor, mask, weight: Tensor,
                         loss: Tensor, logged: Tensor, metrics: dict) -> tuple[Tensor, Tensor]:
        """loss + train.beta * mean_e (o - o_ref)^2 (the KL to the reference as output MSE), and the logged loss
        with it; metrics gains kl_penalty. Unchanged when beta is 0."""
        if self.t.beta <= 0:
            return loss, logged
        with torch.no_grad():
            o_ref = mb.reference(x_t, time)
        kl_term, kl_metric = weighted_terms(output_mse(o, o_ref, mask), weight)
        metrics["kl_penalty"] = kl_metric
        return loss + self.t.beta * kl_term, logged + self.t.beta * kl_metric


# ---------------------------------------------------------------- DiffusionNFT


def nft_optimality(advantages: Tensor, adv_clip_max: float) -> Tensor:
    """DiffusionNFT's optimality probability r = clip(0.5 + 0.5 clip(A, -c, c) / c, 0, 1), c = adv_clip_max
    (the paper's normaliser Z; its code uses the advantage clip bound, 5)."""
    if not adv_clip_max > 0:
        raise ValueError(f"adv_clip_max must be > 0, got {adv_clip_max!r}")
    return (0.5 + 0.5 * advantages.float().clamp(-adv_clip_max, adv_clip_max) / adv_clip_max).clamp(0.0, 1.0)


def nft_implicit_outputs(output: Tensor, old_output: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    """The implicit positive and negative policies in the model's output space:
    o+ = beta o_theta + (1 - beta) o_old, o- = (1 + beta) o_old - beta o_theta."""
    return beta * output + (1.0 - beta) * old_output, (1.0 + beta) * old_output - beta * output


def self_normalized_sq_error(x0_hat: Tensor, x0: Tensor, mask: Tensor | None = None) -> Tensor:
    """(b,) mean_e (x0_hat - x0)^2 / stopgrad(max(mean_e |x0_hat - x0|, 1e-5)): DiffusionNFT's adaptive
    weighting, which makes the loss's scale independent of the noise level and of the sample."""
    err = x0_hat.float() - x0.float()
    scale = reduce_elements(err.detach().abs(), mask).clamp_min(NFT_WEIGHT_FLOOR)
    return reduce_elements(err**2, mask) / scale


def nft_loss(x0_pos: Tensor, x0_neg: Tensor, x0: Tensor, optimality: Tensor, beta: float,
             mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, L+, L-), each (b,): loss = (r L+ + (1 - r) L-) / beta with L+- = self_normalized_sq_error of the
    implicit policies' clean-sample predictions x0+-."""
    if not beta > 0:
        raise ValueError(f"nft_beta must be > 0, got {beta!r}")
    pos, neg = self_normalized_sq_error(x0_pos, x0, mask), self_normalized_sq_error(x0_neg, x0, mask)
    return (optimality * pos + (1.0 - optimality) * neg) / beta, pos, neg


@register_objective("nft")
class NFTObjective(_ForwardProcess):
    """DiffusionNFT (arXiv 2509.16117): forward-process fine-tuning toward the positive implicit policy.

    The rollouts are drawn by the old policy (the public script switches to the "old" adapter to sample), an average
    of the policy whose weight ramps from 0 (train.old_policy_decay_ramp, up to train.old_policy_decay), so early on
    it is the policy itself. Each final sample x0 is re-noised at train.fp_num_timesteps levels u
    (train.fp_timestep_sampling "stratified" over [fp_min_noise, fp_max_noise]); with o = policy(x_t),
    o_old = old_policy(x_t) (no gradient), o+- = nft_implicit_outputs(o, o_old, train.nft_beta) (default 1.0)
    mapped to clean samples by the scheduler's x0_from_output, the per-sample loss is
    (r L+ + (1 - r) L-) / nft_beta + train.beta * mean_e (o - o_ref)^2 with r = nft_optimality(A, adv_clip_max).
    Weighted by sample_weight, averaged over the noise levels. The paper's code also multiplies the policy term
    by adv_clip_max (5); that is a constant step-size factor left out here, so train.beta is its kl_beta / 5.
    """

    needs_log_probs = False
    needs_old_means = False
    needs_old_policy = True
    samples_with_old_policy = True

    def __init__(self, train_config, scheduler):
        super().__init__(train_config, scheduler)
        if not train_config.nft_beta > 0:
            raise ValueError(f"train.nft_beta must be > 0, got {train_config.nft_beta!r}")

    def accumulate(self, mb: MicroBatch, backward: Callable[[Tensor, bool], None]) -> list[dict]:
        t, sched = self.t, self.scheduler
        self.check(mb)
        x0, mask, K = mb.final, mb.element_mask, self.num_levels
        weight = mb.sample_weight.to(x0.device)
        adv = mb.advantages[:, 0].to(x0.device)
        r = nft_optimality(adv, t.adv_clip_max)
        levels, noise = self.draws(mb)
        out = []
        for k in range(K):
            u = levels[:, k]
            x_t, time = sched.noise_to(x0, noise[:, k], u)
            o = mb.policy(x_t, time)
            with torch.no_grad():
                o_old = mb.old_policy(x_t, time)
            o_pos, o_neg = nft_implicit_outputs(o.float(), o_old.float(), t.nft_beta)
            per_sample, pos, neg = nft_loss(sched.x0_from_output(o_pos, x_t, u), sched.x0_from_output(o_neg, x_t, u),
                                            x0, r, t.nft_beta, mask)
            loss, policy_metric = weighted_terms(per_sample, weight)
            metrics = {"policy_loss": policy_metric, "nft_loss_positive": weighted_terms(pos, weight)[1],
                       "nft_loss_negative": weighted_terms(neg, weight)[1], "mean_optimality": r.mean(),
                       "mean_advantage": adv.float().mean(), "mean_noise_level": u.mean(),
                       "old_output_gap": weighted_terms(output_mse(o.detach(), o_old, mask), weight)[1]}
            metrics["kl_penalty"] = torch.zeros_like(policy_metric)
            loss, metrics["loss"] = self.add_reference_kl(mb, o, x_t, time, mask, weight, loss, policy_metric, metrics)
            backward(loss / K, k == K - 1)
            out.append({name: v.detach() for name, v in metrics.items()})
        return out


# ---------------------------------------------------------------- Advantage Weighted Matching


def awm_matching_loss(log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, adv_scale: float,
                      adv_clip_max: float, clip_range: float, log_ratio_clamp: float,
                      sample_weight: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """AWM's policy term: the PPO clipped surrogate (recam.engine.losses.grpo_policy_loss) with log_prob = -l_theta,
    old_log_prob = -l_old (l: per-sample flow-matching loss), so ratio = exp(-(l_theta - l_old)), and the
    advantage clip(A, -adv_clip_max, adv_clip_max) / adv_scale (the paper's code: clamp to 5, then / 5).

    On-policy the gradient is sum_i w_i (A_i / adv_scale) grad l_theta_i: advantage-weighted flow matching."""
    if not adv_scale > 0:
        raise ValueError(f"awm_adv_scale must be > 0, got {adv_scale!r}")
    return grpo_policy_loss(log_prob, old_log_prob, advantages / adv_scale, clip_range, adv_clip_max / adv_scale,
                            log_ratio_clamp, sample_weight=sample_weight)


def awm_weighted_loss(mse: Tensor, u: Tensor, weighting: str, power: float) -> Tensor:
    """(b,) the matching loss that enters AWM's ratio, from the per-sample flow-matching MSE (b,) at noise level u
    (b,): "uniform" is the MSE itself; "ghuber" is ((mse + 1e-10)^p - 1e-10^p) u / p, a generalised Huber loss (p
    0.25 in every public preset) that grows slower than the MSE and weighs the noisier levels more. float64, as
    AWM's code computes its log-probs."""
    if weighting not in AWM_WEIGHTINGS:
        raise ValueError(f"awm_weighting must be one of {AWM_WEIGHTINGS}, got {weighting!r}")
    mse = mse.double()
    if weighting == "uniform":
        return mse
    if not power > 0:
        raise ValueError(f"awm_ghuber_power must be > 0, got {power!r}")
    return ((mse + _GHUBER_OFFSET) ** power - _GHUBER_OFFSET**power) * u.to(mse.device).double() / power


@register_objective("awm")
class AWMObjective(_ForwardProcess):
    """Advantage Weighted Matching (arXiv 2509.25050): a PPO ratio of flow-matching losses on re-noised samples.

    Each final sample x0 is re-noised at train.fp_num_timesteps levels u (as "nft"); with
    l = mean_e (o(x_t) - output_target(x0, eps, u))^2 for the policy and, without gradient, for the weights that
    sampled the epoch (mb.sampling_policy: the public script's old losses come from the sampling adapter, so the
    first step's ratio is exactly 1), the loss is awm_matching_loss (ratio exp(-(l_theta - l_sampler)), log-ratio
    clamped to +-log_ratio_clamp, advantage
    clip(A, +-adv_clip_max) / train.awm_adv_scale (5), clip range train.awm_clip_range (0.2)) plus
    train.beta * mean_e (o - o_ref)^2 + train.awm_old_kl_weight (0.1) * mean_e (o - o_old)^2, o_old from the old
    policy, an average of the policy that is only this KL anchor (the script's EMA adapter). Uniform weight over
    noise levels; the paper's presets instead weight l by u in a generalised Huber (ghuber, power 0.25) and clip
    at 1.
    """

    needs_log_probs = False
    needs_old_means = False
    needs_old_policy = True
    needs_sampling_policy = True

    def __init__(self, train_config, scheduler):
        super().__init__(train_config, scheduler)
        t = train_config
        awm_weighted_loss(torch.zeros(1), torch.ones(1), t.awm_weighting, t.awm_ghuber_power)
        if not (t.awm_adv_scale > 0 and t.awm_clip_range > 0 and t.awm_old_kl_weight >= 0):
            raise ValueError("need train.awm_adv_scale > 0, awm_clip_range > 0 and awm_old_kl_weight >= 0, got "
                             f"{t.awm_adv_scale!r}, {t.awm_clip_range!r}, {t.awm_old_kl_weight!r}")

    def accumulate(self, mb: MicroBatch, backward: Callable[[Tensor, bool], None]) -> list[dict]:
        t, sched = self.t, self.scheduler
        self.check(mb)
        x0, mask, K = mb.final, mb.element_mask, self.num_levels
        weight = mb.sample_weight.to(x0.device)
        adv = mb.advantages[:, 0].to(x0.device).float()
        levels, noise = self.draws(mb)
        out = []
        for k in range(K):
            u, eps = levels[:, k], noise[:, k]
            x_t, time = sched.noise_to(x0, eps, u)
            target = sched.output_target(x0, eps, u)
            o = mb.policy(x_t, time)
            with torch.no_grad():
                l_old = output_mse(mb.sampling_policy(x_t, time), target, mask)
            l_cur = output_mse(o, target, mask)
            w_cur, w_old = (awm_weighted_loss(v, u, t.awm_weighting, t.awm_ghuber_power).float()
                            for v in (l_cur, l_old))
            loss, metrics = awm_matching_loss(-w_cur, -w_old, adv, t.awm_adv_scale, t.adv_clip_max, t.awm_clip_range,
                                              t.log_ratio_clamp, weight)
            logged = metrics["policy_loss"]
            if t.awm_old_kl_weight > 0:
                with torch.no_grad():
                    o_old = mb.old_policy(x_t, time)
                old_term, old_metric = weighted_terms(output_mse(o, o_old, mask), weight)
                loss, logged = loss + t.awm_old_kl_weight * old_term, logged + t.awm_old_kl_weight * old_metric
                metrics["old_kl_penalty"] = old_metric
            loss, logged = self.add_reference_kl(mb, o, x_t, time, mask, weight, loss, logged, metrics)
            metrics.update(loss=logged, fm_loss=weighted_terms(l_cur, weight)[1],
                           fm_loss_old=weighted_terms(l_old, weight)[1], mean_noise_level=u.mean())
            backward(loss / K, k == K - 1)
            out.append({name: v.detach() for name, v in metrics.items()})
        return out
