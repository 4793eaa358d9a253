"""Checks over a parsed `metrics.jsonl`: per epoch record (`EPOCH_CHECKS`), over the step records, and
`verify_metrics`, which runs them all into a `Report`."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from recam.infra.schema import REWARD_BOOKKEEPING
from recam.verify.advantages import recompute_advantages
from recam.verify.checks_noise import check_noise_scale
from recam.verify.checks_shared import EPS_DOMINATES, _guard, check_missing_epochs, check_unreadable
from recam.verify.core import FAIL, PASS, WARN, Check, Report, _array, _close, _float, _get, _int, _short, worst
from recam.verify.parse_metrics import ParsedLog


@dataclass
class Settings:
    tol: float = 1e-3
    std_mode: str = "group"
    eps: float = 1e-4
    config: dict | None = None
    placebo: bool = False  # advantage.placebo: advantages are a within-group permutation of the normalised rewards
    unbiased: bool = False  # advantage.unbiased_std: the stds divided by have Bessel's correction


def settings_from_config(config: dict | None, tol: float = 1e-3) -> Settings:
    std_mode = _get(config, "advantage", "std_mode")
    eps = _float(_get(config, "advantage", "eps"))
    return Settings(tol=tol, std_mode=std_mode if std_mode in ("group", "global", "none") else "group",
                    eps=1e-4 if eps is None else eps, config=config if isinstance(config, dict) else None,
                    placebo=_get(config, "advantage", "placebo") is True,
                    unbiased=_get(config, "advantage", "unbiased_std") is True)


class EpochView:
    """One epoch record with its arrays converted once; a field that cannot be read is None."""

    def __init__(self, rec: dict):
        self.rec = rec
        self.epoch = _int(rec.get("epoch"))
        idx = rec.get("dataset_indices")
        self.indices = [int(i) for i in idx] if isinstance(idx, list) and all(_int(i) is not None for i in idx) \
            else None
        self.N = len(self.indices) if self.indices is not None else None
        self.k = _int(rec.get("k"))
        self.P = _int(rec.get("num_processes"))
        self.bs = _int(rec.get("per_device_batch"))
        self.nb = _int(rec.get("num_batches_per_epoch"))
        self.T = _int(rec.get("num_train_timesteps"))
        self.total = self.nb * self.P * self.bs if None not in (self.nb, self.P, self.bs) else None
        self.m = self.total // self.k if self.total is not None and self.k else None
        self.rewards = {key[len("rewards/"):]: _array(v) for key, v in rec.items() if key.startswith("rewards/")}
        self.adv = _array(rec.get("advantages"))
        excluded = rec.get("excluded")
        self.keep = (~np.asarray(excluded, dtype=bool) if isinstance(excluded, list) and len(excluded) == (self.N or -1)
                     and all(isinstance(x, bool) for x in excluded)
                     else None)  # samples the trainer kept in the advantages (a failed reward excludes one)
        # copies of each condition drawn (every gathered sample) and kept (what the group statistics are over): an
        # excluded sample is a copy that was drawn and not trained on, never a missing copy
        self.drawn = Counter(self.indices) if self.indices is not None else None
        self.kept = (Counter(i for i, k in zip(self.indices, self.keep.tolist(), strict=True) if k)
                     if self.keep is not None else self.drawn)
        self.excluded = int((~self.keep).sum()) if self.keep is not None else 0
        avg = self.rewards.get("avg")
        self.r0 = None
        if avg is not None and avg.ndim in (1, 2) and avg.shape[0] == (self.N or -1):
            self.r0 = avg[:, 0] if avg.ndim == 2 and avg.shape[1] > 0 else (avg if avg.ndim == 1 else None)
        self.a0 = None
        if self.adv is not None and self.adv.ndim in (1, 2) and self.adv.shape[0] == (self.N or -1):
            self.a0 = self.adv[:, 0] if self.adv.ndim == 2 and self.adv.shape[1] > 0 else (
                self.adv if self.adv.ndim == 1 else None)

    def missing(self, *keys: str) -> list[str]:
        return [k for k in keys if k not in self.rec]


def _not_logged(name: str, missing: list[str]) -> Check:
    return Check(name, FAIL, {"missing": missing}, f"not logged or unreadable: {', '.join(missing)}")


def check_sampling_facts(v: EpochView, s: Settings) -> Check:
    """The gathered dataset indices are what every sampling check reads: without them the epoch is unverified."""
    name = "sampling_facts"
    if v.indices is not None:
        return Check(name, PASS, {"samples": v.N}, f"dataset_indices read ({v.N} samples)")
    why = "not logged" if "dataset_indices" not in v.rec else "not a list of integers"
    return Check(name, FAIL, {"missing": ["dataset_indices"]},
                 f"could not verify: dataset_indices {why}, so what was sampled this epoch is unknown")


def check_config_arithmetic(v: EpochView, s: Settings) -> Check:
    name = "config_arithmetic"
    need = {"num_batches_per_epoch": v.nb, "num_processes": v.P, "per_device_batch": v.bs, "k": v.k}
    missing = [k for k, x in need.items() if x is None]
    if missing:
        return _not_logged(name, missing)
    total, k = v.total, v.k
    nums = {"num_batches_per_epoch": v.nb, "num_processes": v.P, "per_device_batch": v.bs, "k": k,
            "total_samples": total, "unique_conditions": total / k if total % k else total // k}
    problems = []
    if k < 1 or total % k:
        problems.append(f"k={k} does not divide {v.nb} x {v.P} x {v.bs} = {total} samples")
    per_batch = v.P * v.bs
    expected = {"samples_per_epoch": total, "unique_conditions_per_epoch": total // k if k else None,
                "samples_per_batch": per_batch, "conditions_per_batch": per_batch // k if k else None}
    for key, want in expected.items():
        got = v.rec.get(key)
        if got is not None:
            nums[f"logged_{key}"] = got
            if _int(got) != want:
                problems.append(f"logged {key}={got} but the arithmetic gives {want}")
    if k and per_batch % k:
        problems.append(f"k={k} does not divide one sampling batch of {per_batch}: groups straddle batches")
    cfg = s.config
    for section, key, got in (("sample", "batch_size", v.bs), ("sample", "k", k),
                              ("sample", "num_batches_per_epoch", v.nb)):
        want = _int(_get(cfg, section, key))
        if want is not None and want != got:
            problems.append(f"config.json {section}.{key}={want} but the epoch record says {got}")
    expected_procs = _int(cfg.get("expected_num_processes")) if cfg else None
    if expected_procs and expected_procs != v.P:
        problems.append(f"config.json expected_num_processes={expected_procs} but {v.P} processes ran")
    if problems:
        return Check(name, FAIL, nums, "; ".join(problems))
    return Check(name, PASS, nums, f"{v.nb} batches x {v.P} processes x {v.bs} per device = {total} samples "
                                   f"= {total // k} conditions x k={k}")


def check_sample_count(v: EpochView, s: Settings) -> Check:
    name = "sample_count"
    if v.N is None:
        return _not_logged(name, ["dataset_indices"])
    if v.total is None:
        return Check(name, FAIL, {"logged_samples": v.N}, "expected total unknown (config arithmetic not logged)")
    nums = {"logged_samples": v.N, "expected_samples": v.total}
    if v.N == v.total:
        return Check(name, PASS, nums, f"{v.N} samples logged")
    hint = ""
    if v.P and v.P > 1 and v.N * v.P == v.total:
        hint = " (exactly one process's share: were the samples gathered from every process?)"
    return Check(name, FAIL, nums, f"{v.N} samples logged, {v.total} expected{hint}")


def check_unique_conditions(v: EpochView, s: Settings) -> Check:
    name = "unique_conditions"
    if v.N is None:
        return _not_logged(name, ["dataset_indices"])
    unique = len(set(v.indices))
    nums = {"unique_conditions": unique, "expected": v.m}
    if v.m is None:
        return Check(name, WARN, nums, "expected number unknown (config arithmetic not logged)")
    if unique != v.m:
        return Check(name, FAIL, nums, f"{unique} unique conditions, {v.m} expected")
    return Check(name, PASS, nums, f"{unique} unique conditions")


def _ids_by_index(v: EpochView) -> dict[int, str]:
    ids = v.rec.get("condition_ids")
    if not isinstance(ids, list) or v.indices is None or len(ids) != len(v.indices):
        return {}
    return {i: str(c) for i, c in zip(v.indices, ids, strict=True)}


def check_count_per_condition(v: EpochView, s: Settings) -> Check:
    name = "count_per_condition"
    if v.N is None:
        return _not_logged(name, ["dataset_indices"])
    if v.k is None:
        return _not_logged(name, ["k"])
    counts = v.drawn
    offenders = {i: c for i, c in sorted(counts.items()) if c != v.k}
    ids = _ids_by_index(v)
    nums = {"k": v.k, "conditions": len(counts), "min_count": min(counts.values(), default=0),
            "max_count": max(counts.values(), default=0), "offenders": len(offenders)}
    if v.excluded:
        kept = [v.kept.get(i, 0) for i in counts]
        nums.update({"excluded_samples": v.excluded, "min_kept": min(kept), "max_kept": max(kept)})
    if offenders:
        listed = [f"{i}{' (' + ids[i] + ')' if i in ids else ''}: {c}" for i, c in offenders.items()]
        nums["offender_counts"] = {str(i): c for i, c in offenders.items()}
        return Check(name, FAIL, nums, f"conditions without exactly k={v.k} copies: {_short(listed)}")
    note = ""
    if v.excluded:
        note = (f"; {v.excluded} excluded sample(s) (failed rewards) leave {nums['min_kept']}..{nums['max_kept']} "
                "kept copies per condition, which is not a missing copy")
    return Check(name, PASS, nums, f"every one of {len(counts)} conditions has exactly k={v.k} copies drawn{note}")


def check_condition_ids(v: EpochView, s: Settings) -> Check:
    name = "condition_ids"
    ids = v.rec.get("condition_ids")
    if v.N is None or not isinstance(ids, list):
        return _not_logged(name, v.missing("dataset_indices", "condition_ids") or ["condition_ids"])
    nums = {"condition_ids": len(ids), "samples": v.N}
    if len(ids) != v.N:
        return Check(name, FAIL, nums, f"{len(ids)} condition ids for {v.N} samples")
    by_index: dict[int, set] = {}
    by_id: dict[str, set] = {}
    for i, c in zip(v.indices, ids, strict=True):
        by_index.setdefault(i, set()).add(str(c))
        by_id.setdefault(str(c), set()).add(i)
    clashes = [f"index {i} -> {sorted(c)}" for i, c in by_index.items() if len(c) > 1]
    clashes += [f"id {c} -> indices {sorted(i)}" for c, i in by_id.items() if len(i) > 1]
    if clashes:
        return Check(name, FAIL, nums, f"dataset index and condition id disagree: {_short(clashes, 6)}")
    return Check(name, PASS, nums, "one condition id per dataset index")


def check_batch_groups(v: EpochView, s: Settings) -> Check:
    """Gathered order is rank-major (each rank's batches concatenated, ranks concatenated), so sampling
    batch b is the union over ranks of that rank's b-th slice; the k-repeat sampler keeps whole groups there."""
    name = "batch_groups"
    if v.N is None or v.total is None or v.k is None:
        return Check(name, WARN, {}, "not checked: indices or batch arithmetic not logged")
    if v.N != v.total:
        return Check(name, WARN, {"samples": v.N, "expected": v.total}, "not checked: sample count differs")
    split = []
    for b in range(v.nb):
        batch = []
        for r in range(v.P):
            start = r * v.nb * v.bs + b * v.bs
            batch += v.indices[start:start + v.bs]
        split += [f"batch {b}: {i} x{c}" for i, c in sorted(Counter(batch).items()) if c != v.k]
    nums = {"sampling_batches": v.nb, "split_groups": len(split)}
    if split:
        return Check(name, WARN, nums, "groups not whole within a sampling batch (advantages still use the "
                                       "epoch's groups, but the k-repeat sampler should not do this): "
                                       + _short(split, 6))
    return Check(name, PASS, nums, f"each of {v.nb} sampling batches holds whole groups of k={v.k}")


def _reward_keys(v: EpochView) -> list[str]:
    return sorted(v.rewards, key=lambda k: (k != "avg", k))


def check_reward_shapes(v: EpochView, s: Settings) -> Check:
    name = "reward_shapes"
    if v.N is None:
        return _not_logged(name, ["dataset_indices"])
    problems = []
    shapes = {}
    if "avg" not in v.rewards:
        problems.append("rewards/avg not logged")
    for key in _reward_keys(v):
        a = v.rewards[key]
        if a is None:
            problems.append(f"rewards/{key} is ragged or not numeric")
            continue
        shapes[key] = list(a.shape)
        want = (v.N, v.T) if key == "avg" else (v.N,)
        if tuple(a.shape) != want:
            problems.append(f"rewards/{key} has shape {tuple(a.shape)}, expected {want}")
        elif key == "avg" and a.size and not np.array_equal(a.max(axis=1), a.min(axis=1), equal_nan=True):
            problems.append("rewards/avg is not constant over the trained timesteps")
    declared = v.rec.get("reward_shapes")
    if isinstance(declared, dict):
        for key, shp in declared.items():
            if key in shapes and list(shp) != shapes[key]:
                problems.append(f"reward_shapes[{key}]={shp} but the array is {shapes[key]}")
        absent = sorted(set(declared) ^ set(v.rewards))
        if absent:
            problems.append(f"reward_shapes and the logged arrays name different keys: {absent}")
    else:
        problems.append("reward_shapes not logged")
    nums = {"N": v.N, "T": v.T, "shapes": shapes}
    if problems:
        return Check(name, FAIL, nums, "; ".join(problems))
    return Check(name, PASS, nums, f"avg is (N, T) = ({v.N}, {v.T}), the others (N,)")


def check_reward_gathered(v: EpochView, s: Settings) -> Check:
    name = "reward_gathered"
    lengths = {k: (int(a.shape[0]) if a is not None and a.ndim >= 1 else None) for k, a in v.rewards.items()}
    if not lengths:
        return _not_logged(name, ["rewards/*"])
    nums = {"lengths": lengths, "samples": v.N, "expected": v.total}
    want = v.total if v.total is not None else v.N
    bad = {k: n for k, n in lengths.items() if n != want or (v.N is not None and n != v.N)}
    if bad:
        hint = ""
        if v.P and v.P > 1 and want and any(n is not None and n * v.P == want for n in bad.values()):
            hint = " (one process's share: rewards were not gathered from every process)"
        return Check(name, FAIL, nums, f"reward arrays of the wrong length {bad}, expected {want}{hint}")
    return Check(name, PASS, nums, f"every reward array holds all {want} gathered samples")


def check_reward_finite(v: EpochView, s: Settings) -> Check:
    name = "reward_finite"
    bad = {}
    arrays = {f"rewards/{k}": a for k, a in v.rewards.items()}
    arrays["advantages"] = v.adv
    excused = 0
    for key, a in arrays.items():
        if a is not None and a.size:
            nonfinite = ~np.isfinite(a)
            if v.keep is not None and key.startswith("rewards/") and a.shape[0] == len(v.keep):
                # a reward that failed is NaN by design when the trainer excluded that sample from training
                excluded = ~v.keep.reshape((-1,) + (1,) * (a.ndim - 1))
                excused += int((nonfinite & excluded).sum())
                nonfinite &= ~excluded
            n = int(nonfinite.sum())
            if n:
                bad[key] = n
    for key, x in v.rec.items():
        if key.startswith("reward_") and isinstance(x, float) and not math.isfinite(x) \
                and not _undefined_by_exclusion(v, key):
            bad[key] = 1
    if bad:
        return Check(name, FAIL, {"non_finite": bad}, f"NaN/Inf values: {bad}")
    if excused:
        # not a warning of its own: check_excluded_samples reports (and warns about) the exclusions
        failed = int((~np.isfinite(v.r0) & ~v.keep).sum()) if v.r0 is not None and v.keep is not None else None
        return Check(name, PASS, {"non_finite": 0, "failed_and_excluded_values": excused, "failed_samples": failed},
                     "no NaN or Inf on kept samples; the rewards that failed (NaN) are all on samples the trainer "
                     "excluded from the advantages")
    return Check(name, PASS, {"non_finite": 0}, "no NaN or Inf in rewards or advantages")


def _undefined_by_exclusion(v: EpochView, key: str) -> bool:
    """An epoch scalar that is NaN because nothing was left to compute it over: the mean of a reward that failed
    on every sample, or the group statistics of an epoch whose every sample was excluded."""
    if key in ("reward_std_mean", "zero_std_ratio"):
        return v.keep is not None and not v.keep.any()
    arr = v.rewards.get(key[len("reward_"):])
    return (arr is not None and arr.size > 0 and not np.isfinite(arr).any() and v.keep is not None
            and arr.shape[0] == len(v.keep) and not v.keep.any())


def check_advantage_shape(v: EpochView, s: Settings) -> Check:
    name = "advantage_shape"
    if v.adv is None:
        return _not_logged(name, ["advantages"])
    shape = tuple(v.adv.shape)
    nums = {"shape": list(shape), "expected": [v.N, v.T]}
    if shape != (v.N, v.T):
        return Check(name, FAIL, nums, f"advantages have shape {shape}, expected (N, T) = ({v.N}, {v.T})")
    return Check(name, PASS, nums, f"advantages are (N, T) = {shape}")


def check_advantage_per_condition(v: EpochView, s: Settings) -> Check:
    name = "advantage_per_condition"
    if v.a0 is None:
        return _not_logged(name, v.missing("advantages", "dataset_indices") or ["advantages (shape)"])
    ids = _ids_by_index(v)
    idx = np.asarray(v.indices)
    groups = None
    if v.r0 is not None:
        _, groups = recompute_advantages(v.r0, idx, s.std_mode, s.eps, v.keep, s.unbiased)
    rows = []
    kept = v.keep if v.keep is not None else np.ones(len(idx), dtype=bool)
    for g in sorted(set(idx[kept].tolist())):
        vals = v.a0[(idx == g) & kept]
        mean, std = float(vals.mean()), float(vals.std())
        reward = groups.get(g) if groups else None
        constant = reward.constant if reward else bool(np.all(vals == 0))
        row = {"condition": g, "id": ids.get(g, ""), "samples": int(vals.size), "mean": mean, "std": std,
               "reward_std": reward.std if reward else None}
        if constant:
            exact = bool(np.all(vals == 0))
            row["status"], row["note"] = (PASS, "zero-std group: all 0") if exact else (
                FAIL, "zero-std group but advantages are not exactly 0")
        elif not abs(mean) <= s.tol:
            row["status"], row["note"] = FAIL, f"mean {mean:.3g} is not 0"
        elif s.std_mode != "group":
            row["status"], row["note"] = PASS, f"std_mode={s.std_mode}: std is not 1 by design"
        elif abs(std - 1.0) <= s.tol:
            row["status"], row["note"] = PASS, ""
        elif reward and abs(std - (expected := reward.std / (reward.divisor + s.eps))) <= s.tol:
            # std_r / (std_r + eps) is what the formula gives every group; only a reward std of a few eps makes
            # eps, not the rewards, set the advantages, which is worth a look but is not a bug.
            dominated = reward.std < EPS_DOMINATES * s.eps
            row["status"] = WARN if dominated else PASS
            row["note"] = (f"std = std_r/(divisor+eps) = {expected:.4f} (reward std {reward.std:.2g}, eps {s.eps:g})"
                           + (f"; below {EPS_DOMINATES:g} eps, eps sets these advantages" if dominated else ""))
        else:
            row["status"], row["note"] = FAIL, f"std {std:.4f} is not 1"
        rows.append(row)
    if not rows:
        return Check(name, WARN, {"conditions": 0, "excluded_samples": v.excluded},
                     "no condition kept a sample (every one was excluded): there is no advantage to check")
    tally = Counter(r["status"] for r in rows)
    live = [r for r in rows if r["note"] != "zero-std group: all 0"]
    nums = {"conditions": len(rows), "pass": tally[PASS], "warn": tally[WARN], "fail": tally[FAIL],
            "max_abs_mean": max((abs(r["mean"]) for r in rows), default=0.0),
            "min_std": min((r["std"] for r in live), default=None),
            "max_std": max((r["std"] for r in live), default=None)}
    status = worst(r["status"] for r in rows)
    bad = [f"{r['condition']}: mean {r['mean']:.4g} std {r['std']:.4g}" for r in rows if r["status"] == FAIL]
    detail = (f"{tally[FAIL]} of {len(rows)} conditions fail: {_short(bad, 6)}" if bad else
              f"{tally[PASS]} conditions with mean 0 and std 1 (or exactly 0), {tally[WARN]} warnings")
    return Check(name, status, nums, detail, table=rows)


def check_advantage_recompute(v: EpochView, s: Settings) -> Check:
    name = "advantage_recompute"
    if v.r0 is None or v.adv is None or v.indices is None:
        return _not_logged(name, v.missing("rewards/avg", "advantages", "dataset_indices") or
                           ["rewards/avg or advantages (shape)"])
    if v.adv.ndim not in (1, 2):
        return Check(name, FAIL, {"logged_shape": list(v.adv.shape)}, "advantages are not an (N, T) array")
    expected, _ = recompute_advantages(v.r0, np.asarray(v.indices), s.std_mode, s.eps, v.keep, s.unbiased)
    logged = v.adv if v.adv.ndim == 2 else v.adv[:, None]
    if logged.shape[0] != expected.shape[0]:
        return Check(name, FAIL, {"logged": list(v.adv.shape), "expected_N": int(expected.size)},
                     "advantages and rewards have different numbers of samples")
    flagged = v.rec.get("placebo") is True
    if s.config is not None and flagged != s.placebo:
        return Check(name, FAIL, {"record_placebo": flagged, "config_placebo": s.placebo},
                     f"the epoch record says placebo={flagged} but the run's config says advantage.placebo="
                     f"{s.placebo}")
    if flagged or s.placebo:
        return _placebo_permutation(name, logged, expected, np.asarray(v.indices), v.keep, s)
    diff = np.abs(logged - expected[:, None])
    diff = np.where(np.isnan(diff), np.inf, diff)
    worst_i = np.unravel_index(int(np.argmax(diff)), diff.shape) if diff.size else (0, 0)
    max_diff = float(diff.max()) if diff.size else 0.0
    nums = {"max_abs_diff": max_diff, "std_mode": s.std_mode, "eps": s.eps,
            "samples_off": int((diff > s.tol).any(axis=1).sum())}
    if max_diff > s.tol:
        i, t = int(worst_i[0]), int(worst_i[1])
        return Check(name, FAIL, nums, f"{nums['samples_off']} samples differ from (r - mean_g)/(std_g + eps); "
                                       f"worst sample {i} timestep {t}: logged {logged[i, t]:.5g}, "
                                       f"recomputed {expected[i]:.5g}")
    return Check(name, PASS, nums, "logged advantages equal the ones recomputed from the logged rewards")


def _placebo_permutation(name: str, logged: np.ndarray, expected: np.ndarray, indices: np.ndarray,
                         keep: np.ndarray | None, s: Settings) -> Check:
    """A placebo epoch: every sample's advantage is one value over its timesteps, and each group's kept values are
    its recomputed ones in some order (a permutation within the group); excluded samples stay 0."""
    problems = []
    spread = np.nanmax(np.abs(logged - logged[:, :1]), axis=1) if logged.size else np.zeros(0)
    if np.any(~np.isfinite(logged)) or np.any(spread > s.tol):
        problems.append("a sample's advantage differs over its timesteps or is not finite")
    kept = np.ones(len(indices), bool) if keep is None else np.asarray(keep, bool)
    if np.any(np.abs(logged[~kept, 0]) > s.tol):
        problems.append(f"{int((np.abs(logged[~kept, 0]) > s.tol).sum())} excluded sample(s) with advantage != 0")
    groups_off, moved = [], 0
    for g in np.unique(indices[kept]):
        rows = kept & (indices == g)
        got, want = np.sort(logged[rows, 0]), np.sort(expected[rows])
        if not np.all(np.abs(got - want) <= s.tol):
            groups_off.append(int(g))
        moved += int(np.any(np.abs(logged[rows, 0] - expected[rows]) > s.tol))
    nums = {"groups": int(len(np.unique(indices[kept]))), "groups_off": len(groups_off),
            "groups_reordered": moved, "std_mode": s.std_mode, "eps": s.eps}
    if groups_off:
        problems.append(f"{len(groups_off)} group(s) whose advantages are not a permutation of (r - mean_g)/(std_g "
                        f"+ eps): {_short([str(g) for g in groups_off])}")
    if problems:
        return Check(name, FAIL, nums, "PLACEBO: " + "; ".join(problems))
    return Check(name, PASS, nums, "PLACEBO: the trained advantages are a within-group permutation of the normalised "
                                   f"rewards ({moved} of {nums['groups']} groups reordered)")


def check_advantage_summary(v: EpochView, s: Settings) -> Check:
    name = "advantage_summary"
    logged = v.rec.get("advantage_per_condition")
    if not isinstance(logged, dict):
        return Check(name, WARN, {}, "advantage_per_condition not logged")
    if v.a0 is None:
        return _not_logged(name, ["advantages (shape)"])
    idx = np.asarray(v.indices)
    problems = []
    actual = {str(g) for g in set(v.indices)}
    if set(logged) != actual:
        problems.append(f"conditions differ: only logged {_short(sorted(set(logged) - actual))}; "
                        f"only sampled {_short(sorted(actual - set(logged)))}")
    for key, stat in logged.items():
        if key not in actual or not isinstance(stat, dict):
            continue
        vals = v.a0[idx == int(key)]
        got = {"count": vals.size, "mean": float(vals.mean()), "std": float(vals.std())}
        for field_name, x in got.items():
            claimed = _float(stat.get(field_name))
            if claimed is None or not _close(claimed, x, s.tol):
                problems.append(f"condition {key} {field_name}: logged {stat.get(field_name)}, array gives {x:.5g}")
    nums = {"conditions_logged": len(logged), "conditions_sampled": len(actual), "mismatches": len(problems)}
    if problems:
        return Check(name, FAIL, nums, _short(problems, 6))
    return Check(name, PASS, nums, "logged per-condition count/mean/std match the advantages array")


def check_zero_std_groups(v: EpochView, s: Settings) -> Check:
    name = "zero_std_groups"
    if v.r0 is None or v.indices is None:
        return _not_logged(name, ["rewards/avg", "dataset_indices"])
    _, groups = recompute_advantages(v.r0, np.asarray(v.indices), s.std_mode, s.eps, v.keep, s.unbiased)
    zero = [g for g, st in groups.items() if st.constant]
    ratio = len(zero) / len(groups) if groups else 0.0
    nums = {"zero_std_groups": len(zero), "groups": len(groups), "zero_std_ratio": ratio,
            "logged_zero_std_ratio": v.rec.get("zero_std_ratio")}
    problems = []
    if v.adv is not None and v.adv.shape[:1] == (len(v.indices),):
        idx = np.asarray(v.indices)
        nonzero = [g for g in zero if np.any(v.adv[idx == g] != 0)]
        if nonzero:
            problems.append(f"zero-std groups with non-zero advantages: {_short(nonzero)}")
    logged = _float(v.rec.get("zero_std_ratio"))
    if not groups:
        # every sample excluded: the ratio is over no group, so the trainer logs NaN
        nums["zero_std_ratio"] = None
        if logged is None or not math.isnan(logged):
            problems.append(f"no group kept a sample, so zero_std_ratio is undefined, but {logged} is logged")
        if problems:
            return Check(name, FAIL, nums, "; ".join(problems))
        return Check(name, PASS, nums, "no group kept a sample: zero_std_ratio is undefined and logged as NaN")
    if logged is None:
        problems.append("zero_std_ratio not logged")
    elif not abs(logged - ratio) <= s.tol:
        problems.append(f"logged zero_std_ratio {logged:.4g} but {len(zero)}/{len(groups)} = {ratio:.4g} recomputed")
    if problems:
        return Check(name, FAIL, nums, "; ".join(problems))
    return Check(name, PASS, nums, f"{len(zero)} of {len(groups)} groups have equal rewards, advantages exactly 0")


def check_reward_means(v: EpochView, s: Settings) -> Check:
    name = "reward_means"
    logged = {k[len("reward_"):]: x for k, x in v.rec.items()
              if k.startswith("reward_") and k not in REWARD_BOOKKEEPING}
    problems, nums = [], {}
    for key in sorted(set(logged) | set(v.rewards)):
        claimed = _float(logged.get(key))
        arr = v.rewards.get(key)
        if claimed is None:
            problems.append(f"reward_{key} not logged")
            continue
        if arr is None:
            problems.append(f"rewards/{key} not logged or unreadable, cannot check reward_{key}")
            continue
        # failed (NaN) rewards are excluded from training and from the logged mean
        finite = arr[np.isfinite(arr)]
        mean = float(finite.mean()) if finite.size else float("nan")
        nums[key] = {"logged": claimed, "array_mean": mean}
        if math.isnan(mean) and math.isnan(claimed) and arr.size:
            continue  # the reward failed on every sample: a mean over no value is NaN, and NaN is logged
        if not _close(claimed, mean, s.tol):
            problems.append(f"reward_{key}={claimed:.6g} but the mean of rewards/{key} is {mean:.6g}")
    if problems:
        return Check(name, FAIL, nums, "; ".join(problems))
    return Check(name, PASS, nums, f"every logged reward mean equals its array's mean ({len(nums)} keys)")


def check_group_size(v: EpochView, s: Settings) -> Check:
    """group_size is the mean number of kept copies over the groups that kept any (the trainer's statistics are
    over kept samples): k when nothing was excluded, less when failed rewards were. Short groups pass when every
    group drew its k copies and only exclusions shortened it; a copy that was never drawn fails."""
    name = "group_size"
    logged = _float(v.rec.get("group_size"))
    if logged is None or v.k is None:
        return _not_logged(name, [k for k in ("group_size", "k") if _float(v.rec.get(k)) is None])
    nums = {"logged_group_size": logged, "k": v.k}
    if not v.indices:
        return _not_logged(name, ["dataset_indices"])
    kept = [c for c in v.kept.values() if c > 0]
    expected = sum(kept) / len(kept) if kept else 0.0
    missing = {i: c for i, c in sorted(v.drawn.items()) if c != v.k}
    nums.update({"mean_copies": len(v.indices) / len(v.drawn), "mean_kept_copies": expected,
                 "excluded_samples": v.excluded, "groups_short_by_exclusion": sum(1 for c in kept if c < v.k)})
    problems = []
    if missing:
        problems.append(f"conditions drawn without k={v.k} copies: {_short([f'{i}: {c}' for i, c in missing.items()])}")
    if not abs(logged - expected) <= s.tol:
        over = f"the mean kept copies per group is {expected:g}" if v.excluded else f"k={v.k}"
        problems.append(f"group_size {logged:g} is not {over}")
    if problems:
        return Check(name, FAIL, nums, "; ".join(problems))
    if v.excluded:
        return Check(name, PASS, nums, f"group_size {logged:g} = mean kept copies over {len(kept)} groups; every group "
                                       f"drew k={v.k} copies and {v.excluded} excluded sample(s) shortened "
                                       f"{nums['groups_short_by_exclusion']} of them")
    return Check(name, PASS, nums, f"group_size = k = {v.k}")


def check_trained_prompt_num(v: EpochView, s: Settings) -> Check:
    """trained_prompt_num counts the groups that kept a sample: m when nothing was excluded, less when a failed
    reward excluded a whole group."""
    name = "trained_prompt_num"
    logged = _float(v.rec.get("trained_prompt_num"))
    if logged is None:
        return _not_logged(name, ["trained_prompt_num"])
    unique = len(v.drawn) if v.drawn is not None else None
    kept = sum(1 for c in v.kept.values() if c > 0) if v.kept is not None else None
    nums = {"logged": logged, "expected_m": v.m, "unique_in_indices": unique, "groups_kept": kept,
            "groups_excluded_whole": unique - kept if unique is not None else None}
    problems = []
    if v.m is None:
        problems.append("m unknown (config arithmetic not logged)")
    elif unique is not None and unique != v.m:
        problems.append(f"{unique} unique conditions drawn, not m={v.m}")
    if kept is None:
        problems.append("dataset_indices not logged: the groups cannot be counted")
    elif logged != kept:
        why = f" ({unique - kept} of {unique} excluded whole)" if unique != kept else ""
        problems.append(f"trained_prompt_num {logged:g} but {kept} groups kept a sample{why}")
    if problems:
        return Check(name, FAIL, nums, "; ".join(problems))
    if kept != unique:
        return Check(name, PASS, nums, f"trained_prompt_num {logged:g} = m={v.m} less {unique - kept} group(s) whose "
                                       "every sample was excluded")
    return Check(name, PASS, nums, f"trained_prompt_num = m = {v.m}")


def check_reward_std_mean(v: EpochView, s: Settings) -> Check:
    name = "reward_std_mean"
    logged = _float(v.rec.get("reward_std_mean"))
    if logged is None:
        return Check(name, WARN, {}, "reward_std_mean not logged")
    if v.r0 is None:
        return _not_logged(name, ["rewards/avg"])
    _, groups = recompute_advantages(v.r0, np.asarray(v.indices), s.std_mode, s.eps, v.keep, s.unbiased)
    if not groups:
        nums = {"logged": logged, "recomputed": None, "excluded_samples": v.excluded}
        if math.isnan(logged):
            return Check(name, PASS, nums, "no group kept a sample: the mean group std is undefined, logged as NaN")
        return Check(name, FAIL, nums, f"no group kept a sample, so the mean group std is undefined, but {logged:.5g} "
                                       "is logged")
    mean_std = float(np.mean([g.std for g in groups.values()]))
    nums = {"logged": logged, "recomputed": mean_std}
    if not _close(logged, mean_std, s.tol):
        return Check(name, FAIL, nums, f"logged {logged:.5g}, recomputed mean group std {mean_std:.5g}")
    return Check(name, PASS, nums, "mean per-group reward std matches")


def check_excluded_samples(v: EpochView, s: Settings) -> Check:
    """The trainer's exclusions (samples whose reward failed, kept out of the advantages) agree with its counts, and
    every excluded sample has advantage 0. Exclusions warn: the run handled them, but it trained on fewer samples
    than it drew, which is worth a look at the reward servers."""
    name = "excluded_samples"
    if "excluded" not in v.rec:
        return Check(name, WARN, {}, "no exclusion mask (`excluded`) logged: every sample is taken as kept, which "
                                     "the reward and advantage checks then verify")
    if v.N is None:
        return _not_logged(name, ["dataset_indices"])
    if v.keep is None:
        return Check(name, FAIL, {"samples": v.N}, f"`excluded` is not a list of {v.N} booleans")
    empty = sorted(i for i in v.drawn if v.kept.get(i, 0) == 0)
    short = sum(1 for i in v.drawn if 0 < v.kept.get(i, 0) < v.drawn[i])
    nums = {"excluded_samples": v.excluded, "samples": v.N, "groups_short": short, "groups_excluded_whole": len(empty)}
    problems = []
    for key, want in (("excluded_samples", v.excluded), ("excluded_groups", len(empty))):
        if key in v.rec:
            got = _int(v.rec.get(key))
            nums[f"logged_{key}"] = v.rec.get(key)
            if got != want:
                problems.append(f"logged {key}={v.rec.get(key)} but the `excluded` mask gives {want}")
    failed = _int(v.rec.get("failed_samples"))
    if failed is not None:
        nums["failed_samples"] = failed
        if failed > v.excluded:
            problems.append(f"{failed} samples failed but only {v.excluded} were excluded")
    if v.a0 is not None and v.excluded:
        trained = [i for i, a in zip(np.flatnonzero(~v.keep).tolist(), np.asarray(v.adv)[~v.keep], strict=True)
                   if np.any(a != 0)]
        if trained:
            problems.append(f"excluded samples with a non-zero advantage: {_short(trained)}")
    if problems:
        return Check(name, FAIL, nums, "; ".join(problems))
    if not v.excluded:
        return Check(name, PASS, nums, "no sample excluded: every reward was scored")
    why = f"{failed} failed reward(s)" if failed is not None else "failed rewards"
    return Check(name, WARN, nums, f"{v.excluded} of {v.N} samples excluded from the advantages ({why}): {short} "
                                   f"group(s) trained on fewer than k copies, {len(empty)} not at all; group "
                                   "statistics and the checks above use the kept samples")


EPOCH_CHECKS = (
    check_sampling_facts, check_config_arithmetic, check_sample_count, check_unique_conditions,
    check_count_per_condition, check_condition_ids, check_batch_groups, check_reward_shapes, check_reward_gathered,
    check_reward_finite, check_advantage_shape, check_advantage_per_condition, check_advantage_recompute,
    check_advantage_summary, check_zero_std_groups, check_reward_means, check_group_size, check_trained_prompt_num,
    check_reward_std_mean, check_excluded_samples,
)


def check_step_records(epochs: list[dict], steps: list[dict]) -> Check:
    """Step records present (a log of epoch records only fails), strictly increasing, in non-decreasing epochs,
    epoch steps non-decreasing, and the optimizer_steps stored in each epoch record as many as that epoch's step
    records."""
    name = "step_records"
    problems = []
    nums: dict[str, Any] = {"step_records": len(steps)}
    values = [_int(r.get("step")) for r in steps]
    if any(x is None for x in values):
        problems.append(f"{sum(x is None for x in values)} step records without an integer step")
    # every field of a step record but its type is a number (recam.infra.schema); a true or a "0.1" there is damage
    # that the numeric checks would pass over
    wrong = [(r.get("step"), k) for r in steps for k, v in r.items()
             if k != "type" and (isinstance(v, bool) or not isinstance(v, (int, float)))]
    if wrong:
        problems.append(f"{len(wrong)} step record field(s) not a number: "
                        + _short([f"step {s} {k}" for s, k in wrong], 6))
    # the trainer's guard stops a run at a non-finite step metric (recam.engine.health.rule_non_finite), so one in
    # the log is an update that overflowed, or damage: the weights after it are not what the checks below vouch for
    non_finite = [(r.get("step"), k) for r in steps for k, v in r.items()
                  if isinstance(v, float) and not math.isfinite(v)]
    if non_finite:
        problems.append(f"{len(non_finite)} step record value(s) NaN or infinite: "
                        + _short([f"step {s} {k}" for s, k in non_finite], 6))
    vals = [x for x in values if x is not None]
    backwards = [(a, b) for a, b in zip(vals, vals[1:], strict=False) if b <= a]
    if backwards:
        problems.append(f"steps not strictly increasing: {_short([f'{a}->{b}' for a, b in backwards], 6)}")
    s_epochs = [_int(r.get("epoch")) for r in steps]
    s_epochs = [e for e in s_epochs if e is not None]
    if any(b < a for a, b in zip(s_epochs, s_epochs[1:], strict=False)):
        problems.append("step records go back to an earlier epoch")
    ordered = sorted((r for r in epochs if _int(r.get("epoch")) is not None), key=lambda r: _int(r["epoch"]))
    e_steps = [_int(r.get("step")) for r in ordered]
    if any(x is None for x in e_steps):
        problems.append("epoch records without an integer step")
    elif any(b < a for a, b in zip(e_steps, e_steps[1:], strict=False)):
        problems.append(f"epoch steps decrease: {e_steps}")
    nums["epoch_steps"] = e_steps
    if epochs and not steps:
        # nothing below compares anything then, and a check with nothing to compare must not pass
        stored = [len(r["optimizer_steps"]) for r in epochs if isinstance(r.get("optimizer_steps"), list)]
        if len(stored) == len(epochs) and not any(stored):
            problems.append("no step record: no epoch took an optimizer step (each stores none), so nothing was "
                            "trained")
        else:
            problems.append(f"no step record for {len(epochs)} epoch record(s)"
                            + (f" storing {sum(stored)} optimizer step(s)" if stored else "")
                            + ": the run's updates cannot be verified")
    torn = [r.get("epoch") for r in epochs if "optimizer_steps" in r and not isinstance(r["optimizer_steps"], list)]
    if torn:
        problems.append(f"epoch(s) {_short(torn, 6)} store optimizer_steps that are not a list")
    if steps:
        per_epoch = Counter(s_epochs)
        for r in ordered:
            opt = r.get("optimizer_steps")
            if isinstance(opt, list) and len(opt) != per_epoch.get(_int(r["epoch"]), 0):
                problems.append(f"epoch {r['epoch']} stores {len(opt)} optimizer steps but "
                                f"{per_epoch.get(_int(r['epoch']), 0)} step records carry its number")
    if problems:
        return Check(name, FAIL, nums, "; ".join(problems))
    return Check(name, PASS, nums, "step records strictly increasing; epoch steps non-decreasing")


def check_epoch_steps(epochs: list[dict], steps: list[dict]) -> list[Check]:
    """Per epoch: its logged step is the global step, i.e. the number of optimizer steps before it, and its
    own step records are numbered step+1 .. step+n."""
    out = []
    step_pairs = [(_int(r.get("epoch")), _int(r.get("step"))) for r in steps]
    by_epoch = {_int(r.get("epoch")): r for r in epochs}
    for rec in epochs:
        e = _int(rec.get("epoch"))
        step = _int(rec.get("step"))
        if e is None or step is None:
            out.append(Check("epoch_step", FAIL, {"epoch": rec.get("epoch"), "step": rec.get("step")},
                             "epoch or step is not an integer", epoch=e))
            continue
        nums: dict[str, Any] = {"logged_step": step}
        problems = []
        if steps:
            before = sum(1 for se, _ in step_pairs if se is not None and se < e)
            nums["optimizer_steps_before"] = before
            if step != before:
                problems.append(f"logged step {step} but {before} optimizer steps were logged before epoch {e}")
            own = [st for se, st in step_pairs if se == e]
            want = list(range(step + 1, step + 1 + len(own)))
            if own != want:
                problems.append(f"this epoch's step records are {_short(own, 6)}, expected {_short(want, 6)}")
        else:
            prev = by_epoch.get(e - 1)
            prev_ok = prev is not None and isinstance(prev.get("optimizer_steps"), list)
            if prev_ok and _int(prev.get("step")) is not None:
                expected = _int(prev["step"]) + len(prev["optimizer_steps"])
                nums["expected_from_previous_epoch"] = expected
                if step != expected:
                    problems.append(f"logged step {step} but the previous epoch ended at step {expected}")
            elif e == 0 and step != 0:
                problems.append(f"epoch 0 starts at step {step}, not 0")
        if problems:
            out.append(Check("epoch_step", FAIL, nums, "; ".join(problems), epoch=e))
        else:
            out.append(Check("epoch_step", PASS, nums, f"epoch {e} starts at global step {step}", epoch=e))
    return out


def verify_metrics(parsed: ParsedLog, config: dict | None = None, tol: float = 1e-3,
                   source: str = "metrics.jsonl") -> Report:
    """Every check over a parsed metrics.jsonl (config is the run's config.json, optional)."""
    s = settings_from_config(config, tol)
    epochs = [r for r in parsed.records if r.get("type") == "epoch"]
    steps = [r for r in parsed.records if r.get("type") == "step"]
    others = Counter(str(r.get("type")) for r in parsed.records if r.get("type") not in ("epoch", "step", "eval"))
    checks = [check_unreadable(parsed.unreadable)]
    n_epochs = {"epoch_records": len(epochs), "step_records": len(steps),
                "eval_records": sum(r.get("type") == "eval" for r in parsed.records)}
    if epochs:
        checks.append(Check("epoch_records", PASS, n_epochs, f"{len(epochs)} epoch records"))
    else:
        checks.append(Check("epoch_records", FAIL, n_epochs, "no epoch record: nothing about GRPO can be verified"))
    lost_steps = [e for _, kind, e in parsed.lost if kind == "step" and e is not None]
    checks += _guard("missing_epochs", check_missing_epochs, [r.get("epoch") for r in epochs],
                     [r.get("epoch") for r in steps] + lost_steps)
    reasons = {u.line: u.reason for u in parsed.unreadable}
    for line, kind, e in parsed.lost:
        if kind == "epoch":
            which = f"epoch {e}" if e is not None else "an epoch"
            checks.append(Check("epoch_record", FAIL, {"line": line, "epoch": e},
                                f"could not verify {which}: its record on line {line} could not be parsed "
                                f"({reasons.get(line, 'unreadable')})", epoch=e))
    checks += _guard("step_records", check_step_records, epochs, steps)
    checks += _guard("noise_scale", check_noise_scale, epochs)
    step_checks = _guard("epoch_step", check_epoch_steps, epochs, steps)
    for rec in epochs:
        try:
            view = EpochView(rec)
        except Exception as e:
            checks.append(Check("epoch_record", FAIL, {"epoch": str(rec.get("epoch"))},
                                f"epoch record unreadable: {type(e).__name__}: {e}", epoch=_int(rec.get("epoch"))))
            continue
        for fn in EPOCH_CHECKS:
            for c in _guard(fn.__name__[len("check_"):], fn, view, s):
                c.epoch = view.epoch
                checks.append(c)
        checks += [c for c in step_checks if c.epoch == view.epoch and view.epoch is not None]
    checks += [c for c in step_checks if c.epoch is None]
    notes = [f"{n} record(s) of unknown type {t!r} ignored" for t, n in others.items()]
    epoch_nums = sorted({e for e in (_int(r.get("epoch")) for r in epochs) if e is not None})
    return Report(source, "metrics.jsonl", checks, parsed.unreadable, epoch_nums,
                  {"tol": tol, "std_mode": s.std_mode, "eps": s.eps, "unbiased_std": s.unbiased,
                   "config": config is not None,
                   "placebo": s.placebo or any(r.get("placebo") is True for r in epochs)}, notes)
