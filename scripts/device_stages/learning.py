"""learning: presets tiny_gpu and motion_tiny_gpu run by scripts/train_recam.py within a time cap each: the held-out
curve (an evaluation every few updates, drawn in DIR/learning_<domain>.png), the base and final scores and the gain
with its 95% interval over conditions, seconds per update and the device's busy share. The runs add up over GPU
windows: --resume DIR continues each run DIR/runs/<preset> of an earlier check for --learning-seconds more training
seconds, and each run folder is left as a small bundle (scripts/device_stages/bundle.py: the checkpoint `latest`
names and `selected`'s, metrics.jsonl gzipped) to bring back for that. The runs use the committed embedded bases:
random weights would time alike but make the scores meaningless.

The placebo arm (size["arms"] holding "placebo": --learning-arms) runs each preset again with advantage.placebo=True
(each group's advantages permuted within the group: the same loop without the reward's information) in
DIR/runs/<preset>_placebo, reported as learning.<domain>_placebo, from the same base and evaluated on the same
held-out conditions. Its budget is the GRPO run's: it trains until its cumulative training seconds reach the
GRPO run's (a placebo that starts after GRPO's earlier windows catches up in one), and it evaluates after every update,
so that each of GRPO's evaluations has a placebo twin at the same update. learning.<domain>.vs_placebo is GRPO minus
placebo at the last update both evaluated, paired over the held-out conditions, and at each run's end, with each
arm's health-guard events beside it (rollbacks, critical findings, a guard stop: recam.infra.reports.run_events of
each run folder, read before it is packed); each run's entry holds its own under "events".
"""

from __future__ import annotations

import json
import math
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from recam.infra.reports import eval_change, per_condition_change, run_events
from recam.infra.stats import crossed_interval, paired_change
from scripts.device_stages import Context
from scripts.device_stages.bundle import carry_over, pack, trained_seconds

ROOT = Path(__file__).resolve().parents[2]

SIZES = {
    # eval_freq: a held-out point every 5 updates (one update per epoch), about every 2-3 minutes on the H100
    # arms: "grpo" trains the preset's run, "placebo" its placebo beside it (placebo_eval_freq: after every update)
    "full": {"presets": ("tiny_gpu", "motion_tiny_gpu"), "seconds": 30, "eval_freq": 5, "overrides": (),
             "arms": ("grpo",), "placebo_eval_freq": 1},
    # the GPU presets' code path at smoke size: epochs of 8 samples, a few held-out conditions; a cap below any
    # epoch's time, so that each window (the first, and each --resume) trains exactly one epoch
    "tiny": {"presets": ("tiny_gpu", "motion_tiny_gpu"), "seconds": 0.01, "eval_freq": 1, "arms": ("grpo",),
             "placebo_eval_freq": 1, "overrides": {
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
# a placebo run's further margin: it evaluates after every update, about 2.5 s (camera, 32 conditions) and 4 s
# (motion, 128 captions) each on the H200 (the gaps between its epoch lines around an evaluation), up to about 15
# of them when it catches up with a GRPO run of three minutes. A fresh camera run now evaluates tiny_gpu's 128
# held-out conditions (one forward batch of eval.batch_size 256, where 32 were): not yet timed on a GPU.
PLACEBO_MARGIN_S = 40
# the entry holds one dict per run, under its domain's name (NAMES), and bundle_bytes; a run that ran holds these
KEYS = ("samples_per_update", "epochs", "seconds", "base", "final", "gain", "ci95", "curve", "plot",
        "seconds_per_update", "seconds_device", "seconds_host", "device_share", "bundle", "max_train_seconds",
        "events")
# with the placebo arm: learning.<domain>_placebo holds KEYS too (and "placebo": True), and learning.<domain> adds
# PLACEBO_KEYS, the comparison (versus_placebo)
ARMS = ("grpo", "placebo")
PLACEBO = "_placebo"  # a placebo run's folder runs/<preset>_placebo, its entry learning.<domain>_placebo
PLACEBO_KEYS = ("vs_placebo",)

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


def plot_curve(path: Path, title: str, points: list[dict], panels: list[tuple],
               placebo: list[dict] | None = None) -> None:
    """Held-out score against training seconds, one panel per (key, label, base, gain, ci95): the base as a
    horizontal line, the end's paired 95% interval as an error bar at base + gain; `placebo`: the placebo run's
    points, in grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8))
    for ax, (key, label, base, gain, half) in zip(list(getattr(axes, "flat", [axes])), panels, strict=True):
        xy = [(p["train_seconds"], p[key]) for p in points
              if isinstance(p["train_seconds"], (int, float)) and isinstance(p[key], (int, float))]
        ax.plot([x for x, _ in xy], [y for _, y in xy], "o-", color="C0", label="held-out" + (
            ", GRPO" if placebo else ""))
        if placebo:
            pxy = [(q["train_seconds"], q[key]) for q in placebo
                   if isinstance(q["train_seconds"], (int, float)) and isinstance(q[key], (int, float))]
            ax.plot([x for x, _ in pxy], [y for _, y in pxy], ".-", color="grey", label="held-out, placebo")
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
                    out_dir: Path, plot: bool = True) -> dict:
    """What the run's log says: the curve over every window, the end's paired change against the base, the
    seconds per update, and the curve's plot (out_dir/learning_<name>.png; plot=False: none, a placebo's curve is
    drawn beside its GRPO run's). The evaluations behind the curve, with their per-condition rows, are under
    "_evals" (the stage takes them out: they pair GRPO with its placebo)."""
    from recam.infra.runlog import read_records

    records = read_records(run_dir / "metrics.jsonl")
    epochs = [r for r in records if r.get("type") == "epoch"]
    evals = [r for r in records if r.get("type") == "eval"]
    score, beside = SCORES[preset]
    out = {"score": score, "epochs": len(epochs), "events": run_events(run_dir), **update_timing(epochs),
           "samples_per_update": epochs[0]["samples_per_epoch"] / max(1, len(epochs[0]["optimizer_steps"]))
           if epochs else None}
    if not evals:
        return {**out, "curve": [], "_evals": []}
    merged = merged_evals(prior_evals, evals, resumed_epochs)
    start, end = evals[0], evals[-1]  # the base (a resumed run's log keeps it first) and the newest evaluation
    mean, half, n = paired_change(start.get(f"rows/{score}", []), end.get(f"rows/{score}", []))
    other = paired_change(start.get(f"rows/{beside}", []), end.get(f"rows/{beside}", []))
    points = curve_points(merged, score, beside)
    out.update({"_evals": merged, "train_seconds": end.get("train_seconds"), "base": start.get(score),
                "final": end.get(score), "end": end.get("tag"), "gain": mean, "ci95": half, "conditions": n,
                "beside": {"score": beside, "base": start.get(beside), "final": end.get(beside), "gain": other[0],
                           "ci95": other[1]},
                "curve": points})
    if preset == "motion_tiny_gpu":
        # the score above is the grader's; the reward's own network grades too, beside it, unless it is the grader
        own = end.get("eval/grader_is_reward_net") != 0.0
        out["grader"] = "the reward's own network" if own else "motion.metric_evaluator, independent of the reward"
        out["reward_net_base"] = start.get("eval/reward_net/r_precision_top3")
        out["reward_net_final"] = end.get("eval/reward_net/r_precision_top3")
    if plot:
        draw(preset, out, out_dir)
    return out


def draw(preset: str, out: dict, out_dir: Path, placebo: dict | None = None) -> None:
    """out_dir/learning_<name>.png from a run's entry (its curve and end), with its placebo's curve beside it when
    given; out["plot"] names the file, or is None with plot_error saying why."""
    if not out.get("curve"):
        return
    plot = out_dir / f"learning_{NAMES[preset]}.png"
    score, beside = SCORES[preset]
    try:
        plot_curve(plot, f"{preset}: held-out score over training ({len(out['curve'])} evaluations)"
                   + (" beside its placebo" if placebo else ""), out["curve"],
                   [("score", score, out["base"], out["gain"], out["ci95"]),
                    ("beside", beside, out["beside"]["base"], out["beside"]["gain"], out["beside"]["ci95"])],
                   placebo=(placebo or {}).get("curve"))
        out["plot"] = plot.name  # beside device_check.json
    except Exception as e:  # noqa: BLE001 - a plot that fails leaves the numbers standing, and says why
        out["plot"], out["plot_error"] = None, f"{type(e).__name__}: {e}"
    if placebo is not None:
        placebo["plot"], placebo["plot_error"] = out["plot"], out.get("plot_error")
        if placebo["plot_error"] is None:
            del placebo["plot_error"]


# what vs_placebo repeats of each arm's run_events: the guard acts on the rewards, so it can roll back or stop the
# two arms differently, and a difference in scores is read beside that
EVENT_KEYS = ("rollbacks", "guard_stop", "critical", "warning")


def arm_events(grpo: dict | None, placebo: dict | None) -> dict:
    """Each arm's guard events (recam.infra.reports.run_events of its run folder; None: its folder held no log) and
    whether the arms differ in them (None when either is not known)."""
    def keep(e):
        return None if e is None else {k: e.get(k) for k in EVENT_KEYS}
    g, p = keep(grpo), keep(placebo)
    return {"grpo": g, "placebo": p, "differ": None if g is None or p is None else g != p}


def versus_placebo(grpo: list[dict], placebo: list[dict], score: str, beside: str,
                   samples_per_update: float | None, grpo_events: dict | None = None,
                   placebo_events: dict | None = None) -> dict:
    """GRPO minus placebo from the two runs' evaluations (each over every window, with per-condition rows): at the
    last update both evaluated (the same samples trained on; the placebo evaluates after every update, so that is
    GRPO's last evaluation whenever the placebo got as far), and at each run's end (the same training seconds).
    Both are paired over the held-out conditions: the runs start from the same base and evaluate the same
    conditions with the same fixed noise. base_difference checks that: the placebo's base minus GRPO's.
    grpo_events, placebo_events: each run's guard events (learning_result's "events"), repeated under "events"
    (`arm_events`), also beside an error."""
    events = arm_events(grpo_events, placebo_events)

    def by_step(evals):  # a periodic and a final evaluation of one update evaluate the same weights: the later kept
        return {r["step"]: r for r in evals if isinstance(r.get("step"), int) and not isinstance(r.get("step"), bool)}

    g, p = by_step(grpo), by_step(placebo)
    if 0 not in g or 0 not in p:
        return {"error": "no evaluation of the base in " + " and ".join(
            name for name, arm in (("the GRPO run", g), ("the placebo run", p)) if 0 not in arm), "events": events}
    try:
        return _versus(g, p, score, beside, samples_per_update, events)
    except ValueError as e:  # the arms scored different held-out sets (recam.infra.reports.condition_rows)
        return {"error": f"the GRPO run and its placebo are not paired: {e}", "events": events}


def _versus(g: dict, p: dict, score: str, beside: str, samples_per_update: float | None, events: dict) -> dict:
    """versus_placebo's comparison of the two runs' evaluations by update, each arm's base at update 0."""
    common = sorted(set(g) & set(p))
    last = common[-1]

    def change(before, after, key):
        # one seed pair: the seeds x conditions interval of seed_gains reduces to the pairing over the conditions,
        # which says nothing of another seed's draw (recam.infra.stats.crossed_interval)
        c = crossed_interval([per_condition_change(before, after, key)])
        return {"difference": c.mean, "ci95": c.half, "conditions": c.conditions, "p": c.p,
                "interval": "one seed pair, paired over the held-out conditions: conditional on this seed"}

    out = {"score": score, "events": events, "base_difference": eval_change(g[0], p[0], score)[0],
           "steps_in_common": common,
           "step": last, "samples": None if samples_per_update is None else last * samples_per_update,
           "grpo_train_seconds": g[last].get("train_seconds"), "placebo_train_seconds": p[last].get("train_seconds")}
    if last == 0:
        out["note"] = "no update that both runs evaluated: nothing but the base to compare at the same update"
        out.update(difference=None, ci95=None, conditions=0)
    else:
        d = change(p[last], g[last], score)  # GRPO's values minus the placebo's, condition by condition
        out.update(d, grpo_gain=eval_change(g[0], g[last], score)[:2],
                   placebo_gain=eval_change(p[0], p[last], score)[:2],
                   beside={"score": beside, **change(p[last], g[last], beside)})
    ge, pe = g[max(g)], p[max(p)]
    out["at_ends"] = {"grpo_step": max(g), "placebo_step": max(p), "grpo_train_seconds": ge.get("train_seconds"),
                      "placebo_train_seconds": pe.get("train_seconds"), **change(pe, ge, score)}
    return out


def verification(run_dir: Path) -> str | None:
    """The verifier's verdict on the run (PASS, WARN or FAIL), as its report at the run's end says; None without
    one."""
    report = run_dir / "grpo_verification.md"
    found = re.search(r"\*\*Result: (\w+)\*\*", report.read_text(errors="replace")) if report.is_file() else None
    return found.group(1) if found else None


def kept_heldout(run_dir: Path, overrides) -> tuple[str, ...]:
    """The override that sets the held-out count run_dir's config.json records, unless `overrides` set one: the
    count is fixed for a run's life (a resume that changes it is refused), so a run begun before the camera presets
    went from 32 held-out conditions to 128 (issue 61, item 6) goes on with its 32, and its placebo evaluates the
    same conditions."""
    if any(o.startswith("--config.data.num_heldout_conditions=") for o in overrides):
        return ()
    try:
        count = json.loads((run_dir / "config.json").read_text())["data"]["num_heldout_conditions"]
    except (OSError, ValueError, KeyError, TypeError):
        return ()  # the trainer's resume check then names what it lacks
    return (f"--config.data.num_heldout_conditions={count}",)


def _same(value, setting: str) -> bool:
    """A config.json value against an override's text (--config.<key>=<text>), as the flag parser would read it."""
    if isinstance(value, bool) or value is None:
        return str(value) == setting
    try:
        return float(value) == float(setting)
    except (TypeError, ValueError):
        return str(value) == setting


def unpaired_sizes(preset: str, overrides, grpo_run: Path) -> list[str]:
    """The size settings in which a placebo run with `overrides` would differ from its GRPO run (grpo_run's
    config.json): every key that some size of SIZES sets for the preset, read from `overrides` where they set it
    and from the preset otherwise. A placebo of another size (a --tiny placebo beside a GPU run from --resume) draws
    other samples and scores another held-out set, so GRPO minus it would measure the sizes, not the advantages.
    A GRPO run without a readable config.json gives none: its own resume check names what it lacks."""
    from config.grpo import get_config

    try:
        ran = json.loads((grpo_run / "config.json").read_text())
    except (OSError, ValueError):
        return []
    set_here = dict(o.removeprefix("--config.").split("=", 1) for o in overrides)
    keys = dict.fromkeys(o.removeprefix("--config.").split("=", 1)[0] for size in SIZES.values()
                         if isinstance(size["overrides"], dict) for o in size["overrides"].get(preset, ()))
    def lookup(node, key: str):  # a dotted key in config.json's dict or the preset's ConfigDict; None if absent
        for part in key.split("."):
            node = node.get(part) if hasattr(node, "get") else None
        return node

    preset_config, out = get_config(preset), []
    for key in keys:
        theirs, ours = lookup(ran, key), set_here.get(key, str(lookup(preset_config, key)))
        if theirs is not None and not _same(theirs, ours):
            out.append(f"{key} {ours!r} here, {theirs!r} there")
    return out


def run_preset(preset: str, size: dict, out_dir: Path, cap: float, prior: Path | None, placebo: bool = False,
               target: float | None = None) -> dict:
    """One learning run in out_dir/runs/<preset> (placebo: its placebo, runs/<preset>_placebo): fresh, or (prior: a
    previous window's run folder) continued from it, for `size["seconds"]` more training seconds, or (target) until
    its cumulative training seconds reach `target`. Afterwards the folder is packed (`pack`) to come back small."""
    from recam.infra.runlog import read_records

    run_dir = out_dir / "runs" / (preset + (PLACEBO if placebo else ""))
    out: dict = {"resumed_from": None, **({"placebo": True} if placebo else {})}
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
    out["max_train_seconds"] = earlier + size["seconds"] if target is None else target
    overrides = size["overrides"].get(preset, ()) if isinstance(size["overrides"], dict) else ()
    # a continued run keeps the held-out count it began with, a placebo takes its GRPO run's: the arms are paired
    # condition by condition
    began = out_dir / "runs" / preset if placebo else run_dir if prior is not None else None
    if began is not None:
        overrides = (*overrides, *kept_heldout(began, overrides))
    if placebo and (unpaired := unpaired_sizes(preset, overrides, began)):
        more = f" and {len(unpaired) - 4} more" if len(unpaired) > 4 else ""
        return {**out, "error": f"not run: this placebo would not pair with {began}, which ran at another size: "
                                f"{'; '.join(unpaired[:4])}{more}. Run both arms at one size (with --tiny, --resume "
                                "a folder that --tiny made)"}
    eval_freq = size["placebo_eval_freq"] if placebo else size["eval_freq"]
    cmd = [sys.executable, str(ROOT / "scripts" / "train_recam.py"), f"--config={ROOT / 'config' / 'grpo.py'}:{preset}",
           f"--config.run_dir={run_dir}", "--config.logging.wandb_mode=disabled", *overrides,
           *(["--config.advantage.placebo=True"] if placebo else []),
           f"--config.num_epochs={LEARNING_EPOCHS}", f"--config.eval.freq={eval_freq}",
           "--config.eval.num_videos=0", f"--config.max_train_seconds={out['max_train_seconds']}"]
    out["command"] = " ".join(cmd[1:])
    t0 = time.perf_counter()
    if prior is not None and earlier >= out["max_train_seconds"]:
        # a placebo already as far as its GRPO run: started, the trainer would only report its logged end again
        out["exit"], out["note"] = None, f"not trained: it has {earlier:.1f} s of training already"
    else:
        try:
            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=cap)
            out["exit"] = p.returncode
            if p.returncode not in (0, 3):
                out["error"] = (p.stderr or p.stdout)[-1500:]
        except subprocess.TimeoutExpired:
            # killed: its checkpoints are whole (written aside, then renamed), so the next window continues from
            # the newest, and what it logged so far is reported
            out["exit"], out["error"] = None, f"did not finish within its cap of {cap:.0f} s"
    out["seconds"] = time.perf_counter() - t0
    if (run_dir / "metrics.jsonl").exists():
        out.update(learning_result(preset, run_dir, prior_evals, resumed_epochs, out_dir, plot=not placebo))
    out["verification"] = verification(run_dir)
    if run_dir.exists():
        out["bundle"] = pack(run_dir)
    return out


def keep_run(preset: str, out_dir: Path, prior: Path) -> dict:
    """A GRPO run this window does not train (arms without "grpo"): its bundle copied into out_dir, so that the
    folder is the next window's whole --resume, and reported as it stands, so that its placebo is compared with it."""
    run_dir = out_dir / "runs" / preset
    if run_dir.exists() and prior.resolve() != run_dir.resolve():
        return {"error": f"{run_dir} exists: continue it with --resume {out_dir}, or choose a new --out"}
    try:
        carried = carry_over(prior, run_dir)
    except Exception as e:  # noqa: BLE001 - as run_preset: this preset's error, the other runs go on
        if prior.resolve() != run_dir.resolve():
            shutil.rmtree(run_dir, ignore_errors=True)
        return {"error": f"cannot carry {prior} over: {type(e).__name__}: {e}"}
    # its log holds every evaluation it keeps (the ones a resume dropped are in no bundle any more)
    out = {"resumed_from": carried, "trained": False, "max_train_seconds": carried["train_seconds"], "seconds": 0.0,
           **learning_result(preset, run_dir, [], carried["epochs"], out_dir)}
    out["verification"] = verification(run_dir)
    out["bundle"] = pack(run_dir)
    return out


def plans(size: dict, resume: Path | None) -> list[tuple[str, str, float]]:
    """The stage's runs in order, (preset, arm, training seconds this window): a GRPO run trains size["seconds"];
    its placebo trains up to the GRPO run's cumulative seconds (from the --resume bundles; the GRPO run's overshoot
    of its cap, up to one epoch, is not known before it runs, and the run's margin takes it)."""
    def cumulative(preset):
        return (trained_seconds(resume / "runs" / preset) or 0.0) if resume is not None else 0.0

    out = []
    for preset in size["presets"]:  # (a fresh GRPO run counts 0 s before; so does a placebo never run)
        grpo = cumulative(preset) + (size["seconds"] if "grpo" in size["arms"] else 0.0)
        if "grpo" in size["arms"]:
            out.append((preset, "grpo", size["seconds"]))
        if "placebo" in size["arms"]:
            out.append((preset, "placebo", max(0.0, grpo - cumulative(preset + PLACEBO))))
    return out


def allowance(arm: str, seconds: float) -> float:
    """A run's share of the stage's cap: its training seconds and its margin."""
    return seconds + LEARNING_MARGIN_S + (PLACEBO_MARGIN_S if arm == "placebo" else 0.0)


def run(device: torch.device, size: dict, ctx: Context) -> dict:
    """Each preset's runs in turn (its GRPO run, then its placebo), each within its share of the stage's cap (10 s
    kept for the stage's own end): the time left, split in proportion to the runs' allowances (training seconds
    and margin), so that a run that ends early leaves its time to the ones after it."""
    deadline, out_dir, resume = time.perf_counter() + ctx.cap - 10, ctx.out_dir, ctx.resume
    todo = plans(size, resume)
    weights = [allowance(arm, seconds) for _, arm, seconds in todo]

    def share(i):
        return max(1.0, (deadline - time.perf_counter()) * weights[i] / sum(weights[i:]))

    out, evals = {}, {}
    for i, (preset, arm, _) in enumerate(todo):
        name = NAMES[preset]
        if arm == "grpo":
            prior = None if resume is None else resume / "runs" / preset
            if prior is not None and not prior.is_dir():
                out[name] = {**run_preset(preset, size, out_dir, share(i), None),
                             "note": f"{prior} does not exist: this run started afresh"}
            else:
                out[name] = run_preset(preset, size, out_dir, share(i), prior)
            evals[name] = out[name].pop("_evals", None)
            continue
        # the placebo arm
        grpo_dir = out_dir / "runs" / preset
        if "grpo" not in size["arms"]:
            prior = None if resume is None else resume / "runs" / preset
            if prior is None or not prior.is_dir():
                out[name + PLACEBO] = {"error": f"no GRPO run to match: {prior or '--resume'} names none, and the "
                                                "arms do not train one (add grpo to --learning-arms)"}
                continue
            out[name] = keep_run(preset, out_dir, prior)
            evals[name] = out[name].pop("_evals", None)
        if "error" in out[name] and "bundle" not in out[name]:
            # refused or not carried over: whatever grpo_dir holds is not the GRPO run of this window
            out[name + PLACEBO] = {"error": f"its GRPO run did not run: {out[name]['error'][:300]}"}
            continue
        target = trained_seconds(grpo_dir)
        if target is None:
            out[name + PLACEBO] = {"error": f"{grpo_dir} holds no checkpoint with training seconds: no budget to "
                                            "match"}
            continue
        prior = None if resume is None else resume / "runs" / (preset + PLACEBO)
        entry = run_preset(preset, size, out_dir, share(i), prior if prior is not None and prior.is_dir() else None,
                           placebo=True, target=target)
        placebo_evals = entry.pop("_evals", None)
        out[name + PLACEBO] = entry
        if evals.get(name) and placebo_evals:
            score, beside = SCORES[preset]
            out[name]["vs_placebo"] = versus_placebo(evals[name], placebo_evals, score, beside,
                                                     out[name].get("samples_per_update"), out[name].get("events"),
                                                     entry.get("events"))
            draw(preset, out[name], out_dir, placebo=entry)
        else:
            out[name]["vs_placebo"] = {"error": "no evaluations to compare in " + " and ".join(
                f"the {arm_name} run" for arm_name, e in (("GRPO", evals.get(name)), ("placebo", placebo_evals))
                if not e), "events": arm_events(out[name].get("events"), entry.get("events"))}
    # what the next window needs brought back: out_dir/runs (the plots and device_check.json besides are small)
    out["bundle_bytes"] = sum(r["bundle"]["bytes"] for r in out.values() if "bundle" in r)
    return out
