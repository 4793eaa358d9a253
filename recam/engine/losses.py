"""GRPO policy losses and KL estimators, with small name registries.

Shapes: N = B * K samples (B conditions, K copies each). Log-probs, advantages and KL values are (N,)
tensors for one trained timestep (any shape works as long as they match; means run over all elements).
KL estimators take the transition's (N, ...) means, its std and the stored (N, ...) next state, and return
(N,) per-element KL estimates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from recam.engine.sde import checked_std, gaussian_kl_between_means, reduce_elements
from recam.infra.registry import registrar

__all__ = [
    "K3_LOG_RATIO_CLAMP",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "LossSettings",
    "StepLossInputs",
    "weighted_terms",
    "gaussian_log_ratio",
    "get_kl_estimator",
    "get_policy_loss",
    "grpo_policy_loss",
    "kl_gaussian_mean",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "register_kl_estimator",
    "register_policy_loss",
]



@dataclass
class StepLossInputs:
    """One trained timestep j of a micro-batch of b samples: what every registered policy loss receives.

    log_prob: (b,) under the current policy (carries the gradient); old_log_prob: (b,) under the sampling policy;
    advantages: (b,); sample_weight: (b,) each sample's weight in the optimizer step's loss (0 for an excluded
    sample; the trainer scales them so a step's loss is the mean over its kept samples on every process);
    kl: (b,) per-element KL to the reference or None; seq_log_prob / seq_old_log_prob: (b, T) every timestep's
    log-probs (sequence-level variants), detached; ema_weight / grad_weight: (b,) variant weights or None.
    """

    log_prob: Tensor
    old_log_prob: Tensor
    advantages: Tensor
    sample_weight: Tensor
    kl: Tensor | None
    timestep_index: int
    num_timesteps: int
    seq_log_prob: Tensor | None = None
    seq_old_log_prob: Tensor | None = None
    ema_weight: Tensor | None = None
    grad_weight: Tensor | None = None


@dataclass(frozen=True)
class LossSettings:
    """Hyperparameters of the policy losses (config train.*); `variants` holds the grpo_variants flags."""

    clip_range: float
    adv_clip_max: float
    log_ratio_clamp: float
    beta: float
    variants: dict = field(default_factory=dict)


# Every registered policy loss: fn(StepLossInputs, LossSettings) -> (loss scalar, metrics of detached 0-dim tensors)
PolicyLoss = Callable[[StepLossInputs, LossSettings], tuple[Tensor, dict[str, Tensor]]]
# fn(cur_mean, ref_mean, std, sample, mask=None) -> (N,), mask: the elements averaged over; see "KL estimators".
KLEstimator = Callable[[Tensor, Tensor, "float | Tensor", Tensor], Tensor]

K3_LOG_RATIO_CLAMP = 20.0

POLICY_LOSSES: dict[str, PolicyLoss] = {}
KL_ESTIMATORS: dict[str, KLEstimator] = {}


def _lookup(table: dict, kind: str, name: str) -> Callable:
    if name not in table:
        raise KeyError(f"unknown {kind} {name!r}; known: {sorted(table)}")
    return table[name]


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator adding a policy loss to POLICY_LOSSES under `name` (duplicates are an error)."""
    return registrar(POLICY_LOSSES, "policy loss", name)


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered as `name`; KeyError listing the known names otherwise."""
    return _lookup(POLICY_LOSSES, "policy loss", name)


def register_kl_estimator(name: str) -> Callable[[KLEstimator], KLEstimator]:
    """Decorator adding fn(cur_mean, ref_mean, std, sample, mask=None) -> (N,) to KL_ESTIMATORS ("KL estimators")."""
    return registrar(KL_ESTIMATORS, "KL estimator", name)


def get_kl_estimator(name: str) -> KLEstimator:
    """The KL estimator registered as `name`; KeyError listing the known names otherwise."""
    return _lookup(KL_ESTIMATORS, "KL estimator", name)


# ---------------------------------------------------------------- KL estimators
#
# Every estimator takes (cur_mean, ref_mean, std, sample) for one Gaussian transition x_t -> x_{t-1} and
# returns the (N,) per-sample estimate of KL(pi_theta(.|x_t) || pi_ref(.|x_t)) per element, i.e. the mean
# over non-batch elements of the element-wise KLs: the units of the closed form "gaussian_mean".
#
# The estimator is applied to each element's log-ratio and only then averaged. Applying it to the
# element-averaged log-probs (what the step functions return) is wrong for a D-element Gaussian: k2 and k3
# are non-linear, so their value and gradient shrink to about 1/D of the KL's when the KL is small, and
# k1's gradient with the sample held fixed has zero mean.
#
# All but the closed form assume sample ~ pi_theta. After an optimizer step within an epoch the stored
# sample comes from the sampling-time policy instead, whose mean differs by a drift e. k1's gradient then
# has mean (mean_old - ref_mean) / std^2, the KL gradient at the sampling policy (off by e / std^2);
# k2's and k3's are off by a relative O(e * (e + |cur_mean - ref_mean|) / std^2), a product of two small gaps.


def _kl_inputs(cur_mean: Tensor, ref_mean: Tensor, std: float | Tensor, sample: Tensor) -> tuple[Tensor, ...]:
    """Validated float32 (cur_mean, ref_mean, std, sample); ref_mean and sample are constants."""
    if not (cur_mean.shape == ref_mean.shape == sample.shape):
        raise ValueError(
            f"cur_mean {tuple(cur_mean.shape)}, ref_mean {tuple(ref_mean.shape)} and sample "
            f"{tuple(sample.shape)} must have the same shape"
        )
    if cur_mean.dim() < 2:
        raise ValueError(f"means need a batch axis and at least one more, got shape {tuple(cur_mean.shape)}")
    std_t = checked_std(std, cur_mean)
    # The reference is frozen and the sample is data: a gradient through either would not be a KL gradient.
    return cur_mean.float(), ref_mean.detach().float(), std_t, sample.detach().float()


def _element_mean(per_element: Tensor, mask: Tensor | None = None) -> Tensor:
    return reduce_elements(per_element, mask)


def gaussian_log_ratio(cur_mean: Tensor, ref_mean: Tensor, std: Tensor, sample: Tensor, pathwise: bool) -> Tensor:
    """Per-element log N(x; ref_mean, std^2) - log N(x; cur_mean, std^2), same shape as the means.

    With gap = (cur_mean - ref_mean) / std and noise = (x - cur_mean) / std this is -gap * (noise + gap / 2):
    the normalising constants cancel for equal stds, and the factored form keeps the small difference of
    two O(1) squares free of float32 cancellation.

    pathwise=False holds x fixed, so the gradient is the score -grad log p_theta(x). pathwise=True holds
    the noise fixed instead (x = cur_mean + std * noise moves with the policy mean, the reparameterised
    sample); the value is the same.
    """
    gap = (cur_mean - ref_mean) / std
    noise = (sample - (cur_mean.detach() if pathwise else cur_mean)) / std
    return -gap * (noise + 0.5 * gap)


@register_kl_estimator("gaussian_mean")
def kl_gaussian_mean(cur_mean: Tensor, ref_mean: Tensor, std: float | Tensor, sample: Tensor,
                     mask: Tensor | None = None) -> Tensor:
    """Closed form (cur_mean - ref_mean)^2 / (2 std^2), element mean: exact value and gradient, no noise.

    `sample` is unused; it is accepted so that every estimator has one signature.
    """
    cur, ref, std_t, _ = _kl_inputs(cur_mean, ref_mean, std, sample)
    return gaussian_kl_between_means(cur, ref, std_t, mask)


@register_kl_estimator("k1")
def kl_k1(cur_mean: Tensor, ref_mean: Tensor, std: float | Tensor, sample: Tensor,
          mask: Tensor | None = None) -> Tensor:
    """k1 = -log r per element, at the reparameterised sample (noise held fixed), element mean.

    Value: unbiased for the KL when sample ~ pi_theta. Gradient: (x - ref_mean) / std^2 * grad cur_mean,
    whose mean is the exact KL gradient. With the sample held fixed instead, the gradient would be the
    score -grad log p_theta(x), which has mean zero. Its variance does not shrink with the KL (k2 and k3's
    does), so k1's gradient is the noisiest of the three when policy and reference are close.
    """
    cur, ref, std_t, x = _kl_inputs(cur_mean, ref_mean, std, sample)
    return _element_mean(-gaussian_log_ratio(cur, ref, std_t, x, pathwise=True), mask)


@register_kl_estimator("k2")
def kl_k2(cur_mean: Tensor, ref_mean: Tensor, std: float | Tensor, sample: Tensor,
          mask: Tensor | None = None) -> Tensor:
    """k2 = (log r)^2 / 2 per element with the sample held fixed, element mean.

    Gradient: E[(log p_theta - log p_ref) grad log p_theta] is the exact KL gradient (score-function
    identity). Value: biased upward; for equal-std Gaussians E[k2] = KL + KL^2 / 2 per element, so the
    relative bias is KL / 2 (0.5 % at a per-element KL of 0.01).
    """
    cur, ref, std_t, x = _kl_inputs(cur_mean, ref_mean, std, sample)
    return _element_mean(0.5 * gaussian_log_ratio(cur, ref, std_t, x, pathwise=False) ** 2, mask)


@register_kl_estimator("k3")
def kl_k3(cur_mean: Tensor, ref_mean: Tensor, std: float | Tensor, sample: Tensor,
          mask: Tensor | None = None) -> Tensor:
    """k3 = exp(log r) - 1 - log r per element with the sample held fixed, element mean; non-negative.

    Value: unbiased (E[p_ref / p_theta] = 1 on-policy). Gradient: in general the forward-KL gradient, which for two
    Gaussians of equal std equals the reverse-KL gradient, so its mean is exact here.
    log r is clamped to +-K3_LOG_RATIO_CLAMP inside exp only (exp(89) overflows float32); beyond it the value
    is an underestimate and the exp term's gradient is cut.
    """
    cur, ref, std_t, x = _kl_inputs(cur_mean, ref_mean, std, sample)
    log_r = gaussian_log_ratio(cur, ref, std_t, x, pathwise=False)
    return _element_mean(torch.exp(log_r.clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)) - 1.0 - log_r, mask)


def weighted_terms(per_sample: Tensor, sample_weight: Tensor | None) -> tuple[Tensor, Tensor]:
    """(loss term, its metric): sum_i w_i x_i for the gradient and sum_i w_i x_i / sum_i w_i for the log (0 when
    every weight is 0); without weights both are the plain mean."""
    if sample_weight is None:
        mean = per_sample.mean()
        return mean, mean.detach()
    w = sample_weight.to(per_sample.dtype)
    total = (w * per_sample).sum()
    # total is exactly 0 when every weight is, so the clamp gives 0 there without a host sync per timestep
    return total, (total / w.sum().clamp_min(torch.finfo(w.dtype).tiny)).detach()


@register_policy_loss("grpo_clip")
def grpo_clip(x: StepLossInputs, s: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
    return grpo_policy_loss(x.log_prob, x.old_log_prob, x.advantages, s.clip_range, s.adv_clip_max,
                            s.log_ratio_clamp, x.kl, s.beta, sample_weight=x.sample_weight)


def grpo_policy_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    clip_range: float,
    adv_clip_max: float,
    log_ratio_clamp: float = 10.0,
    kl: Tensor | None = None,
    beta: float = 0.0,
    sample_weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-style clipped GRPO loss: mean(max(-A r, -A clip(r, 1 - eps, 1 + eps))) + beta * mean(kl); with
    `sample_weight` (N,) the means become weighted sums (see weighted_terms) and the logged loss terms are the
    weighted means over samples of positive weight.

    log_prob (N,) current policy (carries the gradient), old_log_prob (N,) rollout policy, advantages (N,).
    The log-ratio is clamped to +-log_ratio_clamp before exp so a single off-policy outlier cannot produce
    inf/NaN; advantages are clamped to +-adv_clip_max. Returns (loss scalar, metrics of detached 0-dim
    tensors; clip fractions count ratios strictly outside [1 - eps, 1 + eps]).
    """
    if not (log_prob.shape == old_log_prob.shape == advantages.shape):
        raise ValueError(
            f"log_prob {tuple(log_prob.shape)}, old_log_prob {tuple(old_log_prob.shape)} and advantages "
            f"{tuple(advantages.shape)} must have the same shape"
        )
    bounds = {"clip_range": clip_range, "adv_clip_max": adv_clip_max, "log_ratio_clamp": log_ratio_clamp}
    for name, value in bounds.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    if not beta >= 0:
        raise ValueError(f"beta must be >= 0, got {beta!r}")
    if beta > 0 and kl is None:
        raise ValueError("beta > 0 needs a kl tensor")
    diff = log_prob - old_log_prob
    ratio = torch.exp(diff.clamp(-log_ratio_clamp, log_ratio_clamp))
    adv = advantages.clamp(-adv_clip_max, adv_clip_max)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    policy_loss, policy_metric = weighted_terms(torch.maximum(unclipped, clipped), sample_weight)
    kl_penalty, kl_metric = weighted_terms(kl, sample_weight) if kl is not None else (
        torch.zeros_like(policy_loss), torch.zeros_like(policy_metric))
    loss = policy_loss + beta * kl_penalty if beta > 0 else policy_loss
    with torch.no_grad():
        high = (ratio > 1.0 + clip_range).float().mean()
        low = (ratio < 1.0 - clip_range).float().mean()
        metrics = {
            "loss": policy_metric + beta * kl_metric if beta > 0 else policy_metric,
            "policy_loss": policy_metric,
            "kl_penalty": kl_metric,
            "mean_ratio": ratio.mean(),
            "ratio_min": ratio.min(),
            "ratio_max": ratio.max(),
            "clipfrac_high": high,
            "clipfrac_low": low,
            "clipfrac": high + low,
            "approx_kl": 0.5 * (diff**2).mean(),
            "mean_log_prob_current": log_prob.mean(),
            "mean_log_prob_old": old_log_prob.mean(),
            "mean_advantage": adv.mean(),
        }
    return loss, metrics
