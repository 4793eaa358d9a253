"""GRPO policy losses and KL estimators, with small name registries.

Shapes: N = B * K samples (B conditions, K copies each). Log-probs, advantages and KL values are (N,)
tensors for one trained timestep (any shape works as long as they match; means run over all elements).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = [
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "get_kl_estimator",
    "get_policy_loss",
    "grpo_policy_loss",
    "kl_estimate",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "register_kl_estimator",
    "register_policy_loss",
]

PolicyLoss = Callable[..., tuple[Tensor, dict[str, Tensor]]]
KLEstimator = Callable[[Tensor, Tensor], Tensor]

POLICY_LOSSES: dict[str, PolicyLoss] = {}
KL_ESTIMATORS: dict[str, KLEstimator] = {}


def _register(table: dict, kind: str, name: str) -> Callable:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{kind} name must be a non-empty string, got {name!r}")

    def decorator(fn: Callable) -> Callable:
        if name in table:
            raise ValueError(f"{kind} {name!r} is already registered")
        table[name] = fn
        return fn

    return decorator


def _lookup(table: dict, kind: str, name: str) -> Callable:
    if name not in table:
        raise KeyError(f"unknown {kind} {name!r}; known: {sorted(table)}")
    return table[name]


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator adding a policy loss to POLICY_LOSSES under `name` (duplicates are an error)."""
    return _register(POLICY_LOSSES, "policy loss", name)


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered as `name`; KeyError listing the known names otherwise."""
    return _lookup(POLICY_LOSSES, "policy loss", name)


def register_kl_estimator(name: str) -> Callable[[KLEstimator], KLEstimator]:
    """Decorator adding a KL estimator fn(log_prob, log_prob_ref) -> Tensor to KL_ESTIMATORS."""
    return _register(KL_ESTIMATORS, "KL estimator", name)


def get_kl_estimator(name: str) -> KLEstimator:
    """The KL estimator registered as `name`; KeyError listing the known names otherwise."""
    return _lookup(KL_ESTIMATORS, "KL estimator", name)


def _log_ratio(log_prob: Tensor, log_prob_ref: Tensor) -> Tensor:
    if log_prob.shape != log_prob_ref.shape:
        raise ValueError(
            f"log_prob shape {tuple(log_prob.shape)} != log_prob_ref shape {tuple(log_prob_ref.shape)}"
        )
    return log_prob_ref - log_prob


@register_kl_estimator("k1")
def kl_k1(log_prob: Tensor, log_prob_ref: Tensor) -> Tensor:
    """k1 = -log r with log r = log p_ref - log q; unbiased for KL(q || p_ref) on samples from q."""
    return -_log_ratio(log_prob, log_prob_ref)


@register_kl_estimator("k2")
def kl_k2(log_prob: Tensor, log_prob_ref: Tensor) -> Tensor:
    """k2 = (log r)^2 / 2; biased but low-variance, and its gradient is the reverse-KL gradient."""
    return 0.5 * _log_ratio(log_prob, log_prob_ref) ** 2


@register_kl_estimator("k3")
def kl_k3(log_prob: Tensor, log_prob_ref: Tensor, log_ratio_clamp: float = 20.0) -> Tensor:
    """k3 = exp(log r) - 1 - log r, unbiased and non-negative.

    log r is clamped to [-log_ratio_clamp, log_ratio_clamp] inside exp only: exp(89) already overflows
    float32, while the linear -log r term needs no protection. Beyond the clamp the value is an
    underestimate and the exp term's gradient is cut.
    """
    log_r = _log_ratio(log_prob, log_prob_ref)
    return torch.exp(log_r.clamp(-log_ratio_clamp, log_ratio_clamp)) - 1.0 - log_r


def kl_estimate(log_prob: Tensor, log_prob_ref: Tensor, kind: str = "k3") -> Tensor:
    """Per-sample KL(q || p_ref) estimate from log q (log_prob) and log p_ref; kind in KL_ESTIMATORS."""
    return get_kl_estimator(kind)(log_prob, log_prob_ref)


@register_policy_loss("grpo_clip")
def grpo_policy_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    clip_range: float,
    adv_clip_max: float,
    log_ratio_clamp: float = 10.0,
    kl: Tensor | None = None,
    beta: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-style clipped GRPO loss: mean(max(-A r, -A clip(r, 1 - eps, 1 + eps))) + beta * mean(kl).

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
    policy_loss = torch.maximum(unclipped, clipped).mean()
    kl_penalty = kl.mean() if kl is not None else torch.zeros_like(policy_loss)
    loss = policy_loss + beta * kl_penalty if beta > 0 else policy_loss
    with torch.no_grad():
        high = (ratio > 1.0 + clip_range).float().mean()
        low = (ratio < 1.0 - clip_range).float().mean()
        metrics = {
            "loss": loss.detach(),
            "policy_loss": policy_loss.detach(),
            "kl_penalty": kl_penalty.detach(),
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
