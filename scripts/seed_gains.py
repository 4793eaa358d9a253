"""The held-out gain of finished runs (one per seed): per run, the paired change over the held-out conditions with
its 95% interval, for the checkpoint the run reports (selected on validation, or its last epoch) and for the last
epoch; over the runs, the mean change with its 95% interval over seeds and conditions.

    python scripts/seed_gains.py runs/main/seed0 runs/main/seed1 runs/main/seed2
    python scripts/seed_gains.py runs/motion/seed* --metric eval/motion_alignment --metric eval/r_precision_top3

Every seed is evaluated on the same held-out conditions, so each seed's mean carries the same conditions' term: a
t over the seeds' means leaves it out and is too narrow (three seeds whose difference is a shared condition effect
of sd 0.05 over 64 conditions gave +-0.0005 where +-0.013 is right). Over seeds the interval is therefore that of
a seeds x conditions model with crossed random effects (recam.infra.stats.crossed_interval: Satterthwaite's
degrees of freedom). A metric over the whole split (R-precision in pools, FID) has no per-condition values: its
per-run change has no interval, and over seeds only the t over seeds is given, which cannot count the conditions.

**Endpoints.** Each preset names its primary held-out endpoint and time point and its secondary endpoints before
the runs (eval.primary_endpoint, eval.primary_time, eval.secondary_endpoints, in each run's config.json). Without
--metric these are the metrics reported. The primary is tested without adjustment; every other look in the report
(the secondary endpoints, the primary at the other time point, every point of a curve, the training reward) is
Holm-adjusted as one family, and a curve says how many of its points clear 0 after adjustment.

With placebo runs beside them (`advantage.placebo=True`: the same loop with each group's advantages permuted among
its samples), each metric also gets the placebo runs' change and GRPO minus placebo, for the reported checkpoint and
the last epoch:

    python scripts/seed_gains.py runs/main/seed* --placebo runs/placebo/seed*

The difference is paired by seed where both sides have every seed (the config's `seed`): per seed, GRPO's and the
placebo's values on the same held-out conditions, condition by condition; over seeds, the seeds x conditions
interval of those differences (one seed: paired over its conditions, conditional on that seed). Otherwise the two
arms do not pair: a two-way bootstrap over each arm's seeds and the shared conditions (Welch's interval for a
metric over the whole split). Each arm's rollbacks and guard actions are listed beside it: the guard acts on the
rewards, so its decisions can differ between the arms.

`--curve DIR` (with --placebo) adds each metric's held-out curve: at every sample count on which all runs evaluated
(their eval.freq grid), each arm's change from its base and GRPO minus placebo, as a table and as
DIR/curve_<metric>.png.

`--train-reward NAME` (with --placebo) compares the two arms on what they trained on: each epoch's mean training
reward NAME (the epoch record's `rewards/NAME`, one value per sample), GRPO minus placebo epoch by epoch. Both arms
of a seed draw the same conditions in the same order (the draw is seeded, not the policy), so each epoch's
difference is paired over that epoch's conditions. Neighbouring epochs share the weights, so the interval is over
blocks of consecutive epochs (batch means, blocks of at least recam.infra.stats.MIN_BLOCK epochs); one seed's is
conditional on that run pair, and over seeds it is the seeds x blocks interval.

Beside them: GRPO's consecutive-update gradient cosine against the placebo's (recam.engine.diagnosis.
cosine_difference), where the runs logged it.

`--power EFFECT`: from the runs given, the primary endpoint's seed, condition and residual variances, the power of
the runs' design for a true difference EFFECT, and the seed pairs and conditions that give 80%.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scipy import stats  # noqa: E402

from recam.engine.diagnosis import cosine_difference, step_cosines  # noqa: E402
from recam.infra.reports import eval_change, events_table, per_condition_change  # noqa: E402
from recam.infra.runlog import read_records  # noqa: E402
from recam.infra.stats import (  # noqa: E402
    Crossed,
    batch_means_interval,
    blocks_for,
    conditions_for_power,
    crossed_interval,
    crossed_power,
    holm,
    mean_interval,
    seeds_for_power,
    two_way_bootstrap,
    welch_difference,
)

TIMES = {"reported": 1, "last": 2}  # which of run_evals' records each time point is
TIME_NAMES = {1: "reported", 2: "last epoch"}
ALPHA = 0.05


def run_evals(run_dir: Path) -> tuple[dict, dict, dict]:
    """(base, reported, last) evaluation records of a finished run: the "start" evaluation, the one the run's
    `checkpoints/selected` pointer names (the final one when the run selects nothing), and the "final" one."""
    records = [r for r in read_records(run_dir / "metrics.jsonl") if r.get("type") == "eval"]
    try:
        base = next(r for r in records if r.get("tag") == "start")
        last = next(r for r in reversed(records) if r.get("tag") == "final")
    except StopIteration:
        raise SystemExit(f"{run_dir}: metrics.jsonl has no start or final evaluation (did the run finish?)") from None
    pointer = run_dir / "checkpoints" / "selected"
    reported = last
    if pointer.is_file():
        name = pointer.read_text().strip()
        found = [r for r in records if r.get("checkpoint") == name]
        if not found:
            raise SystemExit(f"{run_dir}: the selected checkpoint {name} has no evaluation in metrics.jsonl")
        reported = found[-1]
    return base, reported, last


def fmt(mean: float, half: float) -> str:
    if not math.isfinite(mean):
        return "n/a"
    return f"{mean:+.4f}" + (f" ± {half:.4f}" if math.isfinite(half) else "")


def fmt_p(p: float) -> str:
    if not math.isfinite(p):
        return "n/a"
    return f"{p:.2g}" if p >= 0.001 else "<0.001"


# ---------------------------------------------------------------------------------------------------------------
# an estimate over seeds, and the family of looks it belongs to


@dataclass
class Estimate:
    """A mean over seeds (and conditions) with its 95% interval: symmetric (half) or a bootstrap's percentiles
    (lo, hi), the two-sided p for 0, and how it was computed."""

    mean: float
    half: float
    p: float
    how: str
    lo: float | None = None
    hi: float | None = None
    crossed: Crossed | None = None

    @classmethod
    def of(cls, c: Crossed) -> Estimate:
        return cls(c.mean, c.half, c.p, c.how, crossed=c)

    def text(self) -> str:
        if self.lo is not None and math.isfinite(self.mean):
            return f"{self.mean:+.4f} [{self.lo:+.4f}, {self.hi:+.4f}]"
        return fmt(self.mean, self.half)

    def band(self) -> tuple[float, float]:
        """(mean, half-width) to draw; a bootstrap's percentiles as their half-distance."""
        if self.lo is not None:
            return self.mean, (self.hi - self.lo) / 2
        return self.mean, self.half


class Looks:
    """Every test a report makes, by key: the primary endpoint is read at its own level, every other look is
    Holm-adjusted as one family, so that a report with many metrics and grid points claims no more than one with
    few."""

    def __init__(self, primary: tuple[str, str] | None):
        self.primary = primary
        self.estimates: dict[tuple, Estimate] = {}
        self._adjusted: dict[tuple, float] | None = None

    def add(self, key: tuple, est: Estimate) -> Estimate:
        self.estimates[key] = est
        self._adjusted = None
        return est

    def family(self) -> list[tuple]:
        return [k for k, e in self.estimates.items() if k != self.primary and math.isfinite(e.p)]

    def adjusted(self, key: tuple) -> float:
        """The p a look is judged by: the primary's own, Holm's for the rest (NaN: not tested)."""
        if key == self.primary:
            return self.estimates[key].p
        if self._adjusted is None:
            fam = self.family()
            self._adjusted = dict(zip(fam, holm([self.estimates[k].p for k in fam]), strict=True))
        return self._adjusted.get(key, math.nan)

    def clears(self, key: tuple) -> bool:
        p = self.adjusted(key)
        return math.isfinite(p) and p < ALPHA

    def cell(self, key: tuple) -> str:
        """'p / adjusted p' for a table, the primary marked."""
        if key not in self.estimates:
            return ""
        e = self.estimates[key]
        if key == self.primary:
            return f"{fmt_p(e.p)} (primary, unadjusted)"
        return f"{fmt_p(e.p)} / {fmt_p(self.adjusted(key))}"


# ---------------------------------------------------------------------------------------------------------------
# the runs


def run_config(run_dir: Path) -> dict:
    try:
        config = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def run_seed(run_dir: Path) -> int | None:
    """The seed the run's config.json records, or None (a run folder without one cannot be paired)."""
    seed = run_config(run_dir).get("seed")
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else None


def placebo_flag(run_dir: Path) -> bool | None:
    advantage = run_config(run_dir).get("advantage")
    return advantage.get("placebo") if isinstance(advantage, dict) else None


def pairable(grpo: list[Path], placebo: list[Path]) -> bool:
    """Whether the two sets of runs pair by seed: each side's seeds recorded, distinct, and the same set."""
    seeds_g, seeds_p = [run_seed(r) for r in grpo], [run_seed(r) for r in placebo]
    return (None not in seeds_g and len(set(seeds_g)) == len(seeds_g) and sorted(seeds_g) == sorted(seeds_p)
            and len(set(seeds_p)) == len(seeds_p))


def run_endpoints(runs: list[Path]) -> tuple[tuple[str, str] | None, list[str]]:
    """((primary endpoint, time point), secondary endpoints) the runs' configs name; (None, []) for runs from before
    endpoints were named. Runs that name different endpoints are refused: one report has one primary."""
    named = set()
    for run in runs:
        ev = run_config(run).get("eval")
        ev = ev if isinstance(ev, dict) else {}
        if ev.get("primary_endpoint"):
            secondary = tuple(m.strip() for m in str(ev.get("secondary_endpoints", "")).split(",") if m.strip())
            named.add((ev["primary_endpoint"], ev.get("primary_time", "last"), secondary))
    if len(named) > 1:
        raise SystemExit("the runs name different endpoints in their config.json (eval.primary_endpoint, "
                         f"eval.primary_time, eval.secondary_endpoints): {sorted(named)}; compare runs of one preset")
    if not named:
        return None, []
    primary, time, secondary = named.pop()
    return (primary, time), list(secondary)


def table_of(pairs: list[tuple[dict, dict]], metric: str) -> list[list[float | None]]:
    """A seeds x conditions table of after - before, one row per (before, after) pair of evaluation records."""
    try:
        rows = [per_condition_change(b, a, metric) for b, a in pairs]
    except ValueError as e:  # a pair of runs (or a run's base and end) evaluated different held-out sets
        raise SystemExit(str(e)) from None
    if len({len(r) for r in rows}) > 1:
        raise SystemExit(f"{metric}: the runs' evaluations hold different numbers of conditions "
                         f"({sorted({len(r) for r in rows})}): they were not evaluated on the same held-out set")
    return rows


def over_seeds(pairs: list[tuple[dict, dict]], metric: str) -> Estimate:
    return Estimate.of(crossed_interval(table_of(pairs, metric)))


def unpaired(table_g: list, table_p: list, runs: tuple[int, int]) -> Estimate:
    """GRPO minus placebo from arms whose seeds do not pair: a two-way bootstrap over each arm's seeds and the
    shared conditions; a metric over the whole split, Welch over the runs."""
    if len(table_g[0]) == 1:
        mean, half, df = welch_difference([r[0] for r in table_g], [r[0] for r in table_p])
        p = math.nan
        if math.isfinite(half):
            se = half / float(stats.t.ppf(0.975, df))
            p = float(2 * stats.t.sf(abs(mean) / se, df)) if se > 0 else math.nan
        return Estimate(mean, half, p, f"Welch over {runs[0]} and {runs[1]} runs (df {df:.1f})")
    mean, lo, hi, p = two_way_bootstrap(table_g, table_p)
    return Estimate(mean, math.nan, p, f"two-way bootstrap over each arm's runs ({runs[0]} and {runs[1]}) and the "
                                       "shared conditions (2,000 draws)", lo=lo, hi=hi)


def grpo_minus_placebo(grpo: list[Path], placebo: list[Path], metric: str, which: int) -> Estimate:
    """GRPO minus placebo for one metric at the reported checkpoint (which=1) or the last epoch (which=2)."""
    if pairable(grpo, placebo):
        by_seed = {run_seed(r): r for r in placebo}
        # same conditions: GRPO's values minus the placebo's, condition by condition, seed by seed
        pairs = [(run_evals(by_seed[run_seed(r)])[which], run_evals(r)[which]) for r in grpo]
        est = over_seeds(pairs, metric)
        if len(grpo) == 1:
            est.how = f"seed {run_seed(grpo[0])}: " + est.how
        return est
    tables = [table_of([(e[0], e[which]) for e in map(run_evals, runs)], metric) for runs in (grpo, placebo)]
    return unpaired(*tables, (len(grpo), len(placebo)))


# ---------------------------------------------------------------------------------------------------------------
# the tables


def report(run_dirs: list[Path], metrics: list[str], looks: Looks | None = None) -> str:
    """Each metric's change from the base, run by run and over the runs. `looks`: where these changes are the
    report's tests (no placebo), they are added to it."""
    lines = []
    for metric in metrics:
        lines += [f"**{metric}** (change from the base; ± a 95% interval)", "",
                  "| run | base | reported (checkpoint) | change, reported (paired over conditions) | "
                  "change, last epoch |", "|---|---|---|---|---|"]
        evals = [run_evals(r) for r in run_dirs]
        for run, (base, rep, last) in zip(run_dirs, evals, strict=True):
            r, l_ = eval_change(base, rep, metric), eval_change(base, last, metric)
            b = base.get(metric)
            b = f"{b:.4f}" if isinstance(b, (int, float)) else "n/a"
            lines.append(f"| {run} | {b} | {rep.get(metric, math.nan):.4f} ({rep.get('checkpoint')}) | "
                         f"{fmt(r[0], r[1])} | {fmt(l_[0], l_[1])} |")
        over = {which: over_seeds([(e[0], e[which]) for e in evals], metric) for which in (1, 2)}
        lines.append(f"| over {len(run_dirs)} runs (seeds x conditions) | | | {over[1].text()} | {over[2].text()} |")
        if looks is not None:
            for which in (1, 2):
                looks.add((metric, TIME_NAMES[which].split()[0]), over[which])
            lines.append(f"| p / Holm-adjusted p | | | {looks.cell((metric, 'reported'))} | "
                         f"{looks.cell((metric, 'last'))} |")
        lines += ["", f"Over the runs: {over[2].how}.", ""]
    return "\n".join(lines)


def placebo_rows(grpo: list[Path], placebo: list[Path], metrics: list[str], looks: Looks) -> dict:
    """Per metric and time point: each arm's change over seeds and GRPO minus placebo (added to `looks`)."""
    for run in placebo:
        if placebo_flag(run) is not True:
            raise SystemExit(f"{run}: its config.json does not record advantage.placebo=True: not a placebo run")
    for run in grpo:
        if placebo_flag(run) is True:
            raise SystemExit(f"{run}: a placebo run (advantage.placebo=True) given as a GRPO run")
    out = {}
    for metric in metrics:
        for which in (1, 2):
            sides = [over_seeds([(e[0], e[which]) for e in map(run_evals, runs)], metric) for runs in (grpo, placebo)]
            key = (metric, TIME_NAMES[which].split()[0])
            out[key] = (*sides, looks.add(key, grpo_minus_placebo(grpo, placebo, metric, which)))
    return out


def placebo_table(rows: dict, metrics: list[str], looks: Looks) -> str:
    lines = []
    for metric in metrics:
        lines += [f"**{metric}: GRPO against its placebo** (changes from each run's base; ± a 95% interval; p for 0, "
                  "then Holm-adjusted)", "",
                  "| checkpoint | GRPO change | placebo change | GRPO minus placebo | p / adjusted | interval |",
                  "|---|---|---|---|---|---|"]
        for time in ("reported", "last"):
            g, p, d = rows[(metric, time)]
            name = "last epoch" if time == "last" else time
            lines.append(f"| {name} | {g.text()} | {p.text()} | {d.text()} | {looks.cell((metric, time))} | {d.how} |")
        lines.append("")
    return "\n".join(lines)


def endpoint_summary(looks: Looks, what: str) -> str:
    """The primary endpoint and what the family of other looks clears after Holm's adjustment."""
    lines = [f"**Endpoints** ({what})", ""]
    if looks.primary is None:
        lines.append("The runs name no primary endpoint (config.json from before eval.primary_endpoint, and no "
                     "--primary): every look below is Holm-adjusted.")
    elif looks.primary not in looks.estimates:
        lines.append(f"The primary endpoint {looks.primary[0]} ({looks.primary[1]}) is not among the metrics asked "
                     "for: every look is Holm-adjusted.")
    else:
        e = looks.estimates[looks.primary]
        verdict = "clears 0" if looks.clears(looks.primary) else "does not clear 0"
        lines.append(f"- primary, named before the runs: **{looks.primary[0]} at the "
                     f"{'last epoch' if looks.primary[1] == 'last' else 'reported checkpoint'}**: {e.text()} "
                     f"(p {fmt_p(e.p)}, {e.how}): {verdict}.")
    fam = looks.family()
    cleared = [k for k in fam if looks.clears(k)]
    lines.append(f"- other looks, Holm-adjusted as one family of {len(fam)}: {len(cleared)} clear 0"
                 + (" (" + ", ".join(f"{k[0]} {k[1]}" for k in cleared) + ")" if cleared else "") + ".")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# the held-out curve: every evaluation on the run's grid of sample counts


def run_curve(run_dir: Path) -> dict[int, dict]:
    """A run's evaluations by the samples trained on before each: {samples: record}, the base at 0. An evaluation
    record's `epoch` is the last epoch trained before it (-1 for the base); its `step` counts optimizer steps, of
    which an epoch may take several, so the grid is built on epochs. Where two evaluations follow the same epoch (a
    periodic one and the final one), the later is kept."""
    records = read_records(run_dir / "metrics.jsonl")
    per_epoch = next((r.get("samples_per_epoch") for r in records if r.get("type") == "epoch"), None)
    if not per_epoch:
        raise SystemExit(f"{run_dir}: metrics.jsonl has no epoch record with samples_per_epoch")
    out = {}
    for r in records:
        if r.get("type") == "eval" and isinstance(r.get("epoch"), int):
            out[(r["epoch"] + 1) * int(per_epoch)] = r
    if 0 not in out:
        raise SystemExit(f"{run_dir}: metrics.jsonl has no evaluation of the base (before epoch 0)")
    return dict(sorted(out.items()))


def curve_rows(grpo: list[Path], placebo: list[Path], metric: str, looks: Looks | None = None) -> list[dict]:
    """At every sample count all runs evaluated: each arm's change from its base over seeds and conditions, and GRPO
    minus placebo paired as grpo_minus_placebo pairs it. With `looks`, every point after the base is a look: the
    last one, where every run's last evaluation is, is the metric's last-epoch look itself (not counted twice)."""
    curves = {arm: [run_curve(r) for r in runs] for arm, runs in (("grpo", grpo), ("placebo", placebo))}
    grid = sorted(set.intersection(*(set(c) for cs in curves.values() for c in cs)))
    by_seed = {run_seed(r): c for r, c in zip(placebo, curves["placebo"], strict=True)}
    ends = {max(c) for cs in curves.values() for c in cs}
    paired = pairable(grpo, placebo)
    rows = []
    for n in grid:
        row = {"samples": n}
        for arm, cs in curves.items():
            row[arm] = over_seeds([(c[0], c[n]) for c in cs], metric)
        if paired:
            row["difference"] = over_seeds([(by_seed[run_seed(r)][n], c[n]) for r, c in
                                            zip(grpo, curves["grpo"], strict=True)], metric)
        else:
            tables = [table_of([(c[0], c[n]) for c in curves[a]], metric) for a in ("grpo", "placebo")]
            row["difference"] = unpaired(*tables, (len(grpo), len(placebo)))
        row["key"] = (metric, "last") if ends == {n} else (metric, f"{n:,} samples")
        if looks is not None and n > 0:
            if row["key"] in looks.estimates:
                row["difference"] = looks.estimates[row["key"]]
            else:
                looks.add(row["key"], row["difference"])
        rows.append(row)
    return rows


def curve_table(rows: list[dict], metric: str, looks: Looks | None = None) -> str:
    lines = [f"**{metric} on the held-out grid** (change from each run's base; ± a 95% interval)", "",
             "| samples trained | GRPO | placebo | GRPO minus placebo | p / adjusted |", "|---|---|---|---|---|"]
    lines += [f"| {r['samples']:,} | {r['grpo'].text()} | {r['placebo'].text()} | {r['difference'].text()} | "
              f"{looks.cell(r['key']) if looks is not None and r['samples'] > 0 else ''} |" for r in rows]
    if looks is not None:
        points = [r for r in rows if r["samples"] > 0]
        cleared = sum(looks.clears(r["key"]) for r in points)
        raw = sum(math.isfinite(r["difference"].p) and r["difference"].p < ALPHA for r in points)
        primary = "; the last is the primary endpoint, unadjusted" if looks.primary == (metric, "last") else ""
        lines += ["", f"GRPO minus placebo clears 0 at {cleared} of {len(points)} grid points after Holm's "
                      f"adjustment ({raw} before it){primary}."]
    return "\n".join(lines) + "\n"


def write_curve_png(rows: list[dict], metric: str, path: Path, title: str = "") -> None:
    """Two panels over the samples trained: each arm's change from its base with its interval shaded, and GRPO minus
    placebo with its interval against 0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["samples"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))

    def shade(ax, ests, colour, label=None):
        m = [e.band()[0] for e in ests]
        h = [e.band()[1] if math.isfinite(e.band()[1]) else 0.0 for e in ests]
        ax.plot(x, m, marker="o", color=colour, label=label)
        ax.fill_between(x, [u - v for u, v in zip(m, h, strict=True)], [u + v for u, v in zip(m, h, strict=True)],
                        color=colour, alpha=0.2)

    shade(a, [r["grpo"] for r in rows], "tab:blue", "GRPO")
    shade(a, [r["placebo"] for r in rows], "tab:grey", "placebo")
    shade(b, [r["difference"] for r in rows], "tab:green")
    for ax, name in ((a, f"{metric}: change from the base"), (b, "GRPO minus placebo")):
        ax.axhline(0.0, color="black", lw=0.8)
        ax.set_xlabel("samples trained")
        ax.set_title(name)
    a.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------------
# the training reward: every epoch's samples, both arms on the same conditions


def run_train_rewards(run_dir: Path, name: str) -> tuple[int | None, dict[int, tuple[list, float]]]:
    """(samples per epoch, {epoch: (the epoch's dataset indices, its mean training reward `name`)}) from a run's
    epoch records."""
    out, per_epoch = {}, None
    for r in read_records(run_dir / "metrics.jsonl"):
        if r.get("type") != "epoch":
            continue
        values = r.get(f"rewards/{name}")
        if not isinstance(values, list):
            known = sorted(k.split("/", 1)[1] for k in r if k.startswith("rewards/"))
            raise SystemExit(f"{run_dir}: epoch {r.get('epoch')} has no training reward {name!r} (rewards/{name}); "
                             f"its rewards: {known}")
        per_epoch = per_epoch or r.get("samples_per_epoch")
        finite = [float(x) for x in values if isinstance(x, (int, float)) and math.isfinite(x)]
        out[int(r["epoch"])] = (r.get("dataset_indices"), math.fsum(finite) / len(finite) if finite else math.nan)
    if not out:
        raise SystemExit(f"{run_dir}: metrics.jsonl has no epoch records")
    return per_epoch, dict(sorted(out.items()))


def block_means(series: list[float], blocks: int) -> list[float]:
    """The means of `blocks` equal blocks of consecutive values, the earliest values that fill none left out (as
    batch_means_interval cuts them)."""
    size = len(series) // blocks
    used = series[len(series) - size * blocks:]
    return [math.fsum(used[i * size:(i + 1) * size]) / size for i in range(blocks)] if size else []


def gap_over(per_seed: list[list[float]], blocks: int, seeds: list) -> tuple[Estimate, int]:
    """GRPO minus placebo over seeds' epoch-by-epoch differences (time order): one seed, batch means over `blocks`
    blocks (conditional on this run pair); several, the seeds x blocks interval of their block means (the blocks
    are the same epochs, so a bad stretch of conditions shared by the seeds counts as the conditions' term)."""
    n = len(per_seed[0])
    if len(per_seed) == 1:
        mean, half, used = batch_means_interval(per_seed[0], blocks)
        c = crossed_interval([block_means(per_seed[0], blocks)]) if n // blocks else None
        p = c.p if c is not None else math.nan
        how = (f"seed {seeds[0]}, {used} epochs in {blocks} blocks (batch means), conditional on this run pair")
        return Estimate(mean, half, p, how), used
    if n // blocks == 0:  # fewer epochs than blocks: each seed's mean, a t over the seeds
        mean, half = mean_interval([math.fsum(s) / len(s) for s in per_seed if s])
        return Estimate(mean, half, math.nan, f"t over {len(per_seed)} seeds' means ({n} epochs: too few for "
                                              "blocks)"), n
    table = [block_means(s, blocks) for s in per_seed]
    c = crossed_interval(table)
    est = Estimate.of(c)
    est.how = f"{len(per_seed)} seeds x {blocks} blocks of epochs (Satterthwaite df {c.df:.1f})"
    return est, (n // blocks) * blocks


def train_reward_gap(grpo: list[Path], placebo: list[Path], name: str, blocks: int | None = None) -> dict:
    """GRPO minus placebo in the mean training reward `name`, epoch by epoch on the epochs both runs of a seed
    trained: over the whole run and over its later half (gap_over), and `blocks` rows of consecutive epochs giving
    each arm's reward and the difference (averaged over seeds). blocks None: recam.infra.stats.blocks_for the
    epochs. Refused unless the runs pair by seed and both runs of a seed drew the same conditions at every epoch."""
    if not pairable(grpo, placebo):
        raise SystemExit("--train-reward pairs each GRPO run with the placebo run of its seed: give runs of the same "
                         "seeds on both sides")
    by_seed = {run_seed(r): r for r in placebo}
    per_seed, dropped = [], 0
    for run in grpo:
        twin = by_seed[run_seed(run)]
        (samples, g), (_, p) = run_train_rewards(run, name), run_train_rewards(twin, name)
        epochs = sorted(set(g) & set(p))
        for e in epochs:
            if g[e][0] != p[e][0]:
                raise SystemExit(f"{run} and {twin} drew different conditions at epoch {e}: their training rewards "
                                 "do not pair (same preset and seed, same data config?)")
        # an epoch whose samples all failed has no mean on one side: left out, and said
        kept = [(e, g[e][1], p[e][1]) for e in epochs if math.isfinite(g[e][1]) and math.isfinite(p[e][1])]
        dropped += len(epochs) - len(kept)
        per_seed.append(kept)
    common = set.intersection(*({e for e, _, _ in s} for s in per_seed))  # the epochs every seed has
    per_seed = [[x for x in s if x[0] in common] for s in per_seed]
    n = len(common)
    blocks = blocks if blocks is not None else blocks_for(n)
    late_blocks = blocks_for(n - n // 2)
    seeds = [run_seed(r) for r in grpo]
    diffs = [[g - p for _, g, p in s] for s in per_seed]
    overall, used = gap_over(diffs, blocks, seeds)
    later, _ = gap_over([d[n // 2:] for d in diffs], late_blocks, seeds)
    size = n // blocks
    rows = []
    for b in range(blocks if size else 0):
        lo = n - size * blocks + b * size
        part = [s[lo:lo + size] for s in per_seed]
        mean = lambda xs: math.fsum(xs) / len(xs)  # noqa: E731
        rows.append({"epochs": (part[0][0][0], part[0][-1][0]),
                     "samples": (part[0][-1][0] + 1) * samples if samples else None,
                     "grpo": mean([mean([x[1] for x in q]) for q in part]),
                     "placebo": mean([mean([x[2] for x in q]) for q in part]),
                     "difference": mean([mean([x[1] - x[2] for x in q]) for q in part])})
    how = overall.how + (f"; {dropped} epoch(s) without a finite mean left out" if dropped else "")
    return {"name": name, "epochs": n, "used": used, "rows": rows, "overall": (overall.mean, overall.half),
            "later_half": (later.mean, later.half), "how": how, "estimate": overall, "later": later}


def train_reward_table(gap: dict, looks: Looks | None = None) -> str:
    lines = [f"**training reward {gap['name']}: GRPO minus placebo on the same conditions** (each epoch's mean over "
             "its samples)", "", "| epochs | samples drawn (to the end) | GRPO | placebo | GRPO minus placebo |",
             "|---|---|---|---|---|"]
    for r in gap["rows"]:
        end = f"{r['samples']:,}" if r["samples"] else "n/a"
        first, last = r["epochs"]
        span = str(first) if first == last else f"{first}-{last}"
        lines.append(f"| {span} | {end} | {r['grpo']:.4f} | {r['placebo']:.4f} | {r['difference']:+.4f} |")
    span = f"all {gap['epochs']} epochs" if gap["used"] == gap["epochs"] else f"the last {gap['used']} epochs"
    key = (f"train/{gap['name']}", "all epochs")
    p = f"; p {looks.cell(key)}" if looks is not None and key in looks.estimates else ""
    lines += [f"| {span} | | | | {fmt(*gap['overall'])} ({gap['how']}{p}) |",
              f"| the later half | | | | {fmt(*gap['later_half'])} ({gap['later'].how}) |"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# the updates' direction: consecutive steps' gradient cosine, GRPO against its placebo


def cosine_gap(grpo: list[Path], placebo: list[Path]) -> Estimate | None:
    """GRPO's mean step cosine (grad_cosine_prev) minus the placebo's: a reward signal that repeats from update to
    update makes consecutive gradients agree; the placebo's updates have none to repeat, only the KL pull's.
    recam.engine.diagnosis.cosine_difference (Welch over block means, or over seeds' means). None when no run
    logged step cosines."""
    series = [[step_cosines(read_records(r / "metrics.jsonl")) for r in runs] for runs in (grpo, placebo)]
    if not any(s for arm in series for s in arm):
        return None
    d = cosine_difference(*series)
    p = math.nan
    if math.isfinite(d["half"]) and d["half"] > 0:
        se = d["half"] / float(stats.t.ppf(0.975, d["df"]))
        p = float(2 * stats.t.sf(abs(d["difference"]) / se, d["df"]))
    how = (f"GRPO {d['grpo_mean']:+.4f} over {d['grpo_unit']}, placebo {d['placebo_mean']:+.4f} over "
           f"{d['placebo_unit']}; Welch")
    return Estimate(d["difference"], d["half"], p, how)


# ---------------------------------------------------------------------------------------------------------------
# power: how many seed pairs and conditions an effect needs


def power_report(est: Estimate, effect: float, what: str) -> str:
    """From an estimate over a seeds x conditions table: the variance components, the power of this design for a
    true difference `effect`, and the seeds and conditions that give 80%."""
    c = est.crossed
    lines = [f"**Power for a true difference of {effect:+.4f}** ({what})", ""]
    if c is None or c.conditions < 2:
        lines.append("No per-condition values for this metric: its seed and condition variances cannot be "
                     "separated, and no power is computed.")
        return "\n".join(lines) + "\n"
    S, C = c.seeds, c.conditions
    if S == 1:
        spread = (c.se * math.sqrt(C)) ** 2  # the variance over conditions: condition and residual together
        need = conditions_for_power(effect, 0.0, spread, 0.0, 1)
        lines += [f"One seed pair: the variance over its {C} conditions is {spread:.3g}; the seeds' own term cannot "
                  "be measured from one pair (run a second seed pair), so the numbers below count none and are the "
                  "least a design needs.",
                  f"- power of this design: {crossed_power(effect, 0.0, spread, 0.0, 1, C):.0%}",
                  f"- conditions for 80% with one pair: {need:,}" if need else "- no number of conditions reaches 80%"]
        return "\n".join(lines) + "\n"
    vs, vc, ve = c.var_seed, c.var_condition, c.var_residual
    now = crossed_power(effect, vs, vc, ve, S, C)
    seeds = seeds_for_power(effect, vs, vc, ve, C)
    conds = conditions_for_power(effect, vs, vc, ve, S)
    lines += [f"From {S} seed pairs on {C} shared conditions: variance of the seeds' term {vs:.3g}, of the "
              f"conditions' {vc:.3g}, residual {ve:.3g} (each estimated from {S} seeds: the seeds' term is itself "
              "uncertain).",
              f"- power of this design ({S} pairs, {C} conditions): {now:.0%}",
              f"- seed pairs for 80% on {C} conditions: " + (
                  f"{seeds}" if seeds else "none suffice (the shared conditions' term, the same for every seed, "
                  "alone keeps it below: more conditions are needed)" if vc / C > 0 else "more than 1,000"),
              f"- conditions for 80% with {S} pairs: " + (f"{conds:,}" if conds else
                                                         "none suffice (the seeds' term alone keeps it below)"),
              ""]
    sizes = sorted({C, 32, 128, 512})  # this design's conditions among the usual sizes, each column once
    lines += ["| seed pairs | " + " | ".join(f"{n:,} conditions" for n in sizes) + " |", "|---|" + "---|" * len(sizes)]
    for s in sorted({S, 3, 8, 16, 32}):
        lines.append(f"| {s} | " + " | ".join(f"{crossed_power(effect, vs, vc, ve, s, n):.0%}" for n in sizes) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="finished run folders (one per seed)")
    p.add_argument("--metric", action="append", default=[],
                   help="an evaluation key, e.g. eval/cam_score (default: the runs' primary and secondary endpoints)")
    p.add_argument("--primary", default=None, metavar="METRIC[:last|reported]",
                   help="the primary endpoint of runs whose config.json names none (runs that name one keep theirs)")
    p.add_argument("--placebo", nargs="+", type=Path, default=[],
                   help="placebo runs (advantage.placebo=True) of the same preset: GRPO minus placebo per metric")
    p.add_argument("--curve", type=Path, default=None,
                   help="with --placebo: a folder for the held-out curve of each metric (curve_<metric>.png) over "
                        "the runs' evaluation grid of sample counts; its table is printed too")
    p.add_argument("--train-reward", action="append", default=[], metavar="NAME",
                   help="with --placebo: GRPO minus placebo in the training reward NAME (e.g. cam_score), epoch by "
                        "epoch on the same conditions")
    p.add_argument("--power", type=float, default=None, metavar="EFFECT",
                   help="the power of the runs' design for a true difference EFFECT on the primary endpoint, and "
                        "the seed pairs and conditions that give 80%%")
    args = p.parse_args(argv)
    if args.train_reward and not args.placebo:
        raise SystemExit("--train-reward compares GRPO with its placebo: give --placebo runs too")
    if args.curve is not None and not args.placebo:
        raise SystemExit("--curve draws GRPO beside its placebo: give --placebo runs too")
    primary, secondary = run_endpoints(args.runs + args.placebo)
    if primary is None and args.primary:
        metric, _, time = args.primary.partition(":")
        if (time or "last") not in TIMES:
            raise SystemExit(f"--primary {args.primary}: the time point is 'last' or 'reported'")
        primary = (metric, time or "last")
    metrics = args.metric or ([primary[0], *secondary] if primary else [])
    if not metrics:
        raise SystemExit("name the metrics (--metric eval/...): the runs' config.json names no endpoints")
    looks = Looks(primary)
    text = report(args.runs, metrics, None if args.placebo else looks)
    if args.placebo:
        rows = placebo_rows(args.runs, args.placebo, metrics, looks)
        curves = {m: curve_rows(args.runs, args.placebo, m, looks) for m in metrics} if args.curve else {}
        gaps = [train_reward_gap(args.runs, args.placebo, name) for name in args.train_reward]
        for gap in gaps:
            looks.add((f"train/{gap['name']}", "all epochs"), gap["estimate"])
        cosine = cosine_gap(args.runs, args.placebo)
        if cosine is not None:
            looks.add(("step cosine", "all steps"), cosine)
        text = endpoint_summary(looks, "GRPO minus placebo") + "\n" + text + "\n" + placebo_table(rows, metrics, looks)
        if args.curve is not None:
            args.curve.mkdir(parents=True, exist_ok=True)
            for metric, crows in curves.items():
                text += "\n" + curve_table(crows, metric, looks)
                write_curve_png(crows, metric, args.curve / f"curve_{metric.replace('/', '_')}.png",
                                f"{len(args.runs)} GRPO run(s) beside {len(args.placebo)} placebo run(s)")
        for gap in gaps:
            text += "\n" + train_reward_table(gap, looks)
        text += "\n**Consecutive updates' gradient cosine, GRPO minus placebo** (grad_cosine_prev)\n\n"
        text += (f"{cosine.text()} (p / adjusted {looks.cell(('step cosine', 'all steps'))}; {cosine.how})\n"
                 if cosine is not None else "No run logged step cosines (train.log_gradient_cosine).\n")
        text += "\n**Guard events per arm** (the guard acts on the rewards, so the arms can differ)\n\n"
        text += events_table(args.runs, args.placebo) + "\n"
    else:
        text = endpoint_summary(looks, "change from the base") + "\n" + text
    if args.power is not None:
        key = primary if primary is not None and primary in looks.estimates else (metrics[0], "last")
        when = "the last epoch" if key[1] == "last" else "the reported checkpoint"
        text += "\n" + power_report(looks.estimates[key], args.power, f"{key[0]} at {when}, "
                                    + ("GRPO minus placebo" if args.placebo else "change from the base"))
    print(text)
    return text


if __name__ == "__main__":
    main()
