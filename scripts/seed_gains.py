"""The held-out gain of finished runs (one per seed): per run, the paired change over the held-out conditions with
its 95% interval, for the checkpoint the run reports (selected on validation, or its last epoch) and for the last
epoch; over the runs, the mean change with its 95% t-interval over seeds.

    python scripts/seed_gains.py runs/main/seed0 runs/main/seed1 runs/main/seed2 --metric eval/cam_score
    python scripts/seed_gains.py runs/motion/seed* --metric eval/motion_alignment --metric eval/r_precision_top3

A metric over the whole split (R-precision in pools, FID) has no per-condition values: its per-run change has no
interval, and only the interval over seeds is given.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from recam.infra.reports import eval_change  # noqa: E402
from recam.infra.runlog import read_records  # noqa: E402
from recam.infra.stats import mean_interval  # noqa: E402


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


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="finished run folders (one per seed)")
    p.add_argument("--metric", action="append", required=True, help="an evaluation key, e.g. eval/cam_score")
    args = p.parse_args(argv)
    text = report(args.runs, args.metric)
    print(text)
    return text


if __name__ == "__main__":
    main()
