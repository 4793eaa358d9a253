"""GRPO policy losses and KL estimators, with small name registries.

Shapes: N = B * K samples (B conditions, K copies each). Log-probs, advantages and KL values are (N,)
tensors for one trained timestep (any shape works as long as they match; means run over all elements).
KL estimators take the transition's (N, ...) means, its std and the stored (N, ...) next state, and return
(N,) per-element KL estimates.

A policy loss is registered with the settings it reads (register_policy_loss): a frozen dataclass whose fields are
config train.<field> names with their defaults. The objectives build it from config.train (loss_settings) and the
validation runs its `check`, so a new loss is written in one place and no other module names its settings. A loss
that needs more than one timestep's tensors (every timestep's log-probs, weights kept across micro-batches) registers
an `inputs` class that computes them, so the objective runs it without knowing the loss.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from recam.engine.sde import checked_std, gaussian_kl_between_means, reduce_elements
from recam.infra.registry import registrar

__all__ = [
    "K3_LOG_RATIO_CLAMP",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "ClipSettings",
    "RegisteredPolicyLoss",
    "StepLossInputs",
    "weighted_terms",
    "gaussian_log_ratio",
    "get_kl_estimator",
    "get_policy_loss",
    "grpo_policy_loss",
    "known_policy_losses",
    "kl_gaussian_mean",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "loss_settings",
    "policy_loss_switches",
    "register_kl_estimator",
    "register_policy_loss",
    "registered_policy_loss",
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
class ClipSettings:
    """The clipped surrogate's settings (config train.*), whose defaults config/base.py takes from here. Other
    objectives read them too (beta decides whether a reference is kept), so config/validate.py checks their ranges
    for every run."""

    # PPO clip epsilon on r = exp(logp - logp_old): diffusion ratios sit within ~1e-3 of 1
    clip_range: float = 1e-3
    adv_clip_max: float = 5.0  # advantages are clamped to +-this
    log_ratio_clamp: float = 10.0  # log-ratio clamped to +-this before exp, so one outlier cannot overflow
    beta: float = 0.02  # KL coefficient toward the frozen reference (0 disables the reference)
    # MixGRPO's "KL" (train_grpo_flux.py L583-584): this x 0.5 mean over samples of (log p - log p_old)^2, against the
    # sampling log-probs, no reference model; its public scripts run it at 0 (kl_coeff 0.0)
    sampling_kl_coeff: float = 0.0


# Every registered policy loss: fn(StepLossInputs, its settings) -> (loss scalar, metrics of detached 0-dim tensors)
PolicyLoss = Callable[[StepLossInputs, Any], tuple[Tensor, dict[str, Tensor]]]
# fn(cur_mean, ref_mean, std, sample, mask=None, reduction="mean") -> (N,), mask: the elements averaged over,
# reduction "sum" sums them (as a scheduler that sums its log-probs does, so the KL is in the log-ratio's units).
KLEstimator = Callable[[Tensor, Tensor, "float | Tensor", Tensor], Tensor]

K3_LOG_RATIO_CLAMP = 20.0
# A setting arrives from the command line as text and is parsed as its default's type, so only these are allowed.
SETTING_TYPES = (bool, int, float, str)


@dataclass(frozen=True)
class RegisteredPolicyLoss:
    """One entry of POLICY_LOSSES: the loss, the dataclass of the settings it reads, the check of their ranges, and
    the class that computes its extra StepLossInputs fields (None: it reads only the timestep's own)."""

    fn: PolicyLoss
    settings: type
    check: Callable[[Any], None] | None = None
    inputs: type | None = None

    def fields(self) -> dict[str, bool | int | float | str]:
        """train.<field> -> default, in the dataclass's order."""
        return {f.name: f.default for f in dataclasses.fields(self.settings)}


POLICY_LOSSES: dict[str, RegisteredPolicyLoss] = {}
KL_ESTIMATORS: dict[str, KLEstimator] = {}

# The built-in losses registered outside this module (research extensions), named here and imported only when the
# registry is asked what it holds: the core's code never depends on them.
_POLICY_LOSS_MODULES = ("recam.engine.extensions.variants",)


def known_policy_losses() -> list[str]:
    """Registered policy loss names, after importing the built-in modules that register more than this one does."""
    for module in _POLICY_LOSS_MODULES:
        importlib.import_module(module)
    return sorted(POLICY_LOSSES)


def _lookup(table: dict, kind: str, name: str) -> Any:
    if name not in table:
        raise KeyError(f"unknown {kind} {name!r}; known: {sorted(table)}")
    return table[name]


def _check_settings_type(name: str, settings: Any) -> None:
    """A frozen dataclass whose every field has a default of SETTING_TYPES: the defaults are what a config without
    the field runs with (config.plugins.add_loss_settings adds them), frozen so a loss cannot change them mid-run."""
    if not (isinstance(settings, type) and dataclasses.is_dataclass(settings)
            and settings.__dataclass_params__.frozen):
        raise TypeError(f"policy loss {name!r}: settings must be a frozen dataclass, got {settings!r}")
    for f in dataclasses.fields(settings):
        if f.default is dataclasses.MISSING or type(f.default) not in SETTING_TYPES:
            raise TypeError(f"policy loss {name!r}: setting {f.name!r} needs a default of type bool, int, float or "
                            f"str (a command-line value is parsed as that type), got {f.default!r}")


def register_policy_loss(name: str, *, settings: type, check: Callable[[Any], None] | None = None,
                         inputs: type | None = None) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator registering `fn(inputs: StepLossInputs, settings) -> (loss, metrics)` under `name` (duplicates are
    an error). settings: a frozen dataclass whose fields are the config train.<field> names the loss reads, each with
    its default; fn receives an instance built from config.train (loss_settings). check(checks), optional: their
    ranges, stated with recam/infra/config_checks.py's FieldChecks on the fields "train.<field>", run when the
    loss is the chosen train.policy_loss. A bool setting named use_* is a switch: validation refuses it switched on
    unless the chosen loss has it. inputs, optional: a class built as inputs(train_config, scheduler) by the GRPO
    objective for the fields of StepLossInputs that one timestep's tensors cannot give (recam.engine.objective.
    NoStepInputs states its methods)."""
    _check_settings_type(name, settings)
    add = registrar(POLICY_LOSSES, "policy loss", name)

    def decorator(fn: PolicyLoss) -> PolicyLoss:
        add(RegisteredPolicyLoss(fn, settings, check, inputs))
        return fn

    return decorator


def registered_policy_loss(name: str) -> RegisteredPolicyLoss:
    """The entry of the policy loss registered as `name`; KeyError listing the known names otherwise."""
    known_policy_losses()
    return _lookup(POLICY_LOSSES, "policy loss", name)


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered as `name`; KeyError listing the known names otherwise."""
    return registered_policy_loss(name).fn


def loss_settings(name: str, train_config: Mapping, **overrides) -> Any:
    """The settings of policy loss `name`: each field from train_config (config.train), its default where
    train_config lacks it, and `overrides` (field=value) over both. An override of a field the loss does not have is
    dropped: the loss would not read it (GRPO-Guard's beta=0 for a loss without a KL term)."""
    entry = registered_policy_loss(name)
    values = {f: train_config[f] if f in train_config else default for f, default in entry.fields().items()}
    values.update({f: v for f, v in overrides.items() if f in values})
    return entry.settings(**values)


def policy_loss_switches() -> dict[str, list[str]]:
    """Every switch (a bool setting named use_*) of the registered losses -> the losses that have it, in order."""
    known_policy_losses()
    out: dict[str, list[str]] = {}
    for name, entry in POLICY_LOSSES.items():
        for f, default in entry.fields().items():
            if f.startswith("use_") and isinstance(default, bool):
                out.setdefault(f, []).append(name)
    return out


def register_kl_estimator(name: str) -> Callable[[KLEstimator], KLEstimator]:
    """Decorator adding fn(cur_mean, ref_mean, std, sample, mask=None, reduction="mean") -> (N,) to KL_ESTIMATORS
    ("KL estimators")."""
    return registrar(KL_ESTIMATORS, "KL estimator", name)


def get_kl_estimator(name: str) -> KLEstimator:
    """The KL estimator registered as `name`; KeyError listing the known names otherwise."""
    return _lookup(KL_ESTIMATORS, "KL estimator", name)


# ---------------------------------------------------------------- KL estimators
#
# Every estimator takes (cur_mean, ref_mean, std, sample) for one Gaussian transition x_t -> x_{t-1} and
# returns the (N,) per-sample estimate of KL(pi_theta(.|x_t) || pi_ref(.|x_t)) per element, i.e. the mean
# over non-batch elements of the element-wise KLs: the units of the closed form "gaussian_mean". With
# reduction="sum" they sum over the elements instead: a scheduler that sums its log-probs (motion's
# log_prob_reduction "sum") gets a KL in the same units as its log-ratio, as its policy term is.
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
                     mask: Tensor | None = None, reduction: str = "mean") -> Tensor:
    """Closed form (cur_mean - ref_mean)^2 / (2 std^2), element mean: exact value and gradient, no noise.

    `sample` is unused; it is accepted so that every estimator has one signature.
    """
    cur, ref, std_t, _ = _kl_inputs(cur_mean, ref_mean, std, sample)
    return gaussian_kl_between_means(cur, ref, std_t, mask, reduction)


@register_kl_estimator("k1")
def kl_k1(cur_mean: Tensor, ref_mean: Tensor, std: float | Tensor, sample: Tensor,
          mask: Tensor | None = None, reduction: str = "mean") -> Tensor:
    """k1 = -log r per element, at the reparameterised sample (noise held fixed), element mean.

    Value: unbiased for the KL when sample ~ pi_theta. Gradient: (x - ref_mean) / std^2 * grad cur_mean,
    whose mean is the exact KL gradient. With the sample held fixed instead, the gradient would be the
    score -grad log p_theta(x), which has mean zero. Its variance does not shrink with the KL (k2 and k3's
    does), so k1's gradient is the noisiest of the three when policy and reference are close.
    """
    cur, ref, std_t, x = _kl_inputs(cur_mean, ref_mean, std, sample)
    return reduce_elements(-gaussian_log_ratio(cur, ref, std_t, x, pathwise=True), mask, reduction)


@register_kl_estimator("k2")
def kl_k2(cur_mean: Tensor, ref_mean: Tensor, std: float | Tensor, sample: Tensor,
          mask: Tensor | None = None, reduction: str = "mean") -> Tensor:
    """k2 = (log r)^2 / 2 per element with the sample held fixed, element mean.

    Gradient: E[(log p_theta - log p_ref) grad log p_theta] is the exact KL gradient (score-function
    identity). Value: biased upward; for equal-std Gaussians E[k2] = KL + KL^2 / 2 per element, so the
    relative bias is KL / 2 (0.5 % at a per-element KL of 0.01).
    """
    cur, ref, std_t, x = _kl_inputs(cur_mean, ref_mean, std, sample)
    return reduce_elements(0.5 * gaussian_log_ratio(cur, ref, std_t, x, pathwise=False) ** 2, mask, reduction)


@register_kl_estimator("k3")
def kl_k3(cur_mean: Tensor, ref_mean: Tensor, std: float | Tensor, sample: Tensor,
          mask: Tensor | None = None, reduction: str = "mean") -> Tensor:
    """k3 = exp(log r) - 1 - log r per element with the sample held fixed, element mean; non-negative.

    Value: unbiased (E[p_ref / p_theta] = 1 on-policy). Gradient: in general the forward-KL gradient, which for two
    Gaussians of equal std equals the reverse-KL gradient, so its mean is exact here.
    log r is clamped to +-K3_LOG_RATIO_CLAMP inside exp only (exp(89) overflows float32); beyond it the value
    is an underestimate and the exp term's gradient is cut.
    """
    cur, ref, std_t, x = _kl_inputs(cur_mean, ref_mean, std, sample)
    log_r = gaussian_log_ratio(cur, ref, std_t, x, pathwise=False)
    k3 = torch.exp(log_r.clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)) - 1.0 - log_r
    return reduce_elements(k3, mask, reduction)


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


@register_policy_loss("grpo_clip", settings=ClipSettings)
def grpo_clip(x: StepLossInputs, s: ClipSettings) -> tuple[Tensor, dict[str, Tensor]]:
    return grpo_policy_loss(x.log_prob, x.old_log_prob, x.advantages, s.clip_range, s.adv_clip_max,
                            s.log_ratio_clamp, x.kl, s.beta, sample_weight=x.sample_weight,
                            sampling_kl_coeff=s.sampling_kl_coeff)


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
    sampling_kl_coeff: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-style clipped GRPO loss: mean(max(-A r, -A clip(r, 1 - eps, 1 + eps))) + beta * mean(kl)
    + sampling_kl_coeff * mean(0.5 (log_prob - old_log_prob)^2) (MixGRPO's form, unclamped); with
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
    if not (beta >= 0 and sampling_kl_coeff >= 0):
        raise ValueError(f"beta and sampling_kl_coeff must be >= 0, got {beta!r}, {sampling_kl_coeff!r}")
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
    loss_metric = policy_metric + beta * kl_metric if beta > 0 else policy_metric
    if sampling_kl_coeff > 0:
        sampling_kl, sampling_kl_metric = weighted_terms(0.5 * diff**2, sample_weight)
        loss = loss + sampling_kl_coeff * sampling_kl
        loss_metric = loss_metric + sampling_kl_coeff * sampling_kl_metric
    with torch.no_grad():
        high = (ratio > 1.0 + clip_range).float().mean()
        low = (ratio < 1.0 - clip_range).float().mean()
        metrics = {
            "loss": loss_metric,
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
