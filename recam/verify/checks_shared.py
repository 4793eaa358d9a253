"""Whole-run checks both sources share (unreadable lines, missing epochs) and the guard every check runs under."""

from __future__ import annotations

from collections import Counter
from itertools import islice

from recam.verify.core import FAIL, PASS, WARN, Check, Unreadable, _int, _short


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
    # counted, and the first few listed, without building the range: an epoch number of 1e18 is damage to report,
    # not a set of 1e18 numbers to allocate
    n_missing = last + 1 - sum(1 for e in counts if 0 <= e <= last)
    missing = list(islice((e for e in range(last + 1) if e not in counts), 12))
    trailing = sorted({e for e in (_int(x) for x in step_epochs or []) if e is not None and e > last})
    nums = {"epochs": len(counts), "first": min(ints, default=None), "last": last if ints else None,
            "missing": missing, "missing_count": n_missing, "duplicated": dups, "steps_without_epoch_record": trailing}
    problems = []
    if missing:
        more = f", … (+{n_missing - len(missing)})" if n_missing > len(missing) else ""
        problems.append(f"epochs {_short(missing)}{more} have no epoch record")
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


def _guard(name: str, fn, *args) -> list[Check]:
    """Run one check; a malformed record must yield a failing check, never a traceback."""
    try:
        out = fn(*args)
    except Exception as e:
        return [Check(name, FAIL, {}, f"could not evaluate: {type(e).__name__}: {e}")]
    return out if isinstance(out, list) else [out]


# Below this many eps of reward std, eps rather than the rewards sets a group's advantages: worth a warning.
EPS_DOMINATES = 10.0


def implied_reward_std(advantage_std: float, eps: float) -> float:
    """The group reward std s that (r - mean) / (s + eps) turns into this advantage std: std_A = s / (s + eps),
    so s = eps std_A / (1 - std_A)."""
    return eps * advantage_std / (1.0 - advantage_std)
