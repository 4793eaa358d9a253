"""A run's health after the fact: the rules only an epoch knows (the reward spread, exclusions, the first on-policy
ratio), the update's noise over a run, and `diagnose_run(records)`, which replays a whole metrics.jsonl through
these and the step rules of recam.engine.health and reports each rule once, with the steps and epochs it fired on
(scripts/diagnose.py, diagnosis.md). Nothing here runs on the way to an optimizer step.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import replace
from typing import Any

from recam.engine.health import (
    _RANK,
    DEFAULT,
    Finding,
    Thresholds,
    _num,
    _ok,
    _sorted,
    _where,
    diagnose_step,
    rule_advantage_signal,
    rule_first_step_ratio,
    rule_non_finite,
    rule_reward,
    rule_reward_term,
)
from recam.infra.stats import t975


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
