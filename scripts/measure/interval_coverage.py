"""How often recam's 95% intervals cover the truth on simulated data: the seeds x conditions interval
(recam.infra.stats.crossed_interval) beside the t over the seeds' means, for three seeds on 64 shared conditions in
several regimes of seed, condition and residual spread; and batch means (recam.infra.stats.batch_means_interval)
on AR(1) series of 64 values, at the default blocks (blocks_for) beside 4 and 8.

    python scripts/measure/interval_coverage.py --sets 4000 --series 10000

docs/results.md ("Intervals a reviewer would accept") quotes its output; tests/test_stats.py asserts the floors.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from recam.infra.stats import batch_means_interval, blocks_for, crossed_interval, mean_interval  # noqa: E402

REGIMES = {  # sd of the seeds' term, the conditions' term, the residual
    "conditions dominate": (0.002, 0.05, 0.01),
    "seeds dominate": (0.03, 0.005, 0.01),
    "both": (0.02, 0.05, 0.01),
    "all three alike": (0.01, 0.02, 0.02),
    "residual dominates": (0.005, 0.005, 0.05),
    "the issue's synthetic case": (0.0005, 0.05, 0.0005),
}


def crossed_coverage(sets: int, seeds: int = 3, conditions: int = 64, seed: int = 11) -> list[str]:
    rng = np.random.default_rng(seed)
    lines = ["| regime (sd seed / condition / residual) | seeds x conditions: coverage (median half) | t over the "
             "seeds' means: coverage (median half) |", "|---|---|---|"]
    for name, (a, b, e) in REGIMES.items():
        hit = [0, 0]
        halves = [[], []]
        for _ in range(sets):
            t = rng.normal(0, a, (seeds, 1)) + rng.normal(0, b, (1, conditions)) + rng.normal(0, e, (seeds, conditions))
            c = crossed_interval(t)
            m, h = mean_interval(t.mean(axis=1))
            for i, (mean, half) in enumerate(((c.mean, c.half), (m, h))):
                hit[i] += abs(mean) <= half
                halves[i].append(half)
        lines.append(f"| {name} ({a} / {b} / {e}) | " + " | ".join(
            f"{hit[i] / sets:.1%} (±{np.median(halves[i]):.4f})" for i in range(2)) + " |")
    return lines


def ar1_coverage(series: int, n: int = 64, seed: int = 8) -> list[str]:
    rng = np.random.default_rng(seed)
    choices = (blocks_for(n), 4, 8)
    lines = ["| lag-1 autocorrelation | " + " | ".join(f"{b} blocks" + (" (default)" if i == 0 else "")
                                                       for i, b in enumerate(choices)) + " |",
             "|---|" + "---|" * len(choices)]
    for phi in (0.0, 0.3, 0.56, 0.6, 0.8):
        e = rng.standard_normal((series, n + 100))
        x = np.zeros_like(e)
        for t in range(1, n + 100):
            x[:, t] = phi * x[:, t - 1] + e[:, t]
        x = x[:, 100:]
        cov = []
        for b in choices:
            cov.append(sum(abs(m) <= h for m, h, _ in (batch_means_interval(row, b) for row in x)) / series)
        lines.append(f"| {phi} | " + " | ".join(f"{c:.1%}" for c in cov) + " |")
    return lines


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", type=int, default=4000, help="simulated seed sets per regime")
    ap.add_argument("--series", type=int, default=10000, help="AR(1) series per autocorrelation")
    args = ap.parse_args(argv)
    text = "\n".join(["Three seeds on 64 shared conditions, true mean 0:", "", *crossed_coverage(args.sets), "",
                      "AR(1) series of 64 values, true mean 0:", "", *ar1_coverage(args.series)])
    print(text)
    return text


if __name__ == "__main__":
    main()
