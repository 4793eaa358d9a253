"""Intervals the reports share: the Student t quantile of a two-sided 95% interval, and a mean with its t-interval.

Every report that states a mean over seeds, repeats or steps with a 95% interval takes its quantile from here, so a
3-seed interval is 4.303 standard errors wide everywhere (the normal's 1.96 would understate it by half)."""

from __future__ import annotations

import math

# t_{0.975} by degrees of freedom 1..30; beyond, the normal's 1.96 (t_{0.975, 30} is 2.042, within 4%)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with df >= 1 degrees of freedom."""
    if isinstance(df, bool) or not isinstance(df, int) or df < 1:
        raise ValueError(f"degrees of freedom must be an int >= 1, got {df!r}")
    return _T975[df - 1] if df <= len(_T975) else 1.96


def mean_interval(values) -> tuple[float, float]:
    """Mean of the finite values and the half-width of its 95% t-interval (NaN half-width for a single value; NaN
    mean for none). None and non-finite values are left out."""
    v = [float(x) for x in values if x is not None and math.isfinite(x)]
    if not v:
        return math.nan, math.nan
    mean = math.fsum(v) / len(v)
    if len(v) == 1:
        return mean, math.nan
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in v) / (len(v) - 1))
    return mean, t975(len(v) - 1) * sd / math.sqrt(len(v))
