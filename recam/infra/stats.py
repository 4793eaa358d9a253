"""Intervals the reports share: the Student t quantile of a two-sided 95% interval, a mean with its t-interval, and
a paired change between two evaluations of the same conditions.

Every report that states a mean over seeds, repeats or steps with a 95% interval takes its quantile from here, so a
3-seed interval is 4.303 standard errors wide everywhere (the normal's 1.96 would understate it by half); large
samples get t's own quantile, not the normal's."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import integrate, stats


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


# ---------------------------------------------------------------------------------------------------------------
# seeds evaluated on the same held-out conditions

# Batch means: the shortest block that keeps a 95% interval's coverage at 94% or more for a series of 64 values with
# lag-1 autocorrelation up to 0.6 (AR(1); tests/test_stats.py measures it). 8 blocks of 8 covered 92%, 4 of 16 94%.
MIN_BLOCK = 21
MAX_BLOCKS = 8


def blocks_for(n: int) -> int:
    """How many batch-means blocks a series of n values gets: as many blocks of at least MIN_BLOCK values as fit,
    between 2 and MAX_BLOCKS."""
    return max(2, min(MAX_BLOCKS, n // MIN_BLOCK))


@dataclass(frozen=True)
class Crossed:
    """The mean of a seeds x conditions table of values (a change, or GRPO minus placebo, per seed and condition)
    and its 95% interval under crossed random effects:

        value[s, c] = mu + seed_s + condition_c + residual_sc

    Var(mean) = var_seed / S + var_condition / C + var_residual / (S C), each component from the two-way ANOVA's
    mean squares (truncated at 0), the degrees of freedom Satterthwaite's (at most S - 1 where the seeds' term is
    the larger of the two). A t over the seeds' means leaves
    var_condition / C out: every seed is evaluated on the same conditions, so their shared term is in every mean and
    in none of their differences. One seed: the t over its conditions (conditional on that seed). One condition (a
    metric over the whole split): the t over the seeds (the conditions' term cannot be measured, and is not
    counted)."""

    mean: float
    half: float  # 95% half-width; NaN when it cannot be estimated
    df: float
    se: float
    p: float  # two-sided, for mean = 0
    seeds: int
    conditions: int
    var_seed: float | None = None
    var_condition: float | None = None
    var_residual: float | None = None
    dropped: int = 0  # conditions left out because some seed has no finite value there

    @property
    def how(self) -> str:
        if self.seeds == 1:
            text = f"one seed, paired over {self.conditions} conditions (conditional on this seed)"
        elif self.conditions == 1:
            text = f"t over {self.seeds} seeds (no per-condition values: the shared conditions' term is not counted)"
        else:
            text = f"seeds x conditions, {self.seeds} x {self.conditions} (Satterthwaite df {self.df:.1f})"
        return text + (f"; {self.dropped} condition(s) without a value for every seed left out" if self.dropped else "")


def _t_stats(mean: float, se: float, df: float) -> tuple[float, float]:
    """(95% half-width, two-sided p) of a t with df degrees of freedom and standard error se."""
    if not (math.isfinite(se) and math.isfinite(df) and df > 0):
        return math.nan, math.nan
    if se == 0:
        return 0.0, (1.0 if mean == 0 else 0.0)
    return float(stats.t.ppf(0.975, df)) * se, float(2 * stats.t.sf(abs(mean) / se, df))


def mean_squares(table: np.ndarray) -> tuple[float, float, float]:
    """(MS_seed, MS_condition, MS_residual) of a complete S x C table (S, C >= 2): the two-way ANOVA without
    replication, whose expectations are var_residual + C var_seed, var_residual + S var_condition and var_residual."""
    S, C = table.shape
    grand = table.mean()
    rows, cols = table.mean(axis=1), table.mean(axis=0)
    ms_s = C * float(((rows - grand) ** 2).sum()) / (S - 1)
    ms_c = S * float(((cols - grand) ** 2).sum()) / (C - 1)
    resid = table - rows[:, None] - cols[None, :] + grand
    ms_e = float((resid ** 2).sum()) / ((S - 1) * (C - 1))
    return ms_s, ms_c, ms_e


def components(ms_s: float, ms_c: float, ms_e: float, S: int, C: int) -> tuple[float, float, float]:
    """(var_seed, var_condition, var_residual) from the mean squares, a negative estimate set to 0."""
    return max(0.0, (ms_s - ms_e) / C), max(0.0, (ms_c - ms_e) / S), ms_e


def crossed_interval(table) -> Crossed:
    """Crossed (see the class) for `table`, S rows of seeds by C columns of conditions in the same order (None or
    NaN: no value). A condition without a finite value for every seed is left out (and counted in `dropped`)."""
    t = np.array([[np.nan if x is None else float(x) for x in row] for row in table], dtype=np.float64)
    if t.ndim != 2 or t.size == 0:
        raise ValueError("crossed_interval needs a seeds x conditions table with at least one value")
    keep = np.isfinite(t).all(axis=0)
    dropped = int((~keep).sum())
    t = t[:, keep]
    S, C = t.shape
    if C == 0:
        return Crossed(math.nan, math.nan, math.nan, math.nan, math.nan, S, 0, dropped=dropped)
    mean = float(t.mean())
    if S == 1 or C == 1:
        v = t.ravel()
        n = v.size
        if n < 2:
            return Crossed(mean, math.nan, math.nan, math.nan, math.nan, S, C, dropped=dropped)
        se = float(v.std(ddof=1)) / math.sqrt(n)
        half, p = _t_stats(mean, se, n - 1)
        return Crossed(mean, half, float(n - 1), se, p, S, C, dropped=dropped)
    ms_s, ms_c, ms_e = mean_squares(t)
    vs, vc, ve = components(ms_s, ms_c, ms_e, S, C)
    # Var(mean) S C = C var_seed + S var_condition + var_residual, written as the mean squares it is made of; a
    # component truncated at 0 drops its mean square (and takes var_residual's share with it)
    coef = {"s": 1.0 if vs > 0 else 0.0, "c": 1.0 if vc > 0 else 0.0}
    coef["e"] = 1.0 - coef["s"] - coef["c"]
    terms = ((coef["s"], ms_s, S - 1), (coef["c"], ms_c, C - 1), (coef["e"], ms_e, (S - 1) * (C - 1)))
    total = sum(a * m for a, m, _ in terms)
    se = math.sqrt(max(total, 0.0) / (S * C))
    denom = sum((a * m) ** 2 / d for a, m, d in terms)
    df = total ** 2 / denom if denom > 0 else math.nan
    if vs > 0 and vs / S >= vc / C:
        # Satterthwaite's df are optimistic when a term of S - 1 = 2 df carries most of the variance: with three
        # seeds whose term is the larger, they covered 92.6-92.9%, capped at S - 1 93.7-95% (docs/results.md)
        df = min(df, float(S - 1))
    half, p = _t_stats(mean, se, df)
    return Crossed(mean, half, df, se, p, S, C, vs, vc, ve, dropped)


def two_way_bootstrap(table_a, table_b=None, reps: int = 2000,
                      seed: int = 0) -> tuple[float, float, float, float]:
    """(mean, 2.5% and 97.5% percentiles, two-sided p for 0) of mean(table_a) - mean(table_b) (or of mean(table_a)
    alone) when the tables' columns are the same conditions: conditions resampled once for both, each table's seeds
    (rows) resampled on their own. For two arms whose seeds do not pair; resampling both ways counts the residual
    twice, so the interval errs wide. The p is twice the smaller share of draws on either side of 0."""
    a = np.asarray(table_a, dtype=np.float64)
    b = None if table_b is None else np.asarray(table_b, dtype=np.float64)
    keep = np.isfinite(a).all(axis=0) & (np.isfinite(b).all(axis=0) if b is not None else True)
    a = a[:, keep]
    b = b[:, keep] if b is not None else None
    C = a.shape[1]
    if C == 0:
        return math.nan, math.nan, math.nan, math.nan
    rng = np.random.default_rng(seed)
    out = np.empty(reps)
    for r in range(reps):
        cols = rng.integers(0, C, C)
        x = a[rng.integers(0, a.shape[0], a.shape[0])][:, cols].mean()
        if b is not None:
            x -= b[rng.integers(0, b.shape[0], b.shape[0])][:, cols].mean()
        out[r] = x
    point = float(a.mean() - (b.mean() if b is not None else 0.0))
    lo, hi = np.percentile(out, [2.5, 97.5])
    p = min(1.0, 2 * min(float((out <= 0).mean()), float((out >= 0).mean())))
    return point, float(lo), float(hi), p


# ---------------------------------------------------------------------------------------------------------------
# many looks, and how many seeds and conditions an effect needs


def holm(pvalues) -> list[float]:
    """Holm's step-down adjustment of a family of p-values (NaN stays NaN and is not counted in the family): the
    adjusted p of the i-th smallest of m is max over j <= i of min(1, (m - j + 1) p_(j))."""
    p = [float(x) if x is not None and math.isfinite(x) else math.nan for x in pvalues]
    order = sorted((i for i, x in enumerate(p) if math.isfinite(x)), key=lambda i: p[i])
    m = len(order)
    out = [math.nan] * len(p)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[i]))
        out[i] = running
    return out


def crossed_power(effect: float, var_seed: float, var_condition: float, var_residual: float, seeds: int,
                  conditions: int, alpha: float = 0.05) -> float:
    """The power of the two-sided crossed test (crossed_interval) at level alpha to find a true mean `effect`, with
    `seeds` seeds on `conditions` shared conditions and these variance components: the noncentral t at the
    Satterthwaite degrees of freedom of the expected mean squares."""
    S, C = seeds, conditions
    if S < 1 or C < 1:
        raise ValueError(f"seeds and conditions must be >= 1, got {S} and {C}")
    var = var_seed / S + var_condition / C + var_residual / (S * C)
    if var <= 0:
        return 1.0 if effect != 0 else alpha
    ems = ((var_residual + C * var_seed, S - 1), (var_residual + S * var_condition, C - 1))
    if S > 1 and C > 1:
        terms = [*ems, (-var_residual, (S - 1) * (C - 1))]
    else:  # one seed or one condition: a plain t over the S C values
        terms = [(var * S * C, S * C - 1)]
    total = sum(m for m, _ in terms)
    denom = sum(m ** 2 / d for m, d in terms if d > 0)
    df = total ** 2 / denom if denom > 0 else math.inf
    df = max(df, 1.0)
    crit = float(stats.t.ppf(1 - alpha / 2, df))
    ncp = abs(effect) / math.sqrt(var)
    power = float(stats.nct.sf(crit, df, ncp) + stats.nct.cdf(-crit, df, ncp))
    if not math.isfinite(power):
        # scipy's noncentral t gives NaN at some points far in a tail; the normal is no substitute at a few degrees
        # of freedom (at df 1.4 it said 0.97 where the power is 0.74), so integrate over the chi-square instead
        power = _two_sided_power(crit, df, ncp)
    return power


def _two_sided_power(crit: float, df: float, ncp: float) -> float:
    """P(|Z + ncp| > crit sqrt(X / df)) for Z normal and X chi-square with df degrees of freedom: the noncentral t's
    two tails as one integral over X's quantiles (bounded and smooth on [0, 1])."""
    if not math.isfinite(df):
        return float(stats.norm.sf(crit - ncp) + stats.norm.cdf(-crit - ncp))

    def tails(u: float) -> float:
        scale = crit * math.sqrt(float(stats.chi2.ppf(u, df)) / df)
        return float(stats.norm.sf(scale - ncp) + stats.norm.cdf(-scale - ncp))

    return float(integrate.quad(tails, 0.0, 1.0, limit=200, epsabs=1e-10)[0])


def seeds_for_power(effect: float, var_seed: float, var_condition: float, var_residual: float, conditions: int,
                    power: float = 0.8, most: int = 1000) -> int | None:
    """The fewest seeds (2 or more) that reach `power` on `conditions` conditions; None if `most` do not."""
    for S in range(2, most + 1):
        if crossed_power(effect, var_seed, var_condition, var_residual, S, conditions) >= power:
            return S
    return None


def detectable_effect(var_seed: float, var_condition: float, var_residual: float, seeds: int, conditions: int,
                      power: float = 0.8, alpha: float = 0.05) -> float:
    """The smallest true mean that the crossed test finds with probability `power` at these variance components,
    seeds and conditions (crossed_power inverted by bisection; power rises with the effect). A reviewer reads a
    difference not separated from 0 against it: an effect this size or larger would most likely have shown."""
    var = var_seed / seeds + var_condition / conditions + var_residual / (seeds * conditions)
    if var <= 0:
        return 0.0
    lo, hi = 0.0, math.sqrt(var)
    while crossed_power(hi, var_seed, var_condition, var_residual, seeds, conditions, alpha) < power:
        lo, hi = hi, 2 * hi
    for _ in range(60):
        mid = (lo + hi) / 2
        if crossed_power(mid, var_seed, var_condition, var_residual, seeds, conditions, alpha) >= power:
            hi = mid
        else:
            lo = mid
    return hi


def conditions_for_power(effect: float, var_seed: float, var_condition: float, var_residual: float, seeds: int,
                         power: float = 0.8, most: int = 1_000_000) -> int | None:
    """The fewest conditions (2 or more) that reach `power` with `seeds` seeds; None if `most` do not (the seeds'
    term alone, var_seed / seeds, can keep any number of conditions below it)."""
    if crossed_power(effect, var_seed, var_condition, var_residual, seeds, most) < power:
        return None
    lo, hi = 1, most  # power rises with the conditions: bisect for the first that reaches it
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if crossed_power(effect, var_seed, var_condition, var_residual, seeds, mid) >= power:
            hi = mid
        else:
            lo = mid
    return max(hi, 2)


def crossed_bound(means, sds, conditions: int) -> Crossed:
    """The widest the seeds x conditions interval can be when only each seed's mean and its standard deviation over
    the C shared conditions are known (a published table's per-seed "mean +- half-width"; the per-condition values
    themselves were not kept): Var(mean) <= s_within^2 / C + s_means^2 / S, which counts all of a seed's spread over
    conditions as the conditions' shared term. It equals the crossed interval's variance when the residual is 0,
    and exceeds it otherwise. The half-width is the wider of this variance's at Satterthwaite's degrees of freedom
    (at most S - 1 where the seeds' term is the larger, as in crossed_interval) and the t over the seeds' means;
    the p is the larger of the two."""
    m = [float(x) for x in means]
    s = [float(x) for x in sds]
    S, C = len(m), int(conditions)
    if S < 2 or len(s) != S or C < 2:
        raise ValueError(f"crossed_bound needs 2 or more seeds with one sd each and 2 or more conditions, got "
                         f"{S} means, {len(s)} sds, {C} conditions")
    mean = math.fsum(m) / S
    within = math.fsum(x * x for x in s) / S
    between = math.fsum((x - mean) ** 2 for x in m) / (S - 1)
    a, b = within / C, between / S
    se = math.sqrt(a + b)
    denom = a * a / (S * (C - 1)) + b * b / (S - 1)
    df = (a + b) ** 2 / denom if denom > 0 else math.nan
    if b >= a:  # the seeds' term the larger: at most S - 1 df, as crossed_interval
        df = min(df, float(S - 1))
    half, p = _t_stats(mean, se, df)
    half_t, p_t = _t_stats(mean, math.sqrt(b), S - 1)
    if half_t > half:
        half, df = half_t, float(S - 1)
    return Crossed(mean, half, df, se, max(p, p_t), S, C)
