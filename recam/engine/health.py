"""Health rules over GRPO training metrics: catch a blown-up run the step it blows up.

`diagnose_step(metrics, history)` is pure Python over the dict of one optimizer step (plus, optionally, epoch
fields merged in such as zero_std_ratio) and the dicts of the steps before it; it is cheap enough to call
every step. A trainer can act on the result:

    findings = diagnose_step(m, recent)            # recent: the last ~200 step dicts, oldest first
    if not is_healthy(findings):                   # any critical finding
        ...stop, or roll back to the last healthy checkpoint...
    recent.append(m)

`diagnose_epoch(record, earlier_epochs)` covers what only an epoch knows (reward level across epochs, the
reward spread, the first on-policy ratio), and `diagnose_run(records)` replays a whole metrics.jsonl and
reports each rule once, with the steps/epochs it fired on.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from recam.infra.schema import REWARD_BOOKKEEPING, reward_terms
from recam.infra.stats import t975

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


def rule_clipfrac(m: dict, history, th: Thresholds, run_dir: str) -> list[Finding]:
    cf = _num(m, "clipfrac")
    if not _ok(cf) or cf <= th.clipfrac_warn:
        return []
    severity = "critical" if cf > th.clipfrac_critical else "warn"
    return [Finding("clip_saturation", severity, {**_where(m), "clipfrac": cf},
                    f"{cf:.0%} of the ratios are clipped: the policy has gone so far off-policy within the epoch "
                    "that most samples give no gradient.",
                    ["lower `train.learning_rate`",
                     "widen `train.clip_range` if it is below the ratio noise of your sampler",
                     "fewer optimizer steps per epoch: `train.num_inner_epochs` 1, a larger `train.batch_size`"])]


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


def reward_signal(record: dict) -> dict:
    """What the guard's reward rules compare between epochs, from an epoch record: the zero-std share, each reward
    term's mean and standard error, the constraint's weight."""
    return {"zero_std_ratio": record["zero_std_ratio"], **reward_terms(record, include_avg=True),
            "term_sem": term_standard_errors(record), "constraint_weight": record.get("constraint_weight")}


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


def _per_sample(record: dict, key: str) -> list[float] | None:
    """rewards/<name> of an epoch record as one float per sample (the first timestep of (N, T) rows); NaN where the
    reward failed. None when absent or malformed."""
    values = record.get(key)
    if not isinstance(values, list) or not values:
        return None
    try:
        return [float(r[0]) if isinstance(r, list) else float(r) for r in values]
    except (TypeError, ValueError, IndexError):
        return None


def excluded_count(record: dict) -> tuple[int, int] | None:
    """(excluded samples, samples) of an epoch record: samples the trainer kept out of the advantages (a failed
    reward, or its group under the drop_group policy). None when the record does not say."""
    excluded = record.get("excluded")
    if isinstance(excluded, list) and excluded:
        return sum(bool(x) for x in excluded), len(excluded)
    n = _num(record, "excluded_samples")
    total = record.get("dataset_indices")
    if n is not None and isinstance(total, list):
        return int(n), len(total)
    return None


def _epoch_reward_std(record: dict) -> float | None:
    """Population std of the epoch's rewards/avg over the samples that were scored: a failed (NaN) reward is an
    excluded sample, not a value, so it takes no part (and never turns the whole statistic into NaN)."""
    vals = _per_sample(record, "rewards/avg")
    if vals is None:
        return None
    vals = [v for v in vals if math.isfinite(v)]
    if len(vals) < 2:
        return None
    mean = math.fsum(vals) / len(vals)
    return math.sqrt(math.fsum((v - mean) ** 2 for v in vals) / len(vals))


def _missing_by_exclusion(record: dict, key: str) -> bool:
    """A non-finite epoch scalar that only says "no sample to compute it over": the mean of a reward that failed on
    every sample, or the advantage statistics of an epoch whose every sample was excluded. It is missing, not a
    numerical blow-up, and rule_exclusions reports why."""
    if key in ("zero_std_ratio", "reward_std_mean", "group_size", "trained_prompt_num"):
        counts = excluded_count(record)
        return counts is not None and counts[0] == counts[1]
    if key.startswith("reward_"):
        vals = _per_sample(record, "rewards/" + key[len("reward_"):])
        return vals is not None and not any(math.isfinite(v) for v in vals)
    return False


def epoch_metrics(record: dict) -> dict:
    """The health-relevant scalars of an epoch record, under the names the step rules read.

    Statistics over rewards ignore excluded samples (NaN rewards); a scalar that is NaN only because no sample was
    left to compute it over is left out (see _missing_by_exclusion), and the number of excluded samples is kept
    as excluded_samples / samples for rule_exclusions."""
    m = {k: record[k] for k in ("epoch", "step", "zero_std_ratio", "first_step_ratio_deviation") if k in record}
    reward = _num(record, "reward_avg")
    if reward is not None:
        m["mean_reward"] = reward
    std = _epoch_reward_std(record)
    if std is not None:
        m["std_reward"] = std
    for k, v in record.items():
        if (k.startswith("reward_") or k in ("group_size", "trained_prompt_num")) and isinstance(v, float):
            m.setdefault(k, v)
    for k in list(m):
        x = _num(m, k)
        if x is not None and not math.isfinite(x) and _missing_by_exclusion(record, "reward_avg" if k == "mean_reward"
                                                                              else k):
            del m[k]
    counts = excluded_count(record)
    if counts is not None:
        m["excluded_samples"], m["samples"] = counts
        for k in ("failed_samples", "excluded_groups"):
            if _num(record, k) is not None:
                m[k] = int(_num(record, k))
    return m


def rule_exclusions(m: dict, history, th: Thresholds, run_dir: str) -> list[Finding]:
    """Samples the trainer kept out of the advantages because their reward failed. Expected with a flaky judge and
    handled (group statistics over the kept samples), so it is information; an epoch that kept nothing trained on
    nothing, which is worth a warning."""
    excluded, n = _num(m, "excluded_samples"), _num(m, "samples")
    if not excluded or not n:
        return []
    nums = {**_where(m), "excluded_samples": int(excluded), "samples": int(n)}
    nums.update({k: m[k] for k in ("failed_samples", "excluded_groups") if k in m})
    actions = ["check the reward servers (e.g. the UnifiedReward judge) for errors and timeouts",
               "raise `reward.max_retries` / `reward.unified.max_retries` if the failures are transient"]
    if excluded >= n:
        return [Finding("excluded_samples", "warn", nums,
                        f"Every one of the {int(n)} samples was excluded from the advantages, so this epoch took no "
                        "optimizer step.", actions)]
    return [Finding("excluded_samples", "info", nums,
                    f"{int(excluded)} of {int(n)} samples were excluded from the advantages (their reward failed); "
                    "group statistics use the kept samples only.", actions)]


def diagnose_epoch(record: dict, earlier_epochs=(), *, thresholds: Thresholds | None = None,
                   run_dir: str = "<run_dir>") -> list[Finding]:
    """Findings for one epoch record (rewards, advantage signal, first on-policy ratio, NaN in its scalars)."""
    th = thresholds or DEFAULT
    m = epoch_metrics(record)
    history = [epoch_metrics(r) for r in earlier_epochs]
    out = []
    for rule in (rule_non_finite, rule_advantage_signal, rule_reward, rule_reward_term, rule_first_step_ratio,
                 rule_exclusions):
        out += rule(m, history, th, run_dir)
    return _sorted(out)


def _merge(findings: list[tuple[Finding, dict]]) -> list[Finding]:
    """One finding per rule: the first at its worst severity, with where it fired at that severity."""
    by_rule: dict[str, list[tuple[Finding, dict]]] = {}
    for f, where in findings:
        by_rule.setdefault(f.rule, []).append((f, where))
    out = []
    for rule, items in by_rule.items():
        top = max(_RANK[f.severity] for f, _ in items)
        items = [(f, w) for f, w in items if _RANK[f.severity] == top]  # milder firings would blur where it hit
        first = items[0][0]
        steps = sorted({w["step"] for _, w in items if isinstance(w.get("step"), int)})
        epochs = sorted({w["epoch"] for _, w in items if isinstance(w.get("epoch"), int)})
        nums = dict(first.numbers)
        nums["occurrences"] = len(items)
        if steps:
            nums["first_step"], nums["last_step"] = steps[0], steps[-1]
        if epochs:
            nums["epochs"] = epochs if len(epochs) <= 12 else epochs[:6] + ["…"] + epochs[-3:]
        where = (f" Fired {len(items)} time(s)" + (f", steps {steps[0]}..{steps[-1]}" if steps else "")
                 + (f", epochs {epochs[0]}..{epochs[-1]}" if epochs else "") + ".") if steps or epochs else ""
        out.append(replace(first, rule=rule, numbers=nums, explanation=first.explanation + where))
    return _sorted(out)


# ----------------------------------------------------------------------------------------------------------
# run rules: over every step of a run


def rule_update_noise(steps: list[dict], th: Thresholds) -> list[Finding]:
    """Info when consecutive optimizer steps' gradients barely agree (grad_cosine_prev, logged by the trainer).

    With g = s + n, s the expected gradient and n the noise of a step's own samples, independent between steps,
    E cos(g_t, g_t-1) ~ |s|^2 / (|s|^2 + var / N): near 0 an update's direction is mostly noise, and the samples per
    step that would bring the cosine to 1/2 are N (1 - c) / c."""
    cos = [c for c in (_num(m, "grad_cosine_prev") for m in steps) if _ok(c)]
    if len(cos) < th.update_noise_min_steps:
        return []
    mean = statistics.fmean(cos)
    half = t975(len(cos) - 1) * statistics.stdev(cos) / math.sqrt(len(cos))
    if mean + half >= th.update_noise_cosine:
        return []
    sizes = [n for n in (_num(m, "step_samples") for m in steps) if _ok(n) and n > 0]
    n = statistics.median(sizes) if sizes else None
    numbers = {"mean_grad_cosine": mean, "interval_95": half, "steps": len(cos), "samples_per_step": n}
    need = ""
    high = mean + half
    if n is not None and high <= 0:  # steps that oppose each other: no signal to extrapolate from
        need = " No agreement is measurable at this many samples per step."
    elif n is not None:
        numbers["samples_for_cosine_half_at_least"] = n * (1 - high) / high
        if mean - half > 0:
            numbers["samples_for_cosine_half"] = n * (1 - mean) / mean
            need = (f" A cosine of 1/2 would take about {n * (1 - mean) / mean:.0f} samples per step "
                    f"(at least {n * (1 - high) / high:.0f}).")
        else:
            need = f" A cosine of 1/2 would take at least {n * (1 - high) / high:.0f} samples per step."
    return [Finding(
        "update_noise", "info", numbers,
        f"Consecutive optimizer steps' gradients agree at cosine {mean:.3f} +- {half:.3f} (95%, {len(cos)} steps"
        + (f", {n:.0f} samples each" if n is not None else "") + "): an update's direction is mostly the noise of "
        "its own samples, not the reward's gradient, so the weights take a random walk around the signal." + need,
        ["more samples per optimizer step (sample.num_batches_per_epoch with train.gradient_accumulation_steps "
         "covering them)", "train only the steps whose gradients carry the signal (sample.window_size; "
         "scripts/gradient_agreement.py measures each step's share)"])]


def diagnose_run(records: list[dict], *, thresholds: Thresholds | None = None,
                 run_dir: str = "<run_dir>") -> list[Finding]:
    """Replay a run's records (step and epoch; others ignored; untyped dicts count as steps).

    Step rules see the epoch's zero_std_ratio merged in (the epoch record is written after its steps, so
    it is looked up by epoch number).
    """
    th = thresholds or DEFAULT
    epochs = [r for r in records if isinstance(r, dict) and r.get("type") == "epoch"]
    zero_std = {r.get("epoch"): r["zero_std_ratio"] for r in epochs
                if _ok(_num(r, "zero_std_ratio"))}  # NaN: nothing was kept, and no step was taken
    collected: list[tuple[Finding, dict]] = []
    history: deque = deque(maxlen=max(th.median_window, th.kl_window))
    steps = []
    for r in records:
        if not isinstance(r, dict) or r.get("type", "step") != "step":
            continue
        m = {k: v for k, v in r.items() if k != "type"}
        steps.append(m)
        if "zero_std_ratio" not in m and m.get("epoch") in zero_std:
            m["zero_std_ratio"] = zero_std[m["epoch"]]
        for f in diagnose_step(m, history, thresholds=th, run_dir=run_dir):
            collected.append((f, _where(m)))
        history.append(m)
    for i, r in enumerate(epochs):
        for f in diagnose_epoch(r, epochs[:i], thresholds=th, run_dir=run_dir):
            # an epoch record's step is where its updates start; only step records locate a step
            collected.append((f, {"epoch": r.get("epoch")}))
    collected += [(f, {}) for f in rule_update_noise(steps, th)]
    return _merge(collected)


def worst_severity(findings: list[Finding]) -> str | None:
    """'critical', 'warn' or 'info'; None when there are no findings."""
    if not findings:
        return None
    return max((f.severity for f in findings), key=_RANK.__getitem__)


def is_healthy(findings: list[Finding]) -> bool:
    """True when nothing is critical (warnings and info do not stop a run)."""
    return all(f.severity != "critical" for f in findings)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def format_findings(findings: list[Finding]) -> str:
    """Markdown list of findings, most severe first."""
    if not findings:
        return "No findings: the metrics look healthy.\n"
    lines = []
    for f in _sorted(findings):
        lines.append(f"- **{f.severity.upper()}** `{f.rule}`: {f.explanation}")
        nums = ", ".join(f"{k}={_fmt(v)}" for k, v in f.numbers.items() if v is not None)
        if nums:
            lines.append(f"  - numbers: {nums}")
        for a in f.actions:
            lines.append(f"  - try: {a}")
    return "\n".join(lines) + "\n"
