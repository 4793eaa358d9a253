"""Health rules over GRPO training metrics: catch a blown-up run the step it blows up; and the gradient cosine
between consecutive steps, a step's measure of how much of an update is noise.

`diagnose_step(metrics, history)` is pure Python over the dict of one optimizer step (plus, optionally, epoch
fields merged in such as zero_std_ratio) and the dicts of the steps before it; it is cheap enough to call
every step. A trainer can act on the result:

    findings = diagnose_step(m, recent)            # recent: the last ~200 step dicts, oldest first
    if any(f.severity == "critical" for f in findings):
        ...stop, or roll back to the last healthy checkpoint...
    recent.append(m)

What only an epoch or a whole run knows (the reward spread, exclusions, the update's noise) and the report of a
run's findings are recam.engine.diagnosis's, which replays a metrics.jsonl through these rules too.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import torch

from recam.engine.records import reward_terms
from recam.infra.schema import REWARD_BOOKKEEPING

SEVERITIES = ("info", "warn", "critical")
_RANK = {s: i for i, s in enumerate(SEVERITIES)}


@dataclass
class Finding:
    rule: str
    severity: str
    numbers: dict = field(default_factory=dict)
    explanation: str = ""
    actions: list[str] = field(default_factory=list)

    def __post_init__(self):
        if self.severity not in _RANK:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")


@dataclass(frozen=True)
class CriticThresholds:
    """Where the learned critic's rules fire (critic_findings). Its accuracy alone cannot tell a saturated critic from
    one that orders every pair by a hair, so saturation is read from the mean margin in temperatures, z = mean(s_teacher
    - s_student) / T, the argument of the pairwise sigmoid: at z the average pair's gradient is sigmoid(-z), against
    1/2 at z = 0."""

    saturation_margin: float = 3.0  # z at which the average pair's gradient is under 10% of its value at z = 0
    saturation_min_acc: float = 0.75  # below this, a large mean margin is a few pairs' large scores, not separation
    target_margin: float = 1.0  # the advice aims the temperature at this mean margin: the sigmoid's useful range
    overconfident: float = 0.9  # d_acc above which a critic whose margin is not logged cannot be judged
    learns_nothing: float = 0.6  # d_acc below which, after warm-up, its reward is noise
    score_reg_info: float = 1.0  # score regulariser above this: scores drift past the threshold


@dataclass(frozen=True)
class Thresholds:
    """Where each rule fires; defaults suit diffusion GRPO, whose ratios sit within ~1e-3 of 1."""

    ratio_critical_low: float = 0.5
    ratio_critical_high: float = 2.0
    ratio_warn_low: float = 0.8
    ratio_warn_high: float = 1.25
    ratio_max_warn: float = 10.0
    ratio_max_critical: float = 100.0
    ref_drift_warn: float = 1.0  # nats per element between current and reference log-density
    ref_drift_critical: float = 10.0
    # a per-element log-density is of order 1 to 10 (a Gaussian step's, in nats); a logged mean log-prob beyond this
    # is a sum over elements, the first cause of an exploded ratio (ratio_explosion_advice)
    per_element_log_prob_max: float = 1e3
    loss_critical: float = 100.0
    loss_median_factor: float = 20.0
    loss_floor: float = 1.0  # losses below this never count as blown up relative to the median
    min_history: int = 5
    median_window: int = 200
    kl_window: int = 10
    kl_growth_factor: float = 10.0
    kl_floor: float = 1e-2  # a KL below this may grow freely (it starts at exactly 0)
    kl_critical: float = 1.0
    clipfrac_warn: float = 0.5
    clipfrac_critical: float = 0.9
    zero_std_warn: float = 0.5
    reward_drop: float = 0.5  # fraction of the earlier best the mean reward may lose
    reward_term_drop: float = 0.75  # the same for one reward term, whose epoch mean is noisier (seen: -51% by chance)
    reward_term_noise: float = 3.0  # ... and by more than this many standard errors of the two epoch means
    reward_std_floor: float = 1e-8
    first_ratio_warn: float = 1e-2
    first_ratio_critical: float = 0.5
    update_noise_cosine: float = 0.1  # consecutive steps' gradients agreeing below this (95% upper bound): noise
    update_noise_min_steps: int = 10
    # an update this small a fraction of the gradient noise scale (or smaller) is mostly noise: said with the number
    noise_scale_fraction: float = 0.1
    critic: CriticThresholds = CriticThresholds()  # the learned critic's rules (critic_findings)


DEFAULT = Thresholds()


def _num(metrics: dict, *keys: str) -> float | None:
    for k in keys:
        v = metrics.get(k)
        if isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            return float(v)
        if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:  # numpy / torch scalars from a live trainer
            try:
                return float(v.item())
            except (TypeError, ValueError):
                continue
    return None


def _ok(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def _rollback(run_dir: str) -> str:
    return (f"roll back: resume from the last healthy checkpoint under `{run_dir}/checkpoints/` "
            f"(`{run_dir}/checkpoints/latest` if it predates the blow-up), with the fix above")


def _where(metrics: dict) -> dict:
    return {k: metrics[k] for k in ("step", "epoch") if k in metrics}


# ----------------------------------------------------------------------------------------------------------
# step rules: each takes (metrics, history, thresholds, run_dir) and returns findings


def rule_non_finite(m: dict, history, th: Thresholds, run_dir: str) -> list[Finding]:
    bad = sorted(k for k in m if (x := _num(m, k)) is not None and not math.isfinite(x))
    if not bad:
        return []
    return [Finding("non_finite", "critical", {**_where(m), "keys": bad},
                    f"{', '.join(bad)} {'is' if len(bad) == 1 else 'are'} NaN or Inf: an update overflowed, and the "
                    "weights it touched carry the damage into every later step.",
                    [_rollback(run_dir), "lower `train.learning_rate`",
                     "keep `train.log_ratio_clamp` finite (5-10) and `train.max_grad_norm` at ~1: safeguards against "
                     "overflow, not fixes; if the clamp binds, ratio_explosion names the causes",
                     "if `mixed_precision` is fp16, try bf16 or 'no'"])]


def rule_ratio(m: dict, history, th: Thresholds, run_dir: str) -> list[Finding]:
    mean, rmax, rmin = _num(m, "mean_ratio"), _num(m, "ratio_max"), _num(m, "ratio_min")
    nums = {**_where(m), "mean_ratio": mean, "ratio_max": rmax, "ratio_min": rmin}
    severity = None
    if _ok(mean) and not th.ratio_critical_low <= mean <= th.ratio_critical_high:
        severity = "critical"
    elif _ok(rmax) and rmax > th.ratio_max_critical:
        severity = "critical"
    elif (_ok(mean) and not th.ratio_warn_low <= mean <= th.ratio_warn_high) or (
            _ok(rmax) and rmax > th.ratio_max_warn):
        severity = "warn"
    if severity is None:
        return []
    if _ok(mean) and not th.ratio_warn_low <= mean <= th.ratio_warn_high:
        peak = f" (max {rmax:.4g})" if _ok(rmax) else ""
        if mean > math.e:
            peak += f", so some samples' log-ratio is at least {math.log(mean):.1f} nats"
        why = (f"The importance ratio pi_new/pi_old averages {mean:.4g}{peak}; it should stay within a few clip "
               "ranges of 1. The policy moved far from the one that drew the samples, or training recomputes "
               "log-probs differently from sampling, so the clipped objective no longer bounds the update.")
    else:
        why = (f"The largest importance ratio is {rmax:.4g}: some sample's log-density moved by "
               f"{math.log(rmax):.2f} nats per element since it was drawn.")
    causes, actions, measured = ratio_explosion_advice(m, th)
    return [Finding("ratio_explosion", severity, {**nums, **measured}, why + causes, [*actions, _rollback(run_dir)])]


def learning_rate_tier(log_ratio: float, th: Thresholds) -> tuple[int, float]:
    """(tier, factor to divide train.learning_rate by) for a worst log-ratio of |log_ratio| nats: within
    log(ratio_critical_high) (a ratio in [0.5, 2]) 2x; within log(ratio_max_critical) 10x; beyond, 100x, and only
    once the causes before it are ruled out (no step size at a per-element mean moves a log-density that far)."""
    size = abs(log_ratio)
    if size <= math.log(th.ratio_critical_high):
        return 1, 2.0
    if size <= math.log(th.ratio_max_critical):
        return 2, 10.0
    return 3, 100.0


def kl_tier(gap: float, th: Thresholds) -> int:
    """0: the policy is within ref_drift_warn nats per element of the reference, the KL holds it; 1: within
    ref_drift_critical, a stronger KL (train.beta 10x) can pull it back; 2: beyond, no KL weight pulls that back
    within a run, and the run restarts from where the gap was small."""
    if gap <= th.ref_drift_warn:
        return 0
    return 1 if gap <= th.ref_drift_critical else 2


def worst_log_ratio(m: dict) -> float | None:
    """The largest |log r| among the step's mean, max and min importance ratios (those that are finite and > 0)."""
    logs = [abs(math.log(r)) for r in (_num(m, "mean_ratio"), _num(m, "ratio_max"), _num(m, "ratio_min"))
            if _ok(r) and r > 0]
    return max(logs) if logs else None


def ratio_explosion_advice(m: dict, th: Thresholds) -> tuple[str, list[str], dict]:
    """(the causes in the order to rule them out, with what the metrics measure of each; the tiered remedies; their
    numbers) for an exploded importance ratio. The causes: log-probs summed over elements (a ratio of e^20 is 20
    nats summed, 4e-4 per element over 51,548 motion elements: an ordinary step), a reference that trains, LoRA bound
    to nothing (the base trains, and with it the reference, the same network with the adapter off), and only then the
    learning rate. A clamp on the log-ratio bounds exp() and so the loss, which hides the cause without fixing it."""
    log_ratio = worst_log_ratio(m)
    cur, ref = _num(m, "mean_log_prob_current"), _num(m, "mean_log_prob_ref")
    gap = abs(cur - ref) if _ok(cur) and _ok(ref) else None
    # the larger logged mean log-prob, which a sum over elements would give away
    key, big = max(((k, x) for k, x in (("mean_log_prob_current", cur), ("mean_log_prob_ref", ref)) if _ok(x)),
                   key=lambda kx: abs(kx[1]), default=(None, None))
    loss, mean = _num(m, "loss", "policy_loss"), _num(m, "mean_ratio")
    nums = {"worst_log_ratio": log_ratio, "log_prob_gap": gap}
    summed = big is not None and abs(big) > th.per_element_log_prob_max
    causes = ["(1) log-probs summed over elements instead of averaged: a log-ratio of L nats summed over D elements "
              "is L / D per element, an ordinary step for D in the thousands (`motion.log_prob_reduction` \"mean\"; "
              "a custom domain's log_prob must average too)"
              + (f"; measured here: {key} {big:.4g} is no per-element log-density (those are of order 1 to 10), it "
                 "is a sum" if summed else ""),
              "(2) a reference that trains: its weights in an optimizer group, or shared with the policy, so the KL "
              "pulls toward a moving target and holds nothing",
              "(3) LoRA bound to nothing: adapter targets that match no module leave the base network training (recam "
              "refuses them; other code may not), and with it the reference, the same network with the adapter off",
              "(4) the learning rate"]
    clamp = _num(m, "log_ratio_clamp")
    why = (" Causes, most likely first: " + "; ".join(causes) + ". A clamp on the log-ratio (`train.log_ratio_clamp`"
           + (f", {clamp:g}" if _ok(clamp) else "") + ") caps exp(log-ratio) and so the loss: it hides the cause, "
           "since the ratios it cuts are still wrong and the weights still move, and fixes none of them.")
    actions = ["check that log-probs are per-element means over the sampled elements (`motion.log_prob_reduction` "
               "\"mean\"), not sums" + (f": {key} {big:.4g} is a sum" if summed else ""),
               "check the reference is frozen and only LoRA trains: no reference parameter takes a gradient or sits "
               "in an optimizer group, and with `model.lora_rank` > 0 the trainable parameters are the adapter's "
               "alone (`model.lora_targets` must match modules)"]
    if log_ratio is not None:
        tier, factor = learning_rate_tier(log_ratio, th)
        lr = _num(m, "learning_rate")
        to = f" ({lr:.3g} -> {lr / factor:.3g})" if _ok(lr) else ""
        nums |= {"learning_rate_tier": tier, "learning_rate_divisor": factor}
        after = (f"; at {log_ratio:.1f} nats only after (1)-(3) are ruled out: no step size moves a per-element "
                 "log-density that far in one epoch" if tier == 3 else "")
        actions.append(f"learning-rate tier {tier} of 3 (worst |log-ratio| {log_ratio:.3g} nats): lower "
                       f"`train.learning_rate` {factor:g}x{to}{after}")
    if gap is not None:
        tier = kl_tier(gap, th)
        nums["kl_tier"] = tier
        if tier == 1:
            actions.append(f"KL tier 1 of 2 (policy {gap:.3g} nats per element from the reference): raise `train.beta` "
                           "10x")
        elif tier == 2:
            actions.append(f"KL tier 2 of 2 (policy {gap:.3g} nats per element from the reference, past "
                           f"{th.ref_drift_critical:g}): no KL weight pulls that back within a run; after (1)-(3), "
                           "resume from a checkpoint where the gap was under "
                           f"{th.ref_drift_warn:g} nat with `train.beta` 10x")
    if _ok(loss) and _ok(mean) and mean > th.ratio_max_warn:
        nums["loss_over_ratio"] = abs(loss) / mean
        if _num(m, "zero_std_ratio") == 1.0:
            why += (f" The loss {loss:.3g} is not this ratio's: every advantage is 0 (zero_std_ratio 1), so the "
                    "clipped objective is 0 whatever the ratio, and the loss comes from elsewhere "
                    "(no_advantage_signal).")
        else:
            why += (f" The loss {loss:.3g} is this ratio's: |loss| / mean_ratio = {abs(loss) / mean:.3g}, an "
                    "advantage-sized factor, so bounding the advantages or the loss would hide the ratio as the clamp "
                    "does.")
    actions.append("check that sampling and training compute log-probs the same way (same `sample.noise_level`, "
                   "`sample.sde_type`, precision, no dropout): the first step of each epoch must have ratio 1")
    return why, actions, nums


def rule_reference_drift(m: dict, history, th: Thresholds, run_dir: str) -> list[Finding]:
    cur, ref = _num(m, "mean_log_prob_current"), _num(m, "mean_log_prob_ref")
    if not (_ok(cur) and _ok(ref)):
        return []
    drift = abs(cur - ref)
    if drift <= th.ref_drift_warn:
        return []
    severity = "critical" if drift > th.ref_drift_critical else "warn"
    return [Finding("reference_drift", severity,
                    {**_where(m), "drift_per_element": drift, "mean_log_prob_current": cur, "mean_log_prob_ref": ref},
                    f"Per element, the policy's log-density of the sampled transitions is {drift:.4g} nats away from "
                    f"the frozen reference's (current {cur:.4g}, reference {ref:.4g}); a healthy run stays within a "
                    "fraction of a nat. The policy has drifted away from the base model the KL term should hold "
                    "it to.",
                    ["raise `train.beta` (stronger KL pull toward the reference)",
                     "lower `train.learning_rate`", _rollback(run_dir)])]


def _median_abs_loss(history, key: str, th: Thresholds) -> float | None:
    vals = [abs(x) for h in list(history)[-th.median_window:] if _ok(x := _num(h, key))]
    return statistics.median(vals) if len(vals) >= th.min_history else None


def rule_loss(m: dict, history, th: Thresholds, run_dir: str) -> list[Finding]:
    out = []
    for key in ("loss", "policy_loss"):
        x = _num(m, key)
        if not _ok(x):
            continue
        med = _median_abs_loss(history, key, th)
        if abs(x) > th.loss_critical:
            severity, why = "critical", f"|{key}| = {abs(x):.4g} exceeds {th.loss_critical:g}"
        elif med is not None and abs(x) > th.loss_floor and abs(x) > th.loss_median_factor * med:
            severity = "warn"
            why = f"|{key}| = {abs(x):.4g} is {abs(x) / max(med, 1e-30):.3g}x its running median {med:.3g}"
        else:
            continue
        out.append(Finding("loss_blowup", severity, {**_where(m), key: x, "running_median_abs": med},
                           f"{why}. A GRPO loss is a mean of advantage x ratio terms of order 1 plus beta x KL; a "
                           "value this size means the ratio or the KL term has exploded.",
                           ["lower `train.learning_rate`",
                            "find what made it this large (ratio_explosion names the causes of a ratio that did): "
                            "bounding it with `train.adv_clip_max` or `train.log_ratio_clamp` keeps it finite and "
                            "hides that cause",
                            "if kl_penalty dominates, the policy drifted: raise `train.beta` earlier in the run, "
                            "not now", _rollback(run_dir)]))
        break  # loss and policy_loss blow up together; one finding says it
    return out


def rule_advantage_signal(m: dict, history, th: Thresholds, run_dir: str) -> list[Finding]:
    zero_std = _num(m, "zero_std_ratio")
    mean_adv = _num(m, "mean_advantage")
    nums = {**_where(m), "zero_std_ratio": zero_std, "mean_advantage": mean_adv}
    actions = ["check `sample.noise_level` > 0 and that each of the k copies of a condition gets its own noise "
               "(identical copies score identically)",
               "check `reward.weights`: the weighted reward must differ between samples of one condition (a reward "
               "that depends only on the condition has zero std in every group)",
               "raise `sample.k` so a group is more likely to contain different rewards"]
    if _ok(zero_std) and zero_std >= 1.0:
        why = (f"Every group's rewards are all equal (zero_std_ratio {zero_std:g}), so every advantage is exactly 0 "
               f"(mean_advantage {mean_adv}) and the policy gradient is zero: whatever changes the weights is not "
               "the reward. The k samples of a condition are identical, or the reward does not depend on the "
               "generated sample.")
        policy_loss = _num(m, "policy_loss")
        if _ok(policy_loss) and abs(policy_loss) > 1e-6:
            nums["policy_loss"] = policy_loss
            why += (f" Yet policy_loss is {policy_loss:.4g}, which the clipped objective cannot be with all-zero "
                    "advantages: the loss is not computed from the logged advantages, or another term dominates it.")
        return [Finding("no_advantage_signal", "critical", nums, why, actions)]
    if _ok(zero_std) and zero_std >= th.zero_std_warn:
        return [Finding("weak_advantage_signal", "warn", nums,
                        f"{zero_std:.0%} of the groups have all-equal rewards and contribute no gradient.", actions)]
    if mean_adv == 0.0 and zero_std is None:
        return [Finding("no_advantage_signal", "info", nums,
                        "mean_advantage is exactly 0 in this step; if zero_std_ratio (epoch record) is 1, no group "
                        "carries a learning signal.", actions)]
    return []


def rule_kl(m: dict, history, th: Thresholds, run_dir: str) -> list[Finding]:
    kl = _num(m, "kl_penalty")
    if not _ok(kl):
        return []
    actions = ["raise `train.beta`", "lower `train.learning_rate`", _rollback(run_dir)]
    if kl > th.kl_critical:
        return [Finding("kl_growth", "critical", {**_where(m), "kl_penalty": kl},
                        f"kl_penalty is {kl:.4g} per element (healthy runs stay far below {th.kl_floor:g}): the "
                        "policy has left the reference model behind.", actions)]
    window = [x for h in list(history)[-th.kl_window:] if _ok(x := _num(h, "kl_penalty"))]
    if kl <= th.kl_floor or not window:
        return []
    low = max(min(window), 0.0)
    if kl > th.kl_growth_factor * max(low, th.kl_floor / th.kl_growth_factor):
        return [Finding("kl_growth", "warn", {**_where(m), "kl_penalty": kl, "window_min": low,
                                             "window_steps": len(window)},
                        f"kl_penalty rose from {low:.3g} to {kl:.3g} within {len(window)} steps: the policy is "
                        "running away from the reference.", actions)]
    return []


def clip_settings_read(m: dict) -> tuple[str, list[str]]:
    """Which trust region a step's metrics come from, and the config fields that set its width, from the keys its
    loss logs: ("ptrw", [train.ptrw_sigma]) for PTRW's Gaussian gate (no hard clip: its clipfrac is measured against
    train.clip_range for comparison only), ("asymmetric", [train.clip_ratio_pos, train.clip_ratio_neg]) for
    asymmetric clipping, ("awm", [train.awm_clip_range]) for AWM's matching-loss ratio, else ("symmetric",
    [train.clip_range]). Advice names these fields: widening one the active loss does not read changes nothing."""
    if _num(m, "ptrw/trust_weights_mean") is not None:
        return "ptrw", ["train.ptrw_sigma"]
    if _num(m, "asymmetric/clipfrac_pos") is not None or _num(m, "asymmetric/clipfrac_neg") is not None:
        return "asymmetric", ["train.clip_ratio_pos", "train.clip_ratio_neg"]
    if _num(m, "fm_loss") is not None:
        return "awm", ["train.awm_clip_range"]
    return "symmetric", ["train.clip_range"]


def rule_clipfrac(m: dict, history, th: Thresholds, run_dir: str) -> list[Finding]:
    kind, fields = clip_settings_read(m)
    fewer_steps = "fewer optimizer steps per epoch: `train.num_inner_epochs` 1, a larger `train.batch_size`"
    if kind == "ptrw":
        # the gate's mean is the share of the gradient it lets through, the counterpart of 1 - clipfrac
        trust = _num(m, "ptrw/trust_weights_mean")
        if not _ok(trust) or trust >= 1.0 - th.clipfrac_warn:
            return []
        severity = "critical" if trust < 1.0 - th.clipfrac_critical else "warn"
        return [Finding("clip_saturation", severity, {**_where(m), "ptrw/trust_weights_mean": trust},
                        f"PTRW's trust gate passes {trust:.0%} of the gradient on average: the ratios have moved so "
                        "many gate widths from 1 within the epoch that most samples barely train. PTRW has no hard "
                        "clip, so `train.clip_range` does not bound it.",
                        ["lower `train.learning_rate`",
                         "widen `train.ptrw_sigma` (by default a multiple of `train.clip_range`) if it is below the "
                         "ratio noise of your sampler", fewer_steps])]
    cf = _num(m, "clipfrac")
    if not _ok(cf) or cf <= th.clipfrac_warn:
        return []
    severity = "critical" if cf > th.clipfrac_critical else "warn"
    numbers = {**_where(m), "clipfrac": cf}
    why = (f"{cf:.0%} of the ratios are clipped: the policy has gone so far off-policy within the epoch that most "
           "samples give no gradient.")
    if kind == "asymmetric":
        sides = {"train.clip_ratio_pos": _num(m, "asymmetric/clipfrac_pos"),
                 "train.clip_ratio_neg": _num(m, "asymmetric/clipfrac_neg")}
        numbers.update({f"asymmetric/clipfrac_{f[-3:]}": v for f, v in sides.items() if _ok(v)})
        # the side whose own samples are mostly clipped, else both
        named = [f for f, v in sides.items() if _ok(v) and v > th.clipfrac_warn] or list(sides)
        widen = " and ".join(f"`{f}`" for f in named) + " (by default multiples of `train.clip_range`)"
        per_side = ", ".join(f"{v:.0%} of the {'positive' if f.endswith('pos') else 'negative'}-advantage ones"
                             for f, v in sides.items() if _ok(v))
        why = (f"{cf:.0%} of the ratios are outside [1 - `train.clip_ratio_neg`, 1 + `train.clip_ratio_pos`], the "
               f"asymmetric clip's bounds" + (f"; clipped, so without gradient: {per_side}" if per_side else "")
               + ". The policy has gone far off-policy within the epoch. Asymmetric clipping does not read "
               "`train.clip_range`.")
        below = "they are" if len(named) > 1 else "it is"
        widen_action = f"widen {widen} if {below} below the ratio noise of your sampler"
    else:
        widen_action = f"widen `{fields[0]}` if it is below the ratio noise of your sampler"
    return [Finding("clip_saturation", severity, numbers, why,
                    ["lower `train.learning_rate`", widen_action, fewer_steps])]


def _reward_of(m: dict) -> float | None:
    return _num(m, "mean_reward", "reward_avg", "reward_mean")


def rule_reward(m: dict, history, th: Thresholds, run_dir: str) -> list[Finding]:
    actions = [_rollback(run_dir), "lower `train.learning_rate`; raise `train.beta`",
               "check `reward.weights`: one term may be hacked at the expense of the others"]
    out = []
    std = _num(m, "std_reward", "reward_std")
    if _ok(std) and std <= th.reward_std_floor:
        out.append(Finding("reward_collapse", "critical", {**_where(m), "std_reward": std},
                           f"The reward std over all samples is {std:.3g}: every sample scores the same, so the "
                           "generator has collapsed to one output or the reward saturated.", actions))
    cur = _reward_of(m)
    # under reward.constraint the mean reward's weights move every epoch (a Lagrange multiplier), so it is only
    # compared with epochs weighted alike; each term is still judged on its own (rule_reward_term)
    weight = m.get("constraint_weight")
    earlier = [x for h in history if _ok(x := _reward_of(h)) and h.get("constraint_weight") == weight]
    if _ok(cur) and earlier:
        best = max(earlier)
        if best - cur > th.reward_drop * abs(best) and best != 0:
            out.append(Finding("reward_collapse", "critical",
                               {**_where(m), "mean_reward": cur, "best_mean_reward": best,
                                "drop": (best - cur) / abs(best)},
                               f"The mean reward fell to {cur:.4g} from its best {best:.4g} "
                               f"({(best - cur) / abs(best):.0%} lower): training is destroying what it learned.",
                               actions))
    return out[:1]


# Rules that judge an epoch's samples, i.e. the weights that drew them. Those weights are already in the latest
# checkpoint (the update that broke them was the previous epoch's), so a rollback must go one checkpoint further.
SAMPLE_RULES = frozenset({"reward_collapse", "reward_term_collapse"})



def term_standard_errors(record: dict) -> dict[str, float]:
    """reward_<name> -> the standard error of that term's epoch mean, from the record's per-sample rewards
    (rewards/<name>, excluded samples and failed rewards (NaN) left out)."""
    excluded = record.get("excluded")
    out = {}
    for key, values in record.items():
        if not key.startswith("rewards/") or key == "rewards/avg" or not isinstance(values, list):
            continue
        x = [float(v) for i, v in enumerate(values) if isinstance(v, (int, float)) and math.isfinite(v)
             and not (excluded and i < len(excluded) and excluded[i])]
        if len(x) >= 2:
            mean = sum(x) / len(x)
            out[f"reward_{key[len('rewards/'):]}"] = math.sqrt(sum((v - mean) ** 2 for v in x) / (len(x) - 1) / len(x))
    return out


def rule_reward_term(m: dict, history, th: Thresholds, run_dir: str) -> list[Finding]:
    """One reward term (reward_<key>) falling far below its best while the weighted average may still hold:
    the policy is buying the other terms with it. Terms that were ever negative are skipped: a zero-centred
    score (a learned critic's) has no meaningful relative drop. When the epochs carry their terms' standard errors
    (m["term_sem"], term_standard_errors), the drop must also exceed th.reward_term_noise of them: a term near its
    floor (a tiny base's cam_score, 0.03 over 8 samples) can lose most of itself by chance."""
    for k in m:
        if not k.startswith("reward_") or k == "reward_avg" or k in REWARD_BOOKKEEPING or not _ok(cur := _num(m, k)):
            continue
        earlier = [x for h in history if _ok(x := _num(h, k))]
        if not earlier or min(earlier + [cur]) < 0:
            continue
        best = max(earlier)
        sem_best = next((_sem(h, k) for h in history if _num(h, k) == best), None)
        sem_cur = _sem(m, k)
        noise = (th.reward_term_noise * math.hypot(sem_best, sem_cur)
                 if sem_best is not None and sem_cur is not None else 0.0)
        if best > 0 and best - cur > th.reward_term_drop * best and best - cur > noise:
            return [Finding("reward_term_collapse", "critical",
                            {**_where(m), "term": k, k: cur, f"best_{k}": best, "drop": (best - cur) / best},
                            f"The reward term {k} fell to {cur:.4g} from its best {best:.4g} "
                            f"({(best - cur) / best:.0%} lower): the policy is trading it away for the other terms.",
                            [_rollback(run_dir), "lower `train.learning_rate`; raise `train.beta`",
                             f"raise `reward.weights.{k[len('reward_'):]}` relative to the other weights"])]
    return []


def _sem(metrics: dict, key: str) -> float | None:
    sems = metrics.get("term_sem")
    value = sems.get(key) if isinstance(sems, dict) else None
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def rule_first_step_ratio(m: dict, history, th: Thresholds, run_dir: str) -> list[Finding]:
    dev = _num(m, "first_step_ratio_deviation")
    if not _ok(dev) or dev <= th.first_ratio_warn:
        return []
    severity = "critical" if dev > th.first_ratio_critical else "warn"
    return [Finding("off_policy_first_step", severity, {**_where(m), "first_step_ratio_deviation": dev},
                    f"On the first optimizer step of an epoch the policy is the one that sampled, so the ratio must "
                    f"be 1; it is off by {dev:.3g}. Sampling and training disagree on the log-probs of the same "
                    "transitions.",
                    ["use the same `sample.noise_level` and `sample.sde_type` (and sigma schedule) in rollout and "
                     "training", "compute log-probs in float32 whatever `mixed_precision` is",
                     "make sure dropout is off in the policy during training (model in eval-equivalent mode)"])]


# ----------------------------------------------------------------------------------------------------------
# the learned critic (rewards/discriminator.py): its metrics arrive unprefixed here (d_acc, score_diff, temperature,
# ranking_loss, margin, ...), from the critic's hook live or from an epoch record's discriminator/* fields offline

_CRITIC = "reward.discriminator"


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


def critic_margin(metrics: dict) -> tuple[float | None, str]:
    """The critic's mean margin in temperatures, z = mean(d) / T over the differences d that enter its ranking term,
    and where it came from: the logged `margin` (exact, normalised scores included), else score_diff / temperature
    (the raw scores'), else (None, why)."""
    margin = _num(metrics, "margin")
    if _ok(margin):
        return margin, "margin"
    diff, temperature = _num(metrics, "score_diff"), _num(metrics, "temperature")
    if _ok(diff) and _ok(temperature) and temperature > 0:
        return diff / temperature, "score_diff / temperature"
    return None, "neither margin nor score_diff with temperature logged"


def margin_at_least(ranking_loss: float) -> float:
    """The mean margin a ranking loss proves: softplus(-z) is convex, so mean_i softplus(-z_i) >= softplus(-mean z),
    and mean z >= -log(e^loss - 1). At or above log 2 it proves nothing (returns 0 or less)."""
    if ranking_loss <= 0:
        return math.inf
    return -math.log(math.expm1(ranking_loss))


def gradient_share_at_least(ranking_loss: float, d_acc: float) -> float | None:
    """The mean pair gradient, as a share of its value at margin 0, that a ranking loss proves when the critic wins
    every pair (d_acc 1); None otherwise. A won pair's gradient g = sigmoid(-z) lies in (0, 1/2], and its loss
    -log(1 - g) is convex in g, so it lies below the chord 2 log 2 g: ranking_loss <= 2 log 2 mean(g), and the mean
    share 2 mean(g) >= ranking_loss / log 2. A lost pair breaks the chord (its loss grows without bound)."""
    if d_acc < 1.0 or not math.isfinite(ranking_loss):
        return None
    return min(1.0, ranking_loss / math.log(2))


def _critic_saturated(m: dict, acc, margin, how, rank, th: CriticThresholds) -> Finding:
    temperature = _num(m, "temperature")
    share = 2 * _sigmoid(-margin)  # the average pair's gradient against a pair at margin 0
    nums = {"d_acc": acc, "score_diff": _num(m, "score_diff"), "temperature": temperature, "margin": margin,
            "ranking_loss": rank, "pair_gradient_share": share}
    shown = ", ".join(f"{k} {v:.4g}" for k, v in (("d_acc", acc), ("score_diff", nums["score_diff"]),
                                                   ("temperature", temperature)) if _ok(v))
    bound = how.startswith("at least")  # a margin the ranking loss proves: the gradient is at most this
    why = (f"The critic separates teacher from student ({shown}) by a mean margin of {margin:.3g} temperatures "
           f"({how}): the pairwise sigmoid has saturated, and the average pair's gradient is {'at most ' * bound}"
           f"{share:.1%} of its value at margin 0. The critic stops learning from the pairs it already wins, its "
           "scores grow in magnitude with only the regulariser to hold them, and its reward ranks the policy's "
           "samples by whatever feature separated the sets, which the policy then chases.")
    actions = []
    needed = temperature * margin / th.target_margin if _ok(temperature) else None
    at = f" to about {needed:.3g} (the average pair {th.target_margin:g} temperature apart)" if needed else ""
    adaptive, bound = _num(m, "adaptive_temperature"), _num(m, "temperature_at_bound")
    if adaptive == 1.0 and bound == 1.0:
        actions.append(f"the adaptive temperature sits at its upper bound: raise `{_CRITIC}.max_temperature`{at}")
    elif adaptive == 1.0:
        actions.append(f"the adaptive temperature trails the margins: lower `{_CRITIC}.temperature_momentum` (T moves "
                       "by 1 - momentum of the gap each step)")
    else:
        actions.append(f"raise `{_CRITIC}.temperature`{at}, or set `{_CRITIC}.adaptive_temperature=True` (T follows "
                       f"the spread of the differences, within [`{_CRITIC}.min_temperature`, "
                       f"`{_CRITIC}.max_temperature`]"
                       + (f"; max_temperature at least {needed:.3g}" if needed else "") + ")")
    if _num(m, "normalize_scores") != 1.0:
        actions.append(f"set `{_CRITIC}.normalize_scores=True`: the ranking term sees each batch's standardised "
                       "scores, so the critic cannot widen its margins by scaling them up")
    actions += [f"hold the scores' magnitude: raise `{_CRITIC}.reg_weight` or lower `{_CRITIC}.reg_threshold`",
                f"train the critic less: lower `{_CRITIC}.lr` or `{_CRITIC}.steps_per_epoch`"]
    return Finding("critic_saturated", "warn", nums, why, actions)


def critic_findings(metrics: dict, th: CriticThresholds | None = None, *, step: int | None = None,
                    warmup_steps: int | None = None) -> list[Finding]:
    """Findings over one step's (or an epoch's last) critic metrics, most severe first; [] when healthy.

    d_acc is read together with the margin (critic_margin) and the ranking loss, because accuracy alone misleads both
    ways: d_acc 0.88 at score_diff 9.81 and T 2 is a margin of 4.9 temperatures, where the average pair's gradient is
    1.5% of its value at margin 0 (saturated, though under the old 0.9 line); d_acc 1.0 at score_diff 0.0025 with
    ranking_loss 0.691 (log 2 = 0.693) orders every pair by a hair, in the sigmoid's linear part (a mean gradient of
    at least 99.7% of that value, gradient_share_at_least), and is not saturation. Without a margin, a ranking loss
    under softplus(-saturation_margin) proves saturation (margin_at_least). "learns nothing" waits for warm-up (step
    and warmup_steps from the arguments, else from the metrics). A non-finite loss is critical."""
    th = th or DEFAULT.critic
    out = []
    loss = _num(metrics, "loss")
    if loss is not None and not math.isfinite(loss):
        out.append(Finding("critic_diverged", "critical", {"loss": loss},
                           f"The critic's loss is {loss}: its weights hold NaN or Inf, and so does every reward it "
                           "hands out.", [f"restore the critic from its last checkpoint and lower `{_CRITIC}.lr`"]))
    acc, rank = _num(metrics, "d_acc"), _num(metrics, "ranking_loss")
    margin, how = critic_margin(metrics)
    share = 2 * _sigmoid(-margin) if _ok(margin) else None
    if margin is None and _ok(rank) and margin_at_least(rank) >= th.saturation_margin:
        margin, how = margin_at_least(rank), f"at least, from ranking_loss {rank:.4g}"
    elif margin is None and _ok(rank) and _ok(acc):
        share = gradient_share_at_least(rank, acc)
        how = f"every pair won and ranking_loss {rank:.4g}" if share is not None else how
    if step is None:
        s = _num(metrics, "step")
        step = int(s) if s is not None else None
    if warmup_steps is None:
        w = _num(metrics, "warmup_steps")
        warmup_steps = int(w) if w is not None else 0
    warmed_up = step is None or step >= warmup_steps
    saturated_share = 2 * _sigmoid(-th.saturation_margin)
    if _ok(acc) and _ok(margin) and margin >= th.saturation_margin and acc >= th.saturation_min_acc:
        out.append(_critic_saturated(metrics, acc, margin, how, rank, th))
    elif _ok(acc) and acc > th.overconfident and share is not None and share > saturated_share:
        said = f"ranking_loss {rank:.4g} against log 2 = {math.log(2):.4g} for margins of 0" if _ok(rank) else ""
        size = (f"a mean margin of {margin:.3g} temperatures ({how}; {said + '; ' if said else ''}the average "
                f"pair's gradient is {share:.1%} of its value at margin 0)" if _ok(margin) else
                f"margins too small to saturate (every pair won, and {said} puts the mean pair gradient at least "
                f"{share:.1%} of its value at margin 0)")
        out.append(Finding("critic_separates", "info", {"d_acc": acc, "margin": margin, "ranking_loss": rank,
                                                         "pair_gradient_share": share},
                           f"The critic orders {acc:.0%} of the pairs, by {size}: saturation takes a margin of "
                           f"{th.saturation_margin:g} temperatures (a gradient share under {saturated_share:.1%}), so "
                           "this is not saturation, and the critic still learns from every pair."))
    elif _ok(acc) and acc > th.overconfident:
        bound = (f"; ranking_loss {rank:.4g} proves a mean margin of only {max(margin_at_least(rank), 0):.3g}"
                 if _ok(rank) else "")
        out.append(Finding("critic_overconfident", "warn", {"d_acc": acc, "ranking_loss": rank},
                           f"d_acc {acc:.3f} > {th.overconfident:g}, but no margin is logged{bound}: a saturated "
                           "critic and one that orders every pair by a hair look the same in d_acc alone.",
                           ["log score_diff and temperature with d_acc (rewards/discriminator.py's train_step does)",
                            f"if it has saturated: raise `{_CRITIC}.temperature` or set "
                            f"`{_CRITIC}.adaptive_temperature=True`"]))
    elif _ok(acc) and acc < th.learns_nothing and warmed_up:
        near = (f" Its ranking_loss {rank:.4g} sits near log 2 = {math.log(2):.4g}, the loss of scores that do not "
                "separate the sets at all." if _ok(rank) and abs(rank - math.log(2)) < 0.05 else "")
        actions = [f"raise `{_CRITIC}.lr`, `{_CRITIC}.width` (capacity) or `{_CRITIC}.steps_per_epoch`",
                   "check the teacher videos: they must be the conditions' ground-truth renders, paired with the "
                   "student samples of the same condition"]
        if _num(metrics, "adaptive_temperature") == 1.0 and _num(metrics, "temperature_at_bound") == 1.0:
            actions.insert(0, f"the adaptive temperature sits at `{_CRITIC}.max_temperature` and divides the margins "
                              "by it: lower that bound")
        out.append(Finding("critic_learns_nothing", "warn",
                           {"d_acc": acc, "margin": margin, "ranking_loss": rank, "critic_step": step,
                            "warmup_steps": warmup_steps},
                           f"d_acc {acc:.3f} < {th.learns_nothing:g} after {step} critic steps (warm-up "
                           f"{warmup_steps}): the critic cannot tell teacher from student, and its reward is noise."
                           + near, actions))
    reg = _num(metrics, "score_reg")
    if _ok(reg) and reg > th.score_reg_info:
        out.append(Finding("critic_score_drift", "info", {"score_reg": reg},
                           f"score_reg {reg:.3g}: the critic's scores drift past its threshold.",
                           [f"raise `{_CRITIC}.reg_weight` or lower `{_CRITIC}.reg_threshold`"]))
    return _sorted(out)


def critic_metrics(record: dict) -> dict:
    """The critic's numbers of an epoch record (its discriminator/* fields, as the critic's hook writes them),
    unprefixed; {} when the run trained no critic."""
    prefix = "discriminator/"
    return {k[len(prefix):]: v for k, v in record.items()
            if k.startswith(prefix) and isinstance(v, (int, float)) and not isinstance(v, bool)}


def rule_critic(m: dict, history, th: Thresholds, run_dir: str) -> list[Finding]:
    """critic_findings over the critic's metrics an epoch carries (m["critic"], diagnosis.epoch_metrics)."""
    critic = m.get("critic")
    if not isinstance(critic, dict) or not critic:
        return []
    found = critic_findings(critic, th.critic)
    for f in found:
        f.numbers = {**_where(m), **f.numbers}
    return found


STEP_RULES = (rule_non_finite, rule_ratio, rule_reference_drift, rule_loss, rule_advantage_signal, rule_kl,
              rule_clipfrac, rule_reward, rule_reward_term, rule_first_step_ratio)


def _sorted(findings: list[Finding]) -> list[Finding]:
    return sorted(findings, key=lambda f: -_RANK[f.severity])


def reward_evidence(record: dict) -> dict:
    """What rule_reward and rule_reward_term compare between epochs, from an epoch record: each reward term's mean
    (reward_avg included) and standard error, and the constraint's weight. The guard (reward_signal) and the
    offline diagnosis (recam.engine.diagnosis.epoch_metrics) both build their reward inputs with it, so that the
    two judge the same records alike."""
    return {**reward_terms(record, include_avg=True), "term_sem": term_standard_errors(record),
            "constraint_weight": record.get("constraint_weight")}


def reward_signal(record: dict) -> dict:
    """What the guard's reward rules compare between epochs, from an epoch record: the zero-std share, each reward
    term's mean and standard error, the constraint's weight."""
    return {"zero_std_ratio": record["zero_std_ratio"], **reward_evidence(record)}


def findings_record(findings: list[Finding]) -> tuple[list[dict], list[str]]:
    """What a health record holds of the guard's findings (rule, severity, numbers), and the console's lines for the
    ones above "info"; recam.infra.runlog writes both as they are."""
    return ([{"rule": f.rule, "severity": f.severity, "numbers": f.numbers} for f in findings],
            [f"health {f.severity}: {f.rule} {f.numbers}" for f in findings if f.severity != "info"])


def nonfinite_findings(bad: list[str]) -> list[Finding]:
    """The critical finding for tensors (by name) left NaN or inf after an applied update; [] for none."""
    if not bad:
        return []
    return [Finding("nonfinite_state", "critical", {"tensors": bad[:5], "count": len(bad)},
                    "the optimizer step left NaN or inf in the weights or optimizer state")]


def diagnose_step(metrics: dict, history=(), *, thresholds: Thresholds | None = None,
                  run_dir: str = "<run_dir>") -> list[Finding]:
    """Findings for one optimizer step's metrics, most severe first.

    `history` holds the metric dicts of earlier steps, oldest first, without this one; only the last
    `thresholds.median_window` are read. Epoch fields (zero_std_ratio, mean_reward/std_reward,
    first_step_ratio_deviation) are used when merged into `metrics`.
    """
    th = thresholds or DEFAULT
    out = []
    for rule in STEP_RULES:
        out += rule(metrics, history, th, run_dir)
    return _sorted(out)


# ---------------------------------------------------------------- the gradient cosine
#
# The cosine between consecutive optimizer steps' gradients (train.log_gradient_cosine, logged grad_cosine_prev).
# Two steps' samples are independent draws, so its mean over a run estimates |E g|^2 / E |g|^2: near 0, an
# update's direction is its samples' noise (recam.engine.diagnosis.rule_update_noise).


class GradientCosine:
    def __init__(self, reduce=None):
        """reduce: sums a tensor over processes when each holds a shard of the gradient (FSDP), else None."""
        self.previous: list[torch.Tensor] | None = None
        self.reduce = reduce

    def reset(self) -> None:
        """After a resume or a rollback: the last gradient belongs to weights that are no longer the policy's."""
        self.previous = None

    def __call__(self, parameters) -> float | None:
        """Cosine between this step's gradient of `parameters` (the trainable ones) and the previous step's; None on
        a run's or a resumed run's first step, and when either gradient is zero (it has no direction, and a NaN
        would trip the guard's non-finite rule: LoRA's first gradient under FSDP is zero on a process holding only
        the zero-initialised half). The gradients are already averaged over processes, so every process computes
        the same number; under FSDP each holds a shard, and `reduce` sums the dot products over them."""
        grads = [p.grad.detach().float().clone() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)
                 for p in parameters if p.requires_grad]
        previous, self.previous = self.previous, grads
        cosine = None if previous is None else flat_cosine(grads, previous, self.reduce)
        return None if cosine is None or math.isnan(cosine) else cosine


def flat_cosine(a: list[torch.Tensor], b: list[torch.Tensor], reduce=None) -> float:
    """Cosine between two parameter lists taken as one flat vector each; NaN when either is zero. Summed in fp32 on
    the tensors' device (NPUs lack fp64) and read back once; `reduce` (when the lists are shards) sums the three
    sums over processes first."""
    pairs = list(zip(a, b, strict=True))
    if not pairs:
        return float("nan")
    totals = torch.stack([sum((x.float() * y.float()).sum() for x, y in pairs),
                          sum((x.float() ** 2).sum() for x, _ in pairs),
                          sum((y.float() ** 2).sum() for _, y in pairs)])
    dot, na, nb = (totals if reduce is None else reduce(totals)).tolist()
    return dot / math.sqrt(na * nb) if na > 0 and nb > 0 else float("nan")
