"""The held-out gain of finished runs (one per seed): per run, the paired change over the held-out conditions with
its 95% interval, for the checkpoint the run reports (selected on validation, or its last epoch) and for the last
epoch; over the runs, the mean change with its 95% t-interval over seeds.

    python scripts/seed_gains.py runs/main/seed0 runs/main/seed1 runs/main/seed2 --metric eval/cam_score
    python scripts/seed_gains.py runs/motion/seed* --metric eval/motion_alignment --metric eval/r_precision_top3

A metric over the whole split (R-precision in pools, FID) has no per-condition values: its per-run change has no
interval, and only the interval over seeds is given.

With placebo runs beside them (`advantage.placebo=True`: the same loop with each group's advantages permuted among
its samples), each metric also gets the placebo runs' change and GRPO minus placebo, for the reported checkpoint and
the last epoch:

    python scripts/seed_gains.py runs/main/seed* --placebo runs/placebo/seed* --metric eval/cam_score

The difference is paired by seed where both sides have every seed (the config's `seed`): per seed, GRPO's and the
placebo's values on the same held-out conditions are paired over the conditions; over seeds, the mean of the
per-seed differences with its t-interval (one seed: its interval over conditions). Otherwise it is Welch's interval
over the two sets of runs' changes.

`--curve DIR` (with --placebo) adds each metric's held-out curve: at every sample count on which all runs evaluated
(their eval.freq grid), each arm's change from its base and GRPO minus placebo, paired the same way, as a table and
as DIR/curve_<metric>.png.

`--train-reward NAME` (with --placebo) compares the two arms on what they trained on: each epoch's mean training
reward NAME (the epoch record's `rewards/NAME`, one value per sample), GRPO minus placebo epoch by epoch. Both arms
of a seed draw the same conditions in the same order (the draw is seeded, not the policy), so each epoch's
difference is paired over that epoch's conditions, and every sample trained on counts (8,192 in tiny_cpu_long)
where the held-out set holds 32 or 128 conditions. Its interval is over blocks of consecutive epochs
(recam.infra.stats.batch_means_interval), since neighbouring epochs share the weights; over several seeds, a
t-interval over the seeds' means.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from recam.infra.reports import eval_change  # noqa: E402
from recam.infra.runlog import read_records  # noqa: E402
from recam.infra.stats import batch_means_interval, mean_interval, welch_difference  # noqa: E402


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


def report(run_dirs: list[Path], metrics: list[str]) -> str:
    lines = []
    for metric in metrics:
        lines += [f"**{metric}** (change from the base; ± a 95% interval)", "",
                  "| run | base | reported (checkpoint) | change, reported (paired over conditions) | "
                  "change, last epoch |", "|---|---|---|---|---|"]
        reported_changes, last_changes = [], []
        for run in run_dirs:
            base, rep, last = run_evals(run)
            r, l_ = eval_change(base, rep, metric), eval_change(base, last, metric)
            reported_changes.append(r[0])
            last_changes.append(l_[0])
            b = base.get(metric)
            lines.append(f"| {run} | {b:.4f} | {rep.get(metric, math.nan):.4f} ({rep.get('checkpoint')}) | "
                         f"{fmt(r[0], r[1])} | {fmt(l_[0], l_[1])} |")
        (rm, rh), (lm, lh) = mean_interval(reported_changes), mean_interval(last_changes)
        lines += [f"| mean over {len(run_dirs)} runs (t-interval over runs) | | | {fmt(rm, rh)} | {fmt(lm, lh)} |",
                  ""]
    return "\n".join(lines)


def run_seed(run_dir: Path) -> int | None:
    """The seed the run's config.json records, or None (a run folder without one cannot be paired)."""
    try:
        seed = json.loads((run_dir / "config.json").read_text()).get("seed")
    except (OSError, ValueError):
        return None
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else None


def placebo_flag(run_dir: Path) -> bool | None:
    try:
        return json.loads((run_dir / "config.json").read_text()).get("advantage", {}).get("placebo")
    except (OSError, ValueError, AttributeError):
        return None


def pairable(grpo: list[Path], placebo: list[Path]) -> bool:
    """Whether the two sets of runs pair by seed: each side's seeds recorded, distinct, and the same set."""
    seeds_g, seeds_p = [run_seed(r) for r in grpo], [run_seed(r) for r in placebo]
    return (None not in seeds_g and len(set(seeds_g)) == len(seeds_g) and sorted(seeds_g) == sorted(seeds_p)
            and len(set(seeds_p)) == len(seeds_p))


def grpo_minus_placebo(grpo: list[Path], placebo: list[Path], metric: str, which: int) -> tuple[float, float, str]:
    """GRPO minus placebo for one metric at the reported checkpoint (which=1) or the last epoch (which=2): (mean,
    95% half-width, how it was paired)."""
    seeds_g = [run_seed(r) for r in grpo]
    if pairable(grpo, placebo):
        by_seed = {run_seed(r): r for r in placebo}
        per_seed = []
        for run in grpo:
            g, p = run_evals(run)[which], run_evals(by_seed[run_seed(run)])[which]
            per_seed.append(eval_change(p, g, metric))  # same conditions: GRPO's values minus the placebo's
        if len(per_seed) == 1:
            mean, half, n = per_seed[0]
            return mean, half, f"seed {seeds_g[0]}, paired over {n} conditions"
        mean, half = mean_interval([d[0] for d in per_seed])
        return mean, half, f"paired by seed over {len(per_seed)} seeds"
    changes = []
    for runs in (grpo, placebo):
        changes.append([eval_change(e[0], e[which], metric)[0] for e in map(run_evals, runs)])
    mean, half, df = welch_difference(*changes)
    return mean, half, f"Welch over {len(grpo)} and {len(placebo)} runs (df {df:.1f})"


def placebo_report(grpo: list[Path], placebo: list[Path], metrics: list[str]) -> str:
    lines = []
    for run in placebo:
        if placebo_flag(run) is not True:
            raise SystemExit(f"{run}: its config.json does not record advantage.placebo=True: not a placebo run")
    for run in grpo:
        if placebo_flag(run) is True:
            raise SystemExit(f"{run}: a placebo run (advantage.placebo=True) given as a GRPO run")
    for metric in metrics:
        lines += [f"**{metric}: GRPO against its placebo** (changes from each run's base; ± a 95% interval)", "",
                  "| checkpoint | GRPO change | placebo change | GRPO minus placebo | paired |",
                  "|---|---|---|---|---|"]
        for which, name in ((1, "reported"), (2, "last epoch")):
            sides = []
            for runs in (grpo, placebo):
                sides.append(mean_interval([eval_change(e[0], e[which], metric)[0] for e in map(run_evals, runs)]))
            mean, half, how = grpo_minus_placebo(grpo, placebo, metric, which)
            lines.append(f"| {name} | {fmt(*sides[0])} | {fmt(*sides[1])} | {fmt(mean, half)} | {how} |")
        lines.append("")
    return "\n".join(lines)


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


def curve_rows(grpo: list[Path], placebo: list[Path], metric: str) -> list[dict]:
    """At every sample count all runs evaluated: each arm's change from its base (the mean over seeds with its
    t-interval; one seed: paired over the held-out conditions), and GRPO minus placebo paired as
    grpo_minus_placebo pairs it (by seed, over conditions; Welch otherwise)."""
    curves = {arm: [run_curve(r) for r in runs] for arm, runs in (("grpo", grpo), ("placebo", placebo))}
    grid = sorted(set.intersection(*(set(c) for cs in curves.values() for c in cs)))
    by_seed = {run_seed(r): c for r, c in zip(placebo, curves["placebo"], strict=True)}
    paired = pairable(grpo, placebo)
    rows = []
    for n in grid:
        row = {"samples": n}
        for arm, cs in curves.items():
            changes = [eval_change(c[0], c[n], metric) for c in cs]
            row[arm] = changes[0][:2] if len(cs) == 1 else mean_interval([d[0] for d in changes])
        if paired:
            diffs = [eval_change(by_seed[run_seed(r)][n], c[n], metric) for r, c in zip(grpo, curves["grpo"],
                                                                                     strict=True)]
            row["difference"] = diffs[0][:2] if len(diffs) == 1 else mean_interval([d[0] for d in diffs])
        else:
            m, h, _ = welch_difference(*[[eval_change(c[0], c[n], metric)[0] for c in curves[a]]
                                         for a in ("grpo", "placebo")])
            row["difference"] = (m, h)
        rows.append(row)
    return rows


def curve_table(rows: list[dict], metric: str) -> str:
    lines = [f"**{metric} on the held-out grid** (change from each run's base; ± a 95% interval)", "",
             "| samples trained | GRPO | placebo | GRPO minus placebo |", "|---|---|---|---|"]
    lines += [f"| {r['samples']:,} | {fmt(*r['grpo'])} | {fmt(*r['placebo'])} | {fmt(*r['difference'])} |"
              for r in rows]
    return "\n".join(lines) + "\n"


def write_curve_png(rows: list[dict], metric: str, path: Path, title: str = "") -> None:
    """Two panels over the samples trained: each arm's change from its base with its interval shaded, and GRPO minus
    placebo with its interval against 0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["samples"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for arm, colour in (("grpo", "tab:blue"), ("placebo", "tab:grey")):
        m = [r[arm][0] for r in rows]
        h = [r[arm][1] if math.isfinite(r[arm][1]) else 0.0 for r in rows]
        a.plot(x, m, marker="o", color=colour, label="GRPO" if arm == "grpo" else "placebo")
        a.fill_between(x, [u - v for u, v in zip(m, h, strict=True)], [u + v for u, v in zip(m, h, strict=True)],
                       color=colour, alpha=0.2)
    m = [r["difference"][0] for r in rows]
    h = [r["difference"][1] if math.isfinite(r["difference"][1]) else 0.0 for r in rows]
    b.plot(x, m, marker="o", color="tab:green")
    b.fill_between(x, [u - v for u, v in zip(m, h, strict=True)], [u + v for u, v in zip(m, h, strict=True)],
                   color="tab:green", alpha=0.2)
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

TRAIN_BLOCKS = 8


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


def train_reward_gap(grpo: list[Path], placebo: list[Path], name: str, blocks: int = TRAIN_BLOCKS) -> dict:
    """GRPO minus placebo in the mean training reward `name`, epoch by epoch on the epochs both runs of a seed
    trained: per seed the mean over epochs with its batch-means interval, and the same over the later half of the
    epochs; over seeds, the seeds' means with a t-interval. `blocks` rows of consecutive epochs give each arm's
    reward and the difference (averaged over seeds). Refused unless the runs pair by seed and both runs of a seed
    drew the same conditions at every epoch."""
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
    whole = [batch_means_interval([g - p for _, g, p in s], blocks) for s in per_seed]
    late = [batch_means_interval([g - p for _, g, p in s[n // 2:]], max(2, blocks // 2)) for s in per_seed]
    size = n // blocks
    rows = []
    for b in range(blocks if size else 0):
        lo = n - size * blocks + b * size
        part = [s[lo:lo + size] for s in per_seed]
        rows.append({"epochs": (part[0][0][0], part[0][-1][0]),
                     "samples": (part[0][-1][0] + 1) * samples if samples else None,
                     "grpo": mean_interval([math.fsum(x[1] for x in q) / size for q in part])[0],
                     "placebo": mean_interval([math.fsum(x[2] for x in q) / size for q in part])[0],
                     "difference": mean_interval([math.fsum(x[1] - x[2] for x in q) / size for q in part])[0]})
    if len(per_seed) == 1:
        overall, later = whole[0][:2], late[0][:2]
        how = f"seed {run_seed(grpo[0])}, {whole[0][2]} epochs in {blocks} blocks"
    else:
        overall, later = mean_interval([w[0] for w in whole]), mean_interval([w[0] for w in late])
        how = f"t-interval over {len(per_seed)} seeds' means"
    if dropped:
        how += f"; {dropped} epoch(s) without a finite mean left out"
    return {"name": name, "epochs": n, "used": whole[0][2], "rows": rows, "overall": overall, "later_half": later,
            "how": how}


def train_reward_table(gap: dict) -> str:
    lines = [f"**training reward {gap['name']}: GRPO minus placebo on the same conditions** (each epoch's mean over "
             "its samples)", "", "| epochs | samples drawn (to the end) | GRPO | placebo | GRPO minus placebo |",
             "|---|---|---|---|---|"]
    for r in gap["rows"]:
        end = f"{r['samples']:,}" if r["samples"] else "n/a"
        first, last = r["epochs"]
        span = str(first) if first == last else f"{first}-{last}"
        lines.append(f"| {span} | {end} | {r['grpo']:.4f} | {r['placebo']:.4f} | {r['difference']:+.4f} |")
    span = f"all {gap['epochs']} epochs" if gap["used"] == gap["epochs"] else f"the last {gap['used']} epochs"
    lines += [f"| {span} | | | | {fmt(*gap['overall'])} ({gap['how']}) |",
              f"| the later half | | | | {fmt(*gap['later_half'])} |"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="finished run folders (one per seed)")
    p.add_argument("--metric", action="append", required=True, help="an evaluation key, e.g. eval/cam_score")
    p.add_argument("--placebo", nargs="+", type=Path, default=[],
                   help="placebo runs (advantage.placebo=True) of the same preset: GRPO minus placebo per metric")
    p.add_argument("--curve", type=Path, default=None,
                   help="with --placebo: a folder for the held-out curve of each metric (curve_<metric>.png) over "
                        "the runs' evaluation grid of sample counts; its table is printed too")
    p.add_argument("--train-reward", action="append", default=[], metavar="NAME",
                   help="with --placebo: GRPO minus placebo in the training reward NAME (e.g. cam_score), epoch by "
                        "epoch on the same conditions")
    args = p.parse_args(argv)
    if args.train_reward and not args.placebo:
        raise SystemExit("--train-reward compares GRPO with its placebo: give --placebo runs too")
    text = report(args.runs, args.metric)
    if args.placebo:
        text += "\n" + placebo_report(args.runs, args.placebo, args.metric)
    if args.curve is not None:
        if not args.placebo:
            raise SystemExit("--curve draws GRPO beside its placebo: give --placebo runs too")
        args.curve.mkdir(parents=True, exist_ok=True)
        for metric in args.metric:
            rows = curve_rows(args.runs, args.placebo, metric)
            text += "\n" + curve_table(rows, metric)
            write_curve_png(rows, metric, args.curve / f"curve_{metric.replace('/', '_')}.png",
                            f"{len(args.runs)} GRPO run(s) beside {len(args.placebo)} placebo run(s)")
    for name in args.train_reward:
        text += "\n" + train_reward_table(train_reward_gap(args.runs, args.placebo, name))
    print(text)
    return text


if __name__ == "__main__":
    main()
