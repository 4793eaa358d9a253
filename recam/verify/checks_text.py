"""Checks over the epochs read from a `[GRPO Debug]` text log, and `verify_debug_log`, which runs them into a
`Report`. An epoch whose sampling facts were not read fails "could not verify"; a check a log gives no facts
for is not run, and the report notes so; a check it gives only some of its facts for warns "could not evaluate" and
never passes. The plan's arithmetic is checked where the log prints it: replicas x per-device batch x batches per
epoch = the samples gathered, the unique conditions = those samples / k, and each reward's shape (N,) or (N, T)
against the samples gathered and the advantages' T."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from recam.verify.checks_shared import EPS_DOMINATES, _guard, check_missing_epochs, check_unreadable, implied_reward_std
from recam.verify.core import FAIL, PASS, WARN, Check, Report, _short
from recam.verify.parse_text import SAMPLING_FIELDS, TAG, DebugEpoch, DebugLog, _count_diff


def check_debug_sampling_facts(ep: DebugEpoch) -> Check:
    """Whether this epoch's sampled conditions were read at all; every other check leans on them."""
    name = "sampling_facts"
    read = [f for f in SAMPLING_FIELDS if getattr(ep, f) is not None]
    unread = [f"line {line} ({fld}): {reason}" for fld, line, reason in ep.unread]
    nums = {"read": read, "unreadable_lines": [line for _, line, _ in ep.unread]}
    if not read:
        why = f"; {_short(unread, 4)}" if unread else " (neither was printed for this epoch)"
        return Check(name, FAIL, nums, "could not verify: neither the gathered dataset indices nor the counts per "
                                       f"condition were read{why}")
    what = " and ".join(f"gathered indices ({len(ep.indices)} samples)" if f == "indices" else
                        f"counts per condition ({len(ep.counts)} conditions)" for f in read)
    if unread:
        return Check(name, WARN, nums, f"verified from the {what}, but some lines of this epoch could not be read: "
                                       f"{_short(unread, 4)}")
    return Check(name, PASS, nums, f"read the {what}")


def _k_offenders(counts: dict, k: int | None) -> tuple[dict, str]:
    if k is not None:
        return {i: c for i, c in counts.items() if c != k}, f"k={k}"
    tally = Counter(counts.values()).most_common()
    if not tally:
        return {}, "k (not printed)"
    if len(tally) > 1 and tally[0][1] == tally[1][1]:
        return dict(counts), "one common count (k not printed, and no count is the most common)"
    mode = tally[0][0]
    return {i: c for i, c in counts.items() if c != mode}, f"the common count {mode} (k not printed)"


def _ids(d: dict) -> list[str]:
    return [f"{i}: {c}" for i, c in sorted(d.items(), key=lambda kv: str(kv[0]))]


def check_debug_counts(ep: DebugEpoch, k: int | None) -> Check:
    name = "count_per_condition"
    counts = ep.sampled_counts()
    if counts is None:
        return Check(name, FAIL, {}, "could not verify: neither the gathered indices nor the counts were read")
    problems = []
    nums: dict[str, Any] = {"k": k, "conditions": len(counts), "samples": sum(counts.values())}
    if ep.indices is not None and ep.counts is not None:
        diff = _count_diff(ep.counts, counts)
        nums["disagreeing_with_indices"] = len(diff)
        if diff:
            problems.append(f"printed counts disagree with the counts recomputed from the gathered indices for "
                            f"conditions {_short(diff, 8)} (printed vs recomputed)")
    offenders, expected = _k_offenders(counts, k)
    nums["offenders"] = {str(i): c for i, c in offenders.items()}
    if offenders:
        problems.append(f"conditions without exactly {expected} copies: {_short(_ids(offenders), 8)}")
    if problems:
        return Check(name, FAIL, nums, "; ".join(problems))
    src = "the gathered indices" + (" (and the printed counts agree)" if ep.counts is not None else "") \
        if ep.indices is not None else "the printed counts"
    return Check(name, PASS, nums, f"{len(counts)} conditions, each with {expected} copies, from {src}")


def check_debug_unique(ep: DebugEpoch, k: int | None) -> Check:
    name = "unique_conditions"
    counts = ep.sampled_counts()
    nums: dict[str, Any] = {"printed": ep.unique, "from_indices": len(set(ep.indices)) if ep.indices else None,
                            "counts_dict_size": len(ep.counts) if ep.counts is not None else None}
    if counts is None:
        return Check(name, WARN, nums, "not compared: no gathered indices or counts were read for this epoch")
    problems = []
    off = _short(_ids(_k_offenders(counts, k)[0]), 8)
    if ep.indices is not None and ep.counts is not None and set(ep.counts) != set(ep.indices):
        only_c = sorted(set(ep.counts) - set(ep.indices), key=str)
        only_i = sorted(set(ep.indices) - set(ep.counts), key=str)
        problems.append(f"the counts dict names {len(ep.counts)} conditions, the indices {len(set(ep.indices))}: "
                        f"only in the dict {_short(only_c)}; only in the indices {_short(only_i)}")
    if ep.unique is not None and ep.unique != len(counts):
        problems.append(f"printed {ep.unique} unique conditions but the "
                        f"{'indices' if ep.indices is not None else 'counts dict'} hold {len(counts)}"
                        + (f" (conditions off the common count: {off})" if off else ""))
    n = sum(counts.values())
    if k:
        nums["expected_N_over_k"] = n / k
        if len(counts) * k != n:
            problems.append(f"{len(counts)} conditions x k={k} != {n} samples (conditions off k: {off})")
    if problems:
        return Check(name, FAIL, nums, "; ".join(problems))
    if ep.unique is None and not k and (ep.indices is None or ep.counts is None):
        # one source of the conditions and nothing to hold it against: counted, not verified
        return Check(name, WARN, nums, f"not compared: {len(counts)} conditions read, but the log prints neither their "
                                       "number nor k, nor both the indices and the counts")
    said = f"printed {ep.unique} = " if ep.unique is not None else ""
    return Check(name, PASS, nums, f"{said}{len(counts)} unique conditions")


def check_debug_shape(ep: DebugEpoch) -> Check:
    name = "advantage_shape"
    n = ep.n_samples()
    nums = {"shape": list(ep.shape) if ep.shape else None, "samples": n}
    if ep.shape is None:
        return Check(name, WARN, nums, "advantages shape not read for this epoch")
    if n is None:
        return Check(name, WARN, nums, "not compared: no gathered indices or counts were read for this epoch")
    if ep.shape[0] != n:
        return Check(name, FAIL, nums, f"advantages have {ep.shape[0]} rows but {n} samples were gathered")
    return Check(name, PASS, nums, f"advantages shape {tuple(ep.shape)} has one row per gathered sample")


def check_debug_condition_samples(ep: DebugEpoch, k: int | None) -> Check:
    """Per-condition `samples=` against the copies gathered (or k when nothing was gathered)."""
    name = "condition_samples"
    printed = {c: s["samples"] for c, s in ep.cond_stats.items() if "samples" in s}
    counts = ep.sampled_counts()
    nums: dict[str, Any] = {"conditions": len(printed)}
    if not printed:
        return Check(name, WARN, nums, "no per-condition samples= printed for this epoch")
    if counts is None:
        if k is None:
            return Check(name, WARN, nums, "not compared: no indices, counts or k read for this epoch")
        bad = {c: s for c, s in printed.items() if s != k}
        ref = f"k={k}"
    else:
        bad = {c: s for c, s in printed.items() if counts.get(c) != s}
        ref = "the copies gathered"
    nums["mismatches"] = len(bad)
    if bad:
        listed = [f"{c}: samples={s} but {counts.get(c, 0) if counts is not None else k} "
                  f"{'gathered' if counts is not None else 'expected'}" for c, s in sorted(bad.items(), key=str)]
        return Check(name, FAIL, nums, f"per-condition samples= disagree with {ref}: {_short(listed, 8)}")
    return Check(name, PASS, nums, f"{len(printed)} per-condition samples= equal {ref}")


def check_debug_advantages(ep: DebugEpoch, tol: float, eps: float = 1e-4) -> Check:
    name = "advantage_per_condition"
    stats = {c: s for c, s in ep.cond_stats.items() if "mean" in s or "std" in s}
    if not stats:
        return Check(name, WARN, {}, "no per-condition advantage mean/std for this epoch")
    counts = ep.sampled_counts()
    rows = []
    for g, st in sorted(stats.items(), key=lambda kv: str(kv[0])):
        mean, std = st.get("mean"), st.get("std")
        n = st.get("samples", counts.get(g) if counts else None)
        row = {"condition": g, "id": "", "samples": n, "mean": mean, "std": std, "reward_std": None}
        bessel = math.sqrt(n / (n - 1)) if n and n > 1 else None
        if mean is None or std is None:
            row["status"], row["note"] = WARN, f"only the {'mean' if std is None else 'std'} was printed"
        elif std == 0 and mean == 0:
            row["status"], row["note"] = PASS, "zero-std group: all 0"
        elif std == 0:
            row["status"], row["note"] = FAIL, "std 0 but mean is not 0"
        elif not abs(mean) <= tol:
            row["status"], row["note"] = FAIL, f"mean {mean:.4g} is not 0"
        elif abs(std - 1) <= tol:
            row["status"], row["note"] = PASS, ""
        elif bessel and (abs(std - bessel) <= tol or abs(std - 1 / bessel) <= tol):
            # normalised with one std convention (population / unbiased) and printed with the other
            row["status"], row["note"] = PASS, f"std {std:.4g} = 1 up to the n/(n-1) factor for n={n}"
        elif 0 < std < 1:
            # (r - mean) / (s + eps) has std s / (s + eps) < 1 for every group: the std tells the reward std s it
            # came from. Only a group whose s is a few eps has advantages that eps rather than the rewards sets.
            implied = implied_reward_std(std, eps)
            row["reward_std"] = implied
            row["status"] = WARN if implied < EPS_DOMINATES * eps else PASS
            row["note"] = (f"std {std:.4g} = s/(s+eps) for a reward std s = {implied:.3g} (eps {eps:g})"
                           + (f": below {EPS_DOMINATES:g} eps, eps sets these advantages" if row["status"] == WARN
                              else ""))
        else:
            row["status"], row["note"] = FAIL, f"std {std:.4g} is neither 1 nor exactly 0"
        if counts is not None and g not in counts:
            row["status"], row["note"] = FAIL, "condition was not among the gathered conditions"
        rows.append(row)
    missing = sorted(set(counts) - set(stats), key=str) if counts else []
    tally = Counter(r["status"] for r in rows)
    nums = {"conditions": len(rows), "pass": tally[PASS], "warn": tally[WARN], "fail": tally[FAIL],
            "not_printed": missing}
    bad = [f"{r['condition']}: {r['note']}" for r in rows if r["status"] == FAIL]
    if bad:
        return Check(name, FAIL, nums, f"{len(bad)} of {len(rows)} conditions fail: {_short(bad, 6)}", table=rows)
    if missing or tally[WARN]:
        parts = [f"no advantage line for conditions {_short(missing)}"] if missing else []
        parts += [f"{r['condition']}: {r['note']}" for r in rows if r["status"] == WARN][:6]
        return Check(name, WARN, nums, "; ".join(parts), table=rows)
    implied = [r["reward_std"] for r in rows if r["reward_std"] is not None]
    if implied:
        nums["min_implied_reward_std"] = min(implied)
        return Check(name, PASS, nums, f"{len(rows)} conditions with mean 0 and std 1 (or exactly 0), or std "
                                       f"s/(s+eps) for a reward std s of at least {EPS_DOMINATES:g} eps (smallest "
                                       f"implied s {min(implied):.3g}, eps {eps:g})", table=rows)
    return Check(name, PASS, nums, f"{len(rows)} conditions with mean 0 and std 1 (or exactly 0)", table=rows)


_SETTING_WORDS = {"replicas": "replicas", "batch": "per device", "batches": "batches", "global_batch": "global batch"}


def expected_samples(settings: dict) -> tuple[int | None, str, list[str]]:
    """(samples an epoch gathers by the log's batch arithmetic, how, the settings still missing): replicas x batch x
    batches, or global batch x batches; with a global batch as well, replicas x batch must equal it (checked by the
    caller). None when the printed settings do not determine it."""
    p, b, nb, g = (settings.get(k) for k in ("replicas", "batch", "batches", "global_batch"))
    if p is not None and b is not None and nb is not None:
        return p * b * nb, f"{p} replicas x {b} per device x {nb} batches = {p * b * nb}", []
    if g is not None and nb is not None:
        return g * nb, f"global batch {g} x {nb} batches = {g * nb}", []
    missing = ["batches per epoch"] if nb is None else []
    if g is None:
        missing += [word for key, word in (("replicas", "replicas"), ("batch", "per-device batch size"))
                    if settings.get(key) is None]
    return None, "", missing


def check_debug_sample_arithmetic(ep: DebugEpoch) -> Check:
    """replicas x per-device batch x batches per epoch = the samples gathered (and the samples the log says it
    gathered). A part of the arithmetic the log does not print leaves the check unevaluated: a warning, never a pass."""
    name = "sample_arithmetic"
    s = ep.settings
    total, how, missing = expected_samples(s)
    gathered = ep.n_samples()
    nums: dict[str, Any] = {**{k: s.get(k) for k in ("replicas", "batch", "batches", "global_batch")},
                            "expected_samples": total, "gathered_samples": gathered, "printed_samples": ep.samples}
    if total is None:
        printed = ", ".join(f"{w} {s[k]}" for k, w in _SETTING_WORDS.items() if k in s) or "nothing of it"
        return Check(name, WARN, nums, f"could not evaluate: the log prints {printed}, but not the "
                                       f"{' or '.join(missing)} the arithmetic needs")
    problems = []
    p, b, g = s.get("replicas"), s.get("batch"), s.get("global_batch")
    if p is not None and b is not None and g is not None and p * b != g:
        problems.append(f"{p} replicas x {b} per device = {p * b}, but the log prints a global batch of {g}")
    if gathered is not None and gathered != total:
        problems.append(f"{how} samples expected, but {gathered} were gathered")
    if ep.samples is not None and ep.samples != total:
        problems.append(f"{how} samples expected, but the log says {ep.samples} were gathered")
    if gathered is not None and ep.samples is not None and gathered != ep.samples:
        problems.append(f"the log says {ep.samples} samples were gathered, the indices hold {gathered}")
    if problems:
        return Check(name, FAIL, nums, "; ".join(dict.fromkeys(problems)))
    if gathered is None and ep.samples is None:
        return Check(name, WARN, nums, f"could not evaluate: {how} samples expected, but no gathered samples were read")
    src = "gathered" if gathered is not None else "said gathered"
    return Check(name, PASS, nums, f"{how} samples, as {src}")


def check_debug_condition_arithmetic(ep: DebugEpoch, k: int | None) -> Check:
    """The unique conditions of an epoch = the samples its batch arithmetic gives / k. Unevaluated (a warning) when
    k, the arithmetic or the conditions are not in the log."""
    name = "condition_arithmetic"
    total, how, missing = expected_samples(ep.settings)
    counts = ep.sampled_counts()
    found = len(counts) if counts is not None else ep.unique
    nums: dict[str, Any] = {"expected_samples": total, "k": k, "unique_conditions": found}
    if total is None or k is None or found is None:
        why = ("the batch arithmetic is incomplete (" + ", ".join(missing) + " not printed)" if total is None else
               "k is not printed" if k is None else "no conditions were read")
        return Check(name, WARN, nums, f"could not evaluate: {why}")
    if k < 1 or total % k:
        return Check(name, FAIL, nums, f"k={k} does not divide the {total} samples of {how}")
    nums["expected_conditions"] = total // k
    said = f"; the log says {ep.unique}" if counts is not None and ep.unique is not None and ep.unique != found else ""
    if found != total // k or said:
        return Check(name, FAIL, nums, f"{how} samples / k={k} = {total // k} unique conditions expected, but "
                                       f"{found} were {'gathered' if counts is not None else 'printed'}{said}")
    return Check(name, PASS, nums, f"{how} samples / k={k} = {found} unique conditions")


def check_debug_reward_shapes(ep: DebugEpoch) -> Check:
    """Each printed reward shape against the log's N (the samples gathered) and T (the advantages' second dimension,
    else the printed timesteps): (N,) or (N, T). What the log does not give is not compared, and said so."""
    name = "reward_shapes"
    n = ep.n_samples() if ep.n_samples() is not None else ep.samples
    t_adv = ep.shape[1] if ep.shape is not None and len(ep.shape) == 2 else None
    t_set = ep.settings.get("timesteps")
    t = t_adv if t_adv is not None else t_set
    nums: dict[str, Any] = {"N": n, "T": t, "shapes": {k or "(unnamed)": list(v) for k, v in ep.reward_shapes.items()}}
    if not ep.reward_shapes:
        return Check(name, WARN, nums, "no reward shape printed for this epoch")
    problems, unknown = [], []
    if t_adv is not None and t_set is not None and t_adv != t_set:
        problems.append(f"the advantages have T={t_adv} timesteps but the log prints T={t_set}")
    for key, shape in sorted(ep.reward_shapes.items()):
        label = f"reward {key}" if key else "the reward"
        if len(shape) not in (1, 2):
            problems.append(f"{label} has shape {shape}: neither (N,) nor (N, T)")
            continue
        if n is None:
            unknown.append(f"{label}'s N (no gathered samples read)")
        elif shape[0] != n:
            problems.append(f"{label} has shape {shape}, but {n} samples were gathered")
        if len(shape) == 2 and t is None:
            unknown.append(f"{label}'s T (the log prints neither a 2-D advantages shape nor T)")
        elif len(shape) == 2 and shape[1] != t:
            src = "the advantages" if t_adv is not None else "the log's T"
            problems.append(f"{label} has shape {shape}, but {src} have T={t}")
    if problems:
        return Check(name, FAIL, nums, "; ".join(problems))
    if unknown:
        return Check(name, WARN, nums, "could not compare " + ", ".join(unknown))
    return Check(name, PASS, nums, f"{len(ep.reward_shapes)} reward shape(s), each (N,) or (N, T) = ({n}, {t})"
                 if t is not None else f"{len(ep.reward_shapes)} reward shape(s), each ({n},)")


def check_debug_ranks(ep: DebugEpoch) -> Check:
    name = "ranks_agree"
    repeats = sum(len(v) - 1 for v in ep.sources.values())
    nums = {"repeated_statements": repeats, "disagreements": len(ep.conflicts)}
    if ep.conflicts:
        return Check(name, FAIL, nums, f"the same fact printed twice disagrees: {_short(ep.conflicts, 4)}")
    return Check(name, PASS, nums, f"{repeats} repeated statements (other ranks) agree")


def verify_debug_log(log: DebugLog, tol: float = 1e-3, source: str = "train.log", eps: float = 1e-4) -> Report:
    """Checks over the [GRPO Debug] lines of a text log.

    Every epoch must have its sampled conditions (gathered indices or counts per condition) read, or it fails
    "could not verify"; a log without any epoch fails. Checks of facts the log never prints (shape, per-condition
    lines) are not run, and the report notes so.
    """
    checks = [check_unreadable(log.unreadable)]
    verified = [ep for ep in log.epochs if any(getattr(ep, f) is not None for f in SAMPLING_FIELDS)]
    nums = {"debug_lines": log.debug_lines, "epochs": len(log.epochs), "epochs_with_sampling_facts": len(verified)}
    if not log.debug_lines:
        checks.append(Check("epoch_records", FAIL, nums, f"no {TAG} line in the log: nothing could be verified"))
    elif not log.epochs:
        checks.append(Check("epoch_records", FAIL, nums, f"no readable {TAG} epoch in the log"))
    else:
        how = "numbered in the log" if log.explicit_epochs else "inferred from the order of the lines"
        status = PASS if verified else FAIL
        checks.append(Check("epoch_records", status, nums, f"{len(log.epochs)} epochs ({how}), {len(verified)} with "
                                                           "their sampling facts read"))
    if log.explicit_epochs:
        checks += _guard("missing_epochs", check_missing_epochs,
                         [ep.epoch for ep in log.epochs if ep.epoch is not None])
    printed = {
        "shape": any(ep.shape is not None or any(f == "shape" for f, _, _ in ep.unread) for ep in log.epochs),
        "arithmetic": bool(log.setting_values) or any(ep.samples is not None for ep in log.epochs),
        "reward_shapes": any(ep.reward_shapes or any(f == "reward_shape" for f, _, _ in ep.unread)
                             for ep in log.epochs),
        "stats": any("mean" in s or "std" in s for ep in log.epochs for s in ep.cond_stats.values()),
        "samples": any("samples" in s for ep in log.epochs for s in ep.cond_stats.values()),
    }
    for ep in log.epochs:
        epoch_checks = _guard("sampling_facts", check_debug_sampling_facts, ep)
        epoch_checks += _guard("count_per_condition", check_debug_counts, ep, ep.k)
        epoch_checks += _guard("unique_conditions", check_debug_unique, ep, ep.k)
        if printed["shape"]:
            epoch_checks += _guard("advantage_shape", check_debug_shape, ep)
        if printed["arithmetic"]:
            epoch_checks += _guard("sample_arithmetic", check_debug_sample_arithmetic, ep)
            epoch_checks += _guard("condition_arithmetic", check_debug_condition_arithmetic, ep, ep.k)
        if printed["reward_shapes"]:
            epoch_checks += _guard("reward_shapes", check_debug_reward_shapes, ep)
        if printed["samples"]:
            epoch_checks += _guard("condition_samples", check_debug_condition_samples, ep, ep.k)
        if printed["stats"]:
            epoch_checks += _guard("advantage_per_condition", check_debug_advantages, ep, tol, eps)
        if ep.conflicts or any(len(v) > 1 for v in ep.sources.values()):
            epoch_checks += _guard("ranks_agree", check_debug_ranks, ep)
        for c in epoch_checks:
            c.epoch = ep.label
        checks += epoch_checks
    notes = []
    if not log.explicit_epochs and log.epochs:
        notes.append("epochs are numbered by the order of their lines (the log prints no epoch numbers)")
    ks = sorted({k for _, k in log.k_values})
    if not ks and log.epochs:
        notes.append("k is not printed: each epoch's counts are compared with their most common value")
    elif len(ks) > 1:
        notes.append(f"k printed with different values {ks}: each epoch uses the last one printed before its end")
    for what, key in (("advantages shape", "shape"), ("per-condition advantage mean/std", "stats"),
                      ("per-condition samples=", "samples"), ("reward shapes", "reward_shapes")):
        if log.epochs and not printed[key]:
            notes.append(f"the log never prints the {what}: that check was not run")
    if log.epochs and not printed["arithmetic"]:
        notes.append("the log never prints its batch arithmetic (replicas, per-device batch size, batches per epoch) "
                     "or the samples it gathered: replicas x batch x batches = samples and conditions = samples / k "
                     "were not checked")
    if log.ignored:
        notes.append("keys read but not used by any check: "
                     + ", ".join(f"{k} ({n})" for k, n in sorted(log.ignored.items())[:20]))
    return Report(source, "[GRPO Debug] text log", checks, log.unreadable, [ep.label for ep in log.epochs],
                  {"tol": tol}, notes)
