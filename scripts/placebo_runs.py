"""GRPO beside its placebo: a preset's runs for each seed, once as it is and once with advantage.placebo=True, then
GRPO minus placebo per metric (scripts/seed_gains.py --placebo).

    python scripts/placebo_runs.py --preset tiny_cpu --seeds 0 1 2 --out runs/placebo_main --power 0.011
    python scripts/placebo_runs.py --preset motion_tiny_cpu --seeds 0 1 2 --out runs/placebo_motion \
        --metric eval/r_precision_top3 --metric eval/motion_alignment

Runs go to <out>/<grpo|placebo>/seed<k>, `--parallel` at a time, each on `--threads` CPU threads (a GRPO run and
its placebo side by side, one core each, by default). Resumable: a finished run (summary.md present) is skipped,
and an interrupted one continues from its checkpoints (train_recam.py resumes by default), so the same command
picks up where it stopped. Any --config.* argument is passed to every run. Without --metric the comparison reports
the preset's named endpoints: the primary unadjusted, the rest Holm-adjusted (scripts/seed_gains.py); GRPO minus
placebo over seeds is the seeds x conditions interval, as every seed is evaluated on the same held-out conditions,
and each arm's rollbacks and guard actions are listed. The comparison is written to
<out>/report.md with this command, and each metric's held-out curve over the runs' evaluation grid, GRPO beside
placebo with intervals, to <out>/curve_<metric>.png (the long presets evaluate every 1,024 or 2,048 samples).
`--train-reward NAME` adds the two arms' training reward NAME compared epoch by epoch on the same conditions
(scripts/seed_gains.py --train-reward): every sample trained on, where the held-out set is 32 or 128 conditions.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts import seed_gains  # noqa: E402

ARMS = {"grpo": "--config.advantage.placebo=False", "placebo": "--config.advantage.placebo=True"}


def run_one(preset: str, arm: str, seed: int, out: Path, threads: int, extra: list[str]) -> tuple[Path, int]:
    run_dir = out / arm / f"seed{seed}"
    if (run_dir / "summary.md").exists():
        return run_dir, 0
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(ROOT / "scripts" / "train_recam.py"), f"--config=config/grpo.py:{preset}",
           f"--config.seed={seed}", f"--config.run_dir={run_dir}", "--config.logging.wandb_mode=disabled",
           f"--config.num_threads={threads}", ARMS[arm], *extra]
    with (run_dir / "console.log").open("a") as log:
        code = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    return run_dir, code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = [a for a in argv if a.startswith("--config.")]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", required=True)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--metric", action="append", default=[],
                    help="an evaluation key, e.g. eval/cam_score (default: the preset's primary and secondary "
                         "endpoints, eval.primary_endpoint and eval.secondary_endpoints)")
    ap.add_argument("--power", type=float, default=None, metavar="EFFECT",
                    help="the seed pairs and conditions that give 80%% power for a true difference EFFECT on the "
                         "primary endpoint (scripts/seed_gains.py --power)")
    ap.add_argument("--train-reward", action="append", default=[], metavar="NAME",
                    help="a training reward (e.g. cam_score) to compare epoch by epoch on the same conditions")
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args([a for a in argv if not a.startswith("--config.")])
    jobs = [(arm, seed) for seed in args.seeds for arm in ARMS]  # a seed's pair runs side by side
    with ThreadPoolExecutor(args.parallel) as pool:
        done = list(pool.map(lambda j: run_one(args.preset, j[0], j[1], args.out, args.threads, extra), jobs))
    failed = [f"{d} (exit {c})" for d, c in done if c not in (0,)]
    if failed:
        print("runs that did not finish (rerun the same command to continue them): " + ", ".join(failed))
        return 1
    grpo = [args.out / "grpo" / f"seed{s}" for s in args.seeds]
    placebo = [args.out / "placebo" / f"seed{s}" for s in args.seeds]
    metrics = [x for m in args.metric for x in ("--metric", m)]
    metrics += [x for m in args.train_reward for x in ("--train-reward", m)]
    metrics += ["--power", str(args.power)] if args.power is not None else []
    text = seed_gains.main([*map(str, grpo), "--placebo", *map(str, placebo), *metrics, "--curve", str(args.out)])
    command = "python scripts/placebo_runs.py " + " ".join(shlex.quote(a) for a in argv)
    (args.out / "report.md").write_text(f"# GRPO against its placebo: {args.preset}\n\n{text}\n\ncommand: "
                                        f"`{command}`\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
