"""A run's health after the fact: the rules only an epoch knows (the reward spread, exclusions, the first on-policy
ratio), the update's noise over a run (the gradient cosine between steps, and the gradient noise scale, whose
meaning for the run's updates noise_scale_line says in one line), and `diagnose_run(records)`, which replays a whole
metrics.jsonl through these and the step rules of recam.engine.health and reports each rule once, with the steps and
epochs it fired on (scripts/diagnose.py, diagnosis.md). Nothing here runs on the way to an optimizer step.

The reward rules see what the trainer's guard sees (health.reward_evidence: each term's mean and standard error,
the constraint's weight), and compare an epoch only with the earlier epochs the guard judged, so that the two agree
on the same records. A finding the guard cannot make (a rule only an epoch or a whole run knows, an epoch that took
no optimizer step) says why in its explanation. Records are screened against recam.infra.schema first
(`screen_records`): one the schema rejects is left out and counted, never diagnosed as if it were a step.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, deque
from dataclasses import replace
from typing import Any

from recam.engine.health import (
    _RANK,
    DEFAULT,
    Finding,
    Thresholds,
    _num,
    _ok,
    _rollback,
    _sorted,
    _where,
    critic_metrics,
    diagnose_step,
    reward_evidence,
    rule_advantage_signal,
    rule_critic,
    rule_first_step_ratio,
    rule_non_finite,
    rule_reward,
    rule_reward_term,
)
from recam.engine.noise_scale import bootstrap_ratio_interval
from recam.infra.schema import (
    RECORD_FIELD_KINDS,
    RECORD_FIELDS,
    RECORD_KEYS,
    RECORD_TYPES,
    REWARD_BOOKKEEPING,
    consistent_share_of,
)
from recam.infra.stats import batch_means_interval, mean_interval, t975, welch_difference

# ----------------------------------------------------------------------------------------------------------
# which records count: recam.infra.schema's fields, checked before any rule reads a record

_KIND_WORDS = {"integer": "an integer", "number": "a number", "number or null": "a number or null",
               "integer list": "a list of integers", "boolean list": "a list of booleans",
               "object list": "a list of objects", "number array": "a list of numbers (or of lists of numbers)"}
_LABELS = {"step": "step record(s)", "epoch": "epoch record(s)", None: "metric dict(s)"}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)  # JSON true/false are no numbers


def _is_kind(value: Any, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return _is_number(value)
    if kind == "number or null":
        return value is None or _is_number(value)
    if not isinstance(value, list):
        return False
    if kind == "integer list":
        return all(_is_kind(v, "integer") for v in value)
    if kind == "boolean list":
        return all(isinstance(v, bool) for v in value)
    if kind == "object list":
        return all(isinstance(v, dict) for v in value)
    if kind == "number array":
        return (all(_is_number(v) for v in value)
                or all(isinstance(v, list) and all(_is_number(x) for x in v) for v in value))
    raise ValueError(f"unknown field kind {kind!r}")


def _has_metric(record: dict) -> bool:
    return any(_is_kind(v, "number") for k, v in record.items() if k not in ("type", "step", "epoch"))


def _field_kind(kinds: dict[str, str], key: str) -> str | None:
    """The kind RECORD_FIELD_KINDS asks of `key` (exact names first, then the longest matching prefix)."""
    if key in kinds:
        return kinds[key]
    if key == "type" or key in REWARD_BOOKKEEPING:
        return None
    prefixes = sorted((p for p in kinds if p.endswith("*") and key.startswith(p[:-1])), key=len, reverse=True)
    return kinds[prefixes[0]] if prefixes else None


def record_problem(record: dict) -> str | None:
    """Why `record` cannot be counted as the step or epoch record it says it is, or as a bare metric dict (no
    "type": a JSON file of step metrics), in words that follow its kind ("without an integer step", "with
    advantages not a list of numbers"); None when it can, and for records of the other types, which no rule here
    reads."""
    kind = record.get("type")
    if kind is None:
        return None if _has_metric(record) else "without a single number"
    fields = RECORD_FIELDS.get(kind) if isinstance(kind, str) else None
    if fields is None:
        return None
    missing = [f"{_KIND_WORDS[want]} {key}" for key, want in fields.items() if not _is_kind(record.get(key), want)]
    if missing:
        return "without " + " or ".join(missing)
    negative = [key for key in ("step", "epoch") if key in fields and record[key] < 0]
    if negative:  # the trainer numbers steps and epochs from 0
        return "with a negative " + " and a negative ".join(negative)
    kinds = RECORD_FIELD_KINDS.get(kind, {})
    wrong = sorted(key for key, value in record.items()
                   if key not in fields and (want := _field_kind(kinds, key)) is not None and not _is_kind(value, want))
    if wrong:
        # a field the rules read, of the wrong type, would be passed over as if absent: the record is not counted
        named = [f"{key} not {_KIND_WORDS[_field_kind(kinds, key)]}" for key in wrong[:3]]
        return "with " + " and ".join(named) + (f" and {len(wrong) - 3} more field(s) of the wrong type"
                                                if len(wrong) > 3 else "")
    if kind == "step" and not _has_metric(record):  # a step that measured nothing gives a rule nothing to judge
        return "without a single metric"
    lengths = {key: len(value) for key, value in record.items()
               if _field_kind(kinds, key) in ("integer list", "boolean list", "number array")}
    if len(set(lengths.values())) > 1:  # one entry per sample in each: a list cut short pairs samples wrongly
        return "with per-sample fields of different lengths (" + ", ".join(f"{k} {n}" for k, n in lengths.items()) + ")"
    return None


def screen_records(records: list) -> tuple[list[dict], dict[str, int]]:
    """(the records the rules may read, {"step record(s) without an integer step": 3, ...}): each record the
    schema rejects is left out and counted under its kind and reason, so that a report can say so line by line.
    A step or epoch record whose number an earlier one already had (RECORD_KEYS) is left out too: which copy is
    the run's is unknown, and counting both would replay the same steps twice."""
    kept, skipped = [], Counter()
    seen: set[tuple[str, int]] = set()
    for r in records:
        if not isinstance(r, dict):
            skipped["item(s) that are not a JSON object"] += 1
            continue
        why = record_problem(r)
        kind = r.get("type")
        if why is None and isinstance(kind, str) and kind in RECORD_KEYS:
            number = (kind, r[RECORD_KEYS[kind]])
            if number in seen:
                why = f"repeating an earlier record's {RECORD_KEYS[kind]} number"
            seen.add(number)
        if why is None:
            kept.append(r)
        else:
            skipped[f"{_LABELS.get(r.get('type'), 'record(s)')} {why}"] += 1
    return kept, dict(skipped)


def step_record_gaps(records: list[dict]) -> list[str]:
    """Where the step records (screened) disagree with what the epoch records say was trained: each epoch record
    stores its optimizer steps, and each of those steps has its own step record. A step record that is missing is
    a step the step rules (ratio, KL, loss) never judged, so a report cannot call the run healthy; [] when they
    agree, or when the epoch records do not say."""
    epochs = [r for r in records if r.get("type") == "epoch"]
    steps = [r for r in records if r.get("type", "step") == "step"]
    if not epochs:
        # Untyped metric dicts (a documented input) carry no epoch to compare with. Typed step records of more than
        # one epoch are a run's log whose epoch records are gone: only the last epoch can still be in progress.
        stepped = sorted({r["epoch"] for r in steps if r.get("type") == "step" and isinstance(r.get("epoch"), int)})
        if len(stepped) < 2:
            return []
        return [f"step records of {len(stepped)} epochs ({stepped[0]}..{stepped[-1]}) but no epoch record at all: no "
                "reward or advantage rule judged what epochs before the last trained on"]
    # The trainer writes an epoch's step records before its epoch record: steps of the one epoch after the last epoch
    # record are a running (or killed) run's epoch in progress; steps of any other epoch without a record were
    # trained on samples no reward rule judged. (Untyped metric dicts carry no epoch to match.)
    stepped = sorted({r["epoch"] for r in steps if r.get("type") == "step"})
    in_progress = stepped[-1] if stepped and stepped[-1] > max(r["epoch"] for r in epochs) else None
    orphans = [e for e in stepped if e != in_progress and e not in {r["epoch"] for r in epochs}]
    orphaned = ([f"step records of epoch(s) {', '.join(map(str, orphans[:6]))}{', ...' if len(orphans) > 6 else ''} "
                 "but no epoch record of theirs: no reward rule judged what they trained on"] if orphans else [])
    taken = [(r.get("epoch"), len(r["optimizer_steps"]) if isinstance(r.get("optimizer_steps"), list) else None)
             for r in epochs]
    if not steps:
        if all(n == 0 for _, n in taken):
            return []  # no epoch trained (every sample excluded): there is no step to record
        known = [n for _, n in taken if n is not None]
        said = (f"their records store {sum(known)} optimizer step(s)" if len(known) == len(taken)
                else "they trained (their records do not all say how many optimizer steps)")
        return [f"no step record at all for {len(epochs)} epoch(s), while {said}: no step rule judged them"]
    per_epoch = Counter(r.get("epoch") for r in steps)
    gaps = orphaned + [f"epoch {e} stores {n} optimizer step(s) but {per_epoch.get(e, 0)} step record(s) carry its "
                       "number" for e, n in taken if n is not None and per_epoch.get(e, 0) != n]
    gaps += _misnumbered(epochs, steps)
    return gaps if len(gaps) <= 6 else gaps[:5] + [f"... and {len(gaps) - 5} more epoch(s) like these"]


def _misnumbered(epochs: list[dict], steps: list[dict]) -> list[str]:
    """An epoch record's step is the optimizer steps taken before it, so its own step records are numbered step+1 ..
    step+n; those of the epoch in progress continue from the last epoch's. A step record numbered otherwise (10**18
    amid 1..4) is not where the run's steps are, and what it says cannot be placed."""
    numbers: dict[int, list[int]] = {}
    for r in steps:
        if r.get("type") == "step":
            numbers.setdefault(r["epoch"], []).append(r["step"])
    out, after = [], None
    for r in sorted(epochs, key=lambda r: r["epoch"]):
        n = len(r["optimizer_steps"]) if isinstance(r.get("optimizer_steps"), list) else None
        if not isinstance(r.get("step"), int) or n is None:
            after = None
            continue
        want = list(range(r["step"] + 1, r["step"] + n + 1))
        got = sorted(numbers.get(r["epoch"], []))
        if got and got != want:
            out.append(f"epoch {r['epoch']}'s step records are numbered {_span(got)} where its record (step "
                       f"{r['step']}, {n} optimizer step(s)) says {_span(want)}")
        after = (r["epoch"], r["step"] + n)
    if after is not None:
        later = {e: sorted(v) for e, v in numbers.items() if e > after[0]}
        if len(later) == 1:
            (e, got), = later.items()
            want = list(range(after[1] + 1, after[1] + len(got) + 1))
            if got != want:
                out.append(f"epoch {e}'s step records (in progress) are numbered {_span(got)} where they follow step "
                           f"{after[1]}: {_span(want)}")
    return out


def _span(numbers: list[int]) -> str:
    if not numbers:
        return "none"
    if all(b == a + 1 for a, b in zip(numbers, numbers[1:], strict=False)):
        return f"{numbers[0]}..{numbers[-1]}"
    shown = ", ".join(map(str, numbers[:6]))
    return shown + (", ..." if len(numbers) > 6 else "")


def epochs_without(records: list[dict], field: str = "advantages") -> list[str]:
    """One line when epoch records lack `field`: every record the trainer writes has it, and the rules that read it
    (non-finite advantages, their sign against the rewards) never judged those epochs; [] when none lacks it."""
    missing = [r["epoch"] for r in records if r.get("type") == "epoch" and field not in r]
    if not missing:
        return []
    shown = ", ".join(map(str, missing[:6])) + (", ..." if len(missing) > 6 else "")
    return [f"epoch record(s) {shown} without {field}: the rules that read them never judged those epochs"]


def advantage_sign_errors(record: dict) -> tuple[int, int] | None:
    """(samples whose advantage has the opposite sign of their reward's deviation from their group's mean, samples
    compared) of a non-placebo epoch record, from its rewards/avg, advantages, dataset_indices and excluded. Every
    std_mode divides the centred reward by a positive number, so the signs agree whatever the run's settings; a
    placebo epoch permutes advantages within groups on purpose and is not compared. None when it cannot say."""
    if record.get("placebo") is True:
        return None
    rewards, advantages = _per_sample(record, "rewards/avg"), _per_sample(record, "advantages")
    groups, excluded = record.get("dataset_indices"), record.get("excluded")
    if rewards is None or advantages is None or not isinstance(groups, list) or len(groups) != len(rewards):
        return None
    if len(advantages) != len(rewards):
        return None
    kept = [not (isinstance(excluded, list) and i < len(excluded) and excluded[i] is True)
            and math.isfinite(rewards[i]) and math.isfinite(advantages[i]) for i in range(len(rewards))]
    by_group: dict[Any, list[int]] = {}
    for i, g in enumerate(groups):
        if kept[i] and isinstance(g, int):
            by_group.setdefault(g, []).append(i)
    wrong = compared = 0
    for members in by_group.values():
        mean = sum(rewards[i] for i in members) / len(members)
        scale = max(abs(rewards[i]) for i in members) + 1.0
        for i in members:
            # float32 round-off leaves a deviation of ~1e-7 with either sign; only a clear one has a sign to keep
            if abs(rewards[i] - mean) <= 1e-5 * scale or abs(advantages[i]) <= 1e-6:
                continue
            compared += 1
            wrong += (rewards[i] > mean) != (advantages[i] > 0)
    return wrong, compared


def unknown_types(records: list[dict]) -> dict[str, int]:
    """{type: count} of records of a type recam.infra.runlog never writes: nothing reads them, and a report says so."""
    return dict(Counter(str(r["type"]) for r in records if r.get("type") is not None
                        and r.get("type") not in RECORD_TYPES))


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


def _missing_by_exclusion(record: dict, key: str, value: float) -> bool:
    """A NaN epoch scalar that only says "no sample to compute it over": the mean of a reward that failed on every
    sample (each NaN), or the advantage statistics of an epoch whose every sample was excluded. It is missing, not a
    numerical blow-up, and rule_exclusions reports why. An infinity is never that: a failed reward is NaN."""
    if not math.isnan(value):
        return False
    if key in ("zero_std_ratio", "reward_std_mean", "group_size", "trained_prompt_num"):
        counts = excluded_count(record)
        return counts is not None and counts[0] == counts[1]
    if key.startswith("reward_"):
        vals = _per_sample(record, "rewards/" + key[len("reward_"):])
        return vals is not None and all(math.isnan(v) for v in vals)
    return False


def _numbers(values: list) -> list[float]:
    """The numbers of an (N,) or (N, T) list, flattened."""
    flat = [x for v in values for x in (v if isinstance(v, list) else [v])]
    return [float(x) for x in flat if isinstance(x, (int, float)) and not isinstance(x, bool)]


def non_finite_samples(record: dict) -> list[str]:
    """The per-sample fields of an epoch record that hold a value the trainer never writes there: an infinite reward
    (a reward that failed is NaN, and its sample excluded) or a non-finite advantage (an excluded sample's is 0)."""
    bad = []
    for key, values in record.items():
        if not isinstance(values, list) or not (key.startswith("rewards/") or key == "advantages"):
            continue
        xs = _numbers(values)
        if any(math.isinf(x) for x in xs) or (key == "advantages" and any(math.isnan(x) for x in xs)):
            bad.append(key)
    return sorted(bad)


def epoch_metrics(record: dict) -> dict:
    """The health-relevant scalars of an epoch record, under the names the step rules read.

    Statistics over rewards ignore excluded samples (NaN rewards); a scalar that is NaN only because no sample was
    left to compute it over is left out (see _missing_by_exclusion), and the number of excluded samples is kept
    as excluded_samples / samples for rule_exclusions."""
    m = {k: record[k] for k in ("epoch", "step", "zero_std_ratio", "first_step_ratio_deviation") if k in record}
    reward = _num(record, "reward_avg")
    if reward is not None:
        m["mean_reward"] = reward
    m.update(reward_evidence(record))  # the guard's own reward inputs, standard errors and constraint weight included
    std = _epoch_reward_std(record)
    if std is not None:
        m["std_reward"] = std
    for k, v in record.items():
        if (k.startswith("reward_") or k in ("group_size", "trained_prompt_num")) and isinstance(v, float):
            m.setdefault(k, v)
    for k in list(m):
        x = _num(m, k)
        if x is not None and not math.isfinite(x) and _missing_by_exclusion(record, "reward_avg" if k == "mean_reward"
                                                                              else k, x):
            del m[k]
    bad = non_finite_samples(record)
    if bad:
        m["non_finite_samples"] = bad
    signs = advantage_sign_errors(record)
    if signs is not None and signs[0]:
        m["advantage_sign_errors"], m["advantage_sign_compared"] = signs
    critic = critic_metrics(record)
    if critic:  # nested, so that rule_non_finite reads the critic's loss as the critic's rule does, not as a blow-up
        m["critic"] = critic
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


def rule_non_finite_samples(m: dict, history, th: Thresholds, run_dir: str) -> list[Finding]:
    """Infinite per-sample rewards or non-finite advantages, judged on the samples themselves: an epoch's means are
    one number each and need not show them (a damaged log's may be finite, or absent)."""
    bad = m.get("non_finite_samples")
    if not bad:
        return []
    return [Finding("non_finite_samples", "critical", {**_where(m), "keys": bad},
                    f"{', '.join(bad)} hold{'s' if len(bad) == 1 else ''} infinite values (or NaN advantages): a "
                    "reward that fails is NaN and its sample excluded with advantage 0, so these are a reward that "
                    "overflowed or a damaged log.",
                    ["check the reward that produced them (its raw outputs in the record's details/ fields)",
                     _rollback(run_dir)])]


def rule_advantage_sign(m: dict, history, th: Thresholds, run_dir: str) -> list[Finding]:
    """Advantages whose sign disagrees with their reward's place in its group: the update then pushes toward the
    worse samples of each group. The trainer never writes such an epoch; a sign flipped in the code or the log does."""
    wrong = m.get("advantage_sign_errors")
    if not wrong:
        return []
    n = m["advantage_sign_compared"]
    return [Finding("advantage_sign", "critical", {**_where(m), "samples": int(wrong), "compared": int(n)},
                    f"{int(wrong)} of {int(n)} samples have an advantage whose sign is the opposite of their reward's "
                    "deviation from their group's mean: the update favours the worse samples (a sign error in the "
                    "advantages or a damaged log).",
                    ["run scripts/verify_grpo_log.py on the run: it recomputes every advantage from the rewards",
                     _rollback(run_dir)])]


def diagnose_epoch(record: dict, earlier_epochs=(), *, thresholds: Thresholds | None = None,
                   run_dir: str = "<run_dir>") -> list[Finding]:
    """Findings for one epoch record (rewards, advantage signal, first on-policy ratio, NaN in its scalars, the
    learned critic's state)."""
    th = thresholds or DEFAULT
    m = epoch_metrics(record)
    history = [epoch_metrics(r) for r in earlier_epochs]
    out = []
    for rule in (rule_non_finite, rule_non_finite_samples, rule_advantage_sign, rule_advantage_signal, rule_reward,
                 rule_reward_term, rule_first_step_ratio, rule_exclusions, rule_critic):
        out += rule(m, history, th, run_dir)
    return _sorted(out)


# Findings the trainer's guard cannot make, and why: it judges each optimizer step's metrics with the epoch's
# health.reward_signal merged in, so what only the rest of an epoch record or a whole run shows is the diagnosis's.
GUARD_CANNOT_JUDGE = {
    "off_policy_first_step": "the first step's ratio reaches the epoch record after the epoch's updates (the guard "
                             "judges each step's ratio as ratio_explosion)",
    "excluded_samples": "the trainer excludes failed rewards itself; they are not a fault to stop for",
    "update_noise": "it is a statistic over the whole run's steps",
    "non_finite_samples": "it reads each reward's epoch mean, not the per-sample rewards and advantages",
    "advantage_sign": "it reads the advantages' summary, not each sample's advantage against its reward",
    "update_below_noise_scale": "it reads the gradient noise scale's running means, an epoch statistic",
}
# The critic's rules read the discriminator/* fields its hook adds to the epoch record; the guard reads none of them
# (the hook logs the same findings as it trains the critic).
GUARD_CANNOT_JUDGE.update(dict.fromkeys(
    ("critic_saturated", "critic_separates", "critic_overconfident", "critic_learns_nothing", "critic_score_drift",
     "critic_diverged"),
    "it reads no discriminator/* field of an epoch record; the critic's hook logs these as it trains the critic"))
_GUARD_EPOCH_KEYS = frozenset({"zero_std_ratio", "mean_reward", "epoch", "step"})


def guard_cannot_judge(f: Finding) -> str | None:
    """Why the trainer's guard cannot make this epoch- or run-level finding; None when it can (the same rule on
    the same inputs)."""
    if f.rule in GUARD_CANNOT_JUDGE:
        return GUARD_CANNOT_JUDGE[f.rule]
    if f.rule == "reward_collapse" and "std_reward" in f.numbers:
        return ("the guard is not given the rewards' spread over all samples (at 0 every group's is 0 too, and the "
                "guard stops on no_advantage_signal)")
    if f.rule == "non_finite":
        keys = f.numbers.get("keys") or []
        unseen = [k for k in keys if k not in _GUARD_EPOCH_KEYS
                  and not (k.startswith("reward_") and k not in REWARD_BOOKKEEPING)]
        if len(unseen) == len(keys) and keys:
            return "of an epoch record the guard reads only zero_std_ratio and the reward means"
    return None


def _merge(findings: list[tuple[Finding, dict, str | None]]) -> list[Finding]:
    """One finding per rule: the first at its worst severity, with where it fired at that severity, and why the
    guard could not have made it when none of those firings was the guard's to make."""
    by_rule: dict[str, list[tuple[Finding, dict, str | None]]] = {}
    for item in findings:
        by_rule.setdefault(item[0].rule, []).append(item)
    out = []
    for rule, items in by_rule.items():
        top = max(_RANK[f.severity] for f, _, _ in items)
        items = [it for it in items if _RANK[it[0].severity] == top]  # milder firings would blur where it hit
        first = items[0][0]
        steps = sorted({w["step"] for _, w, _ in items if isinstance(w.get("step"), int)})
        epochs = sorted({w["epoch"] for _, w, _ in items if isinstance(w.get("epoch"), int)})
        nums = dict(first.numbers)
        nums["occurrences"] = len(items)
        if steps:
            nums["first_step"], nums["last_step"] = steps[0], steps[-1]
        if epochs:
            nums["epochs"] = epochs if len(epochs) <= 12 else epochs[:6] + ["…"] + epochs[-3:]
        where = (f" Fired {len(items)} time(s)" + (f", steps {steps[0]}..{steps[-1]}" if steps else "")
                 + (f", epochs {epochs[0]}..{epochs[-1]}" if epochs else "") + ".") if steps or epochs else ""
        blind = [why for _, _, why in items]
        if all(blind):
            where += f" The run's guard does not judge this: {blind[0]}."
        out.append(replace(first, rule=rule, numbers=nums, explanation=first.explanation + where))
    return _sorted(out)


# ----------------------------------------------------------------------------------------------------------
# run rules: over every step of a run


# Consecutive steps share the weights they start from, so their cosines are correlated, and a t-interval over steps
# would be too narrow; four blocks keep each block long against that correlation and still give an interval (3
# degrees of freedom). A block needs two steps at the least.
COSINE_BLOCKS = 4


def step_cosines(records: list[dict]) -> list[float]:
    """The finite grad_cosine_prev of the step records (untyped dicts count as steps, as diagnose_run reads them),
    in the records' order: a run's time order."""
    out = []
    for r in records:
        if r.get("type", "step") != "step":
            continue
        c = r.get("grad_cosine_prev")
        if _is_number(c) and math.isfinite(c):
            out.append(float(c))
    return out


def cosine_interval(cos: list[float], blocks: int = COSINE_BLOCKS) -> tuple[float, float, int, str]:
    """The mean step cosine, the half-width of its 95% interval, how many steps it used and how: a batch-means
    interval over `blocks` contiguous blocks in time order (recam.infra.stats.batch_means_interval, which leaves out
    the earliest steps that do not fill a block) with at least 2 * blocks steps; with fewer, the plain t-interval
    over steps, which treats correlated steps as independent and is too narrow."""
    if len(cos) >= 2 * blocks:
        mean, half, used = batch_means_interval(cos, blocks)
        return mean, half, used, f"batch means over {blocks} blocks"
    mean, half = mean_interval(cos)
    return mean, half, len(cos), "t over steps (too few steps for blocks: too narrow)"


def _block_means(series: list[float], blocks: int) -> list[float]:
    """The block means batch_means_interval takes its interval over: the series cut into `blocks` contiguous blocks
    of equal length, the earliest values that do not fill one left out."""
    size = len(series) // blocks
    used = series[len(series) - size * blocks:]
    return [math.fsum(used[i * size:(i + 1) * size]) / size for i in range(blocks)]


def _arm_sample(series_list: list[list[float]], blocks: int) -> tuple[list[float], str]:
    """What one arm's mean and its spread are taken over: with one run, its block means (nearly independent where a
    step's neighbours are not), or its steps where it has too few for blocks; with several seeds, each seed's mean
    cosine (the seeds are independent, and a seed's block means would understate what seeds vary by)."""
    runs = [[float(c) for c in s if c is not None and math.isfinite(c)] for s in series_list]
    runs = [r for r in runs if r]
    if len(runs) >= 2:
        return [math.fsum(r) / len(r) for r in runs], f"{len(runs)} seeds' mean cosines"
    if not runs:
        return [], "no cosines"
    if len(runs[0]) >= 2 * blocks:
        return _block_means(runs[0], blocks), f"one run's {blocks} block means"
    return runs[0], "one run's steps (too few for blocks: too narrow)"


def cosine_difference(grpo_series_list: list[list[float]], placebo_series_list: list[list[float]],
                      blocks: int = COSINE_BLOCKS) -> dict:
    """GRPO's mean step cosine minus its placebo's with a 95% Welch interval (recam.infra.stats.welch_difference,
    unequal variances). Each arm is a list of runs' step-cosine series in time order (step_cosines). An arm of one run
    enters as its block means (their mean is its batch-means mean, their spread its batch-means standard error); an
    arm of several seeds as the seeds' mean cosines. The two arms' samples are independent, which is what Welch
    needs, whichever of the two forms each takes. Keys: difference, half (NaN where an arm has fewer than 2 values or
    neither spreads), low, high, df, grpo_mean, placebo_mean, grpo_n, placebo_n (values in each arm's sample),
    grpo_unit, placebo_unit (what those values are)."""
    a, a_unit = _arm_sample(grpo_series_list, blocks)
    b, b_unit = _arm_sample(placebo_series_list, blocks)
    diff, half, df = welch_difference(a, b)
    return {"difference": diff, "half": half, "low": diff - half, "high": diff + half, "df": df,
            "grpo_mean": math.fsum(a) / len(a) if a else math.nan,
            "placebo_mean": math.fsum(b) / len(b) if b else math.nan,
            "grpo_n": len(a), "placebo_n": len(b), "grpo_unit": a_unit, "placebo_unit": b_unit}


def rule_update_noise(steps: list[dict], th: Thresholds) -> list[Finding]:
    """Info when consecutive optimizer steps' gradients barely agree (grad_cosine_prev, logged by the trainer).

    With g = s + n, s the expected gradient and n the noise of a step's own samples, independent between steps,
    E cos(g_t, g_t-1) ~ |s|^2 / (|s|^2 + var / N): near 0 an update's direction is mostly noise, and the samples per
    step that would bring the cosine to 1/2 are N (1 - c) / c. s is the whole loss's expected gradient, the KL pull
    toward the reference included. The interval is cosine_interval's (batch means over the steps in time order)."""
    cos = step_cosines(steps)
    if len(cos) < th.update_noise_min_steps:
        return []
    mean, half, used, how = cosine_interval(cos)
    if mean + half >= th.update_noise_cosine:
        return []
    sizes = [n for n in (_num(m, "step_samples") for m in steps) if _ok(n) and n > 0]
    n = statistics.median(sizes) if sizes else None
    numbers = {"mean_grad_cosine": mean, "interval_95": half, "steps": len(cos), "steps_used": used,
               "interval": how, "samples_per_step": n}
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
    over = f"{len(cos)} steps" if used == len(cos) else f"the last {used} of {len(cos)} steps"
    return [Finding(
        "update_noise", "info", numbers,
        f"Consecutive optimizer steps' gradients agree at cosine {mean:.3f} +- {half:.3f} (95%, {how}, {over}"
        + (f", {n:.0f} samples each" if n is not None else "") + "): an update's direction is mostly the noise of "
        "its own samples, not the loss's expected gradient (the reward's and the KL pull's together), so the weights "
        "take a random walk around it." + need,
        ["more samples per optimizer step (sample.num_batches_per_epoch with train.gradient_accumulation_steps "
         "covering them)", "train only the steps whose gradients carry the signal (sample.window_size; "
         "scripts/measure/gradient_agreement.py measures each step's share)"])]


def _sig2(x: float) -> str:
    """x rounded to two significant digits, with thousands separators: 11,000 for 10,873."""
    if x <= 0 or not math.isfinite(x):
        return f"{x:g}"
    rounded = round(x, 1 - int(math.floor(math.log10(x))))
    return f"{rounded:,.0f}" if rounded >= 10 else f"{rounded:.2g}"


def _noise_epochs(epochs: list[dict]) -> list[dict]:
    return [r for r in epochs if "gradient_noise_scale" in r]


def run_noise_scale(epochs: list[dict]) -> dict | None:
    """The run's gradient noise scale from every epoch's own estimates (noise/g2, noise/trace: unbiased, each the mean
    over its optimizer steps): their means over the epochs weighted by steps, with a 95% t-interval over epochs for
    |G|^2 (g2_half). That interval decides what can be said. Where it contains 0 the signal is not measured, and a
    ratio to an estimate that may be 0 is no estimate (on runs of a known noise scale of 10,000 samples, an
    independent check found the old point values' median at 2,000-4,300): `noise_scale` is None and only `at_least`
    is given, trace / (upper bound of |G|^2), the noise scale the run rules out being below (95%). Where it excludes
    0, `noise_scale` is trace / |G|^2 with its 95% interval (noise_scale_low, noise_scale_high) from a bootstrap over
    epochs (recam.engine.noise_scale.bootstrap_ratio_interval; the upper end inf where it is open). The consistent
    share 1 / (1 + B_simple / B) is what repeats between independent updates, the KL pull included. None with fewer
    than two epochs carrying estimates (one epoch has no interval: its running means are then the record's own)."""
    rows = [(r, _num(r, "noise/g2"), _num(r, "noise/trace"), _num(r, "noise/steps")) for r in _noise_epochs(epochs)]
    rows = [(r, g, t, n) for r, g, t, n in rows if _ok(g) and _ok(t) and _ok(n) and n > 0]
    if len(rows) < 2:
        return None
    weights = [n for *_, n in rows]
    total = sum(weights)
    g2 = sum(g * w for (_, g, _, _), w in zip(rows, weights, strict=True)) / total
    trace = sum(t * w for (_, _, t, _), w in zip(rows, weights, strict=True)) / total
    # the interval treats the epochs as the independent draws: a step-weighted mean's standard error
    spread = sum(w * (g - g2) ** 2 for (_, g, _, _), w in zip(rows, weights, strict=True)) / total
    half = t975(len(rows) - 1) * math.sqrt(spread * sum(w * w for w in weights) / total ** 2 * len(rows)
                                           / (len(rows) - 1))
    samples = _num(rows[-1][0], "noise/update_samples")
    measured = g2 - half > 0 and trace > 0
    low = high = None
    if measured:
        low, high = bootstrap_ratio_interval([g for _, g, _, _ in rows], [t for _, _, t, _ in rows], weights)
    out = {"epochs": len(rows), "steps": int(total), "g2": g2, "g2_half": half, "trace": trace,
           "update_samples": samples, "g2_excludes_0": measured, "noise_scale": trace / g2 if measured else None,
           "noise_scale_low": low, "noise_scale_high": high,
           "at_least": trace / (g2 + half) if g2 + half > 0 and trace > 0 else None}
    out["consistent_share"] = (1 / (1 + out["noise_scale"] / samples)) if out["noise_scale"] and samples else None
    out["consistent_share_at_most"] = (1 / (1 + out["at_least"] / samples)) if out["at_least"] and samples else None
    return out


def _bound(x: float) -> str:
    return _sig2(x) if math.isfinite(x) else "open"


def noise_scale_line(records: list[dict]) -> str | None:
    """One line on what the run's gradient noise scale means for its updates, from the estimates of every epoch
    (run_noise_scale): where |G|^2's interval excludes 0, "updates of 128 samples are about 1.2% consistent (...;
    noise scale ~11,000 samples, 95% [4,000, 60,000] by bootstrap over 12 epochs, 12 steps)"; where it contains 0,
    only the noise scale the run rules out being below. "Consistent": the share of an update that repeats between
    independent updates, the KL pull toward the reference included, so not the reward's signal alone. With one
    epoch, its running means, said to have no interval; where nothing was measured, why; None for records from
    before it was logged."""
    epochs = _noise_epochs([r for r in records if r.get("type") == "epoch"])
    if not epochs:
        return None
    run = run_noise_scale(epochs)
    if run is not None and run["update_samples"]:
        B, n = run["update_samples"], f"over {run['epochs']} epochs, {run['steps']} steps"
        if run["noise_scale"] is not None:
            return (f"updates of {B:.0f} samples are about {100 * run['consistent_share']:.2g}% consistent (the share "
                    f"that repeats between independent updates, KL pull included; noise scale "
                    f"~{_sig2(run['noise_scale'])} samples, 95% [{_bound(run['noise_scale_low'])}, "
                    f"{_bound(run['noise_scale_high'])}] by bootstrap {n})")
        if run["at_least"] is not None:
            return (f"updates of {B:.0f} samples are at most {100 * run['consistent_share_at_most']:.2g}% consistent "
                    f"(KL pull included): the noise scale is at least {_sig2(run['at_least'])} samples (95% {n}; "
                    "|G|^2's interval contains 0, so no point value: the signal is too small for these updates to "
                    "measure)")
        return (f"gradient noise scale: no bound ({n}: |G|^2's 95% interval lies at or below 0, or tr(Sigma) is not "
                "above 0)")
    measured = [r for r in epochs if _ok(_num(r, "gradient_noise_scale")) and _ok(_num(r, "noise/update_samples"))]
    if not measured:
        why = epochs[-1].get("noise/reason") or "no estimate"
        return f"gradient noise scale: not measured ({why})"
    r = measured[-1]
    b_noise, B = _num(r, "gradient_noise_scale"), _num(r, "noise/update_samples")
    share = consistent_share_of(r)
    share = share if _is_number(share) and _ok(share) else 1 / (1 + b_noise / B)
    steps = _num(r, "noise/steps_running")
    over = f"running mean over {int(steps)} steps, " if steps else ""
    return (f"updates of {B:.0f} samples are about {100 * share:.2g}% consistent (KL pull included; noise scale "
            f"~{_sig2(b_noise)} samples, {over}epoch {r.get('epoch')} alone: no interval, which takes two epochs)")


def rule_noise_scale(epochs: list[dict], th: Thresholds) -> list[Finding]:
    """Info when the run's updates are far below its gradient noise scale B_simple (under th.noise_scale_fraction
    of it): an update of B samples then repeats about B / B_simple of itself in the next one (the expected cosine
    between two updates of B samples is 1 / (1 + B_simple / B)), and one of about B_simple samples would repeat half.
    The run's estimate over its epochs (run_noise_scale) decides: its point value where |G|^2's interval excludes 0,
    else the noise scale it is at least; with one epoch, that epoch's running means (no interval)."""
    run = run_noise_scale(epochs)
    if run is not None and run["update_samples"] and not (run["noise_scale"] or run["at_least"]):
        return []  # |G|^2's interval at or below 0 bounds nothing; one epoch's running means would say too much
    if run is not None and run["update_samples"]:
        b_noise, B = run["noise_scale"] or run["at_least"], run["update_samples"]
        lower = run["noise_scale"] is None
        where = (f"95% over {run['epochs']} epochs; |G|^2's interval contains 0, so no point value" if lower else
                 f"95% [{_bound(run['noise_scale_low'])}, {_bound(run['noise_scale_high'])}] by bootstrap over "
                 f"{run['epochs']} epochs")
        numbers = {"epochs": run["epochs"], "update_samples": B, "gradient_noise_scale": run["noise_scale"],
                   "gradient_noise_scale_low": run["noise_scale_low"],
                   "gradient_noise_scale_high": run["noise_scale_high"],
                   "gradient_noise_scale_at_least": run["at_least"], "g2": run["g2"], "g2_ci95": run["g2_half"],
                   "trace": run["trace"]}
    else:
        measured = [r for r in _noise_epochs(epochs) if _ok(_num(r, "gradient_noise_scale"))
                    and _ok(_num(r, "noise/update_samples"))]
        if not measured:
            return []
        r = measured[-1]
        b_noise, B, lower = _num(r, "gradient_noise_scale"), _num(r, "noise/update_samples"), False
        where = f"epoch {r.get('epoch')}, running means, no interval"
        numbers = {"epoch": r.get("epoch"), "update_samples": B, "gradient_noise_scale": b_noise}
    if B >= th.noise_scale_fraction * b_noise:
        return []
    share = 1 / (1 + b_noise / B)
    numbers |= {"update_consistent_share": share, "noise_scale_over_update": b_noise / B}
    about, scale = ("at most", f"at least {_sig2(b_noise)}") if lower else ("about", f"~{_sig2(b_noise)}")
    return [Finding(
        "update_below_noise_scale", "info", numbers,
        f"Updates of {B:.0f} samples are {about} {100 * share:.2g}% consistent between independent updates (the "
        f"reward's signal and the KL pull together): the gradient noise scale is {scale} samples, "
        f"{b_noise / B:.0f} times an update ({where}). Each update's direction is mostly the noise of its own "
        f"samples; {'at least ' if lower else 'about '}{_sig2(b_noise)} samples per update would make half of it "
        "repeat.",
        ["more samples per optimizer step (sample.num_batches_per_epoch with train.gradient_accumulation_steps "
         "covering them; the GPU presets in config/grpo.py)", "lower the noise per sample: train only the steps "
         "whose gradients carry the signal (sample.window_size; scripts/measure/gradient_agreement.py)"])]


def _judged_by_guard(record: dict, step_epochs: set | None) -> bool:
    """Whether the trainer's guard saw this epoch's rewards: it judges them at the epoch's optimizer steps, so an
    epoch that took none (every sample excluded) never entered its history. step_epochs: the epochs of the run's
    step records, None when they do not say (no step records, or some without an epoch)."""
    taken = record.get("optimizer_steps")
    if isinstance(taken, list):
        return bool(taken)
    return step_epochs is None or record.get("epoch") in step_epochs


def diagnose_run(records: list[dict], *, thresholds: Thresholds | None = None,
                 run_dir: str = "<run_dir>") -> list[Finding]:
    """Replay a run's records (step and epoch; others ignored; untyped dicts count as steps). Records the schema
    rejects are left out (screen_records; scripts/diagnose.py says how many and why).

    Step rules see the epoch's zero_std_ratio merged in (the epoch record is written after its steps, so
    it is looked up by epoch number). An epoch's reward rules compare it with the earlier epochs the guard judged,
    on the guard's own inputs (epoch_metrics), so that the two agree on the same records.
    """
    th = thresholds or DEFAULT
    records, _ = screen_records(records)
    epochs = [r for r in records if r.get("type") == "epoch"]
    zero_std = {r.get("epoch"): r["zero_std_ratio"] for r in epochs
                if _ok(_num(r, "zero_std_ratio"))}  # NaN: nothing was kept, and no step was taken
    collected: list[tuple[Finding, dict, str | None]] = []
    history: deque = deque(maxlen=max(th.median_window, th.kl_window))
    steps = []
    for r in records:
        if r.get("type", "step") != "step":
            continue
        m = {k: v for k, v in r.items() if k != "type"}
        steps.append(m)
        if "zero_std_ratio" not in m and m.get("epoch") in zero_std:
            m["zero_std_ratio"] = zero_std[m["epoch"]]
        for f in diagnose_step(m, history, thresholds=th, run_dir=run_dir):
            collected.append((f, _where(m), None))
        history.append(m)
    step_epochs = ({m["epoch"] for m in steps} if steps and all(isinstance(m.get("epoch"), int) for m in steps)
                   else None)
    judged = [_judged_by_guard(r, step_epochs) for r in epochs]
    for i, r in enumerate(epochs):
        earlier = [e for e, seen in zip(epochs[:i], judged[:i], strict=True) if seen]
        unseen = None if judged[i] else f"epoch {r.get('epoch')} took no optimizer step, so the guard never judged it"
        for f in diagnose_epoch(r, earlier, thresholds=th, run_dir=run_dir):
            # an epoch record's step is where its updates start; only step records locate a step
            collected.append((f, {"epoch": r.get("epoch")}, guard_cannot_judge(f) or unseen))
    collected += [(f, {}, guard_cannot_judge(f)) for f in rule_update_noise(steps, th)]
    collected += [(f, {"epoch": f.numbers.get("epoch")}, guard_cannot_judge(f)) for f in rule_noise_scale(epochs, th)]
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
