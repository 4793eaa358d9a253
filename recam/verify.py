"""Independent verification, from its logs alone, that a GRPO run did what it claims.

Two sources are understood:
  * `metrics.jsonl` written by `recam.runlog` (step / epoch / eval records);
  * plain-text training logs carrying `[GRPO Debug]` lines, as earlier GRPO codebases print them.

Parsing turns text into plain Python data; every check is a function over that data (no I/O) returning a
`Check` with a status (pass / warn / fail), the numbers it compared and a short explanation. `render_markdown`
turns a `Report` into Markdown and `write_plots` is the only function here that writes files.

Advantages are recomputed exactly as `recam.advantages.group_advantages` defines them (population std,
eps added to the std, exactly 0 for groups whose rewards are all equal), in float64 numpy so the verifier
shares no code with the trainer it checks.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

PASS, WARN, FAIL = "pass", "warn", "fail"
_RANK = {PASS: 0, WARN: 1, FAIL: 2}

# Keys that start with "reward_" in an epoch record but are not the logged mean of a reward array.
_NOT_REWARD_MEANS = {"reward_seconds", "reward_std_mean", "reward_shapes"}


def worst(statuses) -> str:
    """The most severe of pass / warn / fail (pass for none)."""
    out = PASS
    for s in statuses:
        if _RANK[s] > _RANK[out]:
            out = s
    return out


@dataclass
class Check:
    """One verified property: `name` is stable (tests and tools key on it), `epoch` None means the whole run."""

    name: str
    status: str
    numbers: dict = field(default_factory=dict)
    detail: str = ""
    epoch: int | None = None
    table: list[dict] | None = None


@dataclass
class Unreadable:
    line: int
    reason: str
    text: str


@dataclass
class Report:
    source: str
    kind: str
    checks: list[Check]
    unreadable: list[Unreadable]
    epochs: list[int]
    settings: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        return worst(c.status for c in self.checks)

    def failing(self) -> list[Check]:
        return [c for c in self.checks if c.status == FAIL]

    def find(self, name: str, epoch: int | None = None, any_epoch: bool = False) -> list[Check]:
        """Checks named `name` (of one epoch, or of every epoch when any_epoch)."""
        return [c for c in self.checks if c.name == name and (any_epoch or c.epoch == epoch)]

    def summary(self) -> dict[str, dict]:
        """Per check name: overall status and the epochs where it failed or warned."""
        out: dict[str, dict] = {}
        for c in self.checks:
            row = out.setdefault(c.name, {"status": PASS, "fail": [], "warn": [], "scopes": 0})
            row["status"] = worst([row["status"], c.status])
            row["scopes"] += 1
            if c.status != PASS:
                row[c.status].append("run" if c.epoch is None else c.epoch)
        return out


# ----------------------------------------------------------------------------------------------------------
# small helpers


def _excerpt(text: str, n: int = 80) -> str:
    text = text.strip()
    return text if len(text) <= n else text[:n] + "…"


def _int(v: Any) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and math.isfinite(v) and v == int(v):
        return int(v)
    return None


def _float(v: Any) -> float | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    return None


def _close(a: float, b: float, tol: float) -> bool:
    """|a - b| <= tol, relative for magnitudes above 1 (reward means of large rewards)."""
    if math.isnan(a) or math.isnan(b):
        return False
    return abs(a - b) <= tol * max(1.0, abs(b))


def _array(v: Any) -> np.ndarray | None:
    """Nested lists as float64, None when ragged or not numeric (the shape check reports those)."""
    if v is None or isinstance(v, (str, dict)):
        return None
    try:
        a = np.asarray(v, dtype=np.float64)
    except (TypeError, ValueError):
        return None
    return a


def _short(values: list, n: int = 12) -> str:
    shown = ", ".join(str(v) for v in values[:n])
    return shown + (f", … (+{len(values) - n})" if len(values) > n else "")


def _get(config: dict | None, section: str, key: str) -> Any:
    if not isinstance(config, dict):
        return None
    sec = config.get(section)
    return sec.get(key) if isinstance(sec, dict) else None


# ----------------------------------------------------------------------------------------------------------
# metrics.jsonl parsing


@dataclass
class ParsedLog:
    records: list[dict]
    lines: list[int]
    unreadable: list[Unreadable]


def parse_jsonl(text: str) -> ParsedLog:
    """Records of a metrics.jsonl with their line numbers; unparsable lines are kept aside, never fatal."""
    records, lines, bad = [], [], []
    raw = text.splitlines()
    last = max((i for i, s in enumerate(raw, 1) if s.strip()), default=0)
    for no, line in enumerate(raw, 1):
        s = line.strip()
        if not s:
            continue
        try:
            obj = json.loads(s)
        except json.JSONDecodeError as e:
            reason = ("torn last line (the run was probably killed mid-write)" if no == last
                      else f"not valid JSON ({e.msg}, column {e.colno})")
            bad.append(Unreadable(no, reason, _excerpt(s)))
            continue
        if not isinstance(obj, dict):
            bad.append(Unreadable(no, f"a JSON {type(obj).__name__}, not a record", _excerpt(s)))
            continue
        records.append(obj)
        lines.append(no)
    return ParsedLog(records, lines, bad)


# ----------------------------------------------------------------------------------------------------------
# advantages, recomputed


@dataclass
class GroupStat:
    count: int
    mean: float
    std: float
    constant: bool


def recompute_advantages(rewards, group_ids, std_mode: str = "group",
                         eps: float = 1e-4, keep=None) -> tuple[np.ndarray, dict[int, GroupStat]]:
    """(N,) advantages (r - mean_g) / (std_g + eps) and per-group reward stats (population std).

    Groups whose rewards are all exactly equal get advantage exactly 0, whatever the std_mode. With `keep`
    (N,) bool, samples excluded by the trainer (a reward failed) take no part and get advantage 0.
    """
    if keep is not None:
        keep = np.asarray(keep, dtype=bool)
        full = np.zeros(len(keep))
        if not keep.any():
            return full, {}
        sub, stats = recompute_advantages(np.asarray(rewards, dtype=np.float64)[keep], np.asarray(group_ids)[keep],
                                          std_mode, eps)
        full[keep] = sub
        return full, stats
    r = np.asarray(rewards, dtype=np.float64)
    ids = np.asarray(group_ids)
    if r.ndim != 1 or r.shape != ids.shape:
        raise ValueError(f"rewards {r.shape} and group ids {ids.shape} must both be (N,)")
    uniq, inverse = np.unique(ids, return_inverse=True)
    counts = np.bincount(inverse, minlength=len(uniq))
    means = np.bincount(inverse, weights=r, minlength=len(uniq)) / counts
    centred = r - means[inverse]
    stds = np.sqrt(np.bincount(inverse, weights=centred**2, minlength=len(uniq)) / counts)
    gmax = np.full(len(uniq), -np.inf)
    gmin = np.full(len(uniq), np.inf)
    np.maximum.at(gmax, inverse, r)
    np.minimum.at(gmin, inverse, r)
    constant = gmax == gmin
    if std_mode == "group":
        adv = centred / (stds[inverse] + eps)
    elif std_mode == "global":
        adv = centred / (r.std() + eps)
    elif std_mode == "none":
        adv = centred
    else:
        raise ValueError(f"std_mode must be 'group', 'global' or 'none', got {std_mode!r}")
    adv = np.where(constant[inverse], 0.0, adv)
    stats = {int(g): GroupStat(int(counts[i]), float(means[i]), float(stds[i]), bool(constant[i]))
             for i, g in enumerate(uniq.tolist())}
    return adv, stats


# ----------------------------------------------------------------------------------------------------------
# metrics.jsonl checks


@dataclass
class Settings:
    tol: float = 1e-3
    std_mode: str = "group"
    eps: float = 1e-4
    config: dict | None = None


def settings_from_config(config: dict | None, tol: float = 1e-3) -> Settings:
    std_mode = _get(config, "advantage", "std_mode")
    eps = _float(_get(config, "advantage", "eps"))
    return Settings(tol=tol, std_mode=std_mode if std_mode in ("group", "global", "none") else "group",
                    eps=1e-4 if eps is None else eps, config=config if isinstance(config, dict) else None)


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
                     else None)  # samples the trainer kept in the advantages (a failed reward excludes one)
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
    counts = Counter(v.indices)
    offenders = {i: c for i, c in sorted(counts.items()) if c != v.k}
    ids = _ids_by_index(v)
    nums = {"k": v.k, "conditions": len(counts), "min_count": min(counts.values(), default=0),
            "max_count": max(counts.values(), default=0), "offenders": len(offenders)}
    if offenders:
        listed = [f"{i}{' (' + ids[i] + ')' if i in ids else ''}: {c}" for i, c in offenders.items()]
        nums["offender_counts"] = {str(i): c for i, c in offenders.items()}
        return Check(name, FAIL, nums, f"conditions without exactly k={v.k} copies: {_short(listed)}")
    return Check(name, PASS, nums, f"every one of {len(counts)} conditions has exactly k={v.k} copies")


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
        if key.startswith("reward_") and isinstance(x, float) and not math.isfinite(x):
            bad[key] = 1
    if bad:
        return Check(name, FAIL, {"non_finite": bad}, f"NaN/Inf values: {bad}")
    if excused:
        return Check(name, WARN, {"non_finite": 0, "failed_and_excluded": excused},
                     f"{excused} reward values failed (NaN) on samples the trainer excluded from the advantages")
    return Check(name, PASS, {"non_finite": 0}, "no NaN or Inf in rewards or advantages")


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
        _, groups = recompute_advantages(v.r0, idx, s.std_mode, s.eps, v.keep)
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
        elif reward and abs(std - (expected := reward.std / (reward.std + s.eps))) <= s.tol:
            # std_r / (std_r + eps) is what the formula gives; below 1 by more than 1% the eps visibly
            # shrinks this group's advantages, which is worth a look but is not a bug.
            shrunk = 1.0 - expected > 0.01
            row["status"] = WARN if shrunk else PASS
            row["note"] = (f"std = std_r/(std_r+eps) = {expected:.4f} (reward std {reward.std:.2g}, eps {s.eps:g})"
                           + ("; eps shrinks this group's advantages" if shrunk else ""))
        else:
            row["status"], row["note"] = FAIL, f"std {std:.4f} is not 1"
        rows.append(row)
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
    expected, _ = recompute_advantages(v.r0, np.asarray(v.indices), s.std_mode, s.eps, v.keep)
    logged = v.adv if v.adv.ndim == 2 else v.adv[:, None]
    if logged.shape[0] != expected.shape[0]:
        return Check(name, FAIL, {"logged": list(v.adv.shape), "expected_N": int(expected.size)},
                     "advantages and rewards have different numbers of samples")
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
    _, groups = recompute_advantages(v.r0, np.asarray(v.indices), s.std_mode, s.eps, v.keep)
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
              if k.startswith("reward_") and k not in _NOT_REWARD_MEANS}
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
        mean = float(np.nanmean(arr)) if arr.size and np.isfinite(arr).any() else float("nan")
        nums[key] = {"logged": claimed, "array_mean": mean}
        if not _close(claimed, mean, s.tol):
            problems.append(f"reward_{key}={claimed:.6g} but the mean of rewards/{key} is {mean:.6g}")
    if problems:
        return Check(name, FAIL, nums, "; ".join(problems))
    return Check(name, PASS, nums, f"every logged reward mean equals its array's mean ({len(nums)} keys)")


def check_group_size(v: EpochView, s: Settings) -> Check:
    name = "group_size"
    logged = _float(v.rec.get("group_size"))
    if logged is None or v.k is None:
        return _not_logged(name, [k for k in ("group_size", "k") if _float(v.rec.get(k)) is None])
    nums = {"logged_group_size": logged, "k": v.k}
    if v.indices:
        nums["mean_copies"] = len(v.indices) / len(set(v.indices))
    if not abs(logged - v.k) <= s.tol:
        return Check(name, FAIL, nums, f"group_size {logged:g} is not k={v.k}")
    return Check(name, PASS, nums, f"group_size = k = {v.k}")


def check_trained_prompt_num(v: EpochView, s: Settings) -> Check:
    name = "trained_prompt_num"
    logged = _float(v.rec.get("trained_prompt_num"))
    if logged is None:
        return _not_logged(name, ["trained_prompt_num"])
    nums = {"logged": logged, "expected_m": v.m,
            "unique_in_indices": len(set(v.indices)) if v.indices is not None else None}
    problems = []
    if v.m is None:
        problems.append("m unknown (config arithmetic not logged)")
    elif logged != v.m:
        problems.append(f"trained_prompt_num {logged:g} is not m={v.m}")
    if nums["unique_in_indices"] is not None and logged != nums["unique_in_indices"]:
        problems.append(f"trained_prompt_num {logged:g} but {nums['unique_in_indices']} unique indices logged")
    if problems:
        return Check(name, FAIL, nums, "; ".join(problems))
    return Check(name, PASS, nums, f"trained_prompt_num = m = {v.m}")


def check_reward_std_mean(v: EpochView, s: Settings) -> Check:
    name = "reward_std_mean"
    logged = _float(v.rec.get("reward_std_mean"))
    if logged is None:
        return Check(name, WARN, {}, "reward_std_mean not logged")
    if v.r0 is None:
        return _not_logged(name, ["rewards/avg"])
    _, groups = recompute_advantages(v.r0, np.asarray(v.indices), s.std_mode, s.eps, v.keep)
    mean_std = float(np.mean([g.std for g in groups.values()])) if groups else 0.0
    nums = {"logged": logged, "recomputed": mean_std}
    if not _close(logged, mean_std, s.tol):
        return Check(name, FAIL, nums, f"logged {logged:.5g}, recomputed mean group std {mean_std:.5g}")
    return Check(name, PASS, nums, "mean per-group reward std matches")


EPOCH_CHECKS = (
    check_config_arithmetic, check_sample_count, check_unique_conditions, check_count_per_condition,
    check_condition_ids, check_batch_groups, check_reward_shapes, check_reward_gathered, check_reward_finite,
    check_advantage_shape, check_advantage_per_condition, check_advantage_recompute, check_advantage_summary,
    check_zero_std_groups, check_reward_means, check_group_size, check_trained_prompt_num, check_reward_std_mean,
)


def check_unreadable(unreadable: list[Unreadable]) -> Check:
    nums = {"lines": [u.line for u in unreadable]}
    if unreadable:
        return Check("unreadable_lines", WARN, nums,
                     f"{len(unreadable)} line(s) could not be read, the rest was verified: "
                     + ", ".join(f"line {u.line} ({u.reason})" for u in unreadable[:10]))
    return Check("unreadable_lines", PASS, nums, "every line was read")


def check_missing_epochs(epoch_numbers: list, step_epochs: list | None = None) -> Check:
    """Gaps between 0 and the last epoch fail; optimizer steps after the last epoch record warn (crash)."""
    name = "missing_epochs"
    ints = [_int(e) for e in epoch_numbers]
    bad = [e for e, i in zip(epoch_numbers, ints, strict=True) if i is None]
    ints = [i for i in ints if i is not None]
    counts = Counter(ints)
    dups = sorted(e for e, c in counts.items() if c > 1)
    last = max(ints, default=-1)
    missing = sorted(set(range(0, last + 1)) - set(ints))
    trailing = sorted({e for e in (_int(x) for x in step_epochs or []) if e is not None and e > last})
    nums = {"epochs": len(counts), "first": min(ints, default=None), "last": last if ints else None,
            "missing": missing, "duplicated": dups, "steps_without_epoch_record": trailing}
    problems = []
    if missing:
        problems.append(f"epochs {_short(missing)} have no epoch record")
    if dups:
        problems.append(f"epochs {_short(dups)} logged more than once")
    if bad:
        problems.append(f"unreadable epoch numbers {bad[:5]}")
    if problems:
        return Check(name, FAIL, nums, "; ".join(problems))
    if trailing:
        return Check(name, WARN, nums, f"epoch(s) {trailing} have optimizer steps but no epoch record "
                                       "(the run stopped, or its record was torn)")
    return Check(name, PASS, nums, f"epochs 0..{last} all present" if ints else "no epochs")


def check_step_records(epochs: list[dict], steps: list[dict]) -> Check:
    """Step records strictly increasing, in non-decreasing epochs, epoch steps non-decreasing, and the
    optimizer_steps stored in each epoch record as many as that epoch's step records."""
    name = "step_records"
    problems = []
    nums: dict[str, Any] = {"step_records": len(steps)}
    values = [_int(r.get("step")) for r in steps]
    if any(x is None for x in values):
        problems.append(f"{sum(x is None for x in values)} step records without an integer step")
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


def _guard(name: str, fn, *args) -> list[Check]:
    """Run one check; a malformed record must yield a failing check, never a traceback."""
    try:
        out = fn(*args)
    except Exception as e:
        return [Check(name, FAIL, {}, f"could not evaluate: {type(e).__name__}: {e}")]
    return out if isinstance(out, list) else [out]


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
    checks += _guard("missing_epochs", check_missing_epochs, [r.get("epoch") for r in epochs],
                     [r.get("epoch") for r in steps])
    checks += _guard("step_records", check_step_records, epochs, steps)
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
                  {"tol": tol, "std_mode": s.std_mode, "eps": s.eps, "config": config is not None}, notes)


# ----------------------------------------------------------------------------------------------------------
# [GRPO Debug] text logs

TAG = "[GRPO Debug]"
_FLOAT = r"[-+]?(?:\d+\.?\d*(?:e[-+]?\d+)?|\.\d+(?:e[-+]?\d+)?|nan|inf)"
_EPOCH = re.compile(r"\s*epoch\s*[:=]?\s*(\d+)\s*[,:\-]?\s*", re.I)
_INDICES = re.compile(r"gathered dataset indices\s*[:=]\s*(.*)$", re.I)
_UNIQUE = re.compile(r"number of unique conditions\s*[:=]\s*(\d+)\s*$", re.I)
_COUNTS = re.compile(r"count per condition\s*[:=]\s*(.*)$", re.I)
_SHAPE = re.compile(r"advantages shape\s*[:=]\s*(?:torch\.Size\(\s*)?[\[(]\s*(\d+(?:\s*,\s*\d+)*)\s*,?\s*"
                    r"[\])]\s*\)?\s*$", re.I)
_COND = re.compile(rf"condition\s+(-?\d+)\s*:?\s+advantage mean\s*[:=]\s*({_FLOAT})\s*,?\s*"
                   rf"std\s*[:=]\s*({_FLOAT})\s*$", re.I)
_K = re.compile(r"(?:k|group[ _]size)\s*[:=]\s*(\d+)\s*$", re.I)
_PAIR = re.compile(r"\s*(?:tensor\(\s*)?(-?\d+)\s*\)?\s*:\s*(?:tensor\(\s*)?(\d+)\s*\)?\s*")


@dataclass
class DebugEpoch:
    """What one epoch's [GRPO Debug] lines said; a field never printed stays None."""

    order: int
    epoch: int | None = None
    indices: list[int] | None = None
    unique: int | None = None
    counts: dict[int, int] | None = None
    shape: tuple[int, ...] | None = None
    k: int | None = None
    cond_stats: dict[int, tuple[float, float]] = field(default_factory=dict)
    lines: list[int] = field(default_factory=list)

    @property
    def label(self) -> int:
        return self.epoch if self.epoch is not None else self.order


@dataclass
class DebugLog:
    epochs: list[DebugEpoch]
    unreadable: list[Unreadable]
    debug_lines: int
    explicit_epochs: bool


def _bracketed(text: str, open_: str, close: str) -> str | None:
    a, b = text.find(open_), text.rfind(close)
    return text[a + 1:b] if a >= 0 and b > a else None


def _parse_indices(text: str) -> list[int]:
    inner = _bracketed(text, "[", "]")
    if inner is None:
        raise ValueError("list not closed (truncated line?)")
    if "..." in inner or "…" in inner:
        raise ValueError("list elided with '...' (print the full tensor to verify it)")
    tokens = [t.strip() for t in inner.split(",") if t.strip()]
    if not all(re.fullmatch(r"-?\d+", t) for t in tokens):
        raise ValueError("list holds something other than integers")
    return [int(t) for t in tokens]


def _parse_counts(text: str) -> dict[int, int]:
    inner = _bracketed(text, "{", "}")
    if inner is None:
        raise ValueError("dict not closed (truncated line?)")
    out = {}
    for token in (t for t in inner.split(",") if t.strip()):
        m = _PAIR.fullmatch(token)
        if not m:
            raise ValueError(f"unreadable entry {token.strip()!r}")
        out[int(m.group(1))] = int(m.group(2))
    return out


def _parse_debug_body(body: str) -> tuple[str, Any]:
    """(field, value) of one [GRPO Debug] line body, raising ValueError when it cannot be read."""
    if m := _INDICES.search(body):
        return "indices", _parse_indices(m.group(1))
    if m := _UNIQUE.search(body):
        return "unique", int(m.group(1))
    if m := _COUNTS.search(body):
        return "counts", _parse_counts(m.group(1))
    if re.search(r"advantages shape", body, re.I):
        m = _SHAPE.search(body)
        if not m:
            raise ValueError("shape not readable (truncated line?)")
        return "shape", tuple(int(x) for x in m.group(1).split(","))
    if re.search(r"advantage mean", body, re.I):
        m = _COND.search(body)
        if not m:
            raise ValueError("condition advantage line not readable (truncated line?)")
        return "cond", (int(m.group(1)), float(m.group(2)), float(m.group(3)))
    if m := _K.match(body.strip()):
        return "k", int(m.group(1))
    raise ValueError("unrecognised [GRPO Debug] line")


def _has(ep: DebugEpoch, fld: str, value: Any) -> bool:
    return value[0] in ep.cond_stats if fld == "cond" else getattr(ep, fld) is not None


def _only_k(ep: DebugEpoch) -> bool:
    return (ep.epoch is None and not ep.cond_stats
            and all(getattr(ep, f) is None for f in ("indices", "unique", "counts", "shape")))


def parse_debug_log(text: str) -> DebugLog:
    """[GRPO Debug] lines grouped into epochs.

    An explicit "epoch N" places a line; otherwise a line joins the current epoch unless that epoch already
    has the field it carries, in which case a new epoch starts. This follows the printing order whatever it
    is, as long as it is the same every epoch; a `k` printed once carries over to later epochs.
    """
    epochs: list[DebugEpoch] = []
    by_number: dict[int, DebugEpoch] = {}
    bad: list[Unreadable] = []
    current: DebugEpoch | None = None
    n_debug = 0
    explicit = False
    raw = text.splitlines()
    last = max((i for i, s in enumerate(raw, 1) if s.strip()), default=0)
    for no, line in enumerate(raw, 1):
        pos = line.find(TAG)
        if pos < 0:
            continue
        n_debug += 1
        body = line[pos + len(TAG):]
        number = None
        if m := _EPOCH.match(body):
            number, body = int(m.group(1)), body[m.end():]
        try:
            fld, value = _parse_debug_body(body)
        except ValueError as e:
            reason = f"{e}{'; last line of the log' if no == last else ''}"
            bad.append(Unreadable(no, reason, _excerpt(line[pos:])))
            continue

        if number is not None:
            explicit = True
            target = by_number.get(number)
            if target is None and current is not None and _only_k(current):
                # A group size printed once before the first numbered line belongs to that epoch.
                target = by_number[number] = current
                target.epoch = number
            elif target is None:
                target = by_number[number] = DebugEpoch(order=len(epochs), epoch=number)
                epochs.append(target)
            elif _has(target, fld, value):
                old = target.cond_stats.get(value[0]) if fld == "cond" else getattr(target, fld)
                new = value[1:] if fld == "cond" else value
                if old != new:
                    bad.append(Unreadable(no, f"epoch {number} already has a different '{fld}' line",
                                          _excerpt(line[pos:])))
                continue
        else:
            target = current
            if target is None or _has(target, fld, value):
                target = DebugEpoch(order=len(epochs))
                epochs.append(target)
        if fld == "cond":
            target.cond_stats[value[0]] = (value[1], value[2])
        else:
            setattr(target, fld, value)
        target.lines.append(no)
        current = target
    if epochs and _only_k(epochs[-1]) and len(epochs) > 1:
        epochs.pop()  # a trailing group-size line carries no epoch of its own
    return DebugLog(epochs, bad, n_debug, explicit)


def _debug_k(log: DebugLog) -> dict[int, int | None]:
    """Effective k per epoch (order): printed in that epoch or carried over from an earlier one."""
    out, k = {}, None
    for ep in log.epochs:
        k = ep.k if ep.k is not None else k
        out[ep.order] = k
    return out


def check_debug_counts(ep: DebugEpoch, k: int | None) -> Check:
    name = "count_per_condition"
    from_indices = dict(Counter(ep.indices)) if ep.indices is not None else None
    counts = from_indices if from_indices is not None else ep.counts
    if counts is None:
        return Check(name, WARN, {}, "neither indices nor counts printed for this epoch")
    problems = []
    nums: dict[str, Any] = {"k": k, "conditions": len(counts)}
    if from_indices is not None and ep.counts is not None and ep.counts != from_indices:
        diff = sorted(set(ep.counts.items()) ^ set(from_indices.items()))
        problems.append(f"printed counts disagree with the printed indices: {_short(diff, 6)}")
    if k is not None:
        offenders = {i: c for i, c in sorted(counts.items()) if c != k}
        expected_note = f"k={k}"
    else:
        mode = Counter(counts.values()).most_common(1)[0][0] if counts else None
        offenders = {i: c for i, c in sorted(counts.items()) if c != mode}
        expected_note = f"the common count {mode} (k not printed)"
    nums["offenders"] = {str(i): c for i, c in offenders.items()}
    if offenders:
        problems.append(f"conditions without {expected_note} copies: "
                        f"{_short([f'{i}: {c}' for i, c in offenders.items()])}")
    if problems:
        return Check(name, FAIL, nums, "; ".join(problems))
    return Check(name, PASS, nums, f"{len(counts)} conditions, each with {expected_note} copies")


def check_debug_unique(ep: DebugEpoch, k: int | None) -> Check:
    name = "unique_conditions"
    computed = (len(set(ep.indices)) if ep.indices is not None else
                len(ep.counts) if ep.counts is not None else None)
    nums = {"printed": ep.unique, "from_indices_or_counts": computed}
    problems = []
    if ep.unique is not None and computed is not None and ep.unique != computed:
        problems.append(f"printed {ep.unique} unique conditions but the indices/counts hold {computed}")
    n = len(ep.indices) if ep.indices is not None else (sum(ep.counts.values()) if ep.counts else None)
    if k and n is not None:
        nums["expected_N_over_k"] = n / k
        got = ep.unique if ep.unique is not None else computed
        if got is not None and got * k != n:
            problems.append(f"{got} conditions x k={k} != {n} samples")
    if ep.unique is None and computed is None:
        return Check(name, WARN, nums, "not printed for this epoch")
    if problems:
        return Check(name, FAIL, nums, "; ".join(problems))
    return Check(name, PASS, nums, f"{ep.unique if ep.unique is not None else computed} unique conditions")


def check_debug_shape(ep: DebugEpoch) -> Check:
    name = "advantage_shape"
    n = len(ep.indices) if ep.indices is not None else (sum(ep.counts.values()) if ep.counts else None)
    nums = {"shape": list(ep.shape) if ep.shape else None, "samples": n}
    if ep.shape is None:
        return Check(name, WARN, nums, "advantages shape not printed for this epoch")
    if n is None:
        return Check(name, WARN, nums, "no indices or counts to compare the shape with")
    if ep.shape[0] != n:
        return Check(name, FAIL, nums, f"advantages have {ep.shape[0]} rows but {n} samples were gathered")
    return Check(name, PASS, nums, f"advantages shape {tuple(ep.shape)} has one row per gathered sample")


def check_debug_advantages(ep: DebugEpoch, tol: float) -> Check:
    name = "advantage_per_condition"
    if not ep.cond_stats:
        return Check(name, WARN, {}, "no per-condition advantage lines for this epoch")
    counts = dict(Counter(ep.indices)) if ep.indices is not None else (ep.counts or {})
    rows = []
    for g, (mean, std) in sorted(ep.cond_stats.items()):
        row = {"condition": g, "id": "", "samples": counts.get(g), "mean": mean, "std": std, "reward_std": None}
        if std == 0 and mean == 0:
            row["status"], row["note"] = PASS, "zero-std group: all 0"
        elif std == 0:
            row["status"], row["note"] = FAIL, "std 0 but mean is not 0"
        elif not abs(mean) <= tol:
            row["status"], row["note"] = FAIL, f"mean {mean:.4g} is not 0"
        elif not abs(std - 1) <= tol:
            row["status"], row["note"] = FAIL, f"std {std:.4g} is neither 1 nor exactly 0"
        else:
            row["status"], row["note"] = PASS, ""
        if counts and g not in counts:
            row["status"], row["note"] = FAIL, "condition was not among the gathered indices"
        rows.append(row)
    missing = sorted(set(counts) - set(ep.cond_stats)) if counts else []
    tally = Counter(r["status"] for r in rows)
    nums = {"conditions": len(rows), "pass": tally[PASS], "fail": tally[FAIL], "not_printed": missing}
    status = worst(r["status"] for r in rows)
    bad = [f"{r['condition']}: {r['note']}" for r in rows if r["status"] == FAIL]
    if bad:
        return Check(name, status, nums, f"{len(bad)} of {len(rows)} conditions fail: {_short(bad, 6)}", table=rows)
    if missing:
        return Check(name, WARN, nums, f"no advantage line for conditions {_short(missing)}", table=rows)
    return Check(name, PASS, nums, f"{len(rows)} conditions with mean 0 and std 1 (or exactly 0)", table=rows)


def verify_debug_log(log: DebugLog, tol: float = 1e-3, source: str = "train.log") -> Report:
    """Checks over the [GRPO Debug] lines of a text log; a check whose lines are never printed is skipped."""
    checks = [check_unreadable(log.unreadable)]
    nums = {"debug_lines": log.debug_lines, "epochs": len(log.epochs)}
    if log.epochs:
        how = "numbered in the log" if log.explicit_epochs else "inferred from the order of the lines"
        checks.append(Check("epoch_records", PASS, nums, f"{len(log.epochs)} epochs ({how})"))
    else:
        checks.append(Check("epoch_records", FAIL, nums, "no readable [GRPO Debug] epoch in the log"))
    if log.explicit_epochs:
        checks += _guard("missing_epochs", check_missing_epochs,
                         [ep.epoch for ep in log.epochs if ep.epoch is not None])
    ks = _debug_k(log)
    printed = {f: any(getattr(ep, f) for ep in log.epochs) for f in ("indices", "counts", "unique", "shape",
                                                                       "cond_stats")}
    for ep in log.epochs:
        epoch_checks = []
        if printed["indices"] or printed["counts"]:
            epoch_checks += _guard("count_per_condition", check_debug_counts, ep, ks[ep.order])
        if printed["unique"] or printed["indices"] or printed["counts"]:
            epoch_checks += _guard("unique_conditions", check_debug_unique, ep, ks[ep.order])
        if printed["shape"]:
            epoch_checks += _guard("advantage_shape", check_debug_shape, ep)
        if printed["cond_stats"]:
            epoch_checks += _guard("advantage_per_condition", check_debug_advantages, ep, tol)
        for c in epoch_checks:
            c.epoch = ep.label
        checks += epoch_checks
    notes = []
    if not log.explicit_epochs and log.epochs:
        notes.append("epochs are numbered by the order of their lines (the log prints no epoch numbers)")
    return Report(source, "[GRPO Debug] text log", checks, log.unreadable, [ep.label for ep in log.epochs],
                  {"tol": tol}, notes)


def looks_like_jsonl(text: str) -> bool:
    for line in text.splitlines():
        if line.strip():
            return line.lstrip().startswith("{")
    return False


# ----------------------------------------------------------------------------------------------------------
# Markdown


def _fmt(x: Any, depth: int = 0) -> str:
    if isinstance(x, bool) or x is None:
        return str(x)
    if isinstance(x, float):
        return f"{x:.6g}"
    if isinstance(x, (list, tuple)):
        return "[" + _short([_fmt(i, depth + 1) for i in x], 8) + "]"
    if isinstance(x, dict):
        items = [f"{k}: {_fmt(v, depth + 1)}" for k, v in x.items()]
        return "{" + _short(items, 6) + "}"
    return str(x)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _numbers(nums: dict) -> str:
    return _cell(", ".join(f"{k}={_fmt(v)}" for k, v in nums.items()))


def _check_table(checks: list[Check]) -> list[str]:
    lines = ["| check | status | numbers | detail |", "|---|---|---|---|"]
    for c in checks:
        lines.append(f"| {c.name} | {c.status.upper()} | {_numbers(c.numbers)} | {_cell(c.detail)} |")
    return lines


def _condition_table(rows: list[dict]) -> list[str]:
    lines = ["| condition | id | samples | mean | std | reward std | status | note |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rs = "" if r.get("reward_std") is None else f"{r['reward_std']:.4g}"
        lines.append(f"| {r['condition']} | {_cell(r.get('id', ''))} | {r.get('samples', '')} | {r['mean']:.4g} | "
                     f"{r['std']:.4g} | {rs} | {r['status'].upper()} | {_cell(r.get('note', ''))} |")
    return lines


def render_markdown(report: Report, plots: list[tuple[str, str]] | None = None) -> str:
    """The report as Markdown; `plots` are (title, relative path) pairs to link."""
    summary = report.summary()
    n_fail = sum(1 for c in report.checks if c.status == FAIL)
    n_warn = sum(1 for c in report.checks if c.status == WARN)
    epochs = report.epochs
    span = f"{min(epochs)}..{max(epochs)} ({len(epochs)})" if epochs else "none"
    out = ["# GRPO verification report", "",
           f"- source: `{report.source}` ({report.kind})",
           f"- epochs: {span}",
           f"- settings: {_numbers(report.settings)}", "",
           f"**Result: {report.status.upper()}** — {n_fail} failing and {n_warn} warning check results "
           f"over {len(report.checks)}.", ""]
    out += ["## Summary", "", "| check | overall | failing in | warning in |", "|---|---|---|---|"]
    for name, row in summary.items():
        out.append(f"| {name} | {row['status'].upper()} | {_cell(_short(row['fail'])) or '-'} | "
                   f"{_cell(_short(row['warn'])) or '-'} |")
    out.append("")
    out += ["## Could not read", ""]
    if report.unreadable:
        out += [f"- line {u.line}: {u.reason} — `{u.text.replace('`', chr(39))}`" for u in report.unreadable]
    else:
        out.append("Every line was read.")
    out.append("")
    for note in report.notes:
        out.append(f"> {note}")
    if report.notes:
        out.append("")
    run_checks = [c for c in report.checks if c.epoch is None]
    out += ["## Whole run", ""] + _check_table(run_checks) + [""]
    for e in sorted({c.epoch for c in report.checks if c.epoch is not None}):
        these = [c for c in report.checks if c.epoch == e]
        status = worst(c.status for c in these)
        out += [f"## Epoch {e} — {status.upper()}", ""] + _check_table(these) + [""]
        for c in these:
            if not c.table:
                continue
            title = f"Advantages per condition ({len(c.table)} conditions, {c.status.upper()})"
            if c.status == PASS:
                out += ["<details><summary>" + title + "</summary>", ""] + _condition_table(c.table)
                out += ["", "</details>", ""]
            else:
                out += [f"### {title}", ""] + _condition_table(c.table) + [""]
    if plots:
        out += ["## Plots", ""]
        for title, path in plots:
            out += [f"### {title}", "", f"![{title}]({path})", ""]
    return "\n".join(out).rstrip() + "\n"


# ----------------------------------------------------------------------------------------------------------
# plots


def _finite(values) -> np.ndarray:
    a = np.asarray(values, dtype=np.float64)
    return np.where(np.isfinite(a), a, np.nan)


def write_plots(records: list[dict], out_dir: Path, stem: str) -> list[tuple[str, str]]:
    """PNG plots of a metrics.jsonl next to the report; returns (title, file name) of those written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    written = []
    epochs = sorted((r for r in records if r.get("type") == "epoch" and _int(r.get("epoch")) is not None),
                    key=lambda r: _int(r["epoch"]))
    steps = [r for r in records if r.get("type") == "step" and _int(r.get("step")) is not None]
    if not steps:
        steps = [s for r in epochs for s in (r.get("optimizer_steps") or []) if isinstance(s, dict)]

    keys = sorted({k[len("reward_"):] for r in epochs for k, v in r.items()
                   if k.startswith("reward_") and k not in _NOT_REWARD_MEANS and _float(v) is not None})
    if keys:
        fig, ax = plt.subplots(figsize=(7, 4))
        for key in keys:
            xs = [_int(r["epoch"]) for r in epochs if _float(r.get(f"reward_{key}")) is not None]
            ys = [_float(r.get(f"reward_{key}")) for r in epochs if _float(r.get(f"reward_{key}")) is not None]
            ax.plot(xs, _finite(ys), marker="o", label=key)
        ax.set_xlabel("epoch")
        ax.set_ylabel("mean reward (gathered)")
        ax.set_title("Reward per key over epochs")
        ax.legend()
        ax.grid(alpha=0.3)
        name = f"{stem}_rewards.png"
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=90)
        plt.close(fig)
        written.append(("Reward per key over epochs", name))

    per_epoch = []
    for r in epochs:
        a = _array(r.get("advantages"))
        if a is not None and a.ndim >= 1 and a.size:
            per_epoch.append((_int(r["epoch"]), (a[:, 0] if a.ndim == 2 else a.ravel())))
    if per_epoch:
        fig, ax = plt.subplots(figsize=(7, 4))
        everything = _finite(np.concatenate([a for _, a in per_epoch]))
        everything = everything[np.isfinite(everything)]
        if everything.size:
            ax.hist(everything, bins=50, alpha=0.6, label=f"all {len(per_epoch)} epochs", density=True)
            last_e, last = per_epoch[-1]
            last = _finite(last)
            ax.hist(last[np.isfinite(last)], bins=50, histtype="step", linewidth=1.5,
                    label=f"epoch {last_e}", density=True)
        ax.set_xlabel("advantage (one per sample)")
        ax.set_ylabel("density")
        ax.set_title("Advantage distribution")
        ax.legend()
        name = f"{stem}_advantages.png"
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=90)
        plt.close(fig)
        written.append(("Advantage distribution", name))

    if steps:
        xs = [_int(s.get("step")) if _int(s.get("step")) is not None else i for i, s in enumerate(steps, 1)]
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
        ratio = _finite([_float(s.get("mean_ratio")) if _float(s.get("mean_ratio")) is not None else np.nan
                         for s in steps])
        ax1.plot(xs, ratio, label="mean_ratio")
        for key, style in (("ratio_min", ":"), ("ratio_max", ":")):
            vals = [_float(s.get(key)) for s in steps]
            if any(x is not None for x in vals):
                ax1.plot(xs, _finite([np.nan if x is None else x for x in vals]), style, label=key)
        spread = _finite([_float(s.get(k)) for s in steps for k in ("mean_ratio", "ratio_max", "ratio_min")
                          if _float(s.get(k)) is not None])
        spread = spread[np.isfinite(spread) & (spread > 0)]
        if spread.size and spread.max() / spread.min() > 100:
            ax1.set_yscale("log")
        ax1.set_ylabel("ratio")
        ax1.set_title("Importance ratio and KL over optimizer steps")
        ax1.legend()
        ax1.grid(alpha=0.3)
        positive = []
        for key in ("kl_penalty", "approx_kl"):
            vals = [_float(s.get(key)) for s in steps]
            if any(x is not None for x in vals):
                series = _finite([np.nan if x is None else x for x in vals])
                ax2.plot(xs, series, label=key)
                positive += [x for x in series.tolist() if x > 0]
        # symlog, because KL is exactly 0 at the first step; linear only below the smallest value logged
        ax2.set_yscale("symlog", linthresh=max(min(positive, default=1e-6), 1e-12))
        ax2.set_xlabel("global step")
        ax2.set_ylabel("KL")
        ax2.legend()
        ax2.grid(alpha=0.3)
        name = f"{stem}_ratio_kl.png"
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=90)
        plt.close(fig)
        written.append(("Importance ratio and KL over optimizer steps", name))
    return written
