"""Advantages recomputed independently of the trainer.

Advantages are recomputed exactly as `recam.engine.advantages.group_advantages` defines them (population std, or
Bessel's n - 1 with advantage.unbiased_std, eps added to the std, exactly 0 for groups whose rewards are all equal),
in float64 numpy so the verifier shares no code with the trainer it checks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class GroupStat:
    count: int
    mean: float
    std: float
    constant: bool
    divisor: float = 0.0  # the std the group's centred rewards are divided by (before eps): std, or n - 1's


def recompute_advantages(rewards, group_ids, std_mode: str = "group", eps: float = 1e-4, keep=None,
                         unbiased: bool = False) -> tuple[np.ndarray, dict[int, GroupStat]]:
    """(N,) advantages (r - mean_g) / (std_g + eps) and per-group reward stats (population std). unbiased: the
    divisor is the std with Bessel's correction (ddof 1; a group of one keeps 0), as advantage.unbiased_std.

    Groups whose rewards are all exactly equal get advantage exactly 0, whatever the std_mode. With `keep`
    (N,) bool, samples excluded by the trainer (a reward failed) take no part and get advantage 0.
    """
    if keep is not None:
        keep = np.asarray(keep, dtype=bool)
        full = np.zeros(len(keep))
        if not keep.any():
            return full, {}
        sub, stats = recompute_advantages(np.asarray(rewards, dtype=np.float64)[keep], np.asarray(group_ids)[keep],
                                          std_mode, eps, unbiased=unbiased)
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
    squares = np.bincount(inverse, weights=centred**2, minlength=len(uniq))
    stds = np.sqrt(squares / counts)
    divisors = np.sqrt(squares / np.maximum(counts - 1, 1)) if unbiased else stds
    gmax = np.full(len(uniq), -np.inf)
    gmin = np.full(len(uniq), np.inf)
    np.maximum.at(gmax, inverse, r)
    np.minimum.at(gmin, inverse, r)
    constant = gmax == gmin
    if std_mode == "group":
        adv = centred / (divisors[inverse] + eps)
    elif std_mode == "global":
        adv = centred / (r.std(ddof=1 if unbiased and r.size > 1 else 0) + eps)
    elif std_mode == "none":
        adv = centred
    else:
        raise ValueError(f"std_mode must be 'group', 'global' or 'none', got {std_mode!r}")
    adv = np.where(constant[inverse], 0.0, adv)
    stats = {int(g): GroupStat(int(counts[i]), float(means[i]), float(stds[i]), bool(constant[i]), float(divisors[i]))
             for i, g in enumerate(uniq.tolist())}
    return adv, stats
