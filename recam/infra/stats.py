"""Intervals the reports share: the Student t quantile of a two-sided 95% interval, a mean with its t-interval, and
a paired change between two evaluations of the same conditions.

Every report that states a mean over seeds, repeats or steps with a 95% interval takes its quantile from here, so a
3-seed interval is 4.303 standard errors wide everywhere (the normal's 1.96 would understate it by half); large
samples get t's own quantile, not the normal's."""

from __future__ import annotations

import math

from scipy import stats


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with df >= 1 degrees of freedom."""
    if isinstance(df, bool) or not isinstance(df, int) or df < 1:
        raise ValueError(f"degrees of freedom must be an int >= 1, got {df!r}")
    return float(stats.t.ppf(0.975, df))


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


def paired_change(before, after) -> tuple[float, float, int]:
    """Two evaluations' per-condition values, in the same condition order: the mean of after - before over the
    conditions both scored, the half-width of its 95% t-interval, and how many conditions that is. Pairing removes
    what the conditions share (an easy scene is easy before and after), so the interval measures the change alone."""
    if len(before) != len(after):
        raise ValueError(f"paired values need the same conditions: {len(before)} before, {len(after)} after")
    ok = lambda x: x is not None and math.isfinite(x)  # noqa: E731
    diffs = [float(a) - float(b) for b, a in zip(before, after, strict=True) if ok(b) and ok(a)]
    mean, half = mean_interval(diffs)
    return mean, half, len(diffs)


def welch_difference(a, b) -> tuple[float, float, float]:
    """mean(a) - mean(b) for two independent samples of finite values, the half-width of its 95% Welch interval
    (unequal variances, Welch-Satterthwaite degrees of freedom) and those degrees of freedom. NaN half-width when
    either side has fewer than 2 values or both have no spread."""
    x = [float(v) for v in a if v is not None and math.isfinite(v)]
    y = [float(v) for v in b if v is not None and math.isfinite(v)]
    if not x or not y:
        return math.nan, math.nan, math.nan
    mx, my = math.fsum(x) / len(x), math.fsum(y) / len(y)
    if len(x) < 2 or len(y) < 2:
        return mx - my, math.nan, math.nan
    vx = math.fsum((v - mx) ** 2 for v in x) / (len(x) - 1) / len(x)
    vy = math.fsum((v - my) ** 2 for v in y) / (len(y) - 1) / len(y)
    if vx + vy == 0:
        return mx - my, math.nan, math.nan
    df = (vx + vy) ** 2 / (vx ** 2 / (len(x) - 1) + vy ** 2 / (len(y) - 1))
    # the t quantile at non-integer df, which t975 (integer df) does not take
    return mx - my, float(stats.t.ppf(0.975, df)) * math.sqrt(vx + vy), df


def batch_means_interval(series, blocks: int = 8) -> tuple[float, float, int]:
    """The mean of a series in time order (one value per epoch) and the half-width of its 95% batch-means interval:
    the series cut into `blocks` contiguous blocks of equal length, the interval a t-interval over the block means
    (blocks - 1 degrees of freedom). Values one epoch apart share the run's weights, so they are correlated (lag 1
    about 0.6 for the camera's GRPO-minus-placebo training reward), and a t-interval over epochs would be too narrow;
    blocks long against that correlation are nearly independent. The earliest values that do not fill a block are
    left out of both; the third value is how many values were used. Non-finite values are errors (a block mean would
    hide them)."""
    v = [float(x) for x in series]
    if not all(math.isfinite(x) for x in v):
        raise ValueError("batch_means_interval needs finite values")
    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 2:
        raise ValueError(f"blocks must be an int >= 2, got {blocks!r}")
    size = len(v) // blocks
    if size == 0:
        return (math.fsum(v) / len(v) if v else math.nan), math.nan, len(v)
    used = v[len(v) - size * blocks:]
    means = [math.fsum(used[i * size:(i + 1) * size]) / size for i in range(blocks)]
    mean, half = mean_interval(means)
    return mean, half, len(used)
