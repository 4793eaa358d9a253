"""learning: presets tiny_gpu and motion_tiny_gpu run by scripts/train_recam.py within a time cap each: the held-out
curve (an evaluation every few updates, drawn in DIR/learning_<domain>.png), the base and final scores and the gain
with its 95% interval over conditions, seconds per update and the device's busy share. The runs add up over GPU
windows: --resume DIR continues each run DIR/runs/<preset> of an earlier check for --learning-seconds more training
seconds, and each run folder is left as a small bundle (scripts/device_stages/bundle.py: the checkpoint `latest`
names and `selected`'s, metrics.jsonl gzipped) to bring back for that. The runs use the committed embedded bases:
random weights would time alike but make the scores meaningless.
"""

from __future__ import annotations

import math
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from recam.infra.stats import paired_change
from scripts.device_stages import Context
from scripts.device_stages.bundle import carry_over, pack

ROOT = Path(__file__).resolve().parents[2]

SIZES = {
    # eval_freq: a held-out point every 5 updates (one update per epoch), about every 2-3 minutes on the H100
    "full": {"presets": ("tiny_gpu", "motion_tiny_gpu"), "seconds": 30, "eval_freq": 5, "overrides": ()},
    # the GPU presets' code path at smoke size: epochs of 8 samples, a few held-out conditions; a cap below any
    # epoch's time, so that each window (the first, and each --resume) trains exactly one epoch
    "tiny": {"presets": ("tiny_gpu", "motion_tiny_gpu"), "seconds": 0.01, "eval_freq": 1, "overrides": {
        "tiny_gpu": ("--config.data.num_train_conditions=16", "--config.sample.num_batches_per_epoch=1",
                     "--config.sample.batch_size=8",
                     "--config.train.batch_size=8", "--config.train.gradient_accumulation_steps=1",
                     "--config.data.num_heldout_conditions=4", "--config.data.num_val_conditions=4",
                     "--config.sample.num_steps=3", "--config.sample.eval_num_steps=3"),
        "motion_tiny_gpu": ("--config.data.num_train_conditions=16", "--config.sample.num_batches_per_epoch=1",
                            "--config.sample.batch_size=8",
                            "--config.train.batch_size=8", "--config.train.gradient_accumulation_steps=1",
                            "--config.sample.num_steps=4",
                            "--config.sample.eval_num_steps=4", "--config.data.num_heldout_conditions=32",
                            "--config.data.num_val_conditions=0", "--config.eval.select_by=",
                            "--config.eval.select_guard=",
                            "--config.motion.eval_repetitions=1", "--config.health.action=warn")}},
}
# each learning run gets half its stage's cap on a GPU (start-up, evaluations and an epoch that crosses the 30 s
# budget included); --learning-seconds grows it (scripts/device_check.py set_learning)
CAP = {"full": 170, "tiny": 200}
# per learning run, beyond its training seconds: start-up, the base and final evaluations and the epoch that
# crosses the budget. On the H100 these took about 25 s (camera) and 40 s (motion) besides an epoch of 25-30 s.
LEARNING_MARGIN_S = 90
# the entry holds one dict per run, under its domain's name (NAMES), and bundle_bytes; a run that ran holds these
KEYS = ("samples_per_update", "epochs", "seconds", "base", "final", "gain", "ci95", "curve", "plot",
        "seconds_per_update", "seconds_device", "seconds_host", "device_share", "bundle", "max_train_seconds")

# per preset: the held-out score whose gain is reported (paired over the held-out conditions: motion's R-precision
# per caption is its hit rate over the protocol's shuffles), and a second score reported beside it.
SCORES = {"tiny_gpu": ("eval/cam_score", "eval/fidelity"),
          "motion_tiny_gpu": ("eval/r_precision_top3", "eval/motion_alignment")}
NAMES = {"tiny_gpu": "camera", "motion_tiny_gpu": "motion"}

# The learning runs end on their time cap, never on num_epochs (the presets' 12 and 30 epochs would end a run that
# adds up over several windows); one value for every window, so that a resumed run's config differs from its first
# window's only in the cumulative cap.
LEARNING_EPOCHS = 100_000


def curve_points(evals: list[dict], score: str, beside: str) -> list[dict]:
    """One point per evaluation: `epoch` is the epochs trained (the checkpoint epoch_NNNN evaluated; 0 = the
    base), train_seconds the cumulative training time at it."""
    from recam.infra.checkpoint import epoch_of

    return [{"tag": r.get("tag"), "epoch": epoch_of(Path(str(r.get("checkpoint") or ""))), "step": r.get("step"),
             "train_seconds": r.get("train_seconds"), "score": r.get(score), "beside": r.get(beside)} for r in evals]


def merged_evals(prior: list[dict], now: list[dict], resumed_epochs: int | None) -> list[dict]:
    """The run's evaluations over every window, in training order. A resumed run drops a window's "final"
    evaluation from its log (it evaluates its own end anew); that evaluation stays in the curve when it evaluated
    weights the run continued from (or earlier ones), and any other the log no longer holds is left out."""
    from recam.infra.checkpoint import epoch_of

    def key(r):
        return r.get("tag"), r.get("checkpoint"), r.get("step")

    seen = {key(r) for r in now}
    kept = [r for r in prior if key(r) not in seen and resumed_epochs is not None
            and (epoch_of(Path(str(r.get("checkpoint") or ""))) or 0) <= resumed_epochs]
    both = [*now, *kept]
    return [r for _, r in sorted(enumerate(both), key=lambda x: (x[1].get("train_seconds") or 0.0, x[0]))]


def update_timing(epochs: list[dict]) -> dict:
    """Seconds per update (median over epochs of epoch_seconds / optimizer steps) and the device's busy share:
    medians of seconds_device and seconds_host, and device / (device + host) over the epochs that carry both; None
    for what no epoch record carries."""
    def number(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    per = [r["epoch_seconds"] / len(r["optimizer_steps"]) for r in epochs
           if number(r.get("epoch_seconds")) and r.get("optimizer_steps")]
    timed = [(r["seconds_device"], r["seconds_host"]) for r in epochs
             if number(r.get("seconds_device")) and number(r.get("seconds_host"))]
    total = sum(d + h for d, h in timed)
    return {"seconds_per_update": statistics.median(per) if per else None,
            "seconds_device": statistics.median(d for d, _ in timed) if timed else None,
            "seconds_host": statistics.median(h for _, h in timed) if timed else None,
            "device_share": sum(d for d, _ in timed) / total if total > 0 else None,
            "epochs_device_timed": len(timed)}


def plot_curve(path: Path, title: str, points: list[dict], panels: list[tuple]) -> None:
    """Held-out score against training seconds, one panel per (key, label, base, gain, ci95): the base as a
    horizontal line, the end's paired 95% interval as an error bar at base + gain."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8))
    for ax, (key, label, base, gain, half) in zip(list(getattr(axes, "flat", [axes])), panels, strict=True):
        xy = [(p["train_seconds"], p[key]) for p in points
              if isinstance(p["train_seconds"], (int, float)) and isinstance(p[key], (int, float))]
        ax.plot([x for x, _ in xy], [y for _, y in xy], "o-", color="C0", label="held-out")
        if isinstance(base, (int, float)):
            ax.axhline(base, ls="--", color="grey", label="base")
            if xy and all(isinstance(v, float) and math.isfinite(v) for v in (gain, half)):
                ax.errorbar([xy[-1][0]], [base + gain], yerr=[half], fmt="s", color="C3", capsize=4,
                            label=f"end: {gain:+.4f} +- {half:.4f} (95%)")
        ax.set_xlabel("training seconds")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def learning_result(preset: str, run_dir: Path, prior_evals: list[dict], resumed_epochs: int | None,
                    out_dir: Path) -> dict:
    """What the run's log says: the curve over every window, the end's paired change against the base, the
    seconds per update, and the curve's plot (out_dir/learning_<name>.png)."""
    from recam.infra.runlog import read_records

    records = read_records(run_dir / "metrics.jsonl")
    epochs = [r for r in records if r.get("type") == "epoch"]
    evals = [r for r in records if r.get("type") == "eval"]
    score, beside = SCORES[preset]
    out = {"score": score, "epochs": len(epochs), **update_timing(epochs),
           "samples_per_update": epochs[0]["samples_per_epoch"] / max(1, len(epochs[0]["optimizer_steps"]))
           if epochs else None}
    if not evals:
        return {**out, "curve": []}
    start, end = evals[0], evals[-1]  # the base (a resumed run's log keeps it first) and the newest evaluation
    mean, half, n = paired_change(start.get(f"rows/{score}", []), end.get(f"rows/{score}", []))
    other = paired_change(start.get(f"rows/{beside}", []), end.get(f"rows/{beside}", []))
    points = curve_points(merged_evals(prior_evals, evals, resumed_epochs), score, beside)
    out.update({"train_seconds": end.get("train_seconds"), "base": start.get(score), "final": end.get(score),
                "end": end.get("tag"), "gain": mean, "ci95": half, "conditions": n,
                "beside": {"score": beside, "base": start.get(beside), "final": end.get(beside), "gain": other[0],
                           "ci95": other[1]},
                "curve": points})
    if preset == "motion_tiny_gpu":
        # the score above is the grader's; the reward's own network grades too, beside it, unless it is the grader
        own = end.get("eval/grader_is_reward_net") != 0.0
        out["grader"] = "the reward's own network" if own else "motion.metric_evaluator, independent of the reward"
        out["reward_net_base"] = start.get("eval/reward_net/r_precision_top3")
        out["reward_net_final"] = end.get("eval/reward_net/r_precision_top3")
    plot = out_dir / f"learning_{NAMES[preset]}.png"
    try:
        plot_curve(plot, f"{preset}: held-out score over training ({len(points)} evaluations)", points,
                   [("score", score, start.get(score), mean, half),
                    ("beside", beside, start.get(beside), other[0], other[1])])
        out["plot"] = plot.name  # beside device_check.json
    except Exception as e:  # noqa: BLE001 - a plot that fails leaves the numbers standing, and says why
        out["plot"], out["plot_error"] = None, f"{type(e).__name__}: {e}"
    return out


def run_preset(preset: str, size: dict, out_dir: Path, cap: float, prior: Path | None) -> dict:
    """One learning run in out_dir/runs/<preset>: fresh, or (prior: a previous window's run folder) continued from
    it for `size["seconds"]` more training seconds. Afterwards the folder is packed (`pack`) to come back small."""
    from recam.infra.runlog import read_records

    run_dir = out_dir / "runs" / preset
    out: dict = {"resumed_from": None}
    if run_dir.exists() and (prior is None or prior.resolve() != run_dir.resolve()):
        # train_recam would continue it by itself, from a cap that does not count its earlier seconds
        return {"error": f"{run_dir} exists: continue it with --resume {out_dir}, or choose a new --out"}
    prior_evals, resumed_epochs, earlier = [], None, 0.0
    if prior is not None:
        try:
            carried = carry_over(prior, run_dir)
        except Exception as e:  # noqa: BLE001 - an unusable bundle is this preset's error; the other runs go on
            if prior.resolve() != run_dir.resolve():  # the copy, so that a corrected --resume can use this --out
                shutil.rmtree(run_dir, ignore_errors=True)
            return {"error": f"cannot continue {prior}: {type(e).__name__}: {e}"}
        out["resumed_from"] = carried
        earlier, resumed_epochs = carried["train_seconds"], carried["epochs"]
        prior_evals = [r for r in read_records(run_dir / "metrics.jsonl") if r.get("type") == "eval"]
    out["max_train_seconds"] = earlier + size["seconds"]
    overrides = size["overrides"].get(preset, ()) if isinstance(size["overrides"], dict) else ()
    cmd = [sys.executable, str(ROOT / "scripts" / "train_recam.py"), f"--config={ROOT / 'config' / 'grpo.py'}:{preset}",
           f"--config.run_dir={run_dir}", "--config.logging.wandb_mode=disabled", *overrides,
           f"--config.num_epochs={LEARNING_EPOCHS}", f"--config.eval.freq={size['eval_freq']}",
           "--config.eval.num_videos=0", f"--config.max_train_seconds={out['max_train_seconds']}"]
    out["command"] = " ".join(cmd[1:])
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=cap)
        out["exit"] = p.returncode
        if p.returncode not in (0, 3):
            out["error"] = (p.stderr or p.stdout)[-1500:]
    except subprocess.TimeoutExpired:
        # killed: its checkpoints are whole (written aside, then renamed), so the next window continues from the
        # newest, and what it logged so far is reported
        out["exit"], out["error"] = None, f"did not finish within its cap of {cap:.0f} s"
    out["seconds"] = time.perf_counter() - t0
    if (run_dir / "metrics.jsonl").exists():
        out.update(learning_result(preset, run_dir, prior_evals, resumed_epochs, out_dir))
    if run_dir.exists():
        out["bundle"] = pack(run_dir)
    return out


def run(device: torch.device, size: dict, ctx: Context) -> dict:
    """Each preset's run in turn, each within its share of the stage's cap (10 s kept for the stage's own end)."""
    cap, out_dir, resume = ctx.cap - 10, ctx.out_dir, ctx.resume
    out = {}
    per = cap / len(size["presets"])
    for preset in size["presets"]:
        prior = None if resume is None else resume / "runs" / preset
        if prior is not None and not prior.is_dir():
            out[NAMES[preset]] = {**run_preset(preset, size, out_dir, per, None),
                                  "note": f"{prior} does not exist: this run started afresh"}
            continue
        out[NAMES[preset]] = run_preset(preset, size, out_dir, per, prior)
    # what the next window needs brought back: out_dir/runs (the plots and device_check.json besides are small)
    out["bundle_bytes"] = sum(r["bundle"]["bytes"] for r in out.values() if "bundle" in r)
    return out
