"""recam.infra.stats' intervals over seeds that share their held-out conditions, Holm's adjustment, power, and the
batch-means blocks: each against an independent computation (the expanded linear model solved by least squares, the
model's covariance matrix written out, simulation), and their coverage measured on simulated run sets."""

import math

import numpy as np
import pytest
from scipy import stats

from recam.infra.stats import (
    _two_sided_power,
    batch_means_interval,
    blocks_for,
    conditions_for_power,
    crossed_interval,
    crossed_power,
    detectable_effect,
    holm,
    mean_interval,
    seeds_for_power,
    two_way_bootstrap,
)


def _simulate(rng, S, C, sd_seed, sd_cond, sd_resid, mu=0.0):
    return (mu + rng.normal(0, sd_seed, (S, 1)) + rng.normal(0, sd_cond, (1, C))
            + rng.normal(0, sd_resid, (S, C)))


def _expanded_model(table):
    """The two-way additive model fitted by least squares on its dummy-coded design matrix: the sums of squares of
    seeds and conditions from nested fits, the residual from the full one (nothing shared with mean_squares)."""
    S, C = table.shape
    y = table.ravel()
    seed = np.kron(np.eye(S), np.ones((C, 1)))
    cond = np.kron(np.ones((S, 1)), np.eye(C))
    one = np.ones((S * C, 1))

    def rss(X):
        beta, *_ = np.linalg.lstsq(X, y, rcond=None)
        return float(((y - X @ beta) ** 2).sum())

    full = rss(np.hstack([one, seed[:, 1:], cond[:, 1:]]))
    ss_seed = rss(np.hstack([one, cond[:, 1:]])) - full
    ss_cond = rss(np.hstack([one, seed[:, 1:]])) - full
    return ss_seed / (S - 1), ss_cond / (C - 1), full / ((S - 1) * (C - 1)), seed, cond


def test_crossed_interval_against_the_expanded_model():
    rng = np.random.default_rng(5)
    table = _simulate(rng, 4, 12, 0.02, 0.05, 0.01, mu=0.01)
    ms_s, ms_c, ms_e, Zs, Zc = _expanded_model(table)
    got = crossed_interval(table.tolist())
    vs, vc, ve = (ms_s - ms_e) / 12, (ms_c - ms_e) / 4, ms_e
    assert vs > 0 and vc > 0  # this draw has both components: the untruncated formula applies
    assert (got.var_seed, got.var_condition, got.var_residual) == pytest.approx((vs, vc, ve), rel=1e-9)
    # Var(mean) written out from the model's covariance matrix, 1' V 1 / n^2
    V = vs * Zs @ Zs.T + vc * Zc @ Zc.T + ve * np.eye(48)
    se = math.sqrt(V.sum()) / 48
    assert got.se == pytest.approx(se, rel=1e-9)
    df = (ms_s + ms_c - ms_e) ** 2 / (ms_s ** 2 / 3 + ms_c ** 2 / 11 + ms_e ** 2 / 33)
    assert vs / 4 < vc / 12  # the conditions' term is the larger: Satterthwaite's df, not capped at S - 1
    assert got.df == pytest.approx(df, rel=1e-9)
    assert got.half == pytest.approx(stats.t.ppf(0.975, df) * se, rel=1e-9)
    assert got.p == pytest.approx(2 * stats.t.sf(abs(table.mean()) / se, df), rel=1e-9)
    assert got.mean == pytest.approx(table.mean(), rel=1e-12)


def test_a_truncated_component_drops_its_mean_square():
    # no condition term at all: its estimate is truncated at 0, and Var(mean) is MS_seed / (S C) with S - 1 df
    table = np.array([[0.0, 0.1, 0.2], [1.0, 0.85, 1.1], [0.5, 0.6, 0.4]])
    ms_s, ms_c, ms_e, *_ = _expanded_model(table)
    assert ms_c < ms_e
    got = crossed_interval(table)
    assert got.var_condition == 0 and got.se == pytest.approx(math.sqrt(ms_s / 9), rel=1e-9)
    assert got.df == pytest.approx(2.0)


def test_one_seed_is_paired_over_conditions_and_one_condition_is_a_t_over_seeds():
    d = [0.1, 0.0, 0.3, None, 0.2]
    one = crossed_interval([d])
    assert (one.mean, one.half) == pytest.approx(mean_interval([0.1, 0.0, 0.3, 0.2]))
    assert one.seeds == 1 and one.conditions == 4 and one.dropped == 1 and "conditional on this seed" in one.how
    split = crossed_interval([[0.1], [0.3], [0.2]])
    assert (split.mean, split.half) == pytest.approx(mean_interval([0.1, 0.3, 0.2]))
    assert "not counted" in split.how


def test_a_condition_some_seed_lacks_is_left_out_for_every_seed():
    got = crossed_interval([[0.1, 0.2, math.nan, 0.4], [0.2, 0.1, 0.5, None]])
    assert got.conditions == 2 and got.dropped == 2
    assert got.mean == pytest.approx(0.15)


@pytest.mark.parametrize("regime,sds", [("conditions dominate", (0.002, 0.05, 0.01)),
                                        ("seeds dominate", (0.03, 0.005, 0.01)),
                                        ("both", (0.02, 0.05, 0.01))])
def test_coverage_over_simulated_run_sets(regime, sds):
    """Three seed pairs on 64 shared conditions, 1,500 sets: the crossed interval covers the true 0 in at least 93%
    of them in each regime (where both terms count, Satterthwaite's df alone covered 92.9%). Where the conditions
    dominate, the t over the seeds' means (the interval this replaces) covers far less."""
    rng = np.random.default_rng(11)
    covered = naive = 0
    n = 1500
    for _ in range(n):
        t = _simulate(rng, 3, 64, *sds)
        got = crossed_interval(t)
        covered += abs(got.mean) <= got.half
        m, h = mean_interval(t.mean(axis=1))
        naive += abs(m) <= h
    assert covered / n >= 0.93, regime
    if regime == "conditions dominate":
        assert naive / n < 0.6


def test_the_synthetic_three_pairs_of_the_issue():
    """A condition effect shared by three seeds (sd 0.05 over 64 conditions) plus tiny seed noise, true difference
    0: the interval contains 0 and is at least +-0.007 (the t over seeds gave +0.0034 +- 0.0005)."""
    rng = np.random.default_rng(0)
    t = _simulate(rng, 3, 64, 0.0005, 0.05, 0.0005)
    got = crossed_interval(t)
    assert abs(got.mean) <= got.half and got.half >= 0.007


def test_the_two_way_bootstrap_agrees_with_the_crossed_interval_in_width():
    rng = np.random.default_rng(2)
    t = _simulate(rng, 3, 64, 0.002, 0.05, 0.01)
    got = crossed_interval(t)
    mean, lo, hi, _ = two_way_bootstrap(t, reps=1000)
    assert mean == pytest.approx(got.mean)
    # resampling both ways counts the residual twice: no narrower than the crossed interval, not twice as wide
    assert 0.8 * got.half <= (hi - lo) / 2 <= 2 * got.half
    # a difference of two arms on the same conditions: the shared condition term cancels
    other = t + rng.normal(0, 0.001, t.shape)
    d, lo, hi, p = two_way_bootstrap(t, other, reps=1000)
    assert d == pytest.approx(t.mean() - other.mean()) and (hi - lo) / 2 < 0.5 * got.half


def test_holm_by_hand():
    p = [0.01, 0.04, 0.03, 0.005, math.nan]
    # sorted: 0.005 (x4) 0.02, 0.01 (x3) 0.03, 0.03 (x2) 0.06, 0.04 (x1) 0.04 -> kept monotone: 0.06
    assert holm(p)[:4] == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert math.isnan(holm(p)[4])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])


def test_power_against_simulation():
    """crossed_power predicts the rejection rate of crossed_interval's test on simulated sets."""
    rng = np.random.default_rng(4)
    comps, S, C, effect = (0.01 ** 2, 0.04 ** 2, 0.02 ** 2), 4, 32, 0.012
    n, hits = 1500, 0
    for _ in range(n):
        t = _simulate(rng, S, C, *map(math.sqrt, comps), mu=effect)
        hits += crossed_interval(t).p < 0.05
    predicted = crossed_power(effect, *comps, S, C)
    assert abs(hits / n - predicted) < 0.05


def test_seeds_and_conditions_for_power_match_the_issue_s_numbers():
    """A seed-to-seed sd of 0.014 and a true difference of 0.011: about 16 seed pairs for 80% power (three give
    13%); a spread of 0.065 over conditions with one seed: about 274 conditions."""
    assert 14 <= seeds_for_power(0.011, 0.014 ** 2, 0.0, 0.0, 32) <= 17
    assert crossed_power(0.011, 0.014 ** 2, 0.0, 0.0, 3, 32) == pytest.approx(0.13, abs=0.02)
    assert 260 <= conditions_for_power(0.011, 0.0, 0.065 ** 2, 0.0, 1) <= 290
    assert conditions_for_power(0.011, 0.014 ** 2, 0.0, 0.0, 3) is None  # the seeds' term alone keeps it below


def test_batch_means_blocks_cover_an_ar1_series_of_64():
    """At n = 64 and lag-1 autocorrelation 0.6 the default blocks (blocks_for) cover the true mean 0 in at least 94%
    of 10,000 AR(1) series; 8 blocks cover about 92%."""
    rng = np.random.default_rng(8)
    n, reps, phi = 64, 10000, 0.6
    e = rng.standard_normal((reps, n + 100))
    x = np.zeros_like(e)
    for t in range(1, n + 100):
        x[:, t] = phi * x[:, t - 1] + e[:, t]
    x = x[:, 100:]
    blocks = blocks_for(n)
    covered = eight = 0
    for row in x:
        m, h, _ = batch_means_interval(row, blocks)
        covered += abs(m) <= h
        m, h, _ = batch_means_interval(row, 8)
        eight += abs(m) <= h
    assert covered / reps >= 0.94
    assert eight / reps < covered / reps


def test_the_bound_from_per_seed_summaries():
    """crossed_bound from each seed's mean and sd over conditions: equal to the crossed interval's variance when the
    table has no residual, wider when it has one, and never narrower than the t over the seeds' means."""
    from recam.infra.stats import crossed_bound

    rng = np.random.default_rng(6)
    t = _simulate(rng, 3, 40, 0.01, 0.05, 0.0)
    got = crossed_bound(t.mean(axis=1), t.std(axis=1, ddof=1), 40)
    assert got.se == pytest.approx(crossed_interval(t).se, rel=1e-9) and got.half >= crossed_interval(t).half
    t = _simulate(rng, 3, 40, 0.01, 0.02, 0.04)
    got = crossed_bound(t.mean(axis=1), t.std(axis=1, ddof=1), 40)
    assert got.se > crossed_interval(t).se
    assert got.se ** 2 >= t.mean(axis=1).var(ddof=1) / 3
    assert got.half >= mean_interval(t.mean(axis=1))[1] - 1e-12
    with pytest.raises(ValueError, match="2 or more seeds"):
        crossed_bound([0.1], [0.2], 40)


def test_detectable_effect_inverts_the_power_and_matches_the_normal_formula():
    """The effect found 80% of the time: crossed_power there is 0.8; with many degrees of freedom it is the
    textbook (z_0.975 + z_0.8) x the standard error; and the seeds' term keeps it from shrinking with conditions."""
    comps = (0.01 ** 2, 0.04 ** 2, 0.02 ** 2)
    d = detectable_effect(*comps, 3, 128)
    assert crossed_power(d, *comps, 3, 128) == pytest.approx(0.8, abs=1e-6)
    se = math.sqrt(0.03 ** 2 / 400 + 0.05 ** 2 / 400 ** 2)  # no seeds' term: df in the hundreds
    d_big = detectable_effect(0.0, 0.03 ** 2, 0.05 ** 2, 400, 400)
    assert d_big == pytest.approx((stats.norm.ppf(0.975) + stats.norm.ppf(0.8)) * se, rel=0.01)
    assert detectable_effect(*comps, 3, 10 ** 6) > detectable_effect(*comps, 30, 10 ** 6)
    assert detectable_effect(0.0, 0.0, 0.0, 3, 128) == 0.0


def test_power_is_monotone_where_scipy_s_noncentral_t_gives_nan():
    """At 1.4 degrees of freedom scipy's noncentral t returns NaN for some tails; the power there comes from the
    integral over the chi-square (checked against the noncentral t where it is finite), not from the normal, and it
    rises with the effect."""
    comps, S, C = (0.0, 0.0, 5.378e-4), 3, 8
    effects = np.linspace(0.030, 0.045, 31)
    powers = [crossed_power(e, *comps, S, C) for e in effects]
    assert all(b > a for a, b in zip(powers, powers[1:], strict=False))
    df, crit = 2.0, stats.t.ppf(0.975, 2.0)
    for ncp in (0.5, 2.0, 5.0):
        by_nct = stats.nct.sf(crit, df, ncp) + stats.nct.cdf(-crit, df, ncp)
        assert _two_sided_power(crit, df, ncp) == pytest.approx(by_nct, abs=1e-7)
