"""Composable GRPO variants for diffusion trajectories, and the "grpo_variants" policy loss.

Vocabulary: a "token" is one trained timestep of one sample, a "sequence" is that sample's trajectory of
T trained timesteps. Shapes: n trajectories in a micro-batch, T trained timesteps; position t = 0 is the
noisiest trained step. The trainer runs one backward per timestep j and is assumed to average the T
per-timestep losses (Flow-GRPO's gradient accumulation), so a per-token loss term is "1/T of a sequence".

Variants (research plan numbering):
    2.1 EMA-smoothed importance weights  -> EMAImportanceState, ema_step_metrics, loss input ema_weight
    2.2 gradient-adaptive timestep weights -> policy_gradient_norms, gradient_adaptive_weights, grad_weight
    2.3 AMIC (arithmetic-mean sequence ratio) and GSPO (geometric mean) -> amic_token_weight, gspo_token_weight
    2.4 PTRW Gaussian trust gate in place of hard clipping -> ptrw_trust_weight
    2.5 temporal decay of the advantage over denoising steps -> temporal_decay_weights
    2.6 asymmetric clipping (clip-higher) -> grpo_variants_policy_loss(use_asymmetric_clipping=True)

Importing this module registers grpo_variants_policy_loss in recam.engine.losses.POLICY_LOSSES as "grpo_variants",
with its settings (VariantSettings: config train.use_* and their parameters), their checks, and VariantInputs, which
computes for the GRPO objective what 2.1-2.3 read beyond one timestep. The registry imports this module by name
(recam.engine.losses.known_policy_losses); the core never imports it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from recam.engine.losses import ClipSettings, StepLossInputs, register_policy_loss, weighted_terms
from recam.engine.rollout import rescore

if TYPE_CHECKING:
    from recam.engine.objective import MicroBatch

__all__ = [
    "CLIP_RATIO_NEG_SCALE",
    "CLIP_RATIO_POS_SCALE",
    "EMAImportanceState",
    "EMA_STATE_FILE",
    "EMA_SUMS",
    "PTRW_SIGMA_SCALE",
    "VariantInputs",
    "VariantSettings",
    "amic_token_weight",
    "check_variant_settings",
    "check_ema_has_something_to_smooth",
    "ema_moment_sums",
    "ema_step_metrics",
    "ema_weight_metrics",
    "gradient_adaptive_weights",
    "grpo_variants_policy_loss",
    "gspo_token_weight",
    "importance_weights",
    "log_prob_output_gradient",
    "off_policy_visits",
    "optimizer_steps_per_pass",
    "output_gradient_norm",
    "parameter_probe_projections",
    "policy_gradient_norms",
    "ptrw_trust_weight",
    "temporal_decay_weights",
]

# The trust-region widths of 2.4 and 2.6 as multiples of train.clip_range, the preset's own scale for how far a ratio
# may move: a fixed width would be 50x too tight on a preset clipping at 0.05 (the toy's), where asymmetric clipping
# at 1.4e-3 / 1e-3 clipped 87-95% of the ratios. config/base.py defines the fields as these multiples of
# train.clip_range, so they follow a preset's or the command line's clip range unless set explicitly.
CLIP_RATIO_POS_SCALE = 1.4  # 2.6: DAPO's clip-higher proportion, 0.28 / 0.2, above the symmetric range for A > 0
CLIP_RATIO_NEG_SCALE = 1.0  # 2.6: the symmetric range itself on the negative-advantage side
# 2.4: the gate is exp(-1/8) ~ 0.88 at |r - 1| = clip_range, where a hard clip would start to cut, and exp(-2) ~ 0.14
# at four clip ranges.
PTRW_SIGMA_SCALE = 2.0


@dataclass(frozen=True)
class VariantSettings(ClipSettings):
    """The settings of the "grpo_variants" loss: config train.<field>, whose defaults config/base.py takes from here.
    The EMA and gradient-adaptive ones are read by VariantInputs, which makes the weights the GRPO objective hands the
    loss; they are the loss's because only it uses those weights, so their switches need it too.

    Diffusion importance ratios sit within ~1e-3 of 1 (Flow-GRPO clips at 1e-4..1e-3), far tighter than the 0.2 of
    language models, so every ratio-scale default below lives on that scale: the trust-region widths as multiples of
    clip_range (CLIP_RATIO_POS_SCALE, CLIP_RATIO_NEG_SCALE, PTRW_SIGMA_SCALE)."""

    use_ema_smoothing: bool = False  # 2.1
    # 2.1: the value the published EMA variant recommends; keeps 90% of the fresh weight per update.
    ema_beta: float = 0.9
    # 2.1: keep each sample id's (dataset index, copy) EMA state from one epoch to the next, so that a condition drawn
    # again continues the average of its earlier off-policy weights; off: the state ends with the epoch's samples.
    ema_across_epochs: bool = False
    use_gradient_adaptive_weighting: bool = False  # 2.2
    # 2.2: on log-magnitudes tau = 1 makes timestep weights proportional to the per-token gradient norm.
    gradient_weighting_temperature: float = 1.0
    # 2.2: 0 = exact per-sample gradient norms, which on ReCam-Tiny cost less than even a few probes.
    gradient_weighting_num_probes: int = 0
    use_amic: bool = False  # 2.3
    use_gspo: bool = False  # 2.3
    use_ptrw: bool = False  # 2.4
    # 2.4: PTRW_SIGMA_SCALE x clip_range (config/base.py ties the field to train.clip_range).
    ptrw_sigma: float = PTRW_SIGMA_SCALE * ClipSettings.clip_range
    use_temporal_decay: bool = False  # 2.5
    # 2.5: with T ~ 10 trained steps the last weight is ~0.39 of the first, favouring the high-noise steps.
    temporal_decay_gamma: float = 0.9
    # 2.5: mean-1 weights keep the loss scale (and hence the tuned learning rate) unchanged.
    temporal_decay_normalize: bool = True
    use_asymmetric_clipping: bool = False  # 2.6
    # 2.6: CLIP_RATIO_POS_SCALE / CLIP_RATIO_NEG_SCALE x clip_range (config/base.py ties them to train.clip_range).
    clip_ratio_pos: float = CLIP_RATIO_POS_SCALE * ClipSettings.clip_range
    clip_ratio_neg: float = CLIP_RATIO_NEG_SCALE * ClipSettings.clip_range


def check_variant_settings(checks) -> None:
    """The ranges of VariantSettings' own fields (recam/infra/config_checks.py's FieldChecks; their types and
    ClipSettings' ranges are checked for every run) and the variants that exclude each other."""
    checks.number("train.ema_beta", 0, 1, low_open=True)
    checks.number("train.gradient_weighting_temperature", 0, None, low_open=True, allow_inf=True)
    checks.integer("train.gradient_weighting_num_probes", 0, None, "0 = exact per-sample gradients, P > 0 = P probes")
    checks.number("train.ptrw_sigma", 0, None, low_open=True)
    checks.number("train.temporal_decay_gamma", 0, 1, low_open=True)
    checks.number("train.clip_ratio_pos", 0, None, low_open=True)
    checks.number("train.clip_ratio_neg", 0, None, low_open=True)
    t = checks.config.train
    checks.require(not (t.use_amic and t.use_gspo),
                   "train.use_amic and train.use_gspo are mutually exclusive: AMIC is the arithmetic-mean alternative "
                   "to GSPO's geometric mean; enable one")
    checks.require(not (t.use_ptrw and t.use_asymmetric_clipping),
                   "train.use_ptrw and train.use_asymmetric_clipping are mutually exclusive: PTRW replaces hard "
                   "clipping, so there is no clip range to make asymmetric")
    checks.require(not (t.use_ema_smoothing and (t.use_amic or t.use_gspo)),
                   "train.use_ema_smoothing cannot combine with train.use_amic/train.use_gspo: the EMA smooths one "
                   "timestep's weight, the sequence forms are built from all raw weights")
    check_ema_has_something_to_smooth(checks)


def optimizer_steps_per_pass(samples_per_process: int, batch_size: int, accumulation_steps: int) -> int:
    """Optimizer steps in one pass over a process's samples of an epoch, as recam.engine.trainer walks them:
    micro-batches of batch_size, accumulation_steps of them per step."""
    return math.ceil(math.ceil(samples_per_process / batch_size) / accumulation_steps)


def off_policy_visits(num_inner_epochs: int, steps_per_pass: int) -> tuple[int, int]:
    """(fewest, most) visits within one epoch at which a sample's importance weights are off-policy.

    A weight is off-policy once an optimizer step has moved the policy since the sample was drawn. The samples of the
    epoch's first optimizer step are on-policy in the first pass (every weight exactly 1) and off-policy in each later
    one: num_inner_epochs - 1 visits. The samples of any later step of the first pass are off-policy in every pass."""
    fewest = num_inner_epochs - 1
    return fewest, num_inner_epochs if steps_per_pass >= 2 else fewest


def check_ema_has_something_to_smooth(checks) -> None:
    """Refuse an EMA that can never blend two off-policy weights of one sample (its metrics would say nothing), with
    one line naming the fields and what to set; and cross-epoch state where it would be per process."""
    t, s = checks.config.train, checks.config.sample
    if not t.use_ema_smoothing:
        checks.require(not t.ema_across_epochs,
                       "train.ema_across_epochs=True keeps the EMA's state, and train.use_ema_smoothing is False: set "
                       "train.use_ema_smoothing=True or train.ema_across_epochs=False")
        return
    steps = optimizer_steps_per_pass(s.batch_size * s.num_batches_per_epoch, t.batch_size,
                                     t.gradient_accumulation_steps)
    _, most = off_policy_visits(t.num_inner_epochs, steps)
    # within an epoch the first off-policy visit starts a sample's state, the second is the first one smoothed;
    # across epochs a sample id's first off-policy visit of the epoch can blend with the state of its last epoch
    smooths = most >= 2 or (t.ema_across_epochs and most >= 1)
    passes = 3 if steps == 1 else 2
    checks.require(
        smooths,
        f"train.use_ema_smoothing has nothing to smooth: with train.num_inner_epochs={t.num_inner_epochs} and "
        f"{steps} optimizer step(s) per pass (train.gradient_accumulation_steps={t.gradient_accumulation_steps}, "
        f"train.batch_size={t.batch_size}) no sample has two off-policy importance weights (the first pass before "
        f"an update is on-policy, every weight exactly 1); set train.num_inner_epochs={passes}"
        + (" or train.ema_across_epochs=True" if most >= 1 else "")
        + ", or train.use_ema_smoothing=False")
    processes = getattr(checks, "num_processes", None)
    checks.require(
        not t.ema_across_epochs or processes is None or processes == 1,
        f"train.ema_across_epochs=True with {processes} processes: a sample id lands on another process in a later "
        f"epoch, whose EMA state is its own, and only the main process's would be checkpointed; run one process, or "
        f"set train.ema_across_epochs=False and train.num_inner_epochs={passes}")


def _population_var(x: Tensor) -> Tensor:
    return x.double().var(unbiased=False) if x.numel() > 0 else torch.zeros((), dtype=torch.float64)


def importance_weights(seq_log_prob: Tensor, seq_old_log_prob: Tensor, log_ratio_clamp: float = 10.0) -> Tensor:
    """Raw per-timestep importance weights w_t = exp(clamp(logp_t - logp_old_t, +-log_ratio_clamp)), detached.

    seq_log_prob, seq_old_log_prob: (n, T). Returns (n, T) with no gradient; the clamp matches the one in the
    policy losses, so the weight fed to EMAImportanceState equals the ratio the loss recomputes.
    """
    if seq_log_prob.shape != seq_old_log_prob.shape or seq_log_prob.dim() != 2:
        raise ValueError(
            f"seq_log_prob {tuple(seq_log_prob.shape)} and seq_old_log_prob {tuple(seq_old_log_prob.shape)} "
            "must both be (n, T)"
        )
    diff = (seq_log_prob.detach() - seq_old_log_prob.detach()).clamp(-log_ratio_clamp, log_ratio_clamp)
    return torch.exp(diff)


# ----------------------------------------------------------------------------------------------- 2.1 EMA
#
# What the EMA smooths: a sample's importance weights w = pi_theta / pi_old at the visits after an optimizer step has
# moved the policy (off-policy). Before the first step of an epoch the weights are on-policy, exactly 1: blending with
# them is a fixed shrink of the next deviation toward 1, which a variance ratio reports as 1 / beta^2 whatever the data.
# So on-policy visits neither start nor read a sample's state; its first off-policy visit starts the state at its own
# weights (there is nothing yet to average) and each later one, in a later pass or (train.ema_across_epochs) a later
# epoch, is smoothed. The metrics are over the smoothed weights only, pooled over an optimizer step and its processes
# from sums each micro-batch reports (ema_moment_sums -> ema_step_metrics).

# One micro-batch's sums (ema_moment_sums), in every pass's metrics; ema_step_metrics turns a step's means of them
# into the logged metrics and removes them.
EMA_SUMS = ("ema/sums/weights", "ema/sums/smoothed", "ema/sums/raw", "ema/sums/raw_sq", "ema/sums/smoothed_w",
            "ema/sums/smoothed_w_sq")
EMA_STATE_FILE = "ema_importance_state.json"  # checkpoint side file of train.ema_across_epochs


def ema_weight_metrics(raw: Tensor, smoothed: Tensor) -> dict[str, Tensor]:
    """Variance diagnostics of a set of weights before and after smoothing, over all their entries (population
    variances, float64 inside); the definition ema_step_metrics computes over a step's smoothed weights.

    ema/variance_reduction_ratio = Var(raw) / Var(smoothed): 1 when both variances are 0 (nothing to
    reduce), +inf when only Var(smoothed) is 0 (the spread was removed entirely). ema/smoothing_strength =
    1 - Var(smoothed) / Var(raw), 0 when Var(raw) is 0. Returns detached float32 0-dim tensors.
    """
    if raw.shape != smoothed.shape:
        raise ValueError(f"raw {tuple(raw.shape)} and smoothed {tuple(smoothed.shape)} must have the same shape")
    var_raw = _population_var(raw.detach())
    var_smooth = _population_var(smoothed.detach())
    one = torch.ones_like(var_raw)
    safe_smooth = torch.where(var_smooth > 0, var_smooth, one)
    ratio = torch.where(
        var_smooth > 0, var_raw / safe_smooth, torch.where(var_raw > 0, torch.full_like(var_raw, math.inf), one)
    )
    safe_raw = torch.where(var_raw > 0, var_raw, one)
    strength = torch.where(var_raw > 0, 1.0 - var_smooth / safe_raw, torch.zeros_like(var_raw))
    return {
        "ema/variance_reduction_ratio": ratio.float(),
        "ema/raw_weights_variance": var_raw.float(),
        "ema/smoothed_weights_variance": var_smooth.float(),
        "ema/smoothing_strength": strength.float(),
    }


def ema_moment_sums(raw: Tensor, smoothed: Tensor, blended: Tensor) -> dict[str, Tensor]:
    """One micro-batch's share of its optimizer step's EMA metrics, as float64 0-dim tensors keyed by EMA_SUMS: the
    number of weights (all n * T), the number smoothed (the T weights of each row of `blended`, (n,) bool: the rows
    the EMA averaged with history), and over those the sums of x and x^2 for x = raw - 1 and x = smoothed - 1. Centred
    at 1 so that weights within 1e-3 of 1 keep their digits in E[x^2] - E[x]^2."""
    if raw.shape != smoothed.shape or raw.dim() != 2:
        raise ValueError(f"raw {tuple(raw.shape)} and smoothed {tuple(smoothed.shape)} must both be (n, T)")
    rows = torch.as_tensor(blended, dtype=torch.bool, device=raw.device).reshape(-1)
    if rows.shape[0] != raw.shape[0]:
        raise ValueError(f"blended has {rows.shape[0]} rows, the weights {raw.shape[0]}")
    x = raw.detach().double()[rows] - 1.0
    y = smoothed.detach().double()[rows] - 1.0
    f64 = {"dtype": torch.float64}
    return dict(zip(EMA_SUMS, (torch.tensor(float(raw.numel()), **f64), torch.tensor(float(x.numel()), **f64),
                               x.sum().cpu(), x.square().sum().cpu(), y.sum().cpu(), y.square().sum().cpu()),
                    strict=True))


def ema_step_metrics(m: dict) -> dict:
    """One optimizer step's metrics with its EMA sums (EMA_SUMS; each the mean over the step's passes and processes,
    i.e. a total times a factor common to all of them, which cancels) replaced by what they measure:

        ema/smoothed_fraction          share of the step's importance weights the EMA smoothed (on-policy weights and
                                       a sample's first off-policy visit are not smoothed)
        ema/raw_weights_variance       Var of those weights before smoothing (population, pooled over the step)
        ema/smoothed_weights_variance  Var of the same weights after smoothing
        ema/variance_reduction_ratio   Var(raw) / Var(smoothed): > 1 when the EMA reduced their spread
        ema/smoothing_strength         1 - Var(smoothed) / Var(raw)

    The variances need a smoothed weight, each ratio a positive denominator; a step without one logs only the
    fraction (a constant such as 1.0 in its place would read as a measurement). Returns a new dict."""
    out = {k: v for k, v in m.items() if k not in EMA_SUMS}
    if any(k not in m for k in EMA_SUMS):
        return out
    total, count = float(m["ema/sums/weights"]), float(m["ema/sums/smoothed"])
    out["ema/smoothed_fraction"] = count / total if total > 0 else 0.0
    if count <= 0:
        return out

    def variance(key: str) -> float:
        mean = float(m[key]) / count
        return max(float(m[key + "_sq"]) / count - mean * mean, 0.0)

    var_raw, var_smooth = variance("ema/sums/raw"), variance("ema/sums/smoothed_w")
    out["ema/raw_weights_variance"], out["ema/smoothed_weights_variance"] = var_raw, var_smooth
    if var_smooth > 0:
        out["ema/variance_reduction_ratio"] = var_raw / var_smooth
    if var_raw > 0:
        out["ema/smoothing_strength"] = 1.0 - var_smooth / var_raw
    return out


def _id_list(ids: Tensor | Iterable[Hashable]) -> list[Hashable]:
    keys = ids.tolist() if isinstance(ids, Tensor) else list(ids)
    for key in keys:
        if isinstance(key, list):
            raise ValueError("trajectory ids must be scalars (ints, strings or tuples); got a nested list")
    if len(set(keys)) != len(keys):
        raise ValueError("trajectory ids in one call must be unique; a repeated id would be smoothed twice")
    return keys


class EMAImportanceState:
    """Per-trajectory EMA of off-policy importance weights across the visits that revisit the trajectory.

        w~_k = beta * w_k + (1 - beta) * w~_(k-1),   beta in (0, 1]   (beta = 1: no smoothing)

    State is one (T,) vector per trajectory id (condition id + copy index, any hashable: int, str, tuple,
    or the int64 entries of a tensor), so it survives all-gather, shuffling and mini-batch splitting; keying
    by a group id shared by the k copies would blend different samples' weights.

    Feed it off-policy weights only (the section comment says why; VariantInputs does). The first time an id is seen
    its state is its own raw weights, so that update returns w exactly and later updates average real past weights.

    Raw weights must be detached (from importance_weights on the trainer's no-grad all-T pass); the state
    never holds autograd graphs. State lives on the rank that updates it; retire() the ids whose samples are
    dropped (or retire_all() at the end of an epoch, unless the state is to carry over to later epochs).
    """

    def __init__(self, beta: float = VariantSettings.ema_beta):
        if not 0.0 < beta <= 1.0:
            raise ValueError(f"ema beta must be in (0, 1], got {beta!r}")
        self.beta = float(beta)
        self._state: dict[Hashable, Tensor] = {}
        self.missing_state = 0

    @property
    def active_sequences(self) -> int:
        return len(self._state)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._state

    def has_history(self, ids: Tensor | Sequence[Hashable]) -> Tensor:
        """(n,) bool: which ids have state, i.e. which rows the next update() blends with history."""
        return torch.tensor([key in self._state for key in _id_list(ids)], dtype=torch.bool)

    def update(self, ids: Tensor | Sequence[Hashable], raw_weights: Tensor, expect_state: bool = False) -> Tensor:
        """Smooth raw_weights (n, T) row by row against the state of ids (n,); returns smoothed (n, T).

        The returned tensor is new state for those ids (same dtype and device as raw_weights) and has no
        gradient. An id without state starts from its raw row (smoothed row == raw row); when
        expect_state is True (a revisit the caller knows should have state) that also counts towards
        missing_state, which should stay 0.
        """
        keys = _id_list(ids)
        if raw_weights.dim() != 2 or raw_weights.shape[0] != len(keys):
            raise ValueError(f"raw_weights must be ({len(keys)}, T), got {tuple(raw_weights.shape)}")
        if raw_weights.requires_grad:
            raise ValueError("raw_weights must be detached: the EMA state must not hold autograd graphs")
        num_t = raw_weights.shape[1]
        prev_rows, has_state = [], []
        for row, key in enumerate(keys):
            prev = self._state.get(key)
            has_state.append(prev is not None)
            if prev is None:
                if expect_state:
                    self.missing_state += 1
                prev = raw_weights[row]
            elif prev.shape != (num_t,):
                raise ValueError(f"trajectory {key!r} has state of length {prev.shape[0]}, got {num_t} timesteps")
            prev_rows.append(prev.to(raw_weights.device, raw_weights.dtype))
        prev = torch.stack(prev_rows) if prev_rows else raw_weights.clone()
        blended = self.beta * raw_weights + (1.0 - self.beta) * prev
        # A fresh row is returned as its raw weights bit for bit, not beta * w + (1 - beta) * w rounded.
        known = torch.tensor(has_state, dtype=torch.bool, device=raw_weights.device).reshape(-1, 1)
        smoothed = torch.where(known, blended, raw_weights)
        for row, key in enumerate(keys):
            self._state[key] = smoothed[row].clone()
        return smoothed

    def retire(self, ids: Tensor | Iterable[Hashable]) -> int:
        """Drop the state of ids whose samples are retired; returns how many had state."""
        keys = ids.tolist() if isinstance(ids, Tensor) else list(ids)
        return sum(self._state.pop(key, None) is not None for key in keys)

    def retire_all(self) -> None:
        """Drop every trajectory's state (end of epoch); missing_state is cumulative and kept."""
        self._state.clear()

    def metrics(self, raw: Tensor, smoothed: Tensor, blended: Tensor) -> dict[str, Tensor]:
        """ema_moment_sums(raw, smoothed, blended) plus ema/active_sequences and ema/missing_state."""
        out = ema_moment_sums(raw, smoothed, blended)
        out["ema/active_sequences"] = torch.tensor(float(self.active_sequences))
        out["ema/missing_state"] = torch.tensor(float(self.missing_state))
        return out

    def state_dict(self) -> dict:
        """The state as JSON-able data (ids: ints, strings or tuples of them; weights as floats, which round-trip
        float32 and float64 exactly)."""
        keys = list(self._state)
        for key in keys:
            if not isinstance(key, (int, str, tuple)):
                raise TypeError(f"EMA state id {key!r} cannot be saved: ids must be ints, strings or tuples")
        dtypes = {str(v.dtype) for v in self._state.values()}
        return {"beta": self.beta, "missing_state": self.missing_state,
                "dtype": dtypes.pop() if len(dtypes) == 1 else "torch.float32",
                "ids": [list(k) if isinstance(k, tuple) else k for k in keys],
                "weights": [self._state[k].detach().cpu().tolist() for k in keys]}

    def load_state_dict(self, data: dict) -> None:
        """Restore what state_dict() gave; ValueError when it is not that."""
        ids, weights = data["ids"], data["weights"]
        if len(ids) != len(weights):
            raise ValueError(f"{len(ids)} ids but {len(weights)} weight rows")
        dtype = {"torch.float32": torch.float32, "torch.float64": torch.float64}.get(data.get("dtype"), torch.float32)
        state = {}
        for key, row in zip(ids, weights, strict=True):
            values = torch.tensor(row, dtype=dtype)
            if values.dim() != 1 or not bool(torch.isfinite(values).all()):
                raise ValueError(f"the state of {key!r} is not a finite vector")
            state[tuple(key) if isinstance(key, list) else key] = values
        self._state = state
        self.missing_state = int(data.get("missing_state", 0))


# ------------------------------------------------------------------------------- 2.2 gradient-adaptive
#
# The weight of timestep t of trajectory b follows m_bt = ||grad_theta log pi_theta(x_(t+1) | x_t)||, the size of
# the policy-gradient term that token contributes. Through the network output f (velocity or noise) it factors
# as m_bt = ||J_bt^T u_bt||, with J_bt = d f_b / d theta and u_bt = d log p_b / d f_b. u alone (the old proxy,
# output_gradient_norm) is no use on-policy: there x' - mean = std * eps, so ||u|| = |c| ||eps|| / (std * D),
# a function of the sigma schedule and the noise's norm (which concentrates at sqrt(D)), the same for every
# sample. J carries the dependence on the sample and its condition. Measured on the trained ReCam-Tiny with
# synthetic-world conditions: m spreads 2-7% across the samples of a timestep where ||u|| spreads 0.1-0.7%,
# while the per-timestep profile is still mostly the schedule's.


def log_prob_output_gradient(
    next_sample: Tensor, mean: Tensor, std: Tensor, output_scale: float | Tensor = 1.0, mask: Tensor | None = None
) -> Tensor:
    """u = d log p / d model output for every sample, (n, ...) float32, detached.

    log p is the per-element MEAN Gaussian log-density over D elements (recam.engine.sde), so
        d log p / d mu_i = (x'_i - mu_i) / (std^2 * D),
    and the steps' means are affine in the output, mu = ... + c * output, so u = c times that. c =
    output_scale is d mu / d output (a float or (n,)), e.g. (1 + sigma_t^2 (1 - sigma) / (2 sigma)) dt for
    the Flow-SDE step; its sign flips u and no norm built from u, so |c| will do. next_sample (n, ...) the
    stored x', mean (n, ...), std (n, 1, ..., 1) or broadcastable, all from the no-grad pass. A deterministic
    step (std 0) has no density and gets u = 0. With `mask` the mean runs over the masked-in elements: D is their
    count per sample and the others get u = 0.
    """
    if next_sample.shape != mean.shape:
        raise ValueError(f"next_sample {tuple(next_sample.shape)} and mean {tuple(mean.shape)} must match")
    x = next_sample.detach().float()
    mu = mean.detach().float()
    s = std.detach().float()
    stochastic = s > 0
    safe = torch.where(stochastic, s, torch.ones_like(s))
    inv_var = torch.where(stochastic, 1.0 / safe**2, torch.zeros_like(s))
    if mask is None:
        numel = x[0].numel() if x.shape[0] > 0 else 1
        grad = (x - mu) * inv_var / numel
    else:
        weight = torch.broadcast_to(mask.to(x.device, x.dtype), x.shape)
        count = weight.sum(dim=tuple(range(1, x.dim())), keepdim=True).clamp(min=1.0)
        grad = (x - mu) * inv_var * weight / count
    if isinstance(output_scale, Tensor):
        scale = output_scale.detach().float().to(grad.device)
        return grad * scale.reshape((-1,) + (1,) * (grad.dim() - 1)) if scale.dim() > 0 else grad * scale
    return grad * float(output_scale)


def output_gradient_norm(
    next_sample: Tensor, mean: Tensor, std: Tensor, output_scale: float | Tensor = 1.0
) -> Tensor:
    """||d log p / d model output||_2 per sample, (n,) float32: the norm of log_prob_output_gradient.

    Not a timestep weight on its own: on-policy it is |c| ||eps|| / (std D), fixed by the schedule (see the
    section comment); policy_gradient_norms is the sample-dependent quantity.
    """
    grad = log_prob_output_gradient(next_sample, mean, std, output_scale)
    return torch.linalg.vector_norm(grad.reshape(grad.shape[0], -1), dim=1)


ParamDict = dict[str, Tensor]
OutputFn = Callable[[ParamDict, slice], Tensor]


def _check_output(out: Tensor, expected: torch.Size) -> None:
    if out.shape != expected:
        raise ValueError(f"output_fn returned {tuple(out.shape)}, expected {tuple(expected)} (output_grad's rows)")


def _exact_gradient_norms(output_fn: OutputFn, params: ParamDict, output_grad: Tensor) -> Tensor:
    u = output_grad.detach().float()
    leaves = {name: p.detach().requires_grad_(True) for name, p in params.items()}
    norms = []
    # One sample per pass: a batched backward only yields the sum of the samples' gradients.
    with torch.enable_grad():
        for b in range(u.shape[0]):
            out = output_fn(leaves, slice(b, b + 1))
            _check_output(out, u[b:b + 1].shape)
            if not out.requires_grad:
                raise ValueError("output_fn's output does not depend on params; it must evaluate the module with them")
            grads = torch.autograd.grad((out.float() * u[b:b + 1]).sum(), list(leaves.values()), allow_unused=True)
            norms.append(torch.stack([g.float().square().sum() for g in grads if g is not None]).sum().sqrt())
    return torch.stack(norms) if norms else u.new_zeros((0,))


def _gaussian_probe(params: ParamDict, generator: torch.Generator | None) -> ParamDict:
    probe = {}
    for name, p in params.items():
        # Drawn in float32 where the generator lives, so a seed gives the same probes whatever the parameters'
        # dtype; jvp needs each tangent in its primal's dtype and device.
        device = generator.device if generator is not None else p.device
        probe[name] = torch.randn(p.shape, generator=generator, device=device, dtype=torch.float32).to(p)
    return probe


def parameter_probe_projections(
    output_fn: OutputFn,
    params: ParamDict,
    output_grad: Tensor,
    probes: Sequence[ParamDict],
    step_size: float | None = None,
) -> Tensor:
    """Directional derivatives d log p_b / d theta . z_k = u_b . (J_b z_k), shape (P, n) float32, detached.

    The parameters are shared by the batch, so one Jacobian-vector product J z gives J_b z for every sample b.
    Arguments as policy_gradient_norms; probes: P dicts with the keys, shapes and dtypes of params.

    step_size None: J z by forward-mode AD (torch.func.jvp), exact. Torch has no forward-mode rule for its fused
    attention kernels, so scaled_dot_product_attention is pinned to the math backend inside, which holds the
    (heads, L, L) attention matrix and can run out of memory at long sequences. step_size h: central
    difference (f(theta + h z) - f(theta - h z)) / 2h, two no-grad forwards with any kernel; truncation error
    O(h^2) plus float32 round-off O(ulp(f) / h), about 1e-3 of |u . J z| for ReCam-Tiny at h = 1e-3 (tested),
    so for float32 outputs only.
    """
    from torch.func import jvp
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if step_size is not None and not step_size > 0:
        raise ValueError(f"step_size must be > 0 or None, got {step_size!r}")
    primals = {name: p.detach() for name, p in params.items()}
    u = output_grad.detach().float()
    every_row = slice(None)
    rows = []
    for probe in probes:
        if probe.keys() != primals.keys():
            raise ValueError("every probe must have exactly the keys of params")
        if step_size is None:
            with sdpa_kernel(SDPBackend.MATH):
                out, jz = jvp(lambda p: output_fn(p, every_row), (primals,), (probe,))
        else:
            with torch.no_grad():
                out = output_fn({k: p + step_size * probe[k] for k, p in primals.items()}, every_row)
                minus = output_fn({k: p - step_size * probe[k] for k, p in primals.items()}, every_row)
            jz = (out - minus).float() / (2.0 * step_size)  # differenced in the output's own precision
        _check_output(out, u.shape)
        rows.append((u * jz.detach().float()).reshape(u.shape[0], -1).sum(dim=1))
    return torch.stack(rows) if rows else u.new_zeros((0, u.shape[0]))


def policy_gradient_norms(
    output_fn: OutputFn,
    params: ParamDict,
    output_grad: Tensor,
    num_probes: int = VariantSettings.gradient_weighting_num_probes,
    generator: torch.Generator | None = None,
    step_size: float | None = None,
) -> Tensor:
    """m_b = ||grad_theta log p_b||_2 of one timestep for each sample b, (n,) float32, detached.

    output_fn(params, rows) evaluates the network output for rows (a slice) of this timestep's batch with the
    tensors in params in place of the module's trainable parameters, e.g. torch.func.functional_call(module,
    params, inputs sliced by rows); params maps those names to their current values; output_grad u (n, ...)
    comes from log_prob_output_gradient. Then grad_theta log p_b = J_b^T u_b, J_b = d output_b / d theta.

    num_probes 0: exact, one forward and backward per sample (rows = slice(b, b + 1)); gradients go to
    autograd.grad, never to .grad, and are computed even under no_grad. Measured on ReCam-Tiny at batch 8 (2 CPU
    threads): 4 forwards' time, against 3.3 for a batch forward + backward and 8 (central difference) to 34
    (jvp, math attention) for 4 probes; the exact norms also carry no probe noise.
    num_probes P > 0: for z ~ N(0, I) over the trainable parameters, g_b . z ~ N(0, ||g_b||^2), so
        m_b^2 = mean_k (u_b . J_b z_k)^2
    is an unbiased estimate of ||g_b||^2 with relative standard deviation sqrt(2 / P) (chi-square with P
    degrees of freedom: 0.71 at P = 4, whose square root m_b then has ~35% spread per entry). Cost: P
    Jacobian-vector products of the whole batch (parameter_probe_projections, which also explains step_size).
    generator, on the device the probes are drawn on, makes them reproducible.
    """
    if isinstance(num_probes, bool) or not isinstance(num_probes, int) or num_probes < 0:
        raise ValueError(f"num_probes must be an int >= 0, got {num_probes!r}")
    if num_probes == 0:
        return _exact_gradient_norms(output_fn, params, output_grad)
    probes = [_gaussian_probe(params, generator) for _ in range(num_probes)]
    projections = parameter_probe_projections(output_fn, params, output_grad, probes, step_size)
    return projections.square().mean(dim=0).sqrt()


def gradient_adaptive_weights(
    grad_norms: Tensor, temperature: float = VariantSettings.gradient_weighting_temperature
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-timestep weights w_t = T * softmax_t(log m_t / temperature), mean 1 within each trajectory.

    grad_norms m: (n, T) non-negative, policy_gradient_norms stacked over the trained timesteps. Taking g =
    log m makes the weights m_t^(1/tau) / mean_s m_s^(1/tau): invariant to m's overall scale, proportional to
    m at tau = 1, flatter as tau grows. Normalising within each trajectory keeps every trajectory's total
    weight, so the loss scale is unchanged and no trajectory's advantage is scaled as a whole; weight only
    moves between that trajectory's timesteps. temperature = math.inf is the neutral setting: all weights
    exactly 1. m = 0 is floored to the smallest normal float so an all-zero row gives uniform weights. Returns
    detached weights (n, T) (no gradient flows through them) and metrics gradient_adaptive/avg_gradient_norm
    (mean m) and gradient_adaptive/weight_variance (population variance of all weights).
    """
    if grad_norms.dim() != 2:
        raise ValueError(f"grad_norms must be (n, T), got {tuple(grad_norms.shape)}")
    if not temperature > 0:
        raise ValueError(f"gradient weighting temperature must be > 0, got {temperature!r}")
    m = grad_norms.detach().float()
    if math.isinf(temperature):
        # T * softmax of zeros is T * (1/T) rounded, which is not exactly 1 for every T.
        weights = torch.ones_like(m)
    else:
        floor = torch.finfo(m.dtype).tiny
        logits = torch.log(m.clamp_min(floor)) / temperature
        weights = torch.softmax(logits, dim=1) * m.shape[1]
    metrics = {
        "gradient_adaptive/avg_gradient_norm": m.mean(),
        "gradient_adaptive/weight_variance": _population_var(weights).float(),
    }
    return weights, metrics


# ------------------------------------------------------------------------------------------ 2.3 AMIC / GSPO


def _sequence_log_ratios(
    log_prob: Tensor,
    old_log_prob: Tensor,
    seq_log_prob: Tensor,
    seq_old_log_prob: Tensor,
    timestep_index: int,
    log_ratio_clamp: float,
) -> Tensor:
    """Detached (n, T) clamped log-ratios, column j replaced by this timestep's live values."""
    n = log_prob.shape[0]
    if log_prob.dim() != 1 or old_log_prob.shape != log_prob.shape:
        raise ValueError(
            f"log_prob {tuple(log_prob.shape)} and old_log_prob {tuple(old_log_prob.shape)} must both be (n,)"
        )
    if seq_log_prob.dim() != 2 or seq_log_prob.shape[0] != n or seq_old_log_prob.shape != seq_log_prob.shape:
        raise ValueError(
            f"seq_log_prob {tuple(seq_log_prob.shape)} and seq_old_log_prob {tuple(seq_old_log_prob.shape)} "
            f"must both be ({n}, T)"
        )
    if seq_log_prob.requires_grad or seq_old_log_prob.requires_grad:
        raise ValueError("seq_log_prob / seq_old_log_prob must be detached (the no-grad all-T pass)")
    num_t = seq_log_prob.shape[1]
    if not 0 <= timestep_index < num_t:
        raise ValueError(f"timestep_index must be in [0, {num_t}), got {timestep_index!r}")
    # The live column replaces the no-grad one so the value is consistent with the ratio autograd sees,
    # even if the two passes differ by kernel nondeterminism.
    seq_diff = (seq_log_prob - seq_old_log_prob).clone()
    seq_diff[:, timestep_index] = (log_prob - old_log_prob).detach().to(seq_diff.dtype)
    return seq_diff.clamp(-log_ratio_clamp, log_ratio_clamp)


def amic_token_weight(
    log_prob: Tensor,
    old_log_prob: Tensor,
    seq_log_prob: Tensor,
    seq_old_log_prob: Tensor,
    timestep_index: int,
    log_ratio_clamp: float = 10.0,
) -> tuple[Tensor, Tensor]:
    """AMIC per-token form of the arithmetic-mean sequence weight a = mean_t r_t.

        a_tok = sg[a] + r_j - sg[r_j],   r_t = exp(clamp(logp_t - logp_old_t))

    Value a (the same for every timestep of the trajectory), gradient r_j * grad logp_j. Averaged over
    the T per-timestep losses this is exactly grad a = mean_t r_t grad logp_t, i.e. token-mean GRPO:
    AMIC changes training only because the caller clips a_tok at SEQUENCE level (a outside the band
    zeroes the gradient of all T timesteps of that trajectory, whatever each r_t is).

    log_prob (n,) live (with gradient) at timestep j = timestep_index, old_log_prob (n,), seq_* (n, T)
    detached. Returns (a_tok (n,), a (n,) detached).
    """
    seq_diff = _sequence_log_ratios(log_prob, old_log_prob, seq_log_prob, seq_old_log_prob, timestep_index,
                                    log_ratio_clamp)
    seq_weight = torch.exp(seq_diff).mean(dim=1).to(log_prob.dtype)
    ratio = torch.exp((log_prob - old_log_prob).clamp(-log_ratio_clamp, log_ratio_clamp))
    return seq_weight + (ratio - ratio.detach()), seq_weight


def gspo_token_weight(
    log_prob: Tensor,
    old_log_prob: Tensor,
    seq_log_prob: Tensor,
    seq_old_log_prob: Tensor,
    timestep_index: int,
    log_ratio_clamp: float = 10.0,
) -> tuple[Tensor, Tensor]:
    """GSPO per-token form of the geometric-mean sequence weight s = exp(mean_t log r_t).

        s_tok = exp(sg[log s] + logp_j - sg[logp_j])

    Value s, gradient s * grad logp_j; averaged over the T per-timestep losses this is grad s =
    s * mean_t grad logp_t. Clipped at sequence level by the caller. Shapes as amic_token_weight;
    returns (s_tok (n,), s (n,) detached).
    """
    seq_diff = _sequence_log_ratios(log_prob, old_log_prob, seq_log_prob, seq_old_log_prob, timestep_index,
                                    log_ratio_clamp)
    log_s = seq_diff.mean(dim=1).to(log_prob.dtype)
    return torch.exp(log_s + (log_prob - log_prob.detach())), torch.exp(log_s)


# ------------------------------------------------------------------------------------------------ 2.4 PTRW


def ptrw_trust_weight(ratio: Tensor, sigma: float) -> Tensor:
    """Gaussian trust weight w = exp(-(r - 1)^2 / (2 sigma^2)), same shape as ratio, detached.

    1 at r = 1, exp(-1/2) at |r - 1| = sigma. Used as a gate: loss = -sg[w] * r * A, gradient
    -w * A * r * grad logp, whose sign always follows A. The alternative objective A * r * w peaks at
    r* = (1 + sqrt(1 + 4 sigma^2)) / 2 (~1 + sigma^2), and for A < 0 its gradient RAISES r once
    r > r* because r * w decreases there: with diffusion-scale sigma that is every ratio above ~1, so the
    objective form would reward negative-advantage samples. Hence the gate.
    """
    if not sigma > 0:
        raise ValueError(f"ptrw_sigma must be > 0, got {sigma!r}")
    r = ratio.detach()
    return torch.exp(-((r - 1.0) ** 2) / (2.0 * sigma**2))


# -------------------------------------------------------------------------------------------- 2.5 decay


def temporal_decay_weights(
    num_timesteps: int,
    gamma: float = VariantSettings.temporal_decay_gamma,
    normalize: bool = VariantSettings.temporal_decay_normalize,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Advantage weights w_t = gamma^t over the T trained steps, t = 0 the noisiest; float32 (T,).

    normalize=True rescales to mean 1: w_t = T * gamma^t / sum_s gamma^s. Metrics
    temporal_decay/weight_sum, temporal_decay/first_weight (w_0), temporal_decay/last_weight (w_(T-1)).
    """
    if isinstance(num_timesteps, bool) or not isinstance(num_timesteps, int) or num_timesteps < 1:
        raise ValueError(f"num_timesteps must be a positive int, got {num_timesteps!r}")
    if not gamma > 0:
        raise ValueError(f"temporal_decay_gamma must be > 0, got {gamma!r}")
    weights = torch.pow(torch.tensor(float(gamma), dtype=torch.float64), torch.arange(num_timesteps))
    if normalize:
        weights = weights * (num_timesteps / weights.sum())
    weights = weights.float()
    metrics = {
        "temporal_decay/weight_sum": weights.sum(),
        "temporal_decay/first_weight": weights[0].clone(),
        "temporal_decay/last_weight": weights[-1].clone(),
    }
    return weights, metrics


# --------------------------------------------------------------------------------------------- the loss


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")


def _check_weight(name: str, weight: Tensor, n_shape: torch.Size) -> None:
    if weight.shape != n_shape:
        raise ValueError(f"{name} must have shape {tuple(n_shape)}, got {tuple(weight.shape)}")
    if weight.requires_grad:
        raise ValueError(f"{name} must be detached")


def _exclusive(pairs: dict[tuple[str, str], bool]) -> None:
    for (a, b), both in pairs.items():
        if both:
            raise ValueError(f"{a} and {b} cannot be combined")


def _sign_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of values over mask, 1.0 (the on-policy ratio) when the mask is empty."""
    count = mask.sum()
    total = torch.where(mask, values, torch.zeros_like(values)).sum()
    return torch.where(count > 0, total / count.clamp_min(1), torch.ones_like(total))


def _sign_frac(hit: Tensor, mask: Tensor) -> Tensor:
    return (hit & mask).float().sum() / mask.float().sum().clamp_min(1.0)


class VariantInputs:
    """What "grpo_variants" reads beyond one timestep's tensors, made for the GRPO objective (the `inputs` of its
    registration): a no-grad pass over all the micro-batch's timesteps (sequence log-probs for AMIC / GSPO, EMA-smoothed
    importance weights, gradient-adaptive weights), then each timestep's StepLossInputs fields. Inert (no pass) unless
    one of those variants is switched on."""

    def __init__(self, train_config, scheduler):
        self.t, self.scheduler = train_config, scheduler
        self.ema = EMAImportanceState(train_config.ema_beta) if train_config.use_ema_smoothing else None
        self.across_epochs = bool(getattr(train_config, "ema_across_epochs", False))
        self.needs_pass = (train_config.use_ema_smoothing or train_config.use_gradient_adaptive_weighting
                           or train_config.use_amic or train_config.use_gspo)

    @torch.no_grad()
    def prepare(self, mb: MicroBatch) -> dict:
        out = {"metrics": {}}
        if not self.needs_pass:
            return out
        states, T = mb.states, mb.old_log_probs.shape[1]
        steps = [rescore(mb.policy, states, self.scheduler, j, mb.element_mask, mb.step_offset) for j in range(T)]
        seq = torch.stack([o.log_prob for o in steps], 1)
        out["seq_log_prob"], out["seq_old_log_prob"] = seq, mb.old_log_probs.to(seq.device)
        keys = [tuple(r) for r in mb.traj_ids.tolist()]
        if self.ema is not None:
            # float64: the weights sit within ~1e-3 of 1, where float32 keeps about four digits of their deviation,
            # which the blend and the variances would round further
            raw = importance_weights(seq, out["seq_old_log_prob"], self.t.log_ratio_clamp).double()
            if mb.policy_updates == 0:
                # on-policy (no optimizer step since sampling): the weights are 1 and pass through, leaving no state
                out["ema"], blended = raw, torch.zeros(len(keys), dtype=torch.bool)
            else:
                # from the third pass on every sample has had an off-policy visit in this epoch, so has state
                blended = self.ema.has_history(keys)
                out["ema"] = self.ema.update(keys, raw, expect_state=mb.inner_epoch >= 2)
            out["metrics"].update(self.ema.metrics(raw, out["ema"], blended))
        if self.t.use_gradient_adaptive_weighting:
            norms = torch.stack([self.gradient_norms(mb, j, o) for j, o in enumerate(steps)], 1)
            out["grad"], metrics = gradient_adaptive_weights(norms, self.t.gradient_weighting_temperature)
            out["metrics"].update(metrics)
        return out

    def gradient_norms(self, mb: MicroBatch, j: int, step) -> torch.Tensor:
        """||grad_theta log p|| of each sample's transition j (policy_gradient_norms): the model is evaluated with the
        given parameters by binding them into the policy for the duration of one call."""
        states, sched, module, k = mb.states, self.scheduler, mb.module, mb.step_offset + j
        x, t = states[:, j], sched.model_time(k, states.shape[0])
        u = log_prob_output_gradient(states[:, j + 1], step.mean, step.std, sched.output_coefficient(k),
                                     mb.element_mask)
        params = {k: p.detach() for k, p in module.named_parameters() if p.requires_grad}

        def output_fn(p, rows):
            bound = _Bound(module, mb.policy_rows(rows))
            return torch.func.functional_call(bound, {f"module.{k}": v for k, v in p.items()}, (x[rows], t[rows]))

        gen = torch.Generator().manual_seed(int(mb.traj_ids[0, 0]) * 1009 + j)  # probes only (num_probes > 0)
        return policy_gradient_norms(output_fn, params, u, self.t.gradient_weighting_num_probes, gen)

    def step_tensors(self, prepared: dict, j: int) -> dict:
        """The variant tensors of timestep j (StepLossInputs fields)."""
        kw = {}
        if self.t.use_amic or self.t.use_gspo:
            kw["seq_log_prob"], kw["seq_old_log_prob"] = prepared["seq_log_prob"], prepared["seq_old_log_prob"]
        if "ema" in prepared:
            kw["ema_weight"] = prepared["ema"][:, j]
        if "grad" in prepared:
            kw["grad_weight"] = prepared["grad"][:, j]
        return kw

    def retire_epoch(self) -> None:
        # the EMA state is kept per sample id; without train.ema_across_epochs an epoch's samples are not seen again
        if self.ema is not None and not self.across_epochs:
            self.ema.retire_all()

    def finish_step_metrics(self, m: dict) -> dict:
        """An optimizer step's metrics (averaged over its passes and processes) with the EMA's sums turned into its
        variance metrics (ema_step_metrics)."""
        return ema_step_metrics(m) if self.ema is not None else m

    def side_files(self) -> dict:
        """Checkpoint side files: the EMA state when it outlives the epoch (train.ema_across_epochs)."""
        return {EMA_STATE_FILE: self.ema.state_dict()} if self.ema is not None and self.across_epochs else {}

    def load_side_files(self, folder, info) -> None:
        """Restore the cross-epoch EMA state saved with checkpoint `folder`; a checkpoint without it (written before
        train.ema_across_epochs was on) starts the state empty, and says so."""
        if self.ema is None or not self.across_epochs:
            return
        from recam.infra.checkpoint import CheckpointCorrupt

        path = Path(folder) / EMA_STATE_FILE
        if not path.exists():
            self.ema.retire_all()
            info(f"{folder} holds no {EMA_STATE_FILE}: the EMA of importance weights (train.ema_across_epochs) "
                 "starts empty, so each sample id's next off-policy visit starts its average again")
            return
        try:
            self.ema.load_state_dict(json.loads(path.read_bytes()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointCorrupt(f"{path} is unreadable ({type(e).__name__}: {e})") from e


class _Bound(torch.nn.Module):
    """A denoise closure as a module whose parameters are the policy's, so torch.func.functional_call can swap
    them in for one evaluation."""

    def __init__(self, module: torch.nn.Module, denoise: Callable):
        super().__init__()
        self.module, self.denoise = module, denoise

    def forward(self, x, t):
        return self.denoise(x, t)


@register_policy_loss("grpo_variants", settings=VariantSettings, check=check_variant_settings,
                      inputs=VariantInputs)
def grpo_variants(x: StepLossInputs, s: VariantSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """The registered form: the plan's variants switched by config train.use_* (the EMA and gradient-adaptive
    weights arrive in x, made by VariantInputs for the GRPO objective)."""
    return grpo_variants_policy_loss(
        x.log_prob, x.old_log_prob, x.advantages, s.clip_range, s.adv_clip_max, s.log_ratio_clamp, x.kl, s.beta,
        timestep_index=x.timestep_index, num_timesteps=x.num_timesteps, seq_log_prob=x.seq_log_prob,
        seq_old_log_prob=x.seq_old_log_prob, ema_weight=x.ema_weight, grad_weight=x.grad_weight,
        sample_weight=x.sample_weight, use_amic=s.use_amic, use_gspo=s.use_gspo, use_ptrw=s.use_ptrw,
        ptrw_sigma=s.ptrw_sigma, use_temporal_decay=s.use_temporal_decay, temporal_decay_gamma=s.temporal_decay_gamma,
        temporal_decay_normalize=s.temporal_decay_normalize, use_asymmetric_clipping=s.use_asymmetric_clipping,
        clip_ratio_pos=s.clip_ratio_pos, clip_ratio_neg=s.clip_ratio_neg)


def _check_variant_inputs(log_prob, old_log_prob, advantages, clip_range, adv_clip_max, log_ratio_clamp, kl, beta, *,
                          timestep_index, num_timesteps, seq_log_prob, seq_old_log_prob, ema_weight, grad_weight,
                          use_amic, use_gspo, use_ptrw, ptrw_sigma, use_temporal_decay, use_asymmetric_clipping,
                          clip_ratio_pos, clip_ratio_neg) -> None:
    """grpo_variants_policy_loss's arguments: shapes, ranges, and the variants that exclude each other (its
    docstring says which and why); a ValueError naming the argument."""
    if not (log_prob.shape == old_log_prob.shape == advantages.shape):
        raise ValueError(
            f"log_prob {tuple(log_prob.shape)}, old_log_prob {tuple(old_log_prob.shape)} and advantages "
            f"{tuple(advantages.shape)} must have the same shape"
        )
    _check_positive(clip_range=clip_range, adv_clip_max=adv_clip_max, log_ratio_clamp=log_ratio_clamp)
    if not beta >= 0:
        raise ValueError(f"beta must be >= 0, got {beta!r}")
    if beta > 0 and kl is None:
        raise ValueError("beta > 0 needs a kl tensor")
    _exclusive({
        ("use_amic", "use_gspo"): use_amic and use_gspo,
        ("use_ptrw", "use_asymmetric_clipping"): use_ptrw and use_asymmetric_clipping,
        ("ema_weight", "use_amic"): ema_weight is not None and use_amic,
        ("ema_weight", "use_gspo"): ema_weight is not None and use_gspo,
    })
    if use_ptrw:
        _check_positive(ptrw_sigma=ptrw_sigma)
    if use_asymmetric_clipping:
        _check_positive(clip_ratio_pos=clip_ratio_pos, clip_ratio_neg=clip_ratio_neg)
    if ema_weight is not None:
        _check_weight("ema_weight", ema_weight, log_prob.shape)
    if grad_weight is not None:
        _check_weight("grad_weight", grad_weight, log_prob.shape)
    if (use_amic or use_gspo) and (seq_log_prob is None or seq_old_log_prob is None or timestep_index is None):
        raise ValueError("use_amic / use_gspo need timestep_index, seq_log_prob and seq_old_log_prob")
    if use_temporal_decay and (timestep_index is None or num_timesteps is None):
        raise ValueError("use_temporal_decay needs timestep_index and num_timesteps")
    if use_temporal_decay and not 0 <= timestep_index < num_timesteps:
        raise ValueError(f"timestep_index must be in [0, {num_timesteps}), got {timestep_index!r}")
    if (use_amic or use_gspo) and num_timesteps is not None and seq_log_prob.shape[-1] != num_timesteps:
        raise ValueError(f"seq_log_prob has {seq_log_prob.shape[-1]} timesteps, num_timesteps is {num_timesteps}")


def grpo_variants_policy_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    clip_range: float,
    adv_clip_max: float,
    log_ratio_clamp: float = 10.0,
    kl: Tensor | None = None,
    beta: float = 0.0,
    *,
    timestep_index: int | None = None,
    num_timesteps: int | None = None,
    seq_log_prob: Tensor | None = None,
    seq_old_log_prob: Tensor | None = None,
    ema_weight: Tensor | None = None,
    grad_weight: Tensor | None = None,
    use_amic: bool = False,
    use_gspo: bool = False,
    use_ptrw: bool = False,
    ptrw_sigma: float | None = None,
    use_temporal_decay: bool = False,
    temporal_decay_gamma: float = VariantSettings.temporal_decay_gamma,
    temporal_decay_normalize: bool = VariantSettings.temporal_decay_normalize,
    use_asymmetric_clipping: bool = False,
    clip_ratio_pos: float | None = None,
    clip_ratio_neg: float | None = None,
    sample_weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO loss for timestep j of n trajectories with the plan's variants; all off == grpo_policy_loss.

    Built in three independent stages, for log_prob (n,) live at timestep j, old_log_prob (n,), A (n,)
    clamped to +-adv_clip_max, r = exp(clamp(logp - logp_old, +-log_ratio_clamp)):

    1. Effective ratio rho (value; gradient):
       token (default) rho = r                      (r; r grad logp)
       ema_weight w~   rho = r * sg[w~ / r]         (w~; w~ grad logp)  - 2.1, w~ from EMAImportanceState
       use_amic        rho = sg[a] + r - sg[r]      (a = mean_t r_t; r grad logp)        - 2.3
       use_gspo        rho = exp(sg[log s] + logp - sg[logp])  (s = exp(mean_t log r_t); s grad logp)
       AMIC / GSPO need timestep_index, seq_log_prob and seq_old_log_prob (n, T), detached.
    2. Trust region on rho, per element:
       symmetric       l = max(-A rho, -A clip(rho, 1 - clip_range, 1 + clip_range))
       asymmetric      l = max(-A rho, -A clip(rho, 1 - clip_ratio_neg, 1 + clip_ratio_pos))       - 2.6
                       (A > 0: only 1 + pos binds; A < 0: only 1 - neg binds)
       use_ptrw        l = -A rho sg[w], w = exp(-(rho - 1)^2 / (2 ptrw_sigma^2)), no hard clip      - 2.4
    3. Positive detached per-element weights c (they never change which clip branch is active):
       grad_weight (n,) this timestep's gradient-adaptive weight - 2.2; use_temporal_decay:
       gamma^j (mean-1 normalised if temporal_decay_normalize) with j = timestep_index < num_timesteps - 2.5.
       policy_loss = mean(c * l); loss = policy_loss + beta * mean(kl).

    Metrics: every grpo_policy_loss key (mean_ratio / ratio_min / ratio_max / clip fractions describe rho
    against the bounds in force: clip_range, or 1 + pos / 1 - neg; under PTRW they are diagnostics only;
    approx_kl uses the raw per-timestep log-ratio) plus the enabled variants' keys: amic/ or gspo/
    sequence_weights_variance and avg_sequence_length; ptrw/trust_weights_mean and ptrw/loss_mean (mean
    of -A rho sg[w] before the step-3 weights); temporal_decay/*; asymmetric/pos_advantage_ratio and
    neg_advantage_ratio (mean rho over A > 0 / A < 0, 1.0 if none), asymmetric/clipfrac_pos (A > 0 with
    rho > 1 + pos) and clipfrac_neg (A < 0 with rho < 1 - neg), as fractions of that sign's entries.
    EMA and gradient-adaptive metrics come from EMAImportanceState.metrics and gradient_adaptive_weights.
    Raises ValueError for AMIC with GSPO, PTRW with asymmetric clipping, and ema_weight with AMIC or GSPO
    (w~ smooths one timestep's weight; the sequence forms are built from all T raw weights).
    ptrw_sigma, clip_ratio_pos, clip_ratio_neg left None are PTRW_SIGMA_SCALE, CLIP_RATIO_POS_SCALE and
    CLIP_RATIO_NEG_SCALE times clip_range, as config/base.py defines them.
    """
    ptrw_sigma = PTRW_SIGMA_SCALE * clip_range if ptrw_sigma is None else ptrw_sigma
    clip_ratio_pos = CLIP_RATIO_POS_SCALE * clip_range if clip_ratio_pos is None else clip_ratio_pos
    clip_ratio_neg = CLIP_RATIO_NEG_SCALE * clip_range if clip_ratio_neg is None else clip_ratio_neg
    _check_variant_inputs(
        log_prob, old_log_prob, advantages, clip_range, adv_clip_max, log_ratio_clamp, kl, beta,
        timestep_index=timestep_index, num_timesteps=num_timesteps, seq_log_prob=seq_log_prob,
        seq_old_log_prob=seq_old_log_prob, ema_weight=ema_weight, grad_weight=grad_weight, use_amic=use_amic,
        use_gspo=use_gspo, use_ptrw=use_ptrw, ptrw_sigma=ptrw_sigma, use_temporal_decay=use_temporal_decay,
        use_asymmetric_clipping=use_asymmetric_clipping, clip_ratio_pos=clip_ratio_pos, clip_ratio_neg=clip_ratio_neg)

    diff = log_prob - old_log_prob
    ratio = torch.exp(diff.clamp(-log_ratio_clamp, log_ratio_clamp))
    adv = advantages.clamp(-adv_clip_max, adv_clip_max)
    variant_metrics: dict[str, Tensor] = {}

    rho = ratio
    if ema_weight is not None:
        rho = ratio * (ema_weight.to(ratio.dtype) / ratio).detach()
    elif use_amic or use_gspo:
        token_form = amic_token_weight if use_amic else gspo_token_weight
        rho, seq_weight = token_form(log_prob, old_log_prob, seq_log_prob, seq_old_log_prob, timestep_index,
                                     log_ratio_clamp)
        prefix = "amic" if use_amic else "gspo"
        variant_metrics[f"{prefix}/sequence_weights_variance"] = _population_var(seq_weight).float()
        variant_metrics[f"{prefix}/avg_sequence_length"] = torch.tensor(float(seq_log_prob.shape[-1]))

    low_bound, high_bound = 1.0 - clip_range, 1.0 + clip_range
    if use_asymmetric_clipping:
        low_bound, high_bound = 1.0 - clip_ratio_neg, 1.0 + clip_ratio_pos
    if use_ptrw:
        trust = ptrw_trust_weight(rho, ptrw_sigma)
        per_element = -adv * rho * trust
        variant_metrics["ptrw/trust_weights_mean"] = trust.mean()
        variant_metrics["ptrw/loss_mean"] = per_element.detach().mean()
    else:
        unclipped = -adv * rho
        clipped = -adv * rho.clamp(low_bound, high_bound)
        per_element = torch.maximum(unclipped, clipped)

    if grad_weight is not None:
        per_element = per_element * grad_weight.to(per_element.dtype)
    if use_temporal_decay:
        decay, decay_metrics = temporal_decay_weights(num_timesteps, temporal_decay_gamma, temporal_decay_normalize)
        per_element = per_element * decay[timestep_index].to(per_element.device, per_element.dtype)
        variant_metrics.update(decay_metrics)

    # with sample_weight the means become the trainer's weighted sums (recam.engine.losses.weighted_terms)
    policy_loss, policy_metric = weighted_terms(per_element, sample_weight)
    kl_penalty, kl_metric = weighted_terms(kl, sample_weight) if kl is not None else (
        torch.zeros_like(policy_loss), torch.zeros_like(policy_metric))
    loss = policy_loss + beta * kl_penalty if beta > 0 else policy_loss
    with torch.no_grad():
        rho_d = rho.detach()
        above = rho_d > high_bound
        below = rho_d < low_bound
        high = above.float().mean()
        low = below.float().mean()
        if use_asymmetric_clipping:
            pos, neg = adv > 0, adv < 0
            variant_metrics["asymmetric/pos_advantage_ratio"] = _sign_mean(rho_d, pos)
            variant_metrics["asymmetric/neg_advantage_ratio"] = _sign_mean(rho_d, neg)
            variant_metrics["asymmetric/clipfrac_pos"] = _sign_frac(above, pos)
            variant_metrics["asymmetric/clipfrac_neg"] = _sign_frac(below, neg)
        metrics = {
            "loss": policy_metric + beta * kl_metric if beta > 0 else policy_metric,
            "policy_loss": policy_metric,
            "kl_penalty": kl_metric,
            "mean_ratio": rho_d.mean(),
            "ratio_min": rho_d.min(),
            "ratio_max": rho_d.max(),
            "clipfrac_high": high,
            "clipfrac_low": low,
            "clipfrac": high + low,
            "approx_kl": 0.5 * (diff**2).mean(),
            "mean_log_prob_current": log_prob.mean(),
            "mean_log_prob_old": old_log_prob.mean(),
            "mean_advantage": adv.mean(),
        }
        metrics.update(variant_metrics)
    return loss, metrics
