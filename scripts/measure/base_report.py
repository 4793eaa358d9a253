"""What a base is worth post-training: its samples' quality, the rewards' ceiling and floor, and the signal share of
a GRPO update at it, on the preset's held-out conditions, as one JSON file per base; --table compares several.

    python scripts/measure/base_report.py --config config/grpo.py:tiny_cpu --repeats 4 --out /tmp/base_1x.json
    python scripts/measure/base_report.py --config config/grpo.py:tiny_cpu --config.model.pretrained=/tmp/pt/cam_4x \\
        --repeats 4 --out /tmp/base_4x.json
    python scripts/measure/base_report.py --table /tmp/base_1x.json,/tmp/base_4x.json

Measured at the base's weights, nothing trained:
- samples: the held-out evaluation the trainer runs before its first epoch (deterministic sampling, fixed noise;
  every row of the domain's summary, e.g. cam_score, the CamI2V errors and the share of frames the landmark estimator
  placed, fidelity and PSNR to the ground truth; for motion the independent grader's R-precision, foot skating,
  jitter), with each metric's per-condition values, so two bases compare condition by condition (paired 95%
  interval in the table, the first file being the reference);
- ceiling and floor: the same rewards on the conditions' reference samples (Evaluator.evaluate_references: the
  ground truth, and for the camera the source clip, a camera that never moved to the target);
- signal share: scripts/measure/gradient_agreement.py's share of the whole update's squared norm that agrees between
  --repeats independent epochs, with its 95% jackknife interval (--repeats 0 skips it).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("WANDB_MODE", "disabled")

import torch  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from recam.infra.reports import eval_change  # noqa: E402

config_flags.DEFINE_config_file("config", "config/grpo.py:tiny_cpu", "preset (config/grpo.py:<name>[+method])")
flags.DEFINE_integer("repeats", 4, "independent epochs for the signal share (0: skip it; otherwise >= 3)")
flags.DEFINE_string("out", "", "JSON file to write")
flags.DEFINE_string("table", "", "comma-separated JSON files written by this script: print their comparison")
FLAGS = flags.FLAGS

EXTRA_ROWS = (("PSNR to the ground truth (dB)", "eval/psnr"),)  # the fidelity reward's detail, where scored


def base_budget(folder: str) -> dict:
    """The base's provenance: command, optimizer steps (a staged run's total), batch size, wall time."""
    path = Path(folder) / "provenance.json"
    if not path.is_file():
        return {"folder": folder, "provenance": None}
    prov = json.loads(path.read_text())
    args = prov.get("args", {})
    return {"folder": folder, "command": prov.get("command"), "total_steps": prov.get("total_steps", args.get("steps")),
            "batch_size": args.get("batch_size"), "wall_time_s": prov.get("wall_time_s"),
            "init_from": prov.get("init_from")}


def measure(config, repeats: int) -> dict:
    from scripts.measure.at_base import trainer_at_base
    from scripts.measure.gradient_agreement import agreement, epoch_gradients, share_interval

    pretrained = config.motion.pretrained if config.domain == "motion" else config.model.pretrained
    out: dict = {"domain": config.domain, "base": base_budget(str(pretrained))}
    t0 = time.perf_counter()
    with trainer_at_base(config) as trainer:
        rows = tuple(trainer.domain.summary_rows) + EXTRA_ROWS
        out["rows"] = [list(r) for r in rows]
        references = trainer.evaluator.evaluate_references(trainer.global_step)
        out["references"] = {k: v for k, v in references.items() if not k.startswith("rows/")}
        trainer.model.eval()
        out["samples"] = trainer.evaluator.evaluate_split(trainer.heldout, "base", "eval", None)
        out["seconds_evaluation"] = time.perf_counter() - t0
        if repeats:
            grads, sizes = [], []
            for e in range(repeats):
                g, n = epoch_gradients(trainer, e)
                grads.append(g.sum(0))
                sizes.append(n)
            G = torch.stack(grads)
            share, half = share_interval(G)
            out["signal"] = {"share": share, "ci95": half, "cosine": agreement(G)["cosine"], "repeats": repeats,
                             "samples_per_epoch": sum(sizes) / len(sizes)}
    out["seconds"] = time.perf_counter() - t0
    return out


# What each domain's Domain.references entry is, for the table's footnote (names as in evaluate_references).
REFERENCES = {"ref_target": "the conditions' ground truth (the rewards' ceiling)",
              "ref_source": "the source clip, a camera that never moved to the target",
              "ref_shuffled": "each caption given the next condition's ground-truth motion (real motion, wrong text)"}


def fmt(x, spec=".4f") -> str:
    return "n/a" if x is None or not math.isfinite(x) else format(x, spec)


def table(files: list[Path]) -> str:
    """Markdown: one column per base (the first is the reference the paired changes are taken against), then the
    reference samples' values of the same metric (the same conditions for every base: taken from the first)."""
    reports = [json.loads(f.read_text()) for f in files]
    first = reports[0]
    refs = sorted({k.split("/")[0] for k in first["references"]})
    head = ["held-out metric", *(f"{Path(r['base']['folder']).name} ({r['base'].get('total_steps')} steps)"
                                 for r in reports), *refs]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, key in first["rows"]:
        if not any(key in r["samples"] for r in reports):
            continue
        cells = [fmt(first["samples"].get(key))]
        for file, r in zip(files[1:], reports[1:], strict=True):
            cell = fmt(r["samples"].get(key))
            try:
                mean, half, n = eval_change(first["samples"], r["samples"], key)
            except ValueError as e:  # two bases reported on different held-out sets
                raise SystemExit(f"{files[0]} and {file}: {e}") from None
            if n:  # per-condition values in both: the paired change (a whole-split metric has none)
                cell += f" ({fmt(mean, '+.4f')} ± {fmt(half)})"
            cells.append(cell)
        name = key.split("/", 1)[1]
        cells += [fmt(first["references"].get(f"{ref}/{name}")) for ref in refs]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("| signal share of an update (95% interval) | " + " | ".join(
        f"{fmt(r['signal']['share'])} ± {fmt(r['signal']['ci95'])} ({r['signal']['repeats']} epochs of "
        f"{r['signal']['samples_per_epoch']:.0f})" if r.get("signal") else "n/a" for r in reports)
        + " |" + " |" * len(refs))
    lines.append("")
    lines.append("Changes in brackets: paired over the held-out conditions against the first column, mean ± 95% "
                 "t half-width. " + " ".join(f"{ref}: {REFERENCES.get(ref, 'a reference the domain returns')}."
                                              for ref in refs))
    return "\n".join(lines)


def main(_):
    if FLAGS.table:
        print(table([Path(f) for f in FLAGS.table.split(",") if f]))
        return
    if FLAGS.repeats < 0 or 0 < FLAGS.repeats < 3:
        sys.exit("[recam] --repeats must be 0 (no signal share) or at least 3 (its interval needs them)")
    if not FLAGS.out:
        sys.exit("[recam] --out is required (the JSON file to write)")
    report = measure(FLAGS.config, FLAGS.repeats)
    report["command"] = " ".join(["python", "scripts/measure/base_report.py", *sys.argv[1:]])
    Path(FLAGS.out).parent.mkdir(parents=True, exist_ok=True)
    Path(FLAGS.out).write_text(json.dumps(report, indent=1) + "\n")
    print(table([Path(FLAGS.out)]))


if __name__ == "__main__":
    app.run(main)
