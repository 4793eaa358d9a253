"""Which of a run's evaluated checkpoints the run reports, chosen on a validation split.

A GRPO run's held-out score moves from epoch to epoch (on the synthetic world the camera gain often peaks
mid-run and fades as the fidelity reward pulls back, see docs/results.md; the rule as users see it:
docs/guide.md), so "the last epoch" is an arbitrary choice. Choosing the epoch by its held-out score would be
selecting on the test set; this module chooses on validation conditions from scenes that neither training nor
the held-out evaluation ever sees, and the held-out split then measures the chosen checkpoint without bias.
"""

from __future__ import annotations

import math


def select_checkpoint(evals: list[dict], metric: str, guard: str = "", max_drop: float = 0.0) -> int:
    """Index of the evaluation whose validation `metric` is highest, among the admissible ones.

    evals: evaluations in the order they were taken; evals[0] is the base (before any update). Each maps
        metric names (e.g. "val/cam_score") to floats.
    metric: the key to maximise.
    guard: "" or a key that may not fall more than `max_drop` below its base value (evals[0][guard]); the
        constraint that keeps a checkpoint from buying the metric with the guarded quality.
    Returns the index; the base is always admissible, so a run that never beats it reports the base. Ties go
    to the earlier evaluation; NaN values are never admissible (except the base, which is the fallback).
    """
    if not evals:
        raise ValueError("select_checkpoint needs at least the base evaluation")
    if max_drop < 0:
        raise ValueError(f"max_drop must be >= 0, got {max_drop}")
    for i, e in enumerate(evals):
        missing = [k for k in (metric, guard) if k and k not in e]
        if missing:
            raise KeyError(f"evaluation {i} has no {missing}; it holds {sorted(e)}")

    def value(e: dict, key: str) -> float:
        v = float(e[key])
        return v if math.isfinite(v) else -math.inf

    floor = value(evals[0], guard) - max_drop if guard else -math.inf
    best = 0
    for i, e in enumerate(evals[1:], start=1):
        if guard and value(e, guard) < floor:
            continue
        if value(e, metric) > value(evals[best], metric):
            best = i
    return best
