"""Rank settings by the gradient noise scale of their updates, and by the wall seconds an update whose direction is
half signal would take: one short training run per setting, the noise scale measured on every optimizer step
(train.noise_scale; recam/engine/noise_scale.py) and pooled over the run's epochs (recam.engine.diagnosis.
run_noise_scale).

    python scripts/measure/noise_sweep.py camera --out runs/noise_sweep/camera --epochs 4
    python scripts/measure/noise_sweep.py motion --out runs/noise_sweep/motion --epochs 12 --parallel 2
    python scripts/measure/noise_sweep.py motion --out runs/noise_sweep/motion --table   # what has finished
    python scripts/measure/noise_sweep.py camera --preset tiny_gpu --out runs/noise_sweep/gpu --epochs 4  # a GPU

B_simple = tr(Sigma) / |G|^2 is the update size (in samples) at which two independent updates' directions agree at
cosine 1/2; an update of B samples repeats 1 / (1 + B_simple / B) of itself in another (its consistent share: the
loss's whole gradient, the KL pull toward the reference included, not the reward's signal alone). Where |G|^2's
t-interval over the run's epochs contains 0 there is no point value, only the lower end tr / (|G|^2 + h), open above;
where it excludes 0, the point value with a 95% interval from a bootstrap over epochs (recam.engine.diagnosis.
run_noise_scale). Seconds to a cosine of 1/2 are B_simple times the run's training wall seconds per sample (sampling,
scoring and the update; evaluations and checkpoints excluded), so compare them only between rows run under the same
load (--parallel, and whatever else shares the machine); the network evaluations per sample (sampling and training,
from the epoch records) are the load-free part of that cost. A lower noise scale is better, between settings of the
same objective: fewer samples per update carry the same consistent share.

Runs go to <out>/<setting>, each on one torch thread, resumable (a run with summary.md is skipped, an interrupted one
continues from its checkpoints); <out>/table.md is rewritten after each run.
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from recam.engine.diagnosis import run_noise_scale  # noqa: E402
from recam.infra.runlog import read_records  # noqa: E402

# label -> (preset suffix, overrides); the methods, k and the noise level, as docs/results.md's ranking lists them
_COMMON = [
    ("std global", "", ["--config.advantage.std_mode=global"]),
    ("flow_grpo_fast", "+flow_grpo_fast", []),
    ("mixgrpo", "+mixgrpo", []),
    ("nft", "+nft", []),
    ("awm", "+awm", []),
    ("k 8", "", ["--config.sample.k=8"]),
]
SETTINGS = {
    "camera": ("tiny_cpu", [
        ("default (k 4, group std, noise a 0.7)", "", []), *_COMMON,
        # k 16 needs sampling batches holding whole groups: 8 batches of 16 (the same 128 samples per update)
        ("k 16", "", ["--config.sample.k=16", "--config.sample.batch_size=16",
                      "--config.sample.num_batches_per_epoch=8"]),
        ("noise a 0.4", "", ["--config.sample.noise_level=0.4"]),
        ("noise a 1.0", "", ["--config.sample.noise_level=1.0"]),
    ]),
    "motion": ("motion_tiny_cpu", [
        ("default (k 4, group std, eta 1.0)", "", []), *_COMMON,
        ("k 16", "", ["--config.sample.k=16", "--config.sample.batch_size=16",
                      "--config.sample.num_batches_per_epoch=4"]),
        ("noise eta 0.3", "", ["--config.motion.eta=0.3"]),
        ("noise eta 0.6", "", ["--config.motion.eta=0.6"]),
    ]),
}


def slug(label: str) -> str:
    return re.sub(r"_+", "_", re.sub(r"[^a-zA-Z0-9]", "_", label)).strip("_")


# Only the CPU presets need k 16's batch overrides: their sampling batches of 8 cannot hold a group of 16, the GPU
# presets' (1,024 and 4,096) can.
_CPU_ONLY = ("--config.sample.batch_size=", "--config.sample.num_batches_per_epoch=")


def settings_for(domain: str, preset: str | None) -> tuple[str, list[tuple[str, str, list[str]]]]:
    default, settings = SETTINGS[domain]
    preset = preset or default
    if preset == default:
        return preset, settings
    return preset, [(label, suffix, [o for o in overrides if not o.startswith(_CPU_ONLY)])
                    for label, suffix, overrides in settings]


def run_one(preset: str, label: str, suffix: str, overrides: list[str], out: Path, epochs: int,
            extra: list[str]) -> tuple[str, int]:
    run_dir = out / slug(label)
    if (run_dir / "summary.md").exists():
        return label, 0
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(ROOT / "scripts" / "train_recam.py"), f"--config=config/grpo.py:{preset}{suffix}",
           f"--config.run_dir={run_dir}", f"--config.num_epochs={epochs}", f"--config.eval.freq={epochs + 1}",
           "--config.train.noise_scale=True", "--config.logging.wandb_mode=disabled",
           *(["--config.num_threads=1"] if preset.endswith("_cpu") else []),
           *overrides, *extra]
    (run_dir / "command.txt").write_text(" ".join(cmd[1:]) + "\n")
    with (run_dir / "console.log").open("a") as log:
        return label, subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode


def row(run_dir: Path) -> dict | None:
    """The setting's noise scale with its interval (the point value None where |G|^2's interval contains 0, the
    interval then [lower bound, inf]), and its training seconds per sample, from the run's records; None before the
    run has two epochs with estimates."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    epochs = [r for r in read_records(path) if r.get("type") == "epoch"]
    run = run_noise_scale(epochs)
    if run is None:
        return None
    g2, half, trace = run["g2"], run["g2_half"], run["trace"]
    samples = sum(float(r.get("samples_per_epoch") or 0) for r in epochs)
    seconds = sum(float(r.get("epoch_seconds") or 0) for r in epochs)
    per_sample = seconds / samples if samples else math.nan
    # network evaluations per sample: the cost that does not depend on what else shares the machine
    nfe = sum(float(r.get("nfe_sampling") or 0) + float(r.get("nfe_training") or 0) for r in epochs)
    if run["noise_scale"] is not None:
        low, high = run["noise_scale_low"], run["noise_scale_high"]
    else:  # |G|^2 not measured above 0: the lower bound alone
        low, high = (run["at_least"] if run["at_least"] is not None else math.inf), math.inf
    return {"epochs": run["epochs"], "steps": run["steps"], "update_samples": run["update_samples"],
            "g2": g2, "g2_half": half, "trace": trace, "noise_scale": run["noise_scale"],
            "noise_scale_low": low, "noise_scale_high": high, "seconds_per_sample": per_sample,
            "nfe_per_sample": nfe / samples if samples else math.nan,
            "seconds_to_half": None if run["noise_scale"] is None else run["noise_scale"] * per_sample,
            "seconds_to_half_low": low * per_sample, "seconds_to_half_high": high * per_sample}


def _n(x: float | None) -> str:
    if x is None:
        return "n/a"
    if not math.isfinite(x):
        return "inf"
    return f"{x:,.0f}" if x >= 10 else f"{x:.2g}"


def table(domain: str, out: Path, preset: str | None = None) -> str:
    preset, settings = settings_for(domain, preset)
    rows = []
    for label, *_ in settings:
        r = row(out / slug(label))
        if r is not None:
            rows.append((label, r))
    # rank by the lower end of the interval, the part every run measures; the point value where it exists
    rows.sort(key=lambda lr: (lr[1]["noise_scale_low"], lr[1]["noise_scale"] or math.inf))
    lines = [f"noise scale per setting, {domain} ({preset}), ranked by the interval's lower end (smaller is better)",
             "",
             "| setting | samples per update | epochs (steps) | noise scale B_simple (95%) | consistent share of an "
             "update (KL pull included) | train s / sample | NFE / sample | wall s to cosine 1/2 (95%) |",
             "|---|---|---|---|---|---|---|---|"]
    for label, r in rows:
        b = r["update_samples"]
        share = "n/a" if r["noise_scale"] is None else f"{100 / (1 + r['noise_scale'] / b):.2g}%"
        share_hi = f"at most {100 / (1 + r['noise_scale_low'] / b):.2g}%"
        running = "" if (out / slug(label) / "summary.md").exists() else " (running)"
        lines.append(
            f"| {label}{running} | {b:.0f} | {r['epochs']} ({r['steps']}) | {_n(r['noise_scale'])} "
            f"[{_n(r['noise_scale_low'])}, {_n(r['noise_scale_high'])}] | {share} ({share_hi}) | "
            f"{r['seconds_per_sample']:.3f} | {r['nfe_per_sample']:.1f} | {_n(r['seconds_to_half'])} "
            f"[{_n(r['seconds_to_half_low'])}, {_n(r['seconds_to_half_high'])}] |")
    missing = [label for label, *_ in settings if label not in {lab for lab, _ in rows}]
    if missing:
        lines += ["", "not measured (yet): " + ", ".join(missing)]
    separated = [(a, b) for (a, ra) in rows for (b, rb) in rows if ra["noise_scale_high"] < rb["noise_scale_low"]]
    lines += ["", "intervals that separate: " + (", ".join(f"{a} < {b}" for a, b in separated) or "none")]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = [a for a in argv if a.startswith("--config.")]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("domain", choices=sorted(SETTINGS))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", default=None, help="another preset of the domain (tiny_gpu, motion_tiny_gpu)")
    ap.add_argument("--epochs", type=int, default=None, help="epochs per run (camera 4, motion 12 by default)")
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--only", action="append", default=[], help="run only settings whose label contains this")
    ap.add_argument("--table", action="store_true", help="print the table of finished runs and run nothing")
    args = ap.parse_args([a for a in argv if not a.startswith("--config.")])
    preset, settings = settings_for(args.domain, args.preset)
    epochs = args.epochs or (4 if args.domain == "camera" else 12)
    if not args.table:
        todo = [s for s in settings if not args.only or any(o in s[0] for o in args.only)]
        failed = []

        def go(s):
            label, code = run_one(preset, s[0], s[1], s[2], args.out, epochs, extra)
            if code:
                failed.append(f"{label} (exit {code}; see {args.out / slug(label) / 'console.log'})")
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "table.md").write_text(table(args.domain, args.out, preset) + "\n")

        with ThreadPoolExecutor(args.parallel) as pool:
            list(pool.map(go, todo))
        if failed:
            print("runs that did not finish: " + "; ".join(failed), file=sys.stderr)
    text = table(args.domain, args.out, preset)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
