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
                     "keep `train.log_ratio_clamp` finite and small (5-10) and `train.max_grad_norm` at ~1",
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
    return [Finding("ratio_explosion", severity, nums, why,
                    ["lower `train.learning_rate` (e.g. by 10x)",
                     "keep `train.log_ratio_clamp` small (5-10) so exp(log-ratio) cannot explode; "
                     "tighten `train.clip_range`",
                     "check that sampling and training compute log-probs the same way (same `sample.noise_level`, "
                     "`sample.sde_type`, precision, no dropout): the first step of each epoch must have ratio 1",
                     _rollback(run_dir)])]


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
                            "bound the per-sample loss: `train.adv_clip_max` (advantages) and "
                            "`train.log_ratio_clamp` (log-ratio before exp)",
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
