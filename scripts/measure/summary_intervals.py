"""Intervals recomputed from a published table, for results whose per-condition values were not kept: the docs'
older over-seed and curve claims, redone by the rules scripts/seed_gains.py now applies to run folders.

    # three seeds' "mean ± 95% half-width", each paired over the same 128 held-out conditions: the widest the
    # seeds x conditions interval can be (recam.infra.stats.crossed_bound), beside the t over the seeds' means
    python scripts/measure/summary_intervals.py seeds --conditions 128 -- "+0.0187 ± 0.0338" "+0.0250 ± 0.0444" \
        "+0.0219 ± 0.0346"

    # a curve's points, each "mean ± half-width" over 128 conditions: p for 0, Holm-adjusted over the points (the
    # last one left unadjusted with --primary-last), and how many clear 0
    python scripts/measure/summary_intervals.py holm --conditions 128 "+0.0148 ± 0.0508" "+0.0711 ± 0.0533"

    # a run's training-reward block means (time order) merged into fewer, longer blocks (batch means)
    python scripts/measure/summary_intervals.py blocks --merge 2 +0.0054 +0.0098 +0.0213 +0.0131

Put `--` before the values when one may start with a minus sign. A half-width h over C conditions is a t-interval
with C - 1 degrees of freedom: its standard deviation over the conditions is h / t_{0.975, C-1} * sqrt(C).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scipy import stats  # noqa: E402

from recam.infra.stats import batch_means_interval, crossed_bound, holm, mean_interval, t975  # noqa: E402


def parse(text: str) -> tuple[float, float]:
    """'+0.0187 ± 0.0338' (or '+-') -> (0.0187, 0.0338); a bare number has a NaN half-width."""
    found = re.fullmatch(r"\s*([-+]?\d*\.?\d+(?:e[-+]?\d+)?)\s*(?:(?:±|\+-|\+/-)\s*(\d*\.?\d+(?:e[-+]?\d+)?))?\s*",
                         text)
    if not found:
        raise SystemExit(f"{text!r}: expected 'mean ± half-width' (or 'mean +- half-width')")
    return float(found.group(1)), float(found.group(2)) if found.group(2) else math.nan


def sd_over_conditions(half: float, conditions: int) -> float:
    return half / t975(conditions - 1) * math.sqrt(conditions)


def p_of(mean: float, half: float, conditions: int) -> float:
    se = half / t975(conditions - 1)
    return float(2 * stats.t.sf(abs(mean) / se, conditions - 1)) if se > 0 else math.nan


def seeds(args) -> str:
    values = [parse(x) for x in args.values]
    means = [m for m, _ in values]
    bound = crossed_bound(means, [sd_over_conditions(h, args.conditions) for _, h in values], args.conditions)
    m, h = mean_interval(means)
    return (f"{len(values)} seeds on {args.conditions} shared conditions: {bound.mean:+.4f} ± {bound.half:.4f} at "
            f"most (seeds x conditions bound, df {bound.df:.1f}; p {bound.p:.2g}); the t over the seeds' means "
            f"alone: ± {h:.4f}")


def holm_points(args) -> str:
    values = [parse(x) for x in args.values]
    p = [p_of(m, h, args.conditions) for m, h in values]
    family = p[:-1] if args.primary_last else p
    adjusted = holm(family) + ([p[-1]] if args.primary_last else [])
    lines = ["| point | mean ± half | p | adjusted p |", "|---|---|---|---|"]
    for i, ((m, h), raw, adj) in enumerate(zip(values, p, adjusted, strict=True)):
        tag = " (primary, unadjusted)" if args.primary_last and i == len(values) - 1 else ""
        lines.append(f"| {i + 1} | {m:+.4f} ± {h:.4f} | {raw:.2g} | {adj:.2g}{tag} |")
    lines.append(f"clear 0: {sum(x < 0.05 for x in p)} of {len(p)} unadjusted, {sum(x < 0.05 for x in adjusted)} "
                 f"of {len(p)} after Holm")
    return "\n".join(lines)


def blocks(args) -> str:
    values = [parse(x)[0] for x in args.values]
    if len(values) % args.merge:
        raise SystemExit(f"{len(values)} block means do not merge {args.merge} at a time")
    merged = [math.fsum(values[i:i + args.merge]) / args.merge for i in range(0, len(values), args.merge)]
    mean, half, _ = batch_means_interval(merged, len(merged))
    return f"{len(merged)} blocks of {args.merge} block(s) each: {mean:+.4f} ± {half:.4f} (batch means, " \
           f"{len(merged) - 1} df)"


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    for name, fn in (("seeds", seeds), ("holm", holm_points), ("blocks", blocks)):
        p = sub.add_parser(name)
        p.set_defaults(fn=fn)
        p.add_argument("values", nargs="+")
        if name != "blocks":
            p.add_argument("--conditions", type=int, required=True)
        if name == "holm":
            p.add_argument("--primary-last", action="store_true",
                           help="the last point is the primary endpoint: left out of the family, unadjusted")
        if name == "blocks":
            p.add_argument("--merge", type=int, default=2)
    args = ap.parse_args(argv)
    text = args.fn(args)
    print(text)
    return text


if __name__ == "__main__":
    main()
