"""The ablation of issue 63: the research plan's variants, their three combinations, the two-pass GRPO control and
the policy-optimisation methods, each against GRPO and against its placebo on one preset, seeds x rows.

The real run (motion, 4,096 samples per run, the seeds of issue 61; resumable, so the same command continues):

    python scripts/measure/ablate.py --preset motion_tiny_cpu --seeds 0 1 2 --control-seeds 3 4 5 --samples 4096 \
        --parallel 2 --threads 1 --out runs/ablation_motion --keep docs/ablation/runs \
        --time-to-reward docs/time_to_reward_motion.md

It takes longer than a session, and a machine's runs/ may not outlive it: `--keep` writes each finished run as
it finishes to docs/ablation/runs/<row>/seed<k> (its config, summary and log without the per-sample training lists:
140 kB gzip'd against the 2.5 MB log of a motion run), to commit, and restores from there the runs --out lacks, so
the same command continues on a fresh clone and reports every kept run.

GRPO and its placebo run three more seeds than the rows: on seeds 0-2 GRPO led its placebo by +0.049 ± 0.054 (p
0.066; seeds x conditions), and that design's variance components put 80% power for +0.05 at six seed pairs
(`scripts/seed_gains.py --power 0.05` on those runs). The control seeds add 6 runs, about 1.7 core-hours.

Its CPU time, from motion_tiny_cpu's measured cost (`--estimate` prints it): 16 runnable rows x 3 seeds = 48 runs of
64 epochs, about 18.7 core-hours, so about 9.4 hours of wall time at --parallel 2 on 2 free cores. Each row trains at
0.23 s per sample on one core (docs/results.md), its update's share (about half) scaled by its passes and trained
steps (training_factor: 2.5x for the EMA's two passes, 5x for balanced, a third for flow_grpo_fast's two trained
steps), plus 5 evaluations a run at about 18 s (128 held-out and 32 validation captions, measured) and about 20 s
of start-up and reports. grpo_guard is refused on motion (its objective is derived for the flow SDE; motion samples
with DDIM) and listed as not run; so is mixgrpo_flash, whose changes from mixgrpo act on flow domains only, so that
on motion its config is mixgrpo's (a row whose config equals an earlier row's is not run, and says whose it is).

Rows (`--rows` picks some; GRPO and its placebo are always run, every comparison needs them):
- `grpo`: the preset as it is; `placebo`: the same with `advantage.placebo=True` (each group's advantages permuted
  among its samples: the loop without reward information).
- The variants `ema`, `gradient_adaptive`, `amic`, `ptrw`, `temporal_decay`, `asymmetric`, the combinations
  `conservative`, `balanced`, `aggressive` and the control `ema_control`: the fields each preset of that name in
  config/grpo.py sets (`train.policy_loss` and its `train.use_*` flags), applied to --preset, with the passes per
  epoch `ema_passes` gives --preset where the variant preset runs more than one (two on motion, whose pass takes
  two optimizer steps). `ema_control` is those passes without any variant, so what the EMA does is ema minus
  ema_control and what the extra pass does is ema_control minus grpo.
- The methods `flow_grpo_fast`, `mixgrpo`, `mixgrpo_flash`, `grpo_guard`, `nft`, `awm`: `<preset>+<method>`
  (config/methods.py). A row whose config the validation refuses is listed with its reason and not run.

Each (row, seed) run goes to <out>/<row>/seed<k>: `scripts/train_recam.py` with `--config.seed`, the sample budget
as `num_epochs` (--samples over the preset's samples per epoch), a held-out evaluation every --eval-every samples,
`--threads` torch threads, and any --config.* argument given here (but not of the fields it sets). A finished run
(summary.md present) is skipped and an interrupted one resumes from its checkpoints, so the same command picks up
where it stopped. `--parallel` runs at a time, row by row (every seed of a row, GRPO and its placebo
first), so an interrupted ablation leaves whole rows to report.

The report (<out>/report.md, docs-ready, and <out>/results.json) gives for each row, on the preset's primary
held-out endpoint at its time point (eval.primary_endpoint, eval.primary_time: motion's is the grader's R@3 at the
last epoch):
- its change from the base, the row minus GRPO and the row minus the placebo: paired by seed and condition where
  the arms' seeds match (every seed evaluates the same held-out conditions), over seeds the seeds x conditions
  interval (scripts/seed_gains.py, recam.infra.stats.crossed_interval). GRPO minus its placebo is the gate, at the
  full 5%; the rows minus the placebo are a Holm family behind it (a row's adjusted p is at least the gate's), the
  rows minus GRPO another; a row whose every held-out value equals GRPO's is reported as identical to it, and one
  whose every held-out value equals an earlier row's as identical to that row;
- for a row with ema_control's passes (ema and the combinations that run two), the row minus ema_control, paired
  the same way (a third Holm family): what its change adds to the extra pass;
- whether it cleared the placebo, and for a row that did not, whether it ever led it at an evaluation point
  (rows that never did say so);
- its own metrics (mean over the optimizer steps that logged them, over seeds a t-interval): the EMA's variance
  reduction, PTRW's trust-weight mean, asymmetric clipping's per-side clip fractions, ... and every row's clipfrac;
- training seconds and denoiser evaluations (NFE) per sample, and the samples and training seconds it took to
  reach GRPO's final gain (seed means on the evaluation grid).

`--report-only` rereads finished runs and runs nothing; `--estimate` prints the CPU-time estimate and runs nothing;
`--time-to-reward PATH` also writes docs/time_to_reward_motion.md's table from the same runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from config.grpo import ema_passes, get_config  # noqa: E402
from config.validate import ConfigError, step_plan, validate  # noqa: E402
from recam.infra.reports import run_events  # noqa: E402
from recam.infra.runlog import read_records  # noqa: E402
from recam.infra.stats import detectable_effect, holm, mean_interval, seeds_for_power  # noqa: E402
from scripts import seed_gains  # noqa: E402

VARIANTS = ("ema", "gradient_adaptive", "amic", "ptrw", "temporal_decay", "asymmetric")
COMBINATIONS = ("conservative", "balanced", "aggressive")
CONTROL = "ema_control"
ARMS = ("grpo", "placebo", "control")  # what a row is compared with: GRPO, its placebo, the two-pass control
METHODS = ("flow_grpo_fast", "mixgrpo", "mixgrpo_flash", "grpo_guard", "nft", "awm")
ROW_NAMES = ("grpo", "placebo", *VARIANTS, *COMBINATIONS, CONTROL, *METHODS)

# A variant's own metrics: what it claims to change, as the loss logs it (recam/engine/extensions/variants.py).
# temporal decay's weights are fixed by its config, so its first and last weight say what it did to the steps.
OWN_METRICS = {
    "use_ema_smoothing": ("ema/variance_reduction_ratio", "ema/smoothed_fraction"),
    "use_gradient_adaptive_weighting": ("gradient_adaptive/weight_variance",),
    "use_amic": ("amic/sequence_weights_variance",),
    "use_gspo": ("gspo/sequence_weights_variance",),
    "use_ptrw": ("ptrw/trust_weights_mean",),
    "use_temporal_decay": ("temporal_decay/first_weight", "temporal_decay/last_weight"),
    "use_asymmetric_clipping": ("asymmetric/clipfrac_pos", "asymmetric/clipfrac_neg"),
}
CLIPFRAC = "clipfrac"  # every row's: the share of ratios outside the trust region in force (PTRW: for comparison)
RATIO_REACH = "ratio_reach"  # every row's: the farthest a ratio got from 1 in the run (ratio_reach)
ALPHA = 0.05
# the sample budget at which motion GRPO's held-out R@3 first cleared its placebo (docs/results.md, 16,000 samples)
CLEARED_AT = 4096
UNFINISHED = "Not finished (rerun the command to continue them)"  # the report's heading; the exit status reads it


@dataclass(frozen=True)
class Cost:
    """A preset's measured cost on one core, for the estimate: training seconds per sample of GRPO, the share of
    that in the update (the rest is sampling), one evaluation's seconds (held-out and validation), and a run's
    start-up and reports."""

    seconds_per_sample: float
    training_share: float
    eval_seconds: float
    overhead_seconds: float


# motion_tiny_cpu: 0.23 s per sample (docs/results.md, "What 2 cores reach"); one epoch of 64 samples measured here
# (`scripts/train_recam.py --config config/grpo.py:motion_tiny_cpu --config.num_epochs=1 --config.num_threads=1`)
# took 7.4 s sampling and 6.7 s training, 14.5 s per held-out evaluation of 128 captions plus 3.8 s for 32
# validation captions, 70 s in all
COSTS = {"motion_tiny_cpu": Cost(0.23, 0.48, 18.0, 20.0)}


# ---------------------------------------------------------------------------------------------------------------
# the rows


@dataclass(frozen=True)
class Row:
    name: str
    kind: str  # "GRPO", "placebo", "variant", "combination", "control", "method"
    preset: str  # a config/grpo.py name, "<preset>+<method>" for a method
    overrides: tuple[tuple[str, object], ...] = ()
    own: tuple[str, ...] = ()
    refused: str | None = None  # the validation's reason, for a row that is not run
    same_as: str | None = None  # an earlier row whose config on this preset is this one's: not run, its row answers
    passes: int = 1  # train.num_inner_epochs on the preset: a row with the control's passes is compared with it

    @property
    def runs(self) -> bool:
        return self.refused is None and self.same_as is None

    def argv(self) -> list[str]:
        return [f"--config.{k}={v}" for k, v in self.overrides]


def resolve(preset: str, overrides) -> object:
    """The config of `preset` with the (dotted field, value) overrides set, as the command line would set them."""
    c = get_config(preset)
    for key, value in overrides:
        *path, leaf = key.split(".")
        node = c
        for part in path:
            node = node[part]
        node[leaf] = value
    return c


def variant_overrides(name: str, preset: str) -> tuple[tuple[str, object], ...]:
    """The fields the config/grpo.py preset `name` (a variant, combination or ema_control, all built on tiny_cpu)
    sets beyond tiny_cpu: train.policy_loss and the train.use_* flags, as (field, value); and where that preset runs
    more passes per epoch than tiny_cpu (the EMA's two off-policy visits), the passes ema_passes gives `preset`, which
    depend on its optimizer steps per pass (3 for tiny_cpu, 2 for motion_tiny_cpu)."""
    variant, plain = get_config(name), get_config("tiny_cpu")
    fields = [(f"train.{k}", variant.train[k]) for k in sorted(variant.train.keys())
              if k != "num_inner_epochs" and variant.train[k] != plain.train[k]]
    if variant.train.num_inner_epochs != plain.train.num_inner_epochs:
        fields.append(("train.num_inner_epochs", ema_passes(resolve(preset, fields))))
    return tuple(fields)


# fields that name a run and change nothing it computes
NAMING_FIELDS = ("run_name",)


def fingerprint(c) -> str:
    """A config as what it computes: every field but the names (NAMING_FIELDS), as canonical JSON."""
    d = c.to_dict()
    for key in NAMING_FIELDS:
        d.pop(key, None)
    return json.dumps(d, sort_keys=True, default=repr)


def own_metrics(overrides) -> tuple[str, ...]:
    flags = dict(overrides)
    return tuple(m for flag, keys in OWN_METRICS.items() if flags.get(f"train.{flag}") for m in keys)


def ablation_rows(preset: str, names=ROW_NAMES) -> list[Row]:
    """The rows named (GRPO and the placebo always), each validated as a one-process run of `preset`. A row whose
    config on `preset` is an earlier row's (of ROW_NAMES, named or not; a method whose changes act on flow domains
    only, on a DDIM preset) is not run: it would repeat that row's runs bit for bit, and its row answers for it."""
    rows, seen = [], {}
    for name in ROW_NAMES:
        if name == "grpo":
            row = Row(name, "GRPO", preset)
        elif name == "placebo":
            row = Row(name, "placebo", preset, (("advantage.placebo", True),))
        elif name in METHODS:
            row = Row(name, "method", f"{preset}+{name}")
        else:
            kind = "variant" if name in VARIANTS else "combination" if name in COMBINATIONS else "control"
            overrides = variant_overrides(name, preset)
            row = Row(name, kind, preset, overrides, own_metrics(overrides))
        try:
            validate(resolve(row.preset, row.overrides), 1)
        except (ConfigError, ValueError) as e:
            row = replace(row, refused=str(e).splitlines()[0])
        else:
            config = resolve(row.preset, row.overrides)
            key = fingerprint(config)
            row = replace(row, passes=int(config.train.num_inner_epochs), same_as=seen.get(key))
            seen.setdefault(key, name)
        if name in names or name in ("grpo", "placebo"):
            rows.append(row)
    return rows


def samples_per_epoch(preset: str) -> int:
    return validate(get_config(preset), 1).samples_per_epoch


# the fields ablate.py sets itself, or that the sample budget is computed from: a --config.* override of one of them
# would make the runs differ from the budget and folders the report states
OWN_FIELDS = ("seed", "run_dir", "num_epochs", "eval.freq", "num_threads", "sample.batch_size",
              "sample.num_batches_per_epoch", "advantage.placebo")


def check_extra(extra: list[str]) -> None:
    """Refuse a --config.* override of a field ablate.py sets or computes the budget from, naming the option that
    sets it instead."""
    for arg in extra:
        name = arg.removeprefix("--config.").split("=", 1)[0]
        if name in OWN_FIELDS:
            raise SystemExit(f"{arg}: ablate.py sets config.{name} itself (--seeds, --out, --samples, --eval-every, "
                             "--threads, the placebo row); the budget is in samples of the preset's epoch")


def budget(samples: int, eval_every: int, per_epoch: int) -> tuple[int, int]:
    """(num_epochs, eval.freq in epochs) for a budget of `samples` training samples evaluated every `eval_every`:
    whole epochs, rounded up, so a run trains at least the budget."""
    if samples < 1 or eval_every < 1:
        raise ValueError(f"--samples and --eval-every must be positive, got {samples} and {eval_every}")
    return math.ceil(samples / per_epoch), max(1, round(eval_every / per_epoch))


# ---------------------------------------------------------------------------------------------------------------
# the estimate


def training_factor(c, base) -> float:
    """A row's update cost per sample relative to GRPO's: its passes over the samples times its trained steps (or
    re-noised levels, for the objectives without log-probs), times 2 for the gradient-adaptive weights' per-sample
    backward ("about doubling the update", issue 15), times 1.25 for the no-grad pass over every trained step that
    the EMA, AMIC, GSPO and the gradient-adaptive weights read (one forward beside the about four forward-equivalents
    of a trained step: the policy's forward and backward, the reference's forward)."""
    from recam.engine.extensions.fast_objectives import fp_level_count

    def steps(x):
        t = x.train
        trained = step_plan(x).trained_steps
        if trained == 0:
            trained = fp_level_count(t.fp_timestep_sampling, t.fp_num_timesteps, x.sample.num_steps,
                                     t.fp_grid_fraction)
        return t.num_inner_epochs * trained

    t = c.train
    factor = steps(c) / steps(base)
    variants = t.policy_loss == "grpo_variants"
    if variants and t.use_gradient_adaptive_weighting:
        factor *= 2.0
    if variants and (t.use_ema_smoothing or t.use_gradient_adaptive_weighting or t.use_amic or t.use_gspo):
        factor *= 1.25
    return factor


def estimate_seconds(factors: list[float], seeds: int, samples: int, evaluations: int, cost: Cost) -> float:
    """CPU seconds of `seeds` runs of each row: training at cost.seconds_per_sample, its update share scaled by the
    row's factor (training_factor), plus `evaluations` evaluations and the start-up a run."""
    per_sample = [cost.seconds_per_sample * (1 - cost.training_share + cost.training_share * f) for f in factors]
    per_run = [samples * s + evaluations * cost.eval_seconds + cost.overhead_seconds for s in per_sample]
    return seeds * math.fsum(per_run)


# ---------------------------------------------------------------------------------------------------------------
# the runs


def run_dir(out: Path, row: Row, seed: int) -> Path:
    return out / row.name / f"seed{seed}"


def run_command(row: Row, seed: int, folder: Path, epochs: int, eval_freq: int, threads: int,
                extra: list[str]) -> list[str]:
    return [sys.executable, str(ROOT / "scripts" / "train_recam.py"), f"--config=config/grpo.py:{row.preset}",
            f"--config.seed={seed}", f"--config.run_dir={folder}", f"--config.num_epochs={epochs}",
            f"--config.eval.freq={eval_freq}", f"--config.num_threads={threads}",
            "--config.logging.wandb_mode=disabled", "--config.eval.num_videos=0", *row.argv(), *extra]


def finished(folder: Path) -> bool:
    return (folder / "summary.md").exists()


def run_one(cmd: list[str], folder: Path, threads: int) -> int:
    """Run one (row, seed) unless it finished (summary.md present); an interrupted run resumes from its checkpoints
    (train_recam.py resumes by default). Returns the exit status (0 for a finished one)."""
    if finished(folder):
        return 0
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "command.txt").write_text("python " + shlex.join(cmd[1:]) + "\n")  # to rerun one run by hand
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "WANDB_MODE": "disabled"}
    with (folder / "console.log").open("a") as log:
        return subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env).returncode


# ---------------------------------------------------------------------------------------------------------------
# kept runs: a finished run's record, small enough to commit, so an ablation that takes more than a session outlives
# the machine it ran on

# What the report reads of a run, and all a kept copy holds: the config (seed, placebo, endpoints), summary.md (the
# run finished; the guard's line), the rollbacks' archive and the log. The log keeps every record but the per-sample
# lists of the training epochs (rewards, advantages, reward details: most of a motion run's 2.5 MB) and the
# per-condition rows of the reference and validation sets; an epoch keeps its scalars and dataset_indices (the
# draws), a held-out evaluation every per-condition row (the paired intervals and the identity check read them).
KEPT_FILES = ("config.json", "summary.md")
KEPT_LOGS = ("metrics.jsonl", "rolled_back.jsonl")


def slim_record(record: dict) -> dict:
    """A log record as a kept run holds it (see KEPT_FILES): what the report reads, exactly as logged."""
    kind = record.get("type")
    if kind == "epoch":
        return {k: v for k, v in record.items() if not isinstance(v, list) or k == "dataset_indices"}
    if kind in ("eval", "reference"):
        return {k: v for k, v in record.items()
                if not (k.startswith("rows/") and not k.startswith("rows/eval/"))}
    return record


def keep_run(folder: Path, kept: Path) -> None:
    """Write a finished run's kept copy to `kept` (gzip'd slim logs and the small files), replacing an older one.
    Written to a sibling folder and renamed into place, so an interrupted keep leaves the old copy or none."""
    import gzip
    import shutil

    tmp = kept.with_name(kept.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in KEPT_FILES:
        if (folder / name).is_file():
            shutil.copyfile(folder / name, tmp / name)
    for name in KEPT_LOGS:
        if (folder / name).is_file():
            lines = [json.dumps(slim_record(r)) + "\n" for r in read_records(folder / name)]
            # mtime 0: the same run keeps the same bytes, so a kept copy rewritten is no change to commit
            with gzip.GzipFile(tmp / f"{name}.gz", "wb", mtime=0) as f:
                f.write("".join(lines).encode())
    shutil.rmtree(kept, ignore_errors=True)
    tmp.rename(kept)


def restore_run(kept: Path, folder: Path) -> bool:
    """A kept run unpacked to `folder` where the folder holds no run yet: False (nothing done) where it holds one,
    finished or resuming (its own log is the run's), or where nothing is kept. A kept copy without its log or
    summary.md is refused, naming the file."""
    import gzip
    import shutil

    if not kept.is_dir() or (folder / "metrics.jsonl").exists():
        return False
    for need in ("metrics.jsonl.gz", "summary.md", "config.json"):
        if not (kept / need).is_file():
            raise SystemExit(f"{kept / need} is missing: {kept} is not a kept run (write it again with --keep)")
    folder.mkdir(parents=True, exist_ok=True)
    for name in KEPT_FILES:
        if (kept / name).is_file():
            shutil.copyfile(kept / name, folder / name)
    for name in KEPT_LOGS:
        if (kept / f"{name}.gz").is_file():
            try:
                with gzip.open(kept / f"{name}.gz", "rb") as src, (folder / name).open("wb") as dst:
                    shutil.copyfileobj(src, dst)
            except (OSError, EOFError) as e:
                (folder / name).unlink(missing_ok=True)
                (folder / "summary.md").unlink(missing_ok=True)  # not a finished run without its log
                raise SystemExit(f"{kept / name}.gz is not a readable gzip file ({e}): its run is not restored") from e
    return True


# ---------------------------------------------------------------------------------------------------------------
# what a run says (pure, on its records)


def run_cost(epochs: list[dict]) -> dict:
    """Training seconds (sampling, rewards, update; never evaluation) and denoiser evaluations per sample over a
    run's epoch records. The seconds are the median epoch's per sample: a run paused or crowded for a while (a test
    suite beside it, a machine's other work) has a few slow epochs, and the median is the run's own pace."""
    samples = math.fsum(float(r.get("samples_per_epoch") or 0) for r in epochs)
    paces = [float(r["epoch_seconds"]) / float(r["samples_per_epoch"]) for r in epochs
             if r.get("samples_per_epoch") and isinstance(r.get("epoch_seconds"), (int, float))]
    seconds = float(np.median(paces)) * samples if paces else math.nan
    nfe_s = math.fsum(float(r.get("nfe_sampling") or 0) for r in epochs)
    nfe_t = math.fsum(float(r.get("nfe_training") or 0) for r in epochs)
    per = (lambda x: x / samples) if samples else (lambda x: math.nan)
    return {"samples": samples, "seconds_per_sample": per(seconds), "nfe_per_sample": per(nfe_s + nfe_t),
            "nfe_sampling_per_sample": per(nfe_s), "nfe_training_per_sample": per(nfe_t)}


def step_means(steps: list[dict], keys) -> dict[str, float]:
    """Each key's mean over the step records that logged a finite value of it (NaN when none did: the EMA's ratio,
    for one, is logged only at steps that smoothed a weight)."""
    out = {}
    for key in keys:
        values = [float(s[key]) for s in steps if isinstance(s.get(key), (int, float)) and math.isfinite(s[key])]
        out[key] = math.fsum(values) / len(values) if values else math.nan
    return out


def same_draws(a: list, b: list) -> bool | None:
    """Whether two runs drew the same training conditions at every epoch both have (each epoch record's
    dataset_indices); None when either logged none."""
    n = min(len(a), len(b))
    if n == 0 or any(x is None for x in a[:n] + b[:n]):
        return None
    return all(a[i] == b[i] for i in range(n))


def ratio_reach(steps: list[dict]) -> float:
    """The farthest any importance ratio got from 1 over a run's optimizer steps (max of ratio_max - 1 and
    1 - ratio_min): whether a trust region of the preset's clip range could have bound at all. NaN for an objective
    without ratios."""
    def finite(x):
        return isinstance(x, (int, float)) and math.isfinite(x)

    reach = [max(float(s["ratio_max"]) - 1.0, 1.0 - float(s["ratio_min"])) for s in steps
             if finite(s.get("ratio_max")) and finite(s.get("ratio_min"))]
    return max(reach) if reach else math.nan


def read_run(folder: Path, own: tuple[str, ...]) -> dict:
    records = read_records(folder / "metrics.jsonl")
    epochs = [r for r in records if r.get("type") == "epoch"]
    steps = [r for r in records if r.get("type") == "step"]
    return {"cost": run_cost(epochs), "own": {**step_means(steps, (*own, CLIPFRAC)), RATIO_REACH: ratio_reach(steps)},
            "draws": [r.get("dataset_indices") for r in epochs], "events": run_events(folder)}


# ---------------------------------------------------------------------------------------------------------------
# the comparisons


@dataclass
class RowResult:
    row: Row
    runs: list[Path]
    change: seed_gains.Estimate | None = None
    vs: dict = field(default_factory=dict)  # an arm of ARMS -> the row minus it (Estimate)
    holm: dict = field(default_factory=dict)  # an arm of ARMS -> Holm-adjusted p
    curve: list = field(default_factory=list)  # (samples, row minus placebo) at each evaluation after the base
    own: dict = field(default_factory=dict)  # metric -> (mean over seeds, half-width, per-seed values)
    cost: dict = field(default_factory=dict)
    draws: bool | None = None
    to_gain: dict | None = None
    identical_to: str | None = None  # GRPO or the first earlier row whose every held-out value it equals (seed by seed)
    guard: dict = field(default_factory=dict)  # rollbacks (total over seeds), stops: [{seed, samples, reason}]

    @property
    def identical(self) -> bool:
        """Every held-out value equal to GRPO's on the same seed, at every evaluation point."""
        return self.identical_to == "grpo"


@functools.cache
def held_out(run: Path) -> tuple[dict, ...]:
    """A run's held-out evaluations: every eval/* metric and per-condition value (rows/eval/*) of each (read once:
    the identity checks compare every row with the rows before it)."""
    return tuple({k: v for k, v in r.items() if k.startswith(("eval/", "rows/eval/"))}
                 for r in read_records(run / "metrics.jsonl") if r.get("type") == "eval")


def identical_evals(a: Path, b: Path) -> bool:
    """Whether two runs evaluated to exactly the same numbers: the same evaluation points, and at each every held-out
    metric and per-condition value (eval/*, rows/eval/*) equal. A variant whose update rounds to GRPO's in float32
    (weights within about 1e-6 of 1 under Adam) trains the same parameters bit for bit, and its comparison with GRPO
    is then not a small difference with an interval but none at all."""
    ea, eb = held_out(a), held_out(b)
    return bool(ea) and len(ea) == len(eb) and all(x == y and x for x, y in zip(ea, eb, strict=True))


def identical_row(r: RowResult, results: dict[str, RowResult]) -> str | None:
    """GRPO, or else the first row before `r` in the report's order (the placebo aside), whose run on each of r's
    seeds evaluated to exactly r's numbers (identical_evals); None if none did. Two rows that train the same
    parameters answer as one, whatever their configs say."""
    for name in ("grpo", *(n for n in results if n not in CONTROLS)):
        if name == r.row.name:
            return None
        by_seed = {seed_gains.run_seed(run): run for run in results[name].runs}
        if all(seed_gains.run_seed(run) in by_seed and identical_evals(run, by_seed[seed_gains.run_seed(run)])
               for run in r.runs):
            return name
    return None


def shared_runs(runs: list[Path], seeds) -> list[Path]:
    """The runs on the rows' seeds: GRPO's and the placebo's control seeds have no partner in any row, so every
    quantity set beside a row (its change from the base, its time to GRPO's gain) is read on the seeds it has."""
    return [run for run in runs if seed_gains.run_seed(run) in set(seeds)] if seeds else list(runs)


def compare(results: dict[str, RowResult], metric: str, which: int, seeds=None) -> None:
    """Each finished row's change from its base, minus GRPO and minus the placebo (scripts/seed_gains.py: paired by
    seed and condition where the seeds match, the seeds x conditions interval), adjusted for the many looks (GRPO
    minus its placebo as the gate, the rows behind it in Holm families); whether it is identical to GRPO; and the
    row minus the placebo at every evaluation point, for the rows that never led it."""
    for name, r in results.items():
        evals = [seed_gains.run_evals(run) for run in shared_runs(r.runs, seeds)]
        r.change = seed_gains.over_seeds([(e[0], e[which]) for e in evals], metric)
        # a row is compared on its own seeds: GRPO's and the placebo's extra control seeds have no partner in it
        mine = {seed_gains.run_seed(run) for run in r.runs}
        grpo, placebo, control = ([run for run in results[arm].runs if seed_gains.run_seed(run) in mine]
                                  if arm in results else None for arm in (*CONTROLS, CONTROL))
        if name not in CONTROLS:
            r.vs["grpo"] = seed_gains.grpo_minus_placebo(r.runs, grpo, metric, which)
            r.identical_to = identical_row(r, results)
        if name != "placebo":
            r.vs["placebo"] = seed_gains.grpo_minus_placebo(r.runs, placebo, metric, which)
            r.curve = [(c["samples"], c["difference"]) for c in seed_gains.curve_rows(r.runs, placebo, metric)
                       if c["samples"] > 0]
        # a row with the two-pass control's passes differs from GRPO in its change and in the extra pass: minus the
        # control is what its change adds to the same passes (the control minus GRPO is the pass's own share)
        if control and name not in (*CONTROLS, CONTROL) and r.row.passes == results[CONTROL].row.passes:
            r.vs["control"] = seed_gains.grpo_minus_placebo(r.runs, control, metric, which)
    # GRPO minus its placebo is the gate, tested first at the full level; the rows' differences from the placebo are
    # a Holm family behind it (serial gatekeeping: a row's adjusted p is the larger of the gate's p and its Holm p,
    # so no row clears the placebo unless GRPO's loop does). Rows minus GRPO are one Holm family, rows minus the
    # control another.
    gate = results["grpo"].vs["placebo"].p
    results["grpo"].holm["placebo"] = gate
    for arm in ARMS:
        names = [n for n, r in results.items() if arm in r.vs and n not in CONTROLS]
        ps = [results[n].vs[arm].p for n in names]
        for n, p in zip(names, gated_holm(gate, ps) if arm == "placebo" else holm(ps), strict=True):
            results[n].holm[arm] = p


def gated_holm(gate: float, ps: list[float]) -> list[float]:
    """Adjusted p-values of a Holm family tested behind a gate (serial gatekeeping): each is the larger of the gate's
    p and its Holm-adjusted p, so a family member is rejected at level alpha only when the gate is too. NaN stays
    NaN; a gate that could not be evaluated (NaN) rejects nothing."""
    return [max(p, gate) if math.isfinite(p) and math.isfinite(gate) else math.nan for p in holm(ps)]


def lower_end(est: seed_gains.Estimate) -> float:
    """The lower end of an estimate's 95% interval (NaN where it has none)."""
    return est.lo if est.lo is not None else est.mean - est.half


def verdict(r: RowResult, arm: str) -> str:
    """What the row's difference from `arm` says after Holm's adjustment; for the placebo, a row that did not clear
    it also says whether it ever led it at an evaluation point (before any adjustment, the most generous reading)."""
    est, p = r.vs.get(arm), r.holm.get(arm, math.nan)
    # the presets' primary endpoints (grader R@3, cam_score, the toy's target) are all higher-is-better
    if est is None:
        return "—"
    if arm == "grpo" and r.identical:
        return "identical to GRPO (every held-out value equal, every evaluation point and seed)"
    if math.isfinite(p) and p < ALPHA:
        if arm == "grpo":
            return "beats GRPO" if est.mean > 0 else "worse than GRPO"
        if arm == "control":
            return "beats the two-pass control" if est.mean > 0 else "worse than the two-pass control"
        if est.mean > 0:
            return "clears the placebo"
        return "below the placebo"
    if arm == "grpo":
        return "not separated from GRPO"
    if arm == "control":
        return "not separated from the two-pass control"
    ahead = sum(math.isfinite(lower_end(d)) and lower_end(d) > 0 for _, d in r.curve)
    if ahead == 0:
        return "never cleared the placebo (at no evaluation point, even before Holm's adjustment)"
    return (f"did not clear the placebo after Holm's adjustment (ahead at {ahead} of {len(r.curve)} evaluation "
            "points before it)")


def gain_curve(runs: list[Path], metric: str) -> dict[int, tuple[float, float]]:
    """{samples trained: (seed-mean change of `metric` from the base, seed-mean training seconds)} on the evaluation
    points every run has (scripts/seed_gains.py run_curve)."""
    curves = [seed_gains.run_curve(r) for r in runs]
    grid = sorted(set.intersection(*(set(c) for c in curves)))
    out = {}
    for n in grid:
        change = [float(c[n][metric]) - float(c[0][metric]) for c in curves]
        seconds = [float(c[n].get("train_seconds", math.nan)) for c in curves]
        out[n] = (math.fsum(change) / len(change), math.fsum(seconds) / len(seconds))
    return out


def time_to_gain(curve: dict[int, tuple[float, float]], target: float) -> dict | None:
    """The first evaluation point whose seed-mean change reaches `target` (GRPO's final gain): its samples and
    training seconds; None when none does. A target at or below 0 is no gain to reach (the caller says so)."""
    n = next((k for k in sorted(curve) if k > 0 and curve[k][0] >= target), None)
    return None if n is None else {"samples": n, "seconds": curve[n][1]}


def summarise(results: dict[str, RowResult], metric: str, seeds=None) -> float:
    """Each finished row's own metrics and cost over seeds, whether it drew GRPO's training conditions, and its time
    to GRPO's final gain, all on the rows' seeds (GRPO's and the placebo's too); returns that gain (GRPO's seed-mean
    change at its last evaluation point)."""
    grpo_draws = {seed_gains.run_seed(run): read_run(run, ())["draws"] for run in results["grpo"].runs}
    target = gain_curve(shared_runs(results["grpo"].runs, seeds), metric)
    target = target[max(target)][0]
    for r in results.values():
        runs = shared_runs(r.runs, seeds)
        reads = [read_run(run, r.row.own) for run in runs]
        for key in (*r.row.own, CLIPFRAC, RATIO_REACH):
            values = [x["own"][key] for x in reads]
            r.own[key] = (*mean_interval(values), values)
        r.cost = {k: mean_interval([x["cost"][k] for x in reads])[0] for k in reads[0]["cost"]}
        # the guard acts on the rewards: a run it stopped has its "last epoch" where it stopped, short of the budget
        r.guard = {"rollbacks": sum(x["events"]["rollbacks"] for x in reads),
                   "stops": [{"seed": seed_gains.run_seed(run), "samples": x["cost"]["samples"],
                              "reason": x["events"]["guard_stop"].removeprefix("health guard, ")}
                             for run, x in zip(runs, reads, strict=True) if x["events"]["guard_stop"] is not None]}
        pairs = [same_draws(x["draws"], grpo_draws[seed_gains.run_seed(run)])
                 for run, x in zip(runs, reads, strict=True) if seed_gains.run_seed(run) in grpo_draws]
        r.draws = None if not pairs or None in pairs else all(pairs)
        r.to_gain = time_to_gain(gain_curve(runs, metric), target) if target > 0 else None
        if r.to_gain is not None:  # at the run's own pace (run_cost), not the clock's, which counts any pause
            r.to_gain["seconds"] = r.to_gain["samples"] * r.cost["seconds_per_sample"]
    return target


# ---------------------------------------------------------------------------------------------------------------
# the report


def _est(est: seed_gains.Estimate | None) -> str:
    return "—" if est is None else est.text()


def _p(r: RowResult, arm: str) -> str:
    if arm not in r.vs:
        return "—"
    return f"{seed_gains.fmt_p(r.vs[arm].p)} / {seed_gains.fmt_p(r.holm.get(arm, math.nan))}"


def _num(x: float, spec: str = ".3g") -> str:
    return format(x, spec) if isinstance(x, (int, float)) and math.isfinite(x) else "n/a"


def _own(r: RowResult, keys) -> str:
    parts = []
    for key in keys:
        mean, half, _ = r.own[key]
        parts.append(f"{key} {_num(mean, '.4g')}" + (f" ± {_num(half, '.2g')}" if math.isfinite(half) else "")
                     if math.isfinite(mean) else f"{key} not logged")
    return "; ".join(parts) or "—"


def _guard(r: RowResult) -> str:
    """The health guard's actions in a row's runs: rollbacks, and each run it stopped, with the samples it trained."""
    if not r.guard:
        return "n/a"
    stops = [f"seed {x['seed']} stopped at {x['samples']:,.0f} samples" for x in r.guard["stops"]]
    return "; ".join([f"{r.guard['rollbacks']} rollback(s)", *stops])


def stopped_runs(results: dict[str, RowResult], done: list[Row]) -> list[str]:
    """One line per run the guard stopped before the budget: its endpoint is read where it stopped."""
    return [f"{row.name} seed {x['seed']}: stopped by the health guard at {x['samples']:,.0f} samples "
            f"({str(x['reason']).replace('|', '/')})" for row in done for x in results[row.name].guard.get("stops", [])]


def _gain(r: RowResult, target: float, samples: int) -> str:
    if not target > 0:
        return "n/a (GRPO gained nothing)"
    if r.to_gain is None:
        return f"not reached in {samples:,} samples"
    return f"{r.to_gain['samples']:,} samples ({_num(r.to_gain['seconds'], '.0f')} s)"


def resolution(est: seed_gains.Estimate | None) -> tuple[float, int | None, str]:
    """For a row minus GRPO: the smallest true difference its seeds x conditions design finds 80% of the time at the
    5% level, and the seed pairs on the same conditions that would find the measured difference 80% of the time
    (from the difference's own variance components; NaN / None where they cannot be separated)."""
    c = None if est is None else est.crossed
    if c is None or c.seeds < 2 or c.conditions < 2 or c.var_seed is None:
        return math.nan, None, "n/a (needs 2 or more seeds with per-condition values)"
    comps = (c.var_seed, c.var_condition, c.var_residual)
    mde = detectable_effect(*comps, c.seeds, c.conditions)
    need = seeds_for_power(c.mean, *comps, c.conditions)
    if need is not None:
        text = f"{need}"
    elif c.var_condition / c.conditions >= c.mean ** 2:
        text = "none suffice (the shared captions' term alone keeps it below)"
    else:
        text = "more than 1,000"
    return mde, need, text


def tables(results: dict[str, RowResult], done: list[Row], ctx: dict) -> list[str]:
    """The endpoint table (change, minus GRPO, minus placebo, the verdict) and the mechanics table (own metrics,
    cost, time to GRPO's final gain) of the finished rows."""
    lines = ["", "| row | kind | change from base | minus GRPO | p / Holm | minus placebo | p / Holm | against the "
                 "placebo |", "|---|---|---|---|---|---|---|---|"]
    pairs = len(results["grpo"].runs)
    gate = f" (the gate: {pairs} seed pairs)" if pairs > len(ctx["seeds"]) else " (the gate)"
    for row in done:
        r = results[row.name]
        lines.append(f"| {row.name} | {row.kind} | {_est(r.change)} | {_est(r.vs.get('grpo'))} | {_p(r, 'grpo')} | "
                     f"{_est(r.vs.get('placebo'))}{gate if row.name == 'grpo' else ''} | {_p(r, 'placebo')} | "
                     f"{'—' if row.name == 'placebo' else verdict(r, 'placebo')} |")
    shared = ", ".join(map(str, ctx["seeds"]))
    lines += ["", f"Intervals (GRPO minus placebo): {results['grpo'].vs['placebo'].how}. Every row's change from the "
                  f"base, GRPO's and the placebo's included, is on the rows' seeds ({shared}), and so is each row's "
                  "difference from GRPO and from the placebo."]
    stopped = stopped_runs(results, done)
    if stopped:
        lines += ["", "Runs the health guard stopped short of the budget (the guard acts on the rewards; a stopped "
                      "run's last epoch is where it stopped, and it enters the comparisons there):", ""]
        lines += [f"- {x}" for x in stopped]
    against = [f"{row.name} {verdict(results[row.name], 'grpo')}" for row in done if "grpo" in results[row.name].vs]
    twins = [f"{row.name} identical to {results[row.name].identical_to}" for row in done
             if results[row.name].identical_to not in (None, "grpo")]
    if twins:
        lines += ["", "Rows that evaluated to exactly another row's numbers (every held-out value equal, every "
                      "evaluation point and seed: they trained the same parameters, and answer as one): "
                  + ", ".join(twins) + "."]
    if against:
        lines += ["", "Against GRPO, after Holm's adjustment: " + ", ".join(against) + "."]
        lines += ["", "What these seeds can resolve against GRPO: the smallest true difference each row's design "
                      "finds 80% of the time at the 5% level (its own seeds x conditions variance components; Holm's "
                      "adjustment across the rows raises the bar further), and the seed pairs on the same conditions "
                      "that would find the measured difference 80% of the time.", "",
                  "| row | minus GRPO | found 80% of the time from | seeds for the measured difference |",
                  "|---|---|---|---|"]
        for row in done:
            if row.name == "grpo" or "grpo" not in results[row.name].vs:
                continue
            est = results[row.name].vs["grpo"]
            if results[row.name].identical:
                lines.append(f"| {row.name} | identical | — | none: it trains GRPO's parameters |")
                continue
            mde, _, need = resolution(est)
            lines.append(f"| {row.name} | {_est(est)} | {_num(mde, '.4f')} | {need} |")
    beside = [row for row in done if "control" in results[row.name].vs]
    if beside:
        ctl = results[CONTROL]
        lines += ["", f"Against the two-pass control ({CONTROL}: GRPO with the same {ctl.row.passes} passes over each "
                      "epoch's samples and no variant). A row with those passes differs from GRPO in its change and "
                      f"in the extra pass; minus {CONTROL} is what its change adds to the same passes ({CONTROL} "
                      "minus GRPO, above, is the pass's own share). Paired as above; Holm-adjusted among these rows.",
                  "", f"| row | minus {CONTROL} | p / Holm | found 80% of the time from | against the control |",
                  "|---|---|---|---|---|"]
        for row in beside:
            r = results[row.name]
            lines.append(f"| {row.name} | {_est(r.vs['control'])} | {_p(r, 'control')} | "
                         f"{_num(resolution(r.vs['control'])[0], '.4f')} | {verdict(r, 'control')} |")
    lines += ["", f"What each row did, and what it cost (own metrics: mean over the optimizer steps that logged "
                  f"them, ± over seeds; time to GRPO's final gain of {ctx['target']:+.4f}: the first evaluation "
                  "point whose seed-mean change reaches it, with the training seconds there; farthest ratio from "
                  "1: the largest |ratio - 1| of each run, mean ± over seeds, beside the preset's clip range of "
                  f"{_num(ctx.get('clip_range', math.nan), '.3g')}: a trust-region variant acts only on ratios that "
                  "reach its range)", "",
              "| row | own metrics | clipfrac | farthest ratio from 1 | train s / sample | NFE / sample | drew GRPO's "
              "conditions | time to GRPO's final gain | guard |", "|---|---|---|---|---|---|---|---|---|"]
    for row in done:
        r = results[row.name]
        draws = {True: "yes", False: "no", None: "n/a"}[r.draws]
        reach = _own(r, (RATIO_REACH,)).removeprefix(RATIO_REACH + " ").replace("not logged", "no ratios")
        lines.append(f"| {row.name} | {_own(r, row.own)} | {_own(r, (CLIPFRAC,)).removeprefix(CLIPFRAC + ' ')} | "
                     f"{reach} | {_num(r.cost['seconds_per_sample'], '.3f')} | "
                     f"{_num(r.cost['nfe_per_sample'], '.1f')} | {draws} | {_gain(r, ctx['target'], ctx['samples'])} | "
                     f"{_guard(r)} |")
    return lines


def report(results: dict[str, RowResult], rows: list[Row], ctx: dict) -> str:
    metric, when = ctx["metric"], "the last epoch" if ctx["time"] == "last" else "the reported checkpoint"
    ctl = ctx.get("control_seeds", ctx["seeds"])
    controls = "" if ctl == ctx["seeds"] else (f", GRPO and its placebo on {len(ctl)} ({', '.join(map(str, ctl))}; "
                                               "a row is compared with them on its own seeds)")
    lines = [f"# Ablation on {ctx['preset']}: the plan's variants, the methods and a two-pass control against GRPO "
             "and its placebo", "", f"Made by: `{ctx['command']}`", "",
             f"{len(ctx['seeds'])} seed(s) ({', '.join(map(str, ctx['seeds']))}) per row{controls}, "
             f"{ctx['samples']:,} training "
             f"samples per run ({ctx['epochs']} epoch{'s' if ctx['epochs'] != 1 else ''}), held-out evaluation "
             f"every {ctx['eval_samples']:,} samples. "
             f"Endpoint: **{metric} at {when}** (the preset's eval.primary_endpoint / eval.primary_time), change from "
             "each run's base. Differences are paired by seed and held-out condition where the arms' seeds match "
             "(every seed evaluates the same conditions), over seeds with the seeds x conditions interval "
             "(scripts/seed_gains.py); ± is a 95% interval. p / Holm: the p for 0 and the adjusted p. GRPO minus "
             "its placebo is the gate, tested first at the full level; the rows minus the placebo are Holm-adjusted "
             "among themselves behind it (serial gatekeeping: a row's adjusted p is at least the gate's, so no row "
             "clears the placebo unless GRPO does), and the rows minus GRPO among themselves."]
    if ctx["samples"] < CLEARED_AT:
        lines += ["", f"**{ctx['samples']:,} samples is below the {CLEARED_AT:,} at which motion GRPO first cleared "
                      "its placebo (docs/results.md): these runs check the loop, they resolve nothing.**"]
    done = [r for r in rows if r.name in results]
    lines += tables(results, done, ctx) if done else [
        "", "GRPO and its placebo have not both finished every seed: nothing is compared yet."]
    for title, items in (("Not run (the validation refuses the row's config)",
                          [f"{r.name} (`{r.preset}`): {r.refused}" for r in rows if r.refused]),
                         (f"Not run (the same configuration as an earlier row on {ctx['preset']}: every field but "
                          "the run's name equal, so its runs would repeat that row's)",
                          [f"{r.name} (`{r.preset}`): the same as {r.same_as}" for r in rows if r.same_as]),
                         (UNFINISHED,
                          [f"{name}: {text}" for name, text in ctx["unfinished"].items()])):
        if items:
            lines += ["", f"{title}:", ""] + [f"- {x}" for x in items]
    lines += ["", "How each row is run (the fields it sets on the preset):", ""]
    lines += [f"- {r.name}: `config/grpo.py:{r.preset}`" + (" " + " ".join(f"`{a}`" for a in r.argv()) if r.argv()
                                                            else "") for r in rows]
    return "\n".join(lines) + "\n"


def time_to_reward(results: dict[str, RowResult], rows: list[Row], ctx: dict) -> str:
    """docs/time_to_reward_motion.md from the ablation's runs: for every finished row, the samples and training
    seconds to GRPO's final held-out gain, the speed-up against GRPO's own seconds to it, and the cost per sample.
    It reads the same runs as the report, so a method is timed where GRPO learns and beside its placebo's verdict."""
    metric = ctx["metric"]
    lines = [f"# Time to reward: {ctx['preset']}, held-out {metric}", "",
             f"Made by: `{ctx['command']}` (the ablation's runs: {len(ctx['seeds'])} seed(s) per "
             f"row, {ctx['samples']:,} training samples each, held-out evaluation every {ctx['eval_samples']:,} "
             "samples; docs/ablation/report.md has the same rows' endpoints)."]
    done = [r for r in rows if r.name in results]
    target = ctx["target"]
    if not done:
        return "\n".join([*lines, "", "GRPO and its placebo have not both finished every seed: nothing is timed.", ""])
    if not target > 0:
        return "\n".join([*lines, "", f"**GRPO's seed-mean held-out change at its last evaluation is {target:+.4f}: it "
                           "gained nothing, so there is no gain to time and no speed-up can be read.**"]) + "\n"
    grpo_s = (results["grpo"].to_gain or {}).get("seconds", math.nan)
    lines += ["", f"Target: GRPO's final gain, its seed-mean change from the base at its last evaluation, "
                  f"{target:+.4f}. A row's time is the first evaluation point where its seed-mean change reaches the "
                  "target (points are on the sample grid, so a time is a grid point), with the training seconds "
                  "to get there at the row's median epoch pace (sampling, rewards and updates; evaluations excluded; "
                  "a pause in a run does not count). Speed-up: GRPO's seconds to the target over the row's. Against "
                  "the placebo: the ablation's verdict on the endpoint, adjusted as its report is (behind GRPO's own "
                  "comparison with its placebo, Holm across the rows); a row that reaches the target but does not "
                  "clear the placebo has a time that is not evidence of learning. The target and every time are "
                  f"read on the rows' seeds ({', '.join(map(str, ctx['seeds']))}).",
              "", "| row | kind | against the placebo | samples to target | training s to target | speed-up | "
                  "train s / sample | NFE / sample |", "|---|---|---|---|---|---|---|---|"]
    for row in done:
        r = results[row.name]
        placebo = "—" if row.name == "placebo" else verdict(r, "placebo")
        if r.to_gain is None:
            reach, secs, speed = f"not reached in {ctx['samples']:,}", "—", "—"
        else:
            reach, secs = f"{r.to_gain['samples']:,}", _num(r.to_gain["seconds"], ".0f")
            speed = _num(grpo_s / r.to_gain["seconds"], ".2f") if r.to_gain["seconds"] > 0 else "n/a"
        lines.append(f"| {row.name} | {row.kind} | {placebo} | {reach} | {secs} | {speed} | "
                     f"{_num(r.cost['seconds_per_sample'], '.3f')} | {_num(r.cost['nfe_per_sample'], '.1f')} |")
    return "\n".join(lines) + "\n"


def _est_json(est: seed_gains.Estimate | None, p_holm: float | None = None) -> dict | None:
    if est is None:
        return None
    out = {"mean": est.mean, "half": est.half, "lo": est.lo, "hi": est.hi, "p": est.p, "how": est.how}
    return out | ({"p_holm": p_holm} if p_holm is not None else {})


def results_json(results: dict[str, RowResult], rows: list[Row], ctx: dict) -> dict:
    out = {k: ctx[k] for k in ("command", "preset", "seeds", "samples", "epochs", "eval_samples", "metric", "time",
                                "target")}
    out["rows"] = []
    for row in rows:
        item = {"name": row.name, "kind": row.kind, "preset": row.preset, "overrides": row.argv()}
        r = results.get(row.name)
        if row.refused:
            item["status"] = f"not run: {row.refused}"
        elif row.same_as:
            item["status"] = f"not run: the same configuration as {row.same_as} on {ctx['preset']}"
        elif r is None:
            item["status"] = f"not finished: {ctx['unfinished'].get(row.name, '')}"
        else:
            item |= {"status": "finished", "runs": [_shown(x) for x in r.runs], "change": _est_json(r.change),
                     "minus_grpo": _est_json(r.vs.get("grpo"), r.holm.get("grpo")),
                     "minus_placebo": _est_json(r.vs.get("placebo"), r.holm.get("placebo")),
                     "minus_control": _est_json(r.vs.get("control"), r.holm.get("control")),
                     "against_control": verdict(r, "control") if "control" in r.vs else None,
                     "identical_to_grpo": r.identical, "identical_to": r.identical_to,
                     "resolves_vs_grpo": dict(zip(("detectable_80", "seeds_for_measured"),
                                                  (math.nan, None) if r.identical else resolution(r.vs.get("grpo"))[:2],
                                                  strict=True)),
                     "against_grpo": verdict(r, "grpo"),
                     "against_placebo": "—" if row.name == "placebo" else verdict(r, "placebo"),
                     "curve_minus_placebo": [{"samples": n, **_est_json(d)} for n, d in r.curve],
                     "own": {k: {"mean": m, "half": h, "per_seed": v} for k, (m, h, v) in r.own.items()},
                     "cost": r.cost, "drew_grpo_conditions": r.draws, "time_to_grpo_gain": r.to_gain,
                     "guard": r.guard}
        out["rows"].append(item)
    return out


def _shown(path: Path) -> str:
    """A run's folder as a reader of the report can open it: relative to the repository when it is inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _nan_to_none(x):
    """JSON has no NaN: a value that could not be computed is null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _nan_to_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_nan_to_none(v) for v in x]
    return x


# ---------------------------------------------------------------------------------------------------------------


CONTROLS = ("grpo", "placebo")


def row_seeds(row: Row, seeds: list[int], control_seeds: list[int]) -> list[int]:
    """The seeds a row runs: every row the shared seeds, GRPO and its placebo the control seeds too (their difference
    is the regime check, and it needs more seed pairs than a row's difference from GRPO; issue 61's power)."""
    return control_seed_list(seeds, control_seeds) if row.name in CONTROLS else list(seeds)


def control_seed_list(seeds: list[int], control_seeds: list[int]) -> list[int]:
    return list(seeds) + [s for s in control_seeds if s not in seeds]


def collect(rows: list[Row], out: Path, seeds: list[int], codes: dict,
            control_seeds: list[int] = ()) -> tuple[dict[str, RowResult], dict]:
    """The rows whose every seed finished, and for the others what is missing."""
    results, unfinished = {}, {}
    for row in rows:
        if not row.runs:
            continue
        mine = row_seeds(row, seeds, control_seeds)
        folders = [run_dir(out, row, s) for s in mine]
        missing = [f"seed {s}" + (f" (exit {codes[(row.name, s)]}; see {f / 'console.log'})"
                                  if codes.get((row.name, s)) else "")
                   for s, f in zip(mine, folders, strict=True) if not finished(f)]
        if missing:
            unfinished[row.name] = ", ".join(missing)
        else:
            results[row.name] = RowResult(row, folders)
    return results, unfinished


def main(argv: list[str] | None = None) -> str:
    argv = sys.argv[1:] if argv is None else argv
    extra = [a for a in argv if a.startswith("--config.")]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="motion_tiny_cpu")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--control-seeds", nargs="*", type=int, default=[],
                    help="more seeds for GRPO and its placebo only (their difference is the regime check, which "
                         "needs more seed pairs than the rows' differences from GRPO)")
    ap.add_argument("--samples", type=int, default=CLEARED_AT, help="training samples per run (num_epochs)")
    ap.add_argument("--eval-every", type=int, default=1024, help="samples between held-out evaluations")
    ap.add_argument("--rows", nargs="+", default=list(ROW_NAMES), choices=ROW_NAMES,
                    help="the rows to run (GRPO and its placebo always)")
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--out", type=Path, default=Path("runs/ablation"))
    ap.add_argument("--report-only", action="store_true", help="reread finished runs, run nothing")
    ap.add_argument("--estimate", action="store_true", help="print the CPU-time estimate, run nothing")
    ap.add_argument("--keep", type=Path, default=None,
                    help="a folder of kept runs (docs/ablation/runs): each finished run is kept there small enough to "
                         "commit, and a run kept there but not in --out is restored from it instead of run again")
    ap.add_argument("--time-to-reward", type=Path, default=None,
                    help="also write the time-to-reward document (docs/time_to_reward_motion.md) from these runs")
    args = ap.parse_args([a for a in argv if not a.startswith("--config.")])
    check_extra(extra)
    out = args.out if args.out.is_absolute() else ROOT / args.out
    rows = ablation_rows(args.preset, args.rows)
    per_epoch = samples_per_epoch(args.preset)
    epochs, eval_freq = budget(args.samples, args.eval_every, per_epoch)
    runnable = [r for r in rows if r.runs]
    if args.estimate:
        if args.preset not in COSTS:
            raise SystemExit(f"no measured cost for {args.preset} (known: {sorted(COSTS)})")
        base = get_config(args.preset)
        factors = [training_factor(resolve(r.preset, r.overrides), base) for r in runnable]
        extra = len(row_seeds(runnable[0], args.seeds, args.control_seeds)) - len(args.seeds)
        evaluations = 1 + math.ceil(epochs / eval_freq)
        secs = estimate_seconds(factors, len(args.seeds), epochs * per_epoch, evaluations, COSTS[args.preset])
        secs += estimate_seconds([1.0, 1.0], extra, epochs * per_epoch, evaluations, COSTS[args.preset])
        runs = len(runnable) * len(args.seeds) + 2 * extra
        text = (f"{len(runnable)} rows x {len(args.seeds)} seeds" + (f" + GRPO and its placebo on {extra} more"
                                                                     if extra else "") + f" = {runs} runs of {epochs} "
                f"epochs: about {secs / 3600:.1f} core-hours ({secs / 3600 / max(1, args.parallel):.1f} h of wall "
                f"time at --parallel {args.parallel} on as many free cores); training factors "
                + ", ".join(f"{r.name} {f:.2f}" for r, f in zip(runnable, factors, strict=True)))
        print(text)
        return text
    keep = None if args.keep is None else (args.keep if args.keep.is_absolute() else ROOT / args.keep)
    every = [(row, seed) for row in runnable for seed in row_seeds(row, args.seeds, args.control_seeds)]
    if keep is not None:
        restored = [f"{row.name} seed {seed}" for row, seed in every
                    if restore_run(keep / row.name / f"seed{seed}", run_dir(out, row, seed))]
        if restored:
            print(f"restored from {keep}: " + ", ".join(restored), flush=True)

    def kept(row, seed):
        folder = run_dir(out, row, seed)
        if keep is not None and finished(folder) and not (keep / row.name / f"seed{seed}" / "summary.md").exists():
            keep_run(folder, keep / row.name / f"seed{seed}")

    codes = {}
    if not args.report_only:
        # row-major: GRPO and its placebo lead, and an interrupted ablation leaves whole rows, which report
        jobs = every
        cmds = {(row.name, seed): run_command(row, seed, run_dir(out, row, seed), epochs, eval_freq, args.threads,
                                              extra) for row, seed in jobs}

        def go(job):
            row, seed = job
            code = run_one(cmds[(row.name, seed)], run_dir(out, row, seed), args.threads)
            kept(row, seed)  # at once: a session that ends mid-ablation keeps every run that finished
            print(f"{row.name} seed {seed}: exit {code}", flush=True)
            return code

        with ThreadPoolExecutor(max(1, args.parallel)) as pool:
            codes = {(r.name, s): c for (r, s), c in zip(jobs, pool.map(go, jobs), strict=True)}
    for row, seed in every:
        kept(row, seed)
    results, unfinished = collect(rows, out, args.seeds, codes, args.control_seeds)
    config = resolve(args.preset, ())
    ctx = {"command": "python scripts/measure/ablate.py " + shlex.join(argv), "preset": args.preset,
           "seeds": args.seeds, "control_seeds": control_seed_list(args.seeds, args.control_seeds),
           "samples": epochs * per_epoch, "epochs": epochs, "eval_samples": eval_freq * per_epoch,
           "metric": config.eval.primary_endpoint, "time": config.eval.primary_time, "target": math.nan,
           "clip_range": float(config.train.clip_range),
           "unfinished": unfinished}
    if "grpo" in results and "placebo" in results:
        compare(results, ctx["metric"], seed_gains.TIMES[ctx["time"]], args.seeds)
        ctx["target"] = summarise(results, ctx["metric"], args.seeds)
    else:
        results = {}  # nothing compares without GRPO and its placebo
    text = report(results, rows, ctx)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(text)
    (out / "results.json").write_text(json.dumps(_nan_to_none(results_json(results, rows, ctx)), indent=1) + "\n")
    if args.time_to_reward is not None:
        args.time_to_reward.write_text(time_to_reward(results, rows, ctx))
    print(text)
    return text


if __name__ == "__main__":
    sys.exit(1 if UNFINISHED in main() else 0)  # a run that did not finish: rerun the same command
