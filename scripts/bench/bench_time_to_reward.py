"""Time to reward: policy-optimisation methods (config/methods.py) x seeds on one preset, side by side.

Every run is `scripts/train_recam.py --config config/grpo.py:<preset>+<method>` with the same seed list, a
wall-clock training budget (config max_train_seconds: sampling, rewards and updates; evaluations never count) and
held-out evaluations on a fixed grid of training seconds (config eval.every_seconds). Runs go `--parallel` at a
time with `--threads` torch threads each, seed-major (the runs sharing the machine at any moment are the same
seed's methods), so every method sees the same load.

Reported per method: training seconds and NFEs (sampling and training separately) until the held-out reward first
reaches the baseline's best (the best point of the baseline's seed-mean curve), the best and the final held-out
reward with 95% t-intervals over seeds, median seconds per epoch split into sampling / reward wait / training, and a
plot of held-out reward against training seconds.

    python scripts/bench/bench_time_to_reward.py --preset tiny_cpu --seeds 0,1,2 --budget-s 300 --eval-every-s 30

writes docs/time_to_reward.md, .png and .json (with this command line). `--report-only` re-reads finished runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from config.grpo import get_config  # noqa: E402
from config.methods import METHODS  # noqa: E402
from recam.infra.stats import mean_interval  # noqa: E402

# ---------------------------------------------------------------------------------------------------------------
# statistics (pure)

def seed_mean_curve(curves: list[dict[float, float]]) -> dict[float, float]:
    """Mean over seeds at each grid point every seed reached (a point some seed lacks is left out)."""
    common = set.intersection(*(set(c) for c in curves)) if curves else set()
    return {t: float(np.mean([c[t] for c in curves])) for t in sorted(common)}


def step_curve(curve: dict[float, float], grid: list[float]) -> dict[float, float]:
    """The curve read at each grid point as the latest evaluation at or before it (what the run had to offer at
    that time); a run evaluates at most once per epoch, so its own points skip some grid points."""
    out, times = {}, sorted(curve)
    for g in grid:
        done = [t for t in times if t <= g]
        if done:
            out[g] = curve[done[-1]]
    return out


def first_reach(curve: dict[float, float], target: float) -> float | None:
    """The first grid point whose value reaches target, None if none does."""
    for t in sorted(curve):
        if curve[t] >= target:
            return t
    return None


# ---------------------------------------------------------------------------------------------------------------
# runs

def run_command(preset: str, method: str, seed: int, run_dir: Path, budget_s: float, every_s: float,
                threads: int) -> list[str]:
    return [sys.executable, str(ROOT / "scripts" / "train_recam.py"), "--config",
            f"{ROOT / 'config' / 'grpo.py'}:{preset}+{method}", f"--config.seed={seed}", f"--config.run_dir={run_dir}",
            f"--config.max_train_seconds={budget_s}", f"--config.eval.every_seconds={every_s}",
            "--config.num_epochs=100000", "--config.eval.freq=100000", f"--config.num_threads={threads}",
            "--config.logging.wandb_mode=disabled", "--config.eval.num_videos=0"]


def read_run(run_dir: Path, reward: str) -> dict | None:
    """The run's held-out curve {grid seconds: reward} (the start evaluation at 0, the final one at its training
    seconds), NFE totals at each point, and its epochs' timing; None if it has no final evaluation."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    curve, nfe, epochs, final, cosines = {}, {}, [], None, []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r.get("type") == "step" and isinstance(r.get("grad_cosine_prev"), (int, float)):
            cosines.append(float(r["grad_cosine_prev"]))
        if r.get("type") == "epoch":
            epochs.append({k: r.get(k) for k in ("seconds_sampling", "seconds_rewards", "seconds_training",
                                                 "epoch_seconds", "nfe_sampling", "nfe_training")})
        if r.get("type") != "eval" or f"eval/{reward}" not in r:
            continue
        tag = r["tag"]
        if tag == "start":
            t = 0.0
        elif tag.startswith("time_"):
            t = float(tag[len("time_"):].rstrip("s"))
        elif tag == "final":
            final = r
            continue
        else:
            continue
        curve[t] = float(r[f"eval/{reward}"])
        nfe[t] = (int(r.get("nfe_sampling_total", 0)), int(r.get("nfe_training_total", 0)))
    if final is None:
        return None
    return {"curve": curve, "nfe": nfe, "epochs": epochs, "final": float(final[f"eval/{reward}"]), "cosines": cosines,
            "final_seconds": float(final.get("train_seconds", float("nan"))),
            "final_nfe": (int(final.get("nfe_sampling_total", 0)), int(final.get("nfe_training_total", 0)))}


def launch(jobs: list[tuple[str, int, Path, list[str]]], parallel: int, threads: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "WANDB_MODE": "disabled"}

    def one(job):
        method, seed, run_dir, cmd = job
        run_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        with open(run_dir / "bench.log", "w") as log:
            rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        print(f"  {method} seed {seed}: exit {rc} in {time.time() - t0:.0f} s ({run_dir})", flush=True)
        return rc

    with ThreadPoolExecutor(parallel) as pool:
        codes = list(pool.map(one, jobs))
    failed = [j[2] for j, rc in zip(jobs, codes, strict=True) if rc != 0]
    if failed:
        print(f"{len(failed)} run(s) failed; see bench.log in: " + ", ".join(str(p) for p in failed), flush=True)


# ---------------------------------------------------------------------------------------------------------------
# report

def on_common_grid(runs: dict[str, dict[int, dict]]) -> dict[str, dict[int, dict]]:
    """Every run's curve and NFE totals read on the union of all runs' evaluation times (step_curve)."""
    grid = sorted({t for seeds in runs.values() for r in seeds.values() for t in r["curve"]})
    return {m: {seed: {**r, "curve": step_curve(r["curve"], grid), "nfe": step_curve(r["nfe"], grid)}
                for seed, r in seeds.items()} for m, seeds in runs.items()}


def summarize(runs: dict[str, dict[int, dict]], baseline: str) -> dict:
    """Per-method numbers from every run's record (runs[method][seed]); curves are read on the union of every run's
    evaluation times (step_curve)."""
    runs = on_common_grid(runs)
    base_curve = seed_mean_curve([r["curve"] for r in runs[baseline].values()])
    base_t = max(base_curve, key=lambda t: base_curve[t])
    target = base_curve[base_t]
    out = {"baseline": baseline, "target": target, "baseline_best_at_s": base_t, "methods": {}}
    for method, seeds in runs.items():
        mean_curve = seed_mean_curve([r["curve"] for r in seeds.values()])
        t_mean = first_reach(mean_curve, target)
        per_seed = [first_reach(r["curve"], target) for r in seeds.values()]
        timing = {k: float(np.median([e[k] for r in seeds.values() for e in r["epochs"] if e.get(k) is not None]
                                     or [float("nan")]))
                  for k in ("seconds_sampling", "seconds_rewards", "seconds_training", "epoch_seconds",
                            "nfe_sampling", "nfe_training")}
        base = [r["curve"].get(0.0) for r in seeds.values()]
        best = [max(r["curve"].values()) for r in seeds.values()]
        final = [r["final"] for r in seeds.values()]
        # how much of an update is signal: each seed's mean cosine between consecutive updates (runs logged before
        # trainers logged it have none)
        agreement = [float(np.mean(r["cosines"])) for r in seeds.values() if r.get("cosines")]
        out["methods"][method] = {
            "seeds": sorted(seeds),
            # the seed-mean curve's first grid point at the target: the comparison's number (one curve per method)
            "seconds_to_target": t_mean,
            "speedup_vs_baseline": (base_t / t_mean) if t_mean else None,
            "nfe_to_target_sampling": mean_interval([r["nfe"][t_mean][0] for r in seeds.values()]) if t_mean is not None
            else (None, None),
            "nfe_to_target_training": mean_interval([r["nfe"][t_mean][1] for r in seeds.values()]) if t_mean is not None
            else (None, None),
            # each seed on its own (a seed may never reach the seed-mean best, the baseline's own seeds included)
            "seconds_to_target_per_seed": per_seed,
            "reached": f"{sum(t is not None for t in per_seed)}/{len(per_seed)}",
            "base": mean_interval(base), "best": mean_interval(best), "final": mean_interval(final),
            "gain_best": mean_interval([b - s for b, s in zip(best, base, strict=True)]),
            "gain_final": mean_interval([f - s for f, s in zip(final, base, strict=True)]),
            "epoch_timing_median": timing,
            "update_agreement": mean_interval(agreement) if agreement else (None, None),
            "update_agreement_seeds": len(agreement),
            "curve_mean": mean_curve,
        }
    out["baseline_improved"] = base_t > 0
    # A target is only a target if the baseline's gain to it is distinguishable from zero over seeds: otherwise it
    # sits at the base's level plus the noise of a maximum over evaluations, and "time to reach it" measures noise.
    gain, half = out["methods"][baseline]["gain_best"]
    out["baseline_gain_significant"] = bool(base_t > 0 and math.isfinite(half) and gain - half > 0)
    if not out["baseline_gain_significant"]:
        for m in out["methods"].values():
            m["speedup_vs_baseline"] = None
    return out


def _pm(mi, digits=3) -> str:
    m, h = mi
    if m is None or (isinstance(m, float) and math.isnan(m)):
        return "n/a"
    return f"{m:.{digits}f}" + ("" if h is None or math.isnan(h) else f" ± {h:.{digits}f}")


def write_markdown(path: Path, summary: dict, reward: str, command: str, args) -> None:
    lines = [f"# Time to reward: {args.preset}, held-out {reward}", "",
             f"Made by `{command}` ({len(args.seeds)} seeds, {args.parallel} runs at a time with {args.threads} "
             f"torch thread(s) each, training budget {args.budget_s:g} s per run, evaluation every "
             f"{args.eval_every_s:g} training seconds)"
             + ("; this report was rewritten from those runs' logs with `--report-only`." if args.report_only else
                ".")
             + (f" {args.reused} of the {len(summary['methods']) * len(args.seeds)} runs had finished in an earlier "
                f"invocation with the same settings (`{args.runs_dir}`) and were read, not rerun."
                if getattr(args, "reused", 0) and not args.report_only else ""), "",
             f"Target: the baseline ({summary['baseline']})'s best seed-mean held-out {reward}, "
             f"{summary['target']:.4f} at {summary['baseline_best_at_s']:g} s. Times are training seconds (sampling, "
             "reward wait and updates; evaluations excluded) at the first evaluation where the seed-mean curve "
             "reaches it (evaluations are on a fixed grid, so a time is a grid point); NFEs are denoiser evaluations "
             "per run until then. "
             "Intervals: 95% t over seeds.", ""]
    if not summary["baseline_improved"]:
        lines += ["**The baseline's seed-mean held-out reward never rose above the base's within the budget: every "
                  "method reaches that target at 0 s, so no speed-up can be read from this run.**", ""]
    elif not summary["baseline_gain_significant"]:
        gain, half = summary["methods"][summary["baseline"]]["gain_best"]
        lines += [f"**The baseline's best gain, {_pm((gain, half))}, is not distinguishable from zero over these "
                  "seeds: its best is the base's level plus the noise of a maximum over evaluations, so the times "
                  "to reach it measure noise and no speed-up is given (n/a).** Compare the methods by their gains "
                  "and intervals instead; a speed-up needs a budget in which the baseline's own gain clears its "
                  "interval.", ""]
    lines += [
             "| method | seconds to target (seed mean) | speed-up | seeds reaching it alone | sampling NFE to target "
             "| training NFE to target | base | best | final | best gain | final gain |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in summary["methods"].items():
        sp = m["speedup_vs_baseline"]
        t = m["seconds_to_target"]
        lines.append(f"| {name} | {'not reached' if t is None else f'{t:g}'} | "
                     f"{'n/a' if sp is None else f'{sp:.2f}x'} | {m['reached']} | "
                     f"{_pm(m['nfe_to_target_sampling'], 0)} | "
                     f"{_pm(m['nfe_to_target_training'], 0)} | {_pm(m['base'])} | {_pm(m['best'])} | "
                     f"{_pm(m['final'])} | {_pm(m['gain_best'])} | {_pm(m['gain_final'])} |")
    lines += ["", "Seconds per epoch (median over epochs and seeds), denoiser evaluations per epoch, and update "
              "agreement: the mean cosine between consecutive optimizer steps' gradients (`grad_cosine_prev`), "
              "per seed then over seeds; near 0 an update is mostly its samples' noise (n/a: runs that did not log it)",
              "", "| method | sampling s | reward wait s | training s | epoch s | sampling NFE | training NFE "
              "| update agreement |", "|---|---|---|---|---|---|---|---|"]
    for name, m in summary["methods"].items():
        e = m["epoch_timing_median"]
        lines.append(f"| {name} | {e['seconds_sampling']:.1f} | {e['seconds_rewards']:.1f} | "
                     f"{e['seconds_training']:.1f} | {e['epoch_seconds']:.1f} | {e['nfe_sampling']:.0f} | "
                     f"{e['nfe_training']:.0f} | {_pm(m.get('update_agreement', (None, None)))} |")
    lines += ["", f"![held-out {reward} against training seconds]({path.with_suffix('.png').name})", ""]
    path.write_text("\n".join(lines))


def plot(path: Path, runs: dict[str, dict[int, dict]], reward: str, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=110)
    for i, (name, seeds) in enumerate(runs.items()):
        curves = [r["curve"] for r in seeds.values()]
        ts = sorted(set.intersection(*(set(c) for c in curves)))
        stats = [mean_interval([c[t] for c in curves]) for t in ts]
        m = np.array([s[0] for s in stats])
        h = np.nan_to_num(np.array([s[1] for s in stats]))
        ax.plot(ts, m, color=f"C{i}", label=name, lw=1.6)
        ax.fill_between(ts, m - h, m + h, color=f"C{i}", alpha=0.12)
    ax.axhline(target, color="0.4", ls="--", lw=1, label="baseline's best")
    ax.set(xlabel="training seconds (evaluations excluded)", ylabel=f"held-out {reward} (mean over seeds, 95% CI)")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny_cpu")
    p.add_argument("--methods", default=",".join(m for m in METHODS if m != "preset"),
                   help=f"comma list of config/methods.py names ({', '.join(METHODS)})")
    p.add_argument("--baseline", default="flow_grpo")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--budget-s", type=float, default=300.0, help="training seconds per run")
    p.add_argument("--eval-every-s", type=float, default=30.0)
    p.add_argument("--parallel", type=int, default=2, help="runs at once")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--reward", default="", help="held-out reward compared (default: the preset's eval.select_by)")
    p.add_argument("--runs-dir", default="runs/time_to_reward")
    p.add_argument("--out", default="docs/time_to_reward.md")
    p.add_argument("--report-only", action="store_true", help="only read the finished runs and write the report")
    args = p.parse_args(argv)
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        p.error(f"unknown method(s) {unknown}; known: {sorted(METHODS)}")
    if args.baseline not in methods:
        methods.insert(0, args.baseline)
    reward = args.reward or get_config(args.preset).eval.select_by
    if not reward:
        p.error("--reward is needed: the preset selects no reward (eval.select_by is empty)")
    runs_dir = (ROOT / args.runs_dir).resolve()
    jobs = []
    for seed in args.seeds:  # seed-major: the runs sharing the machine are one seed's methods
        for m in methods:
            run_dir = runs_dir / args.preset / m / f"seed{seed}"
            if read_run(run_dir, reward) is None:
                jobs.append((m, seed, run_dir, run_command(args.preset, m, seed, run_dir, args.budget_s,
                                                           args.eval_every_s, args.threads)))
    args.reused = len(methods) * len(args.seeds) - len(jobs)  # finished runs found in runs_dir, not rerun
    if jobs and not args.report_only:
        print(f"{len(jobs)} runs, {args.parallel} at a time, about {len(jobs) * args.budget_s / args.parallel / 60:.0f}"
              " minutes of training plus evaluations", flush=True)
        launch(jobs, args.parallel, args.threads)
    runs: dict[str, dict[int, dict]] = {}
    missing = []
    for m in methods:
        for seed in args.seeds:
            r = read_run(runs_dir / args.preset / m / f"seed{seed}", reward)
            if r is None:
                missing.append(f"{m} seed {seed}")
            else:
                runs.setdefault(m, {})[seed] = r
    if missing:
        print("no finished run for: " + ", ".join(missing) + " (left out of the report)", flush=True)
    if args.baseline not in runs:
        print(f"the baseline {args.baseline} has no finished run: nothing to compare against", file=sys.stderr)
        return 1
    summary = summarize(runs, args.baseline)
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    # the command that made the runs: a --report-only rewrite is said apart (write_markdown)
    command = "python scripts/bench/bench_time_to_reward.py " + " ".join(
        shlex.quote(a) for a in (argv or sys.argv[1:]) if a != "--report-only")
    summary["command"] = command
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1, default=str))
    plot(out.with_suffix(".png"), on_common_grid(runs), reward, summary["target"])
    write_markdown(out, summary, reward, command, args)
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
