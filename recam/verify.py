"""Independent verification, from its logs alone, that a GRPO run did what it claims.

Two sources are understood:
  * `metrics.jsonl` written by `recam.runlog` (step / epoch / eval records);
  * plain-text training logs carrying `[GRPO Debug]` lines, as earlier GRPO codebases print them: numpy and
    torch reprs with or without commas, values spanning several lines, dicts / Counter / defaultdict with str or
    int keys, rank and timestamp prefixes, several ranks printing the same epoch, per-condition lines in their
    common phrasings. `DEBUG_LOG_FORMS` lists every form read, with an example (the README table is built from it).

A check that could not be evaluated is never a pass. Every line that could not be read is listed with the reason;
an epoch whose sampling facts (gathered dataset indices, or counts per condition) were not read fails "could not
verify", and so does a log without any readable epoch.

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
    # (line, record type, epoch) recovered from the text of unparsable lines, where it shows them
    lost: list[tuple[int, str | None, int | None]] = field(default_factory=list)


_LOST_TYPE = re.compile(r'"type"\s*:\s*"(\w+)"')
_LOST_EPOCH = re.compile(r'"epoch"\s*:\s*(-?\d+)\b')


def parse_jsonl(text: str) -> ParsedLog:
    """Records of a metrics.jsonl with their line numbers; unparsable lines are kept aside, never fatal.

    What an unparsable line was (its "type" and "epoch", when the text still shows them) is kept in `lost`, so
    that a torn epoch record fails its epoch instead of vanishing from the verification.
    """
    records, lines, bad, lost = [], [], [], []
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
            kind, epoch = _LOST_TYPE.search(s), _LOST_EPOCH.search(s)
            lost.append((no, kind.group(1) if kind else None, int(epoch.group(1)) if epoch else None))
            continue
        if not isinstance(obj, dict):
            bad.append(Unreadable(no, f"a JSON {type(obj).__name__}, not a record", _excerpt(s)))
            continue
        records.append(obj)
        lines.append(no)
    return ParsedLog(records, lines, bad, lost)


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
    check_sampling_facts, check_config_arithmetic, check_sample_count, check_unique_conditions,
    check_count_per_condition, check_condition_ids, check_batch_groups, check_reward_shapes, check_reward_gathered,
    check_reward_finite, check_advantage_shape, check_advantage_per_condition, check_advantage_recompute,
    check_advantage_summary, check_zero_std_groups, check_reward_means, check_group_size, check_trained_prompt_num,
    check_reward_std_mean,
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
        # those steps trained on samples nobody can check: not verified is not passed
        return Check(name, FAIL, nums, f"could not verify epoch(s) {trailing}: optimizer steps were logged but no "
                                       "readable epoch record (the run stopped mid-epoch, or its record was torn)")
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
#
# Reading goes through three small layers, each of which says why it gave up instead of guessing:
#   lines -> records  a tagged line's text after the tag, plus the untagged lines that continue a value it left
#                     open (unbalanced brackets, or a key with nothing after it yet);
#   record -> items   a tokenizer and a recursive-descent reader turn `key: value, key=value ...` into
#                     (normalised key, Python value) pairs, values being the reprs Python, numpy and torch print;
#   items -> facts    a table maps the normalised keys onto the sampling facts the checks compare.

TAG = "[GRPO Debug]"
_TAG_RE = re.compile(r"\[\s*GRPO[ _-]?Debug\s*\]", re.I)

# What the text-log reader accepts, with an example of each; the README table and a test are built on this.
DEBUG_LOG_FORMS: tuple[tuple[str, str], ...] = (
    ("tag anywhere in the line, after any prefix (timestamp, logger fields, rank)",
     "2025-06-01 12:00:01,123 - INFO - [GRPO Debug] Unique conditions: 16"),
    ("rank prefixes: `[rank0]:` (torchrun, also on continuation lines), `[Rank 3]`, `[default0]:`, `3: ` (srun -l)",
     "[2025-06-01 12:00:01] [Rank 3] [GRPO Debug] Advantages shape: (64, 18)"),
    ("epoch stated in the prefix or the body (`Epoch 3`, `epoch 3:`, `Epoch 3/10`), or only inferable from the order",
     "[GRPO Debug] Epoch 3"),
    ("numpy arrays without commas, wrapped over several lines (continuations carry no tag)",
     "[GRPO Debug] Gathered dataset_indices: [19928 16416 24708\n 16416 24708 19928]"),
    ("Python lists with commas; nested lists (flattened)", "[GRPO Debug] Gathered dataset indices: [3, 5, 3, 5]"),
    ("torch reprs with device / dtype, over several lines",
     "[GRPO Debug] Gathered dataset_indices: tensor([19928, 16416,\n        16416, 19928], device='npu:0')"),
    ("numpy `array([...], dtype=int64)` and numpy 2 scalars `np.int64(5)`",
     "[GRPO Debug] Count per condition: {np.int64(19928): 2, np.int64(16416): 2}"),
    ("dicts with str or int keys, pprint'ed over several lines",
     "[GRPO Debug] Count per condition: {'16416': 2,\n '19928': 2}"),
    ("`Counter({...})`, `defaultdict(<class 'int'>, {...})`, `OrderedDict([(k, v), ...])` or `OrderedDict({...})`",
     "[GRPO Debug] Count per condition: defaultdict(<class 'int'>, {3: 2, 5: 2})"),
    ("value on the line after its key (`key:` then a pprint'ed dict)",
     "[GRPO Debug] Count per condition:\n{3: 2, 5: 2}"),
    ("shapes as tuples, lists or `torch.Size([...])`", "[GRPO Debug] Advantages shape: torch.Size([64, 18])"),
    ("`Unique conditions` / `Number of unique conditions`; `k` / `group size`",
     "[GRPO Debug] Number of unique conditions: 16, k=4"),
    ("per-condition lines: `name = value` or `name: value` pairs after `Condition <id>`",
     "[GRPO Debug] Condition 16416: samples=4, advantage mean=-0.0000, std=0.9996"),
    ("per-condition lines without separators after the id",
     "[GRPO Debug] condition 16416 advantage mean: 0.0001 std: 1.0000"),
    ("per-condition stats as one dict", "[GRPO Debug] Advantage per condition: {3: {'count': 2, 'mean': 0.0, "
                                        "'std': 1.0}}"),
    ("keys in any case, with `_` or spaces, `nan` / `inf`, several `key: value` pairs per line",
     "[GRPO Debug] epoch 3: GATHERED_DATASET_INDICES: [3 5 3 5]"),
    ("several ranks printing the same epoch: duplicates that agree are accepted, ones that disagree fail", ""),
    ("progress bars (`\\r`, `|###| 3/10 [00:01<00:02, 2.1it/s]`), warnings and other output in between", ""),
)

_ELIDED_REASON = ("printed with '...' (numpy and torch elide long arrays; print them in full, e.g. "
                  "np.set_printoptions(threshold=sys.maxsize) / torch.set_printoptions(profile='full'))")


class _Tok:
    __slots__ = ("kind", "text", "val")

    def __init__(self, kind: str, text: str, val: Any = None):
        self.kind, self.text, self.val = kind, text, val

    def __repr__(self) -> str:
        return f"{self.kind}:{self.text}"


_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<str>'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*")
  | (?P<ellipsis>\.\.\.|…)
  | (?P<num>[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?)|[-+]?(?i:nan|inf)(?![A-Za-z0-9_]))
  | (?P<word>[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)
  | (?P<punct>[\[\](){}:,;=<>])
  | (?P<other>.)
""", re.X | re.S)


def _tokenize(text: str) -> list[_Tok]:
    out = []
    for m in _TOKEN.finditer(text):
        kind, s = m.lastgroup, m.group()
        if kind == "ws":
            continue
        if kind == "num":
            low = s.lower()
            val = float(low) if any(c in low for c in ".en") else int(s)  # "e" and "n": exponents, nan, inf
            out.append(_Tok("num", s, val))
        elif kind == "str":
            out.append(_Tok("str", s, s[1:-1]))
        else:
            out.append(_Tok(kind, s))
    return out


def _depth(tokens: list[_Tok]) -> int:
    d = 0
    for t in tokens:
        if t.kind == "punct":
            d += (t.text in "[({") - (t.text in "])}")
    return d


def _open(tokens: list[_Tok]) -> bool:
    """Whether a value continues on the next line: brackets still open, or a key waiting for its value."""
    return _depth(tokens) > 0 or (len(tokens) > 1 and tokens[-1].kind == "punct" and tokens[-1].text in ":="
                                  and tokens[-2].kind == "word")  # `=== Epoch 4 ===` is decoration, not a key


class _Elided:
    """An array or dict printed with `...`: its length and contents are unknown."""


class _Opaque:
    """A value read but not interpretable (`<class 'int'>`, a set, an unknown constructor)."""

    def __init__(self, what: str):
        self.what = what

    def __repr__(self) -> str:
        return f"<{self.what}>"


class _Stop(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


_CONTAINERS = {"tensor", "array", "asarray", "as_tensor", "from_numpy", "list", "tuple"}
_MAPPINGS = {"counter", "ordereddict", "dict", "defaultdict"}
_SCALARS = {"int", "float", "long", "double", "half", "bool_", "bfloat16", "int8", "int16", "int32", "int64",
            "uint8", "uint16", "uint32", "uint64", "float16", "float32", "float64", "intc", "longlong"}
_CONSTANTS = {"true": True, "false": False, "none": None}


class _Reader:
    """Recursive descent over tokens: numbers, strings, lists with or without commas, tuples, dicts, sets,
    constructor calls (tensor, array, Counter, defaultdict, torch.Size, np.int64 ...), `<...>` type reprs."""

    def __init__(self, tokens: list[_Tok]):
        self.toks, self.i = tokens, 0

    def peek(self, k: int = 0) -> _Tok | None:
        j = self.i + k
        return self.toks[j] if j < len(self.toks) else None

    def at(self, text: str, k: int = 0) -> bool:
        t = self.peek(k)
        return t is not None and t.kind in ("punct", "other") and t.text == text

    def take(self) -> _Tok:
        t = self.peek()
        if t is None:
            raise _Stop("ends before the value does (truncated line?)")
        self.i += 1
        return t

    def expect(self, text: str) -> None:
        t = self.take()
        if not (t.kind in ("punct", "other") and t.text == text):
            raise _Stop(f"expected {text!r}, found {t.text!r}")

    def starts_value(self) -> bool:
        t = self.peek()
        if t is None:
            return False
        return (t.kind in ("num", "str", "ellipsis") or (t.kind == "punct" and t.text in "[({<")
                or (t.kind == "word" and self.at("(", 1)))

    def value(self) -> Any:
        t = self.take()
        if t.kind in ("num", "str"):
            return t.val
        if t.kind == "ellipsis":
            return _Elided()
        if t.kind == "punct":
            if t.text == "[":
                return self.sequence("]")
            if t.text == "(":
                return self.parens()
            if t.text == "{":
                return self.braces()
            if t.text == "<":
                return self.angle()
        if t.kind == "word":
            if self.at("("):
                self.take()
                return self.call(t.text)
            return _CONSTANTS.get(t.text.lower(), t.text)
        raise _Stop(f"unexpected {t.text!r}")

    def sequence(self, close: str) -> list | _Elided:
        items, elided = [], False
        while not self.at(close):
            v = self.value()
            elided |= isinstance(v, _Elided)
            items.append(v)
            if self.at(","):
                self.take()
        self.take()
        return _Elided() if elided else items

    def parens(self) -> Any:
        if self.at(")"):
            self.take()
            return ()
        first = self.value()
        if self.at(")"):
            self.take()
            return first
        items = [first]
        while self.at(","):
            self.take()
            if self.at(")"):
                break
            items.append(self.value())
        self.expect(")")
        return _Elided() if any(isinstance(v, _Elided) for v in items) else tuple(items)

    def braces(self) -> Any:
        if self.at("}"):
            self.take()
            return {}
        first = self.value()
        if not self.at(":"):
            rest = self.sequence("}")
            return _Opaque("set") if not isinstance(rest, _Elided) else rest
        out: dict = {}
        key, elided = first, False
        while True:
            self.expect(":")
            val = self.value()
            if isinstance(key, _Elided) or isinstance(val, _Elided):
                elided = True
            else:
                try:
                    out[key] = val
                except TypeError:
                    raise _Stop(f"dict key {key!r} is not hashable") from None
            if self.at(","):
                self.take()
            if self.at("}"):
                self.take()
                return _Elided() if elided else out
            key = self.value()
            if isinstance(key, _Elided) and (self.at(",") or self.at("}")):  # `{1: 4, ...}`
                elided = True
                if self.at(","):
                    self.take()
                if self.at("}"):
                    self.take()
                    return _Elided()
                key = self.value()

    def angle(self) -> _Opaque:
        depth, parts = 1, []
        while depth:
            t = self.take()
            depth += (t.text == "<") - (t.text == ">") if t.kind == "punct" else 0
            parts.append(t.text)
        return _Opaque("<" + " ".join(parts))

    def call(self, name: str) -> Any:
        args, kwargs = [], {}
        while not self.at(")"):
            if self.peek() is not None and self.peek().kind == "word" and self.at("=", 1):
                key = self.take().text
                self.take()
                kwargs[key] = self.value()
            else:
                args.append(self.value())
            if self.at(","):
                self.take()
        self.take()
        if any(isinstance(a, _Elided) for a in args):
            return _Elided()
        base = name.rsplit(".", 1)[-1].lower()
        if base in _CONTAINERS and len(args) == 1:
            return args[0]
        if base == "size":
            return tuple(args[0]) if len(args) == 1 and isinstance(args[0], (list, tuple)) else tuple(args)
        if base in _MAPPINGS:
            dicts = [a for a in args if isinstance(a, dict)]
            pairs = [a for a in args if isinstance(a, list) and all(isinstance(p, tuple) and len(p) == 2 for p in a)]
            if dicts:
                return dicts[-1]
            if pairs:  # OrderedDict([(3, 2), (5, 2)]) before Python 3.12
                try:
                    return dict(pairs[-1])
                except TypeError:
                    raise _Stop(f"unhashable key in {name}(...)") from None
            return dict(kwargs) if not args else _Opaque(name)
        if base in _SCALARS and len(args) == 1 and isinstance(args[0], (int, float)):
            return args[0]
        return _Opaque(name)


_ITEM_SEPS = {",", ";", ":", "|", "-", "=", "*", "#", "–", "—", ">"}


def _norm_key(words: list[str]) -> str:
    return " ".join(" ".join(words).lower().replace("_", " ").replace(".", " ").split())


def _read_items(tokens: list[_Tok]) -> tuple[list[tuple[str, str, Any]], tuple[str, str] | None]:
    """(normalised key, key as printed, value) pairs of a record, and (key, reason) where reading stopped.

    An item is `words [: or =] value`; the separator may be left out when the value starts with something a
    name cannot (a number, a bracket, a quote, a constructor call), which is how `Condition 16416: ...` and
    `condition 16416 advantage mean: ...` both read as a `condition` item followed by stat items.
    """
    r = _Reader(tokens)
    items: list[tuple[str, str, Any]] = []
    while True:
        while r.peek() is not None and r.peek().kind in ("punct", "other") and r.peek().text in _ITEM_SEPS:
            r.take()
        if r.peek() is None:
            return items, None
        words = []
        while r.peek() is not None and r.peek().kind == "word" and not r.at("(", 1):
            words.append(r.take().text)
        if not words:
            return items, ("", f"expected a name, found {r.peek().text!r}")
        key, printed = _norm_key(words), " ".join(words)
        if r.at(":") or r.at("="):
            r.take()
            if r.peek() is None:
                return items, (printed, f"'{printed}' has no value (truncated line?)")
        elif not r.starts_value():
            return items, (printed, f"'{printed}' is not followed by a value")
        try:
            value = r.value()
        except _Stop as e:
            return items, (printed, f"'{printed}': {e.reason}")
        except RecursionError:
            return items, (printed, f"'{printed}': nested too deeply to read")
        if key == "epoch" and r.at("/") and r.peek(1) is not None and r.peek(1).kind == "num":
            r.take()
            r.take()  # "Epoch 3/10": the total is not a fact
        items.append((key, printed, value))


# Normalised keys (after dropping leading filler words) -> the fact they state.
_FILLERS = ("gathered ", "all ", "global ", "total ", "the ", "number of ", "num ", "no of ", "nb ", "final ")
_FIELD_NAMES = {
    "indices": ("dataset indices", "dataset index", "dataset idx", "indices", "prompt indices", "condition indices",
                "dataset indexes", "indexes"),
    "unique": ("unique conditions", "unique condition", "unique prompts", "unique dataset indices", "unique indices",
               "conditions unique"),
    "counts": ("count per condition", "counts per condition", "count per prompt", "counts per prompt",
               "samples per condition", "samples per prompt", "copies per condition", "condition counts", "counts",
               "count per dataset index", "counts per dataset index", "per condition count", "per condition counts"),
    "shape": ("advantages shape", "advantage shape", "advantages size", "adv shape", "advantages tensor shape"),
    "k": ("k", "group size", "generations", "samples per group"),
    "per_condition": ("advantage per condition", "advantages per condition", "advantage stats per condition",
                      "per condition advantage", "per condition advantages", "advantage stats"),
    "epoch": ("epoch",),
    "subject": ("condition", "cond", "condition id", "prompt", "prompt id", "group", "group id"),
}
_FIELDS = {name: fld for fld, names in _FIELD_NAMES.items() for name in names}
_STATS = {**{n: "samples" for n in ("samples", "count", "n", "copies", "size", "sample count")},
          **{n: "mean" for n in ("mean", "advantage mean", "advantages mean", "adv mean", "mean advantage")},
          **{n: "std" for n in ("std", "advantage std", "advantages std", "adv std", "std advantage", "stdev")}}
_SAMPLING_WORDS = re.compile(r"indic|index|count|unique|condition|sample|\[\s*\d", re.I)
# Fields that carry what was sampled; one of indices / counts must be read for an epoch to be verified.
SAMPLING_FIELDS = ("indices", "counts")


def _strip_fillers(key: str) -> str:
    changed = True
    while changed:
        changed = False
        for f in _FILLERS:
            if key.startswith(f) and len(key) > len(f):
                key, changed = key[len(f):], True
    return key


def _as_int(v: Any) -> int:
    if isinstance(v, _Elided):
        raise ValueError(_ELIDED_REASON)
    i = _int(v)
    if i is None:
        raise ValueError(f"{_excerpt(repr(v), 40)} is not an integer")
    return i


def _as_float(v: Any) -> float:
    f = _float(v)
    if f is None:
        raise ValueError(f"{_excerpt(repr(v), 40)} is not a number")
    return f


def _cond_id(v: Any) -> int | str | None:
    """A condition id as printed: a number, or a string (digits read as the number they spell)."""
    if isinstance(v, str):
        s = v.strip()
        return int(s) if re.fullmatch(r"-?\d+", s) else (s or None)
    return _int(v)


def _flat(v: Any) -> list:
    if isinstance(v, _Elided):
        raise ValueError(_ELIDED_REASON)
    if not isinstance(v, (list, tuple)):
        raise ValueError(f"not a list but {_excerpt(repr(v), 40)}")
    out = []
    for x in v:
        out += _flat(x) if isinstance(x, (list, tuple)) else [x]
    return out


def _as_indices(v: Any) -> list[int]:
    out = []
    for x in _flat(v):
        i = _int(x)
        if i is None:
            raise ValueError(f"holds {_excerpt(repr(x), 30)}, not only integers")
        out.append(i)
    return out


def _as_counts(v: Any) -> dict:
    if isinstance(v, _Elided):
        raise ValueError(_ELIDED_REASON)
    if not isinstance(v, dict):
        raise ValueError(f"not a dict but {_excerpt(repr(v), 40)}")
    out: dict = {}
    for key, c in v.items():
        cid = _cond_id(key)
        if cid is None:
            raise ValueError(f"key {_excerpt(repr(key), 30)} is not a condition id")
        out[cid] = _as_int(c)
    return out


def _as_shape(v: Any) -> tuple[int, ...]:
    if isinstance(v, _Elided):
        raise ValueError(_ELIDED_REASON)
    if isinstance(v, int) and not isinstance(v, bool):
        return (v,)
    if not isinstance(v, (list, tuple)) or not v:
        raise ValueError(f"not a shape but {_excerpt(repr(v), 40)}")
    return tuple(_as_int(x) for x in v)


def _as_stats(v: Any) -> dict[str, float]:
    if not isinstance(v, dict):
        raise ValueError(f"not a dict of stats but {_excerpt(repr(v), 40)}")
    out = {}
    for name, x in v.items():
        stat = _STATS.get(_strip_fillers(_norm_key([str(name)])))
        if stat is not None:
            out[stat] = _as_int(x) if stat == "samples" else _as_float(x)
    return out


@dataclass
class _Record:
    """One tagged statement (its line and the continuation lines it spans) turned into facts."""

    line: int
    end: int
    stream: int | None
    text: str
    epoch: int | None = None
    facts: list[tuple[str, Any]] = field(default_factory=list)
    bad: list[tuple[str | None, str]] = field(default_factory=list)  # (field or None, reason)
    ignored: list[str] = field(default_factory=list)


def _fact_of(fld: str | None, key: str, subject: Any) -> str | None:
    """Which fact an unreadable value was meant to state (None: none the checks use)."""
    if fld in ("indices", "unique", "counts", "shape", "k"):
        return fld
    if fld in ("subject", "per_condition") or (subject is not None and key in _STATS):
        return "cond"
    return None


def _interpret(rec: _Record, items: list[tuple[str, str, Any]], stop: tuple[str, str] | None) -> None:
    subject = None
    for key, printed, value in items:
        key = _strip_fillers(key)
        fld = _FIELDS.get(key)
        try:
            if fld == "subject" and not isinstance(value, (list, tuple, dict)) and _cond_id(value) is not None:
                subject = _cond_id(value)
                rec.facts.append(("cond", (subject, {})))
            elif subject is not None and key in _STATS:
                stat = _STATS[key]
                rec.facts.append(("cond", (subject, {stat: _as_int(value) if stat == "samples" else
                                                     _as_float(value)})))
            elif fld == "epoch":
                rec.epoch = _as_int(value)
            elif fld == "indices":
                rec.facts.append(("indices", _as_indices(value)))
            elif fld == "unique":
                rec.facts.append(("unique", _as_int(value)))
            elif fld == "counts" and (isinstance(value, (int, float)) and not isinstance(value, bool)):
                rec.facts.append(("k", _as_int(value)))  # "samples per prompt: 4" is the group size
            elif fld == "counts":
                rec.facts.append(("counts", _as_counts(value)))
            elif fld == "shape":
                rec.facts.append(("shape", _as_shape(value)))
            elif fld == "k":
                rec.facts.append(("k", _as_int(value)))
            elif fld == "per_condition":
                if isinstance(value, _Elided) or not isinstance(value, dict):
                    raise ValueError(_ELIDED_REASON if isinstance(value, _Elided) else "not a dict")
                for cid, stats in value.items():
                    if _cond_id(cid) is None:
                        raise ValueError(f"key {_excerpt(repr(cid), 30)} is not a condition id")
                    rec.facts.append(("cond", (_cond_id(cid), _as_stats(stats))))
            else:
                rec.ignored.append(key)
        except ValueError as e:
            rec.bad.append((_fact_of(fld, key, subject), f"'{printed}' {e}"))
    if stop is not None:
        printed, reason = stop
        key = _strip_fillers(_norm_key(printed.split())) if printed else ""
        rec.bad.append((_fact_of(_FIELDS.get(key), key, subject), reason))
    if not items and stop is None:
        rec.bad.append((None, "no `key: value` after the tag"))


_RANK_PREFIX = re.compile(r"(?<![A-Za-z])(?:rank|default)\s*[:=#]?\s*(\d+)", re.I)
_SRUN_PREFIX = re.compile(r"^\s*(\d+):\s*$")
_EPOCH_PREFIX = re.compile(r"(?<![A-Za-z])epoch\s*[:=#]?\s*(\d+)", re.I)
_CONT_RANK = re.compile(r"^\s*\[?\s*(?:rank|default)\s*(\d+)\s*\]?\s*:?", re.I)


@dataclass
class _Pending:
    line: int
    end: int
    stream: int | None
    srun: bool
    prefix_epoch: int | None
    parts: list[str]
    tokens: list[_Tok]


def _strip_continuation(seg: str, pending: dict) -> tuple[Any, str] | None:
    """(stream, text) when an untagged line may continue an open value, None when it is some other output."""
    m = _CONT_RANK.match(seg)
    if m:  # torchrun prefixes every line of a process, continuations included
        rank = int(m.group(1))
        return (rank, seg[m.end():]) if rank in pending else None
    for stream, p in pending.items():
        if p.srun and seg.lstrip().startswith(f"{stream}:"):
            return stream, seg.lstrip()[len(f"{stream}:"):]
    # a logger prefixes only a message's first line: an unprefixed line continues the one open value, if one
    plain = [s for s, p in pending.items() if not p.srun]
    return (plain[0], seg) if len(plain) == 1 else None


def _records(text: str) -> tuple[list[_Record], int]:
    """Tagged statements with their continuation lines, in order; also the number of tagged lines."""
    out: list[_Record] = []
    pending: dict[Any, _Pending] = {}
    raw = text.split("\n")
    last = max((i for i, s in enumerate(raw, 1) if s.strip()), default=0)
    n_tagged = 0

    def finish(p: _Pending, truncated: str | None) -> None:
        rec = _Record(p.line, p.end, p.stream, _excerpt(TAG + " " + p.parts[0].strip()), p.prefix_epoch)
        items, stop = _read_items(p.tokens)
        if truncated and stop is None:
            stop = ("", f"value not closed ({truncated})")
        elif truncated:
            stop = (stop[0], f"{stop[1]}; {truncated}")
        _interpret(rec, items, stop)
        if rec.epoch is None:
            rec.epoch = p.prefix_epoch
        out.append(rec)

    for no, line in enumerate(raw, 1):
        for seg in line.split("\r"):  # progress bars redraw with \r: each redraw is its own piece
            m = _TAG_RE.search(seg)
            if m:
                n_tagged += 1
                prefix, body = seg[:m.start()], seg[m.end():]
                rank = _RANK_PREFIX.search(prefix)
                srun = _SRUN_PREFIX.match(prefix)
                stream = int(rank.group(1)) if rank else (int(srun.group(1)) if srun else None)
                ep = _EPOCH_PREFIX.search(prefix)
                if stream in pending:
                    finish(pending.pop(stream), f"the next [GRPO Debug] line, {no}, came first: truncated?")
                p = _Pending(no, no, stream, bool(srun and not rank), int(ep.group(1)) if ep else None, [body],
                             _tokenize(body))
                if _open(p.tokens):
                    pending[stream] = p
                else:
                    finish(p, None)
                continue
            if not pending or not seg.strip():
                continue
            routed = _strip_continuation(seg, pending)
            if routed is None:
                continue
            stream, rest = routed
            toks = _tokenize(rest)
            if not toks or any(t.kind == "other" for t in toks):
                continue  # a progress bar, a warning, a log line: not part of a printed value
            p = pending[stream]
            p.parts.append(rest)
            p.tokens += toks
            p.end = no
            if not _open(p.tokens):
                finish(pending.pop(stream), None)
    for p in pending.values():
        finish(p, "the log ends first" + ("" if p.end < last else ": last line of the log"))
    out.sort(key=lambda r: r.line)
    return out, n_tagged


@dataclass
class DebugEpoch:
    """What one epoch's [GRPO Debug] lines said; a fact never printed (or not readable) stays None."""

    order: int
    epoch: int | None = None
    indices: list[int] | None = None
    unique: int | None = None
    counts: dict | None = None
    shape: tuple[int, ...] | None = None
    k: int | None = None
    cond_stats: dict = field(default_factory=dict)  # condition id -> {"samples", "mean", "std"} as printed
    lines: list[int] = field(default_factory=list)
    sources: dict[str, list[int]] = field(default_factory=dict)  # fact -> lines that stated it
    unread: list[tuple[str, int, str]] = field(default_factory=list)  # (fact, line, reason) not readable
    conflicts: list[str] = field(default_factory=list)  # repeated statements (other ranks) that disagree
    explicit: bool = False

    @property
    def label(self) -> int:
        return self.epoch if self.epoch is not None else self.order

    def sampled_counts(self) -> dict | None:
        """Copies per condition: from the gathered indices when read, else from the printed counts."""
        if self.indices is not None:
            return dict(Counter(self.indices))
        return dict(self.counts) if self.counts is not None else None

    def n_samples(self) -> int | None:
        c = self.sampled_counts()
        return sum(c.values()) if c is not None else None


@dataclass
class DebugLog:
    epochs: list[DebugEpoch]
    unreadable: list[Unreadable]
    debug_lines: int
    explicit_epochs: bool
    ignored: dict[str, int] = field(default_factory=dict)  # keys read but not used -> how many lines
    k_values: list[tuple[int, int]] = field(default_factory=list)  # (line, k) as printed


def _count_diff(a: dict, b: dict) -> list[str]:
    ids = sorted({*a, *b} - {i for i in a if i in b and a[i] == b[i]}, key=str)
    return [f"{i} ({a.get(i, 0)} vs {b.get(i, 0)})" for i in ids]


def _disagreement(fld: str, old: Any, new: Any) -> str:
    if fld == "indices":
        diff = _count_diff(dict(Counter(old)), dict(Counter(new)))
        return (f"conditions {_short(diff, 6)}" if diff else
                f"same conditions and copies, different order or length ({len(old)} vs {len(new)})")
    if fld == "counts":
        return f"conditions {_short(_count_diff(old, new), 6)}"
    return f"{old} vs {new}"


def _put(ep: DebugEpoch, fld: str, value: Any, line: int) -> None:
    if fld == "cond":
        cid, stats = value
        have = ep.cond_stats.setdefault(cid, {})
        for stat, x in stats.items():
            if stat in have and not (have[stat] == x or (math.isnan(have[stat]) and math.isnan(x))):
                ep.conflicts.append(f"condition {cid} {stat}: {have[stat]} here, {x} on line {line}")
            have.setdefault(stat, x)
        _source(ep, f"cond {cid}", line)
        return
    old = getattr(ep, fld)
    if old is None:
        setattr(ep, fld, value)
    elif old != value:
        first = ep.sources[fld][0]
        ep.conflicts.append(f"{fld} on line {line} disagrees with line {first}: {_disagreement(fld, old, value)}")
    _source(ep, fld, line)


def _source(ep: DebugEpoch, fact: str, line: int) -> None:
    lines = ep.sources.setdefault(fact, [])
    if not lines or lines[-1] != line:  # one line may state several stats of one condition
        lines.append(line)


def _fields_of(rec: _Record) -> set[str]:
    out = {f"cond {v[0]}" if f == "cond" else f for f, v in rec.facts if f != "k"}
    return out | {f for f, _ in rec.bad if f not in (None, "k", "cond")}


def parse_debug_log(text: str) -> DebugLog:
    """[GRPO Debug] statements grouped into epochs.

    A statement with an epoch number (in its prefix or body) goes to that epoch, and so do the unnumbered ones
    after it (of the same rank, or of any rank when its own never stated a number). Without numbers, each rank's
    statements are grouped by order: a statement joins that rank's current epoch unless that rank already stated
    the same fact in it, which starts the rank's next epoch; the ranks' n-th epochs are then one epoch, whose
    repeated facts must agree. `k` is a run setting, not an epoch fact: the last one printed before an epoch's
    end applies to it.
    """
    records, n_tagged = _records(text)
    epochs: dict[int, DebugEpoch] = {}
    current: dict[Any, int] = {}
    numbered: dict[Any, bool] = {}
    started: dict[Any, int] = {}
    stated: dict[tuple[Any, int], set] = {}
    unreadable: list[Unreadable] = []
    ignored: Counter = Counter()
    k_values: list[tuple[int, int]] = []
    explicit = False
    latest: int | None = None  # the last epoch number stated by any rank

    def epoch_for(label: int, is_explicit: bool) -> DebugEpoch:
        if label not in epochs:
            epochs[label] = DebugEpoch(order=len(epochs), epoch=label if is_explicit else None, explicit=is_explicit)
        return epochs[label]

    for rec in records:
        if rec.bad:
            unreadable.append(Unreadable(rec.line, "; ".join(reason for _, reason in rec.bad), rec.text))
        ignored.update(rec.ignored)
        k_values += [(rec.line, v) for f, v in rec.facts if f == "k"]
        fields = _fields_of(rec)
        s = rec.stream
        if rec.epoch is not None:
            explicit = True
            label, current[s], numbered[s], latest = rec.epoch, rec.epoch, True, rec.epoch
            is_explicit = True
        elif not fields:
            # unreadable before its key was known, but it speaks of what was sampled: it may not leave its
            # epoch a clean pass, so it joins the epoch this rank (or the log) is in
            label = current.get(s, latest)
            if rec.bad and label in epochs and _SAMPLING_WORDS.search(rec.text):
                epochs[label].unread += [("unrecognised", rec.line, reason) for _, reason in rec.bad]
            continue
        elif numbered.get(s):
            label, is_explicit = current[s], True
        elif latest is not None:
            # e.g. `[rank0] ... epoch 3 ...` then unprefixed lines, or an unprefixed `Epoch 3` then rank lines
            label, is_explicit = latest, True
        else:
            if s not in current or stated.get((s, current[s]), set()) & fields:
                current[s] = started.get(s, 0)
                started[s] = current[s] + 1
            label, is_explicit = current[s], False
        ep = epoch_for(label, is_explicit)
        stated.setdefault((s, label), set()).update(fields)
        for fld, value in rec.facts:
            if fld != "k":
                _put(ep, fld, value, rec.line)
        for fld, reason in rec.bad:
            if fld not in (None, "k"):
                ep.unread.append((fld, rec.line, reason))
            elif fld is None and _SAMPLING_WORDS.search(rec.text):
                ep.unread.append(("unrecognised", rec.line, reason))
        ep.lines += list(range(rec.line, rec.end + 1))

    ordered = sorted(epochs.values(), key=lambda e: e.order)
    distinct_k = {k for _, k in k_values}
    for ep in ordered:
        last_line = max(ep.lines, default=0)
        before = [k for line, k in k_values if line <= last_line]
        # one value printed anywhere holds for the whole run; if it changed, the latest one before counts
        ep.k = before[-1] if before else (next(iter(distinct_k)) if len(distinct_k) == 1 else None)
    return DebugLog(ordered, unreadable, n_tagged, explicit, dict(ignored), k_values)


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


def check_debug_advantages(ep: DebugEpoch, tol: float) -> Check:
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
        else:
            hint = " (a group whose reward std is close to eps gives less than 1; the log has no rewards to tell)" \
                if 0 < std < 1 else ""
            row["status"], row["note"] = FAIL, f"std {std:.4g} is neither 1 nor exactly 0{hint}"
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
    return Check(name, PASS, nums, f"{len(rows)} conditions with mean 0 and std 1 (or exactly 0)", table=rows)


def check_debug_ranks(ep: DebugEpoch) -> Check:
    name = "ranks_agree"
    repeats = sum(len(v) - 1 for v in ep.sources.values())
    nums = {"repeated_statements": repeats, "disagreements": len(ep.conflicts)}
    if ep.conflicts:
        return Check(name, FAIL, nums, f"the same fact printed twice disagrees: {_short(ep.conflicts, 4)}")
    return Check(name, PASS, nums, f"{repeats} repeated statements (other ranks) agree")


def verify_debug_log(log: DebugLog, tol: float = 1e-3, source: str = "train.log") -> Report:
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
        "stats": any("mean" in s or "std" in s for ep in log.epochs for s in ep.cond_stats.values()),
        "samples": any("samples" in s for ep in log.epochs for s in ep.cond_stats.values()),
    }
    for ep in log.epochs:
        epoch_checks = _guard("sampling_facts", check_debug_sampling_facts, ep)
        epoch_checks += _guard("count_per_condition", check_debug_counts, ep, ep.k)
        epoch_checks += _guard("unique_conditions", check_debug_unique, ep, ep.k)
        if printed["shape"]:
            epoch_checks += _guard("advantage_shape", check_debug_shape, ep)
        if printed["samples"]:
            epoch_checks += _guard("condition_samples", check_debug_condition_samples, ep, ep.k)
        if printed["stats"]:
            epoch_checks += _guard("advantage_per_condition", check_debug_advantages, ep, tol)
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
                      ("per-condition samples=", "samples")):
        if log.epochs and not printed[key]:
            notes.append(f"the log never prints the {what}: that check was not run")
    if log.ignored:
        notes.append("keys read but not used by any check: "
                     + ", ".join(f"{k} ({n})" for k, n in sorted(log.ignored.items())[:20]))
    return Report(source, "[GRPO Debug] text log", checks, log.unreadable, [ep.label for ep in log.epochs],
                  {"tol": tol}, notes)


def debug_log_forms_markdown() -> str:
    """DEBUG_LOG_FORMS as the Markdown table the README carries (a test keeps the two the same)."""
    rows = ["| form read | example |", "|---|---|"]
    for what, example in DEBUG_LOG_FORMS:
        shown = "<br>".join(f"`{line}`" for line in example.split("\n")) if example else "-"
        rows.append(f"| {what.replace('|', chr(92) + '|')} | {shown.replace('|', chr(92) + '|')} |")
    return "\n".join(rows)


def has_debug_tag(text: str) -> bool:
    return _TAG_RE.search(text) is not None


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


def _num(x: Any) -> str:
    return "-" if x is None else f"{x:.4g}"


def _condition_table(rows: list[dict]) -> list[str]:
    lines = ["| condition | id | samples | mean | std | reward std | status | note |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        samples = "-" if r.get("samples") is None else r["samples"]
        lines.append(f"| {r['condition']} | {_cell(r.get('id', ''))} | {samples} | {_num(r['mean'])} | "
                     f"{_num(r['std'])} | {_num(r.get('reward_std'))} | {r['status'].upper()} | "
                     f"{_cell(r.get('note', ''))} |")
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
