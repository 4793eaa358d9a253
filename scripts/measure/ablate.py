"""Ablation harness: presets x seeds on the embedded default, compared against plain GRPO.

    python scripts/measure/ablate.py --out runs/ablation --seeds 0 1 2 --epochs 4 \
        --config.sample.num_batches_per_epoch=2

Any --config.* argument is passed to every run. The default preset list is plain GRPO (tiny_cpu, the baseline)
followed by the six single variants and the three combinations.

Each (preset, seed) run goes to <out>/<preset>/seed<k>; finished runs (summary.md present) are skipped and
interrupted ones resume from their checkpoints, so re-running the same command continues where it stopped.
The report (<out>/report.md) gives held-out cam_score and fidelity (mean and 95% t-interval over seeds),
reward curves (PNG), importance-weight variance, KL and wall time per epoch, and the command that made it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from recam.infra.runlog import read_records  # noqa: E402
from recam.infra.stats import mean_interval  # noqa: E402


def run_one(preset: str, seed: int, run_dir: Path, extra: list[str]) -> float:
    if (run_dir / "summary.md").exists():
        return 0.0
    cmd = [sys.executable, str(ROOT / "scripts" / "train_recam.py"), f"--config=config/grpo.py:{preset}",
           f"--config.seed={seed}", f"--config.run_dir={run_dir}", "--config.logging.wandb_mode=disabled",
           *extra]
    t0 = time.time()
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / "stdout.log").open("a") as log:
        p = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if p.returncode not in (0, 3):  # 3 = stopped by the health guard, still a result worth reporting
        raise RuntimeError(f"{preset} seed {seed} failed (exit {p.returncode}); see {run_dir / 'stdout.log'}")
    return time.time() - t0


def collect(run_dir: Path) -> dict:
    recs = read_records(run_dir / "metrics.jsonl")
    evals = {r["tag"]: r for r in recs if r["type"] == "eval"}
    steps = [r for r in recs if r["type"] == "step"]
    epochs = [r for r in recs if r["type"] == "epoch"]
    return {
        "cam_before": evals["start"]["eval/cam_score"], "cam_after": evals["final"]["eval/cam_score"],
        "fid_before": evals["start"]["eval/fidelity"], "fid_after": evals["final"]["eval/fidelity"],
        "reward_curve": [e["reward_avg"] for e in epochs],
        "iw_var": float(np.mean([s.get("importance_weight_var", np.nan) for s in steps])),
        "kl": float(np.mean([s["kl_penalty"] for s in steps])),
        "epoch_seconds": float(np.median([e["epoch_seconds"] for e in epochs])),
    }


def report(out: Path, presets: list[str], seeds: list[int], results: dict, command: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for p in presets:
        curves = np.array([results[(p, s)]["reward_curve"] for s in seeds])
        ax.plot(curves.mean(0), label=p, lw=2 if p == presets[0] else 1)
    ax.set_xlabel("epoch")
    ax.set_ylabel("mean training reward (avg), over seeds")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "reward_curves.png", dpi=110)
    plt.close(fig)

    base = presets[0]
    base_delta = [results[(base, s)]["cam_after"] - results[(base, s)]["cam_before"] for s in seeds]
    lines = ["# Ablation: policy-optimization variants vs plain GRPO", "",
             f"Made by: `{command}`", "",
             f"{len(seeds)} seeds per preset ({', '.join(map(str, seeds))}); held-out conditions, ODE sampling, "
             "fixed noise. Intervals are 95% Student-t over seeds. Δ = after − before on the same seed.", "",
             "| preset | cam_score after | Δ cam_score | Δ vs plain (paired) | fidelity after | Δ fidelity | "
             "importance-weight var | KL | s/epoch |", "|---|---|---|---|---|---|---|---|---|"]
    for p in presets:
        rs = [results[(p, s)] for s in seeds]
        cam, cam_ci = mean_interval([r["cam_after"] for r in rs])
        dcam, dcam_ci = mean_interval([r["cam_after"] - r["cam_before"] for r in rs])
        rel, rel_ci = mean_interval([r["cam_after"] - r["cam_before"] - b for r, b in zip(rs, base_delta, strict=True)])
        fid, fid_ci = mean_interval([r["fid_after"] for r in rs])
        dfid, dfid_ci = mean_interval([r["fid_after"] - r["fid_before"] for r in rs])
        lines.append(f"| {p} | {cam:.4f} ± {cam_ci:.4f} | {dcam:+.4f} ± {dcam_ci:.4f} | "
                     f"{'—' if p == base else f'{rel:+.4f} ± {rel_ci:.4f}'} | {fid:.4f} ± {fid_ci:.4f} | "
                     f"{dfid:+.4f} ± {dfid_ci:.4f} | {np.mean([r['iw_var'] for r in rs]):.3g} | "
                     f"{np.mean([r['kl'] for r in rs]):.3g} | {np.mean([r['epoch_seconds'] for r in rs]):.1f} |")
    lines += ["", "![reward curves](reward_curves.png)", "",
              "Importance-weight var: mean over optimizer steps of the variance of exp(logp - logp_old) within a "
              "micro-batch timestep (the variance the EMA and AMIC variants aim to reduce)."]
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    (out / "results.json").write_text(json.dumps({f"{p}/seed{s}": r for (p, s), r in results.items()}, indent=1))
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/ablation")
    ap.add_argument("--presets", nargs="+", default=["tiny_cpu", "ema", "gradient_adaptive", "amic", "ptrw",
                                                      "temporal_decay", "asymmetric", "conservative", "aggressive",
                                                      "balanced"], help="the first one is the baseline")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--epochs", type=int, default=6)
    args, extra_overrides = ap.parse_known_args(argv)  # any --config.* override is passed to every run
    bad = [a for a in extra_overrides if not a.startswith("--config.")]
    if bad:
        ap.error(f"unrecognized arguments: {bad} (only --config.* overrides pass through)")
    out = ROOT / args.out if not Path(args.out).is_absolute() else Path(args.out)
    command = "python scripts/measure/ablate.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    extra = [f"--config.num_epochs={args.epochs}", *extra_overrides]
    results = {}
    for seed in args.seeds:
        for preset in args.presets:
            run_dir = out / preset / f"seed{seed}"
            secs = run_one(preset, seed, run_dir, extra)
            results[(preset, seed)] = collect(run_dir)
            print(f"{preset} seed {seed}: cam {results[(preset, seed)]['cam_before']:.4f} -> "
                  f"{results[(preset, seed)]['cam_after']:.4f} ({secs:.0f}s)", flush=True)
    print(report(out, args.presets, args.seeds, results, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
